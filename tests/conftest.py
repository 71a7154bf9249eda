import atexit
import gc
import os
import shutil
import sys
import tempfile
from pathlib import Path

# Simulate 8 devices on CPU for sharding tests; must happen before JAX initializes its backends.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAXSPEC_COMPILE_CACHE", "off")  # hermetic tests; tests/test_compile_cache.py turns it on
os.environ.setdefault("JAXSPEC_STEP_COSTS", "off")  # hermetic tests: every process times its own step costs
# libtpu (deviceless TPU compiles) locks /tmp/libtpu_lockfile against a second process using a TPU: the pytest-xdist
# workers and the CLI processes they start compile for TPUs side by side, and none of them holds a chip
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
sys.path.insert(0, str(Path(__file__).parent))


def _session_compile_cache() -> None:
    """One JAX compilation cache for the whole test session: this process and every CLI it starts (they inherit the
    environment). The tests build the same tiny programs many times over, a Generator per test and a process per CLI
    run, and a hit loads what XLA built before instead of building it again. Entries are keyed by the program, the
    backend, the versions and the flags, so a hit is the program a compile would give; a fresh directory per session,
    removed at exit, keeps the tests hermetic. tests/test_compile_cache.py points the CLI at its own directory."""
    if "JAX_COMPILATION_CACHE_DIR" in os.environ:
        return
    where = tempfile.mkdtemp(prefix="jaxspec-tests-compile-cache-")
    atexit.register(shutil.rmtree, where, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = where
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"  # the tiny programs compile fast; they add up
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"


_session_compile_cache()

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
