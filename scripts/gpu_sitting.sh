#!/usr/bin/env bash
# The accelerator issue's GPU sitting: what a session lent a GPU runs first, with random bfloat16 weights at
# Llama-3.1-8B layer shapes (speed, not acceptance), in one device call of at most ~9.5 minutes and, on the same
# warm machine right after it, a second call for what did not fit (a device call is at most 10 minutes; a
# session has 15 in all, a machine's start included).
#
#   here, once:   bash scripts/gpu_sitting.sh stage MAKE_TARGET_PY
#                 copies the random-target writer (the project's shared gpu/make_target.py) and the built-in SmolLM2's
#                 tokenizer into .gpu-stage/ (ignored by git; the device call carries it)
#   there:        bash scripts/gpu_sitting.sh run [PARTS]      (device call with carry [".gpu-stage"])
#                 first call: PARTS "target tests1 bench1 profile" (DEADLINE 540); second call, at once on the warm
#                 machine: "target tests2 bench8 load" with DEADLINE the time left (the target is kept in WORK)
#
# Parts (default: all, in this order), each bounded by what is left of DEADLINE seconds (default 555):
#   target  env (jax, GPU, driver) and the target: make_target.py at the 8B shape with LAYERS layers (default 4:
#           2.80 GB read per token, ~15 s compiles; the full 32 take ~45 s a compile and ~90 s to load) + a random
#           32k-vocabulary head; kept in WORK for a later call on the same machine
#   tests1, tests2   the compiled suite in two halves: the kernels' and the engine's tests with
#           JAXSPEC_KERNELS=pallas (Triton), xdist over the machine's cores, mesh and SmolLM2 tests left out (one GPU;
#           no network). tests1: attention kernel, rejection kernel, dispatch, greedy engine; tests2: trees,
#           sampling, the invariance matrix -> tests.log, tests.xml
#   bench1, bench8   `jaxspec.bench`, batch 1 (2 MT-Bench prompts) or 8 (8 prompts), 64 new tokens, kernels
#           compiled: target-only and a forced-acceptance chain K=5 at p=0.84 (tau ~ 4) interleaved (the decode /
#           verify / head-step component timings too with COMPONENTS=--components) -> bench-b1.json, bench-b8.json
#   dflash1, dflash8   the same bench with a random DFlash block drafter (`convert random-dflash`: blocks of 16,
#           5 layers): chains of 15 from one drafter forward at p=0.84 (tau ~5.9) -> bench-dflash-b1.json, -b8.json
#   load     the target's load speed (#44: >= 1 GB/s): `convert target` to orbax, then `bench --load-time` (3 loads
#           each of safetensors and orbax, weights placed on the GPU) -> its table appended to summary.txt
#   profile  decode steps profiled (scripts/gpu_profile.py: device time per step, launches, top ops by time) with
#           invariant numerics and the compiled kernels, then plain numerics -> profile.json (both)
#   splitk   the invariant decode profiled again with XLA's own split-K choice (JAXSPEC_GPU_SPLIT_K=xla; invariant
#           numerics force none on GPU) -> profile.json (with the profiles before it on this machine)
# summary.txt says what each part returned and how long it took; logs.txt the end of each part's log. At most 8
# files come back from a device call: env.txt summary.txt tests.log tests.xml bench-b*.json profile.json logs.txt.
# First sitting, 2026-11-27 on one H200 (BENCHMARKS.md): a machine's start took ~35 s; tests1 passed 64 of its 79
# cases in 230 s and tests2 22 of 48 in 220 s (no failure; compilation-bound on 16 cores); the bench, with the
# component timings then always on, was still compiling them after 150 s at batch 1 and 8, so they are opt-in now.
# The full 8B (the issue's GPU goals are stated there): LAYERS=32 makes a 32-layer target beside the 4-layer one
# (16 GB; ~35 s to write, ~45 s a compile), e.g. a second call `LAYERS=32 DEADLINE=... run "target bench1 profile"`.
# Plan for 15 minutes of device time: call 1 "target tests1 tests2" (~290 s: the compiled suite is the gate for the
# kernels' default), call 2 at once, LAYERS=32, "target bench1 dflash1 profile" (~7 min, not yet run).
# Second sitting, 2026-11-28 on one H200: "target bench1 profile splitk tests1" took 253 s (tests1: 54 of 54 in
# 125 s) and "target tests2 bench8 load" 219 s (tests2: 14 of 14 in 134 s; bench8 37 s), so both calls end well
# inside their limits; a third call on the warm machine ran the same files' slow cases (74 of 149 in 290 s).
set -uo pipefail
cd "$(dirname "$0")/.."
STAGE=.gpu-stage

