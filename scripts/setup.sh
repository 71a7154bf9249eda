#!/usr/bin/env bash
# Create .venv (or reuse it) and install jaxspec with its test extras.
# torch is only for parity tests against transformers: its CPU build is installed first so that the resolver does
# not pull a multi-GB CUDA build. Override with TORCH_SPEC (e.g. TORCH_SPEC="torch==2.5.1") on other machines.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--fresh" ]; then rm -rf .venv; fi
if [ ! -x .venv/bin/python ]; then python3 -m venv .venv; fi
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet "${TORCH_SPEC:-torch==2.13.0}"
.venv/bin/python -m pip install --quiet -e ".[test]"
echo "jaxspec is installed in .venv"
