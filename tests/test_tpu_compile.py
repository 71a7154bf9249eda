"""Both Pallas kernels through Mosaic's whole TPU compiler on this CPU: libtpu compiles ahead of time for a TPU
topology (`jax.experimental.topologies`) without a TPU, running the passes `jax.export` does not (vector layouts,
tiling and alignment, the VMEM budget; two real bugs surfaced only here). libtpu is ~700 MB and makes every jax
import probe for a TPU, so it is not a test dependency: this test installs the version jax's `tpu` extra pins into
the user's cache directory once and runs the `*compiles_for_tpu*` tests of the lowering files in a subprocess with it
on the path; in the main run they skip."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from jaxspec.bench.compiled_cost import libtpu_dir

ROOT = Path(__file__).resolve().parents[1]
FILES = ["tests/test_invariant_kernel_lowering.py", "tests/test_rejection_lowering.py"]


def test_kernels_compile_for_tpu_with_libtpu():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(libtpu_dir()), str(ROOT)])}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "compiles_for_tpu", *FILES],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=1800, check=False,
    )
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "passed" in summary and "skipped" not in summary, summary  # compiled, not skipped