if [ "${1:-}" = "stage" ]; then
    MAKE_TARGET=${2:?"usage: bash scripts/gpu_sitting.sh stage MAKE_TARGET_PY"}
    mkdir -p "$STAGE/tokenizer"
    cp "$MAKE_TARGET" "$STAGE/make_target.py"
    PY=${PYTHON:-.venv/bin/python}
    TOK=$($PY -c "from jaxspec.checkpoints.builtin import ensure_default_target as e; print(e(log=lambda *a: None))")
    for f in "$TOK"/tokenizer* "$TOK"/special_tokens* "$TOK"/chat_template* "$TOK"/generation_config.json; do
        [ -f "$f" ] && cp "$f" "$STAGE/tokenizer/"
    done
    du -sh "$STAGE"
    exit 0
fi
[ "${1:-}" = "run" ] || { echo "usage: bash scripts/gpu_sitting.sh stage MAKE_TARGET_PY | run [PARTS]" >&2; exit 2; }

OUT=${OUT:-bench-results/gpu-sitting}; WORK=${WORK:-/tmp/jaxspec-sitting}
mkdir -p "$OUT" "$WORK"
PY=${PYTHON:-python3}
DEADLINE=${DEADLINE:-555}; LAYERS=${LAYERS:-4}; SHAPE=${SHAPE:-llama3.1-8b}
TEST_SECONDS=${TEST_SECONDS:-300}; WORKERS=${WORKERS:-16}
COMPONENTS=${COMPONENTS:-}  # "--components": the bench also times decode, verify and a head step alone (+90 s or more)
export PYTHONUNBUFFERED=1 JAXSPEC_STEP_COSTS=off JAXSPEC_COMPILE_CACHE=$WORK/compile-cache
START=$(date +%s)
left() { echo $(( DEADLINE - ($(date +%s) - START) )); }
bounded() {  # bounded LABEL SECONDS CMD...: run CMD for at most SECONDS (and never past the deadline)
    local label=$1 want=$2; shift 2
    local t; t=$(left); [ "$want" -lt "$t" ] && t=$want
    if [ "$t" -lt 20 ]; then echo "$label: skipped (${t}s left)" | tee -a "$OUT/summary.txt" >&2; return 0; fi
    local begin; begin=$(date +%s)
    timeout --foreground -k 5 "$t" "$@"
    local rc=$?
    echo "$label: rc $rc in $(( $(date +%s) - begin ))s (limit ${t}s)" | tee -a "$OUT/summary.txt" >&2  # not stdout:
    # a part's stdout may be its result file (the bench's JSON)
    return $rc
}
log() { { echo "== $1"; tail -${2:-40} "$1"; } >>"$OUT/logs.txt"; }

{
    date -u +"%Y-%m-%dT%H:%M:%SZ"
    $PY -c "import jax, flax; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())"
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv
    git log -1 --format="commit %h %s" 2>/dev/null | cut -c1-120
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

T=$WORK/target-$SHAPE-$LAYERS; H=$WORK/head-$SHAPE-$LAYERS  # one target per shape and layer count on a machine
D=$WORK/dflash-$SHAPE-$LAYERS
PROFILE_SECONDS=$(( 45 + 4 * LAYERS ))  # a profile compiles one program (~1.4 s a layer) and runs it three times
PROMPTS=jaxspec/prompt_sets/mt_bench.jsonl
XDIST=$($PY -c "import xdist" 2>/dev/null && echo "-n $WORKERS")  # pytest-xdist where installed (the GPU image has it)

tests() {  # tests NAME FILES...: the compiled suite's part
    local name=$1; shift
    XLA_PYTHON_CLIENT_PREALLOCATE=false JAXSPEC_KERNELS=pallas bounded "compiled suite, $name" "$TEST_SECONDS" \
        $PY -m pytest -v --durations=20 $XDIST -p no:cacheprovider -m "not slow and not smollm2" -k "not mesh" "$@" \
        --junitxml="$OUT/tests.xml" >"$OUT/tests.log" 2>&1
    tail -5 "$OUT/tests.log"
}

bench() {  # bench BATCH PROMPTS SECONDS [DRAFT K NAME] (+8 s a layer: each of its ~4 programs compiles in ~1.4 s a
    # layer); the draft: the random head with chains of 5 (bench-bB.json), or e.g. the random DFlash drafter's 15
    local draft=${4:-$H} k=${5:-5} name=${6:-bench-b$1}
    bounded "$name" "$(( $3 + 8 * LAYERS ))" $PY -m jaxspec.bench --target "$T" --draft "$draft" \
        --prompts-file "$PROMPTS" \
        --limit "$2" --batch-size "$1" --max-new-tokens 64 --kernels pallas --num-speculative-tokens "$k" \
        --accept-prob 0.84 $COMPONENTS --json >"$OUT/$name.json" 2>"$WORK/$name.log"
    log "$WORK/$name.log" 25
}

profiles() {  # every profile taken so far on this machine -> profile.json
    $PY -c "import json, os, sys; print(json.dumps({n: json.load(open(f'$WORK/profile-{n}.json')) for n in
        sys.argv[1:] if os.path.exists(f'$WORK/profile-{n}.json')}, indent=1))" \
        invariant plain splitk >"$OUT/profile.json"
}

