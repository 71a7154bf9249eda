#!/usr/bin/env bash
# #13's unit tests compiled on a GPU (or TPU): the whole invariance matrix on tiny models, then the Llama-3.1-8B shape
# (random weights) in bfloat16. Logs and JUnit XML go to $OUT (default: bench-results/gpu). Run from the project root
# on the accelerator machine, with its own JAX:
#   bash scripts/gpu_invariance.sh [TINY_SECONDS] [REAL_SECONDS]
# Measured on one H100 (2026-11-24, BENCHMARKS.md): 55 tiny cases in 230 s; ~100 s per 8B case, nearly all of it
# compilation, so the 8B selection (14 cases, 7 of them with the compiled Pallas attention) needs more than one
# 10-minute call.
set -uo pipefail
OUT=${OUT:-bench-results/gpu}; mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
$PY -c "import jax, flax; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())" | tee "$OUT/env.txt"
# tiny models: every case, 8 workers sharing the GPU (no preallocation) where pytest-xdist is installed
WORKERS=$($PY -c "import xdist" 2>/dev/null && echo "-n 8")
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout "${1:-240}" $PY -m pytest -q -m "slow or not slow" $WORKERS -p no:cacheprovider \
    tests/test_invariance.py -k "not mesh" --junitxml="$OUT/tiny.xml" 2>&1 | tail -40 | tee "$OUT/tiny.log"
# the 8B shape: prefill, chain K=1/3/5 and tree verify of the llama family in bfloat16 (one process: 16 GB per model)
JAXSPEC_TEST_SHAPE=llama3.1-8b timeout "${2:-300}" $PY -m pytest -q -m "slow or not slow" -p no:cacheprovider \
    tests/test_invariance.py -k "llama and bfloat16 and (reference or pallas) and not mesh and not greedy" \
    --durations=0 --junitxml="$OUT/llama8b.xml" 2>&1 | tail -60 | tee "$OUT/llama8b.log"
