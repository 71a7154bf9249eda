#!/usr/bin/env bash
# #15's measurements on a GPU, with random weights at real shapes (speed, not acceptance):
#   1. the default command's projected speed-up: `jaxspec.bench --suite` with forced acceptance at the shipped head's
#      measured rates (MT-Bench p=0.31, GSM8K p=0.545: per-position acceptance .314 .086 .031 .015 .005 and
#      .545 .297 .153 .078 .048, BENCHMARKS.md), chains K=1/3/5 against target-only on a SmolLM2-135M-shaped target
#      and a random 16k-vocabulary head; automatic speculation picks the fastest of these (or target-only);
#   2. the head's training step (the shipped config, online features) on a Llama-3.1-8B-shaped target with a
#      32k-vocabulary head, then on the SmolLM2-135M shape.
# Run from the project root on the accelerator machine, with its own JAX, torch and safetensors:
#   bash scripts/gpu_head_measurements.sh MAKE_TARGET_PY TOKENIZER_DIR [PARTS] [SHAPE_8B] [SHAPE_SMALL]
# MAKE_TARGET_PY writes a random-weight Hugging Face checkpoint of a named shape (OUT TOKENIZER_DIR SHAPE);
# PARTS: which of "projection train8b trainsmall" to run (default: all); the shapes default to llama3.1-8b and
# smollm2-135m (a CPU check of the script itself can name a tiny shape for both). Logs and JSON go to $OUT
# (default bench-results/gpu; at most 8 files: env, summary, logs, two projections' results.json, two training
# metrics); the checkpoints and full logs to $WORK (default /tmp/jaxspec-gpu).
set -uo pipefail
MAKE_TARGET=$1; TOK=$2; PARTS=${3:-projection train8b trainsmall}
BIG=${4:-llama3.1-8b}; SMALL=${5:-smollm2-135m}
OUT=${OUT:-bench-results/gpu}; WORK=${WORK:-/tmp/jaxspec-gpu}; mkdir -p "$OUT" "$WORK"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 JAXSPEC_COMPILE_CACHE=$WORK/compile-cache JAXSPEC_STEP_COSTS=off
LIMIT=${LIMIT:-8}; NEW=${NEW:-128}; STEPS=${STEPS:-20}
$PY -c "import jax, flax, optax; print('jax', jax.__version__, 'flax', flax.__version__, 'optax', optax.__version__, jax.devices())" | tee "$OUT/env.txt"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv | tee -a "$OUT/env.txt"

log() {  # the end of a step's log, into the one log file that comes back (the device tool returns at most 8 files)
    { echo "== $1"; tail -40 "$1"; } >>"$OUT/logs.txt"
}

small_target() {
    [ -f "$WORK/small/config.json" ] || $PY "$MAKE_TARGET" "$WORK/small" "$TOK" "$SMALL" >/dev/null
}

train() {  # train SHAPE_DIR LABEL SECONDS [overrides...]: the launcher's own throughput log, no evaluation
    local dir=$1 label=$2 seconds=$3; shift 3
    SECONDS=0
    timeout "$seconds" $PY -m train.launch --config configs/smollm2-eagle3.yaml target="$dir" out="$WORK/run-$label" \
        train.steps="$STEPS" train.eval_every=0 train.log_every=1 train.checkpoint_every=1000 "$@" \
        >"$WORK/train-$label.log" 2>&1
    echo "train $label: rc $? in ${SECONDS}s" | tee -a "$OUT/summary.txt"
    cp "$WORK/run-$label/metrics.jsonl" "$OUT/train-$label.jsonl" 2>/dev/null
    log "$WORK/train-$label.log"
}

for part in $PARTS; do
    case $part in
    projection)
        small_target
        [ -f "$WORK/head-small/config.json" ] || \
            $PY -m jaxspec.convert random-head --target "$WORK/small" --draft-vocab 16384 --out "$WORK/head-small"
        for set_p in mt_bench:0.31 gsm8k:0.545; do
            set=${set_p%%:*}; p=${set_p##*:}
            SECONDS=0
            timeout "${PROJECTION_SECONDS:-170}" $PY -m jaxspec.bench --target "$WORK/small" --draft "$WORK/head-small" \
                --suite "$set" --limit "$LIMIT" --max-new-tokens "$NEW" --batch-sizes 1 --chain-lengths 1,3,5 \
                --accept-prob "$p" --out "$WORK/projection-$set" >"$WORK/projection-$set.log" 2>&1
            echo "projection $set p=$p: rc $? in ${SECONDS}s" | tee -a "$OUT/summary.txt"
            cp "$WORK/projection-$set/results.json" "$OUT/projection-$set.json" 2>/dev/null
            log "$WORK/projection-$set.log"
            cat "$WORK/projection-$set/results.md" 2>/dev/null
        done ;;
    train8b)
        SECONDS=0
        [ -f "$WORK/big/config.json" ] || $PY "$MAKE_TARGET" "$WORK/big" "$TOK" "$BIG" >/dev/null
        echo "make $BIG: ${SECONDS}s" | tee -a "$OUT/summary.txt"
        train "$WORK/big" big "${TRAIN8B_SECONDS:-240}" head.draft_vocab_size=32000 head.intermediate_size=null ;;
    trainsmall)
        small_target
        train "$WORK/small" small "${TRAINSMALL_SECONDS:-90}" ;;
    esac
done
