"""The built-in target builds with the oldest versions pyproject.toml allows of what its conversion uses, in a fresh
virtual environment without jax: `convert smollm2` once imported a private transformers function that a later
release moved, so the floors are tested, not assumed."""

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.version import Version

from jaxspec.checkpoints import builtin

pytestmark = pytest.mark.smollm2
ROOT = Path(__file__).resolve().parents[1]
CONVERSION_DEPENDENCIES = ("transformers", "tokenizers", "gguf", "safetensors", "numpy", "jinja2")


def floor_pins() -> list[str]:
    """`name==floor` for each dependency the conversion uses, read from pyproject.toml's `name>=floor`."""
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    floors = dict(d.replace(" ", "").split(">=", 1) for d in deps if ">=" in d)
    return [f"{name}=={floors[name]}" for name in CONVERSION_DEPENDENCIES]


def run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run(cmd, check=False, capture_output=True, text=True, **kwargs)
    assert result.returncode == 0, f"{' '.join(cmd)} failed:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
    return result


@pytest.mark.slow  # 76 s: a venv at pyproject's lower bounds; run it when a bound moves
def test_builtin_target_builds_with_the_oldest_allowed_dependencies(tmp_path):
    venv = tmp_path / "floor"
    run([sys.executable, "-m", "venv", str(venv)])
    python = str(venv / "bin" / "python")
    run([python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", *floor_pins()])
    report = f"import importlib.metadata as m, json; print(json.dumps({{n: m.version(n) for n in {CONVERSION_DEPENDENCIES}}}))"
    versions = json.loads(run([python, "-c", report]).stdout)
    for pin in floor_pins():
        name, floor = pin.split("==")
        assert Version(versions[name]) == Version(floor), versions

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = tmp_path / "smollm2"
    run([python, "-m", "jaxspec.convert", "smollm2", "--out", str(out)], env=env, cwd=tmp_path)
    ours = builtin.ensure_default_target()  # built with this environment's (newest) versions
    built = sorted(p.name for p in out.iterdir())
    assert built == sorted(p.name for p in ours.iterdir())
    for name in built:
        assert (out / name).read_bytes() == (ours / name).read_bytes(), f"{name} differs with the oldest versions"

    probe = (
        "import sys; from transformers import AutoTokenizer; t = AutoTokenizer.from_pretrained(sys.argv[1]); "
        "print(t.apply_chat_template([{'role': 'user', 'content': 'Add 12 and 7 🌺'}], add_generation_prompt=True))"
    )
    floor_ids = run([python, "-c", probe, str(out)], env=env).stdout.strip()
    newest_ids = run([sys.executable, "-c", probe, str(ours)]).stdout.strip()
    assert floor_ids == newest_ids
