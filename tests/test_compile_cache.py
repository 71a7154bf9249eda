"""The CLIs keep compiled programs on disk (JAX's persistent compilation cache): a second run of the same shapes
loads them instead of compiling; `--no-compile-cache` writes nothing (the tests run with JAXSPEC_COMPILE_CACHE=off)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hf_tiny import make_tiny, write_char_tokenizer

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_compile_cache")
    make_tiny("smollm2_tied", path, seed=4)
    write_char_tokenizer(path)
    return path


def generate(tiny_dir: Path, cache, *extra: str) -> dict:
    """One generate run in a fresh process; its --json record (compile_seconds among the stats)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAXSPEC_COMPILE_CACHE": str(cache)}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)  # the test session's own cache (conftest.py): not this CLI's
    cmd = [sys.executable, "-m", "jaxspec.generate", "--target", str(tiny_dir), "--no-draft", "--raw", "--json",
           "--prompt", "hello", "--max-new-tokens", "4", *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_second_run_skips_compilation_and_the_flag_turns_it_off(tiny_dir, tmp_path):
    cache = tmp_path / "cache"
    first = generate(tiny_dir, cache)
    assert list(cache.iterdir()), "nothing was cached"
    second = generate(tiny_dir, cache)
    assert second["token_ids"] == first["token_ids"]
    cold, warm = first["stats"]["compile_seconds"], second["stats"]["compile_seconds"]
    assert warm < 0.5 * cold, (cold, warm)  # what is left is tracing and lowering, not XLA's compile
    generate(tiny_dir, tmp_path / "unused", "--no-compile-cache")
    assert not (tmp_path / "unused").exists()