for part in ${2:-target tests1 tests2 bench1 profile bench8 load}; do
    case $part in
    target)
        if [ ! -f "$T/config.json" ]; then
            bounded "make target $SHAPE x$LAYERS layers" 120 $PY "$STAGE/make_target.py" "$T" "$STAGE/tokenizer" \
                "$SHAPE" "$LAYERS" >"$WORK/make.log" 2>&1 || { log "$WORK/make.log"; exit 1; }
        fi
        [ -f "$H/config.json" ] || bounded "random head" 60 $PY -m jaxspec.convert random-head --target "$T" \
            --draft-vocab 32000 --out "$H" >"$WORK/head.log" 2>&1 || log "$WORK/head.log" ;;
    tests1) tests tests1 tests/test_invariant_attention.py tests/test_rejection.py tests/test_dispatch.py \
        tests/test_spec_greedy.py ;;
    tests2) tests tests2 tests/test_spec_tree.py tests/test_spec_sampling.py tests/test_invariance.py ;;
    bench1) bench 1 2 120 ;;
    bench8) bench 8 8 120 ;;
    dflash1|dflash8)  # a random DFlash drafter (block 16, 5 layers as z-lab's 8B drafters): chains of 15 from one
        # forward at the same forced p=0.84 (tau ~5.9) against target-only (#45's GPU item)
        [ -f "$D/config.json" ] || bounded "random DFlash drafter" 60 $PY -m jaxspec.convert random-dflash \
            --target "$T" --out "$D" >"$WORK/dflash.log" 2>&1 || log "$WORK/dflash.log"
        b=${part#dflash}
        bench "$b" "$([ "$b" = 1 ] && echo 2 || echo 8)" 120 "$D" 15 "bench-dflash-b$b" ;;
    load)
        [ -d "$T-orbax" ] || bounded "convert target to orbax" 120 $PY -m jaxspec.convert target --target "$T" \
            --out "$T-orbax" --dtype bfloat16 >"$WORK/convert.log" 2>&1 || log "$WORK/convert.log"
        bounded "load time" 120 $PY -m jaxspec.bench --load-time "$T-orbax" --target "$T" --dtype bfloat16 \
            --repeats 3 >"$WORK/load.txt" 2>"$WORK/load.log" && cat "$WORK/load.txt" >>"$OUT/summary.txt"
        log "$WORK/load.log" 10 ;;
    profile)
        for numerics in invariant plain; do
            PYTHONPATH=. bounded "profile $numerics" "$PROFILE_SECONDS" $PY scripts/gpu_profile.py "$T" \
                --kernels pallas --numerics "$numerics" --new-tokens 33 --json "$WORK/profile-$numerics.json" \
                >/dev/null 2>"$WORK/profile-$numerics.log"
            log "$WORK/profile-$numerics.log" 10
        done
        profiles ;;
    splitk)  # the invariant decode with XLA's own split-K choice (JAXSPEC_GPU_SPLIT_K=xla) against the forced none
        JAXSPEC_GPU_SPLIT_K=xla PYTHONPATH=. bounded "profile invariant, XLA's split-K" "$PROFILE_SECONDS" $PY \
            scripts/gpu_profile.py "$T" --kernels pallas --numerics invariant --new-tokens 33 \
            --json "$WORK/profile-splitk.json" >/dev/null 2>"$WORK/profile-splitk.log"
        log "$WORK/profile-splitk.log" 10
        profiles ;;
    *) echo "unknown part $part" >&2; exit 2 ;;
    esac
done
echo "total: $(( $(date +%s) - START ))s" | tee -a "$OUT/summary.txt"
