"""One process of a multi-host run on CPU: `python multihost_worker.py MODULE ARGS...` runs `jaxspec.MODULE` with
the tiny checkpoints' stand-in tokenizer (tests/test_multihost.py starts several, each with its own devices)."""

import importlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import jax  # noqa: E402
from hf_tiny import ByteTokenizer  # noqa: E402

from jaxspec import prompts  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")  # as conftest.py does for the in-process reference
prompts.load_tokenizer = lambda _: ByteTokenizer()
sys.exit(importlib.import_module(f"jaxspec.{sys.argv[1]}").main(sys.argv[2:]))
