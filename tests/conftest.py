import gc
import os
import sys
from pathlib import Path

# Simulate 8 devices on CPU for sharding tests; must happen before JAX initializes its backends.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAXSPEC_COMPILE_CACHE", "off")  # hermetic tests; tests/test_compile_cache.py turns it on
os.environ.setdefault("JAXSPEC_STEP_COSTS", "off")  # hermetic tests: every process times its own step costs
sys.path.insert(0, str(Path(__file__).parent))

import jax

jax.config.update("jax_default_matmul_precision", "highest")


import pytest


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Free each module's compiled programs when it ends. XLA:CPU maps code memory per compiled program (about 100
    mappings for a tiny target's prefill, 275 with invariant numerics' loops); one test process compiles hundreds,
    and past the kernel's limit (vm.max_map_count, 65 530 by default) compilation segfaults."""
    yield
    jax.clear_caches()
    gc.collect()
