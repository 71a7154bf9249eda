"""--distributed on one machine: two processes with two CPU devices each join through jax.distributed and shard
one data=2 × model=2 mesh across both; the greedy output must equal one device's target-only output, and only
process 0 prints it."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from hf_tiny import ByteTokenizer, make_tiny

from jaxspec import generate

WORKER = str(Path(__file__).parent / "multihost_worker.py")


@pytest.fixture(scope="module")
def target_and_head(tmp_path_factory):
    from fit_head import head_config_for
    from flax import nnx

    from jaxspec.checkpoints.heads import export_head
    from jaxspec.checkpoints.hf import load_target
    from jaxspec.models.eagle3 import Eagle3Head

    path = tmp_path_factory.mktemp("multihost")
    make_tiny("qwen2_bias", path / "target", seed=5)  # 4 query and 2 KV heads: model=2 divides both
    target = load_target(path / "target")
    head = Eagle3Head(head_config_for(target), rngs=nnx.Rngs(0))
    export_head(head, path / "head", layout="speculators", target=target.config, dtype="float32")
    return path / "target", path / "head"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _run_two_processes(argv: list[str]) -> list[subprocess.CompletedProcess]:
    port = _free_port()
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu"}
    procs = [
        subprocess.Popen(
            [sys.executable, WORKER, "generate", *argv, "--distributed", "--coordinator", f"localhost:{port}",
             "--num-processes", "2", "--process-id", str(i), "--mesh", "data=2,model=2"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        )
        for i in range(2)
    ]
    done = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=600)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        done.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    return done


# CI: a chain. auto (both processes time the same programs and must choose alike, else a hang) costs two step-cost
# timings, ~70 s more: under -m slow, with target-only
@pytest.mark.parametrize("draft", [
    pytest.param([], marks=pytest.mark.slow), ["--num-speculative-tokens", "3"],
    pytest.param(["--num-speculative-tokens", "auto"], marks=pytest.mark.slow)], ids=["target-only", "chain", "auto"])
def test_two_processes_equal_one_device(draft, target_and_head, tmp_path, capsys, monkeypatch):
    """auto: both processes time the same programs in step, and run the chain length process 0 chose."""
    target, head = target_and_head
    prompts = tmp_path / "p.jsonl"
    texts = ["abc", "hello there"] + (["zz top", "a b c d"] if "auto" in draft else [])  # auto: a second batch
    prompts.write_text("".join(json.dumps({"id": str(i), "prompt": t}) + "\n" for i, t in enumerate(texts)))
    target_only = ["--target", str(target), "--prompts-file", str(prompts), "--raw", "--json", "--max-new-tokens", "10",
                   "--batch-size", "2"]
    argv = [*target_only, *(["--draft", str(head), *draft] if draft else [])]

    from jaxspec import prompts as prompts_mod

    monkeypatch.setattr(prompts_mod, "load_tokenizer", lambda _: ByteTokenizer())
    assert generate.main(target_only) == 0  # one device, target-only: what greedy speculation must give
    out = capsys.readouterr().out
    want = [json.loads(line)["token_ids"] for line in out.strip().splitlines()]

    first, second = _run_two_processes(argv)
    assert first.returncode == 0 and second.returncode == 0, first.stderr[-3000:] + second.stderr[-3000:]
    got = [json.loads(line)["token_ids"] for line in first.stdout.strip().splitlines()]
    assert got == want and len(got) == len(texts) and all(len(ids) == 10 for ids in got)
    if "auto" in draft:  # the second batch's choice rests on timings: the same on both processes (else a hang)
        record = json.loads(first.stdout.strip().splitlines()[-1])
        assert record["stats"]["auto"]["basis"] == "observed" and record["stats"]["auto"]["step_costs_ms"]
    assert second.stdout == ""  # the same results: only process 0 prints them


@pytest.mark.parametrize("flags, message", [
    (["--coordinator", "localhost:1"], "--coordinator, --num-processes and --process-id go with --distributed"),
    (["--distributed", "--coordinator", "localhost:1"], "needs all of --coordinator HOST:PORT, --num-processes N"),
    (["--distributed", "--coordinator", "localhost:1", "--num-processes", "2", "--process-id", "2"],
     "--process-id must be in 0..1, got 2"),
])
def test_bad_distributed_flags_are_one_line_errors(flags, message, target_and_head, capsys):
    with pytest.raises(SystemExit) as exc:
        generate.main(["--target", str(target_and_head[0]), "--prompt", "abc", "--raw", *flags])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert exc.value.code == 2 and len(lines) == 1 and message in lines[0] and "Traceback" not in err
