"""Nothing lost, nothing silently wrong (#46): every bad input, unwritable path and corrupt file is one line,
`error: ...`, and exit code 2, never a traceback; and what the README promises "before any weights load" is checked
before they load. In process (a subprocess costs a JAX import), with a tiny target; no model is loaded."""

import gzip
import json
import random
import shutil
import sys

import numpy as np
import pytest
import yaml
from hf_tiny import make_tiny, write_char_tokenizer
from test_train_config import fails as one_line_error  # exit 2, one line `error: ...`, no traceback

from jaxspec import convert, generate
from jaxspec.bench import cli as bench
from jaxspec.serve import __main__ as serve
from train import data as train_data
from train import launch


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny target with a tokenizer (4 query heads, 1 KV head, vocabulary 97, context 256)."""
    path = tmp_path_factory.mktemp("bad_input") / "target"
    make_tiny("smollm2_tied", path, seed=4)
    write_char_tokenizer(path)
    return path


@pytest.fixture
def no_loading(monkeypatch):
    """Loading a model fails the test: the checks under test must come first."""
    import jaxspec.checkpoints.hf as hf

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the bad input was caught")

    import jaxspec.cli.loading as loading

    for module in (generate, bench, loading):  # loading: the server and train.data import it when they run
        monkeypatch.setattr(module, "load_target_and_tokenizer", refuse)
    monkeypatch.setattr(hf, "load_target", refuse)  # train.launch imports it when it runs


def write_target_config(tiny, tmp_path, change) -> str:
    """A copy of the tiny target whose config.json `change` rewrote (a function of the parsed JSON)."""
    target = tmp_path / "target"
    shutil.copytree(tiny, target)
    (target / "config.json").write_text(json.dumps(change(json.loads((tiny / "config.json").read_text()))))
    return str(target)


BAD_FILES = {
    # name: (file name, bytes, message)
    "prompts not UTF-8": ("p.jsonl", b'{"prompt": "h\xffi"}\n', "is not valid UTF-8 (byte 0xff at offset 13)"),
    "gz that is not gzip": ("p.jsonl.gz", b'{"prompt": "hi"}\n', "is not a whole gzip file"),
    "gz cut short": ("p.jsonl.gz", gzip.compress(b'{"prompt": "hi"}\n' * 50)[:30], "is not a whole gzip file"),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_a_prompts_file_that_cannot_be_read_is_one_line(case, tiny, tmp_path, capsys, no_loading):
    name, data, message = BAD_FILES[case]
    (tmp_path / name).write_bytes(data)
    err = one_line_error(capsys, generate.main, ["--target", str(tiny), "--prompts-file", str(tmp_path / name)])
    assert message in err and name in err
    err = one_line_error(capsys, bench.main, ["--target", str(tiny), "--no-draft", "--suite", str(tmp_path / name)])
    assert message in err


def test_prompt_bytes_that_are_not_utf8(tiny, capsys, no_loading):
    """A --prompt of undecodable bytes reaches Python as surrogate escapes; the tokenizer raised a TypeError."""
    err = one_line_error(capsys, generate.main, ["--target", str(tiny), "--no-draft", "--prompt", "h\udcffi"])
    assert "--prompt is not valid UTF-8 (byte 0xff at offset 1)" in err


def test_a_directory_is_not_reported_missing(tiny, tmp_path, capsys, no_loading):
    err = one_line_error(capsys, generate.main, ["--target", str(tiny), "--prompts-file", str(tmp_path)])
    assert "is a directory; pass a file" in err
    (tmp_path / "head").write_text("")
    err = one_line_error(capsys, generate.main, ["--target", str(tiny), "--draft", str(tmp_path / "head"),
                                                 "--prompt", "hi"])
    assert "is a file; pass the head's directory" in err
    err = one_line_error(capsys, convert.main, ["smollm2", "--gguf", str(tmp_path), "--out", str(tmp_path / "o")])
    assert "is a directory; pass the .gguf file" in err


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda raw: [1, 2], "holds list [1, 2], not a JSON object"),
        (lambda raw: {**raw, "hidden_size": "big"}, "config.json: hidden_size must be an integer, got 'big'"),
        (lambda raw: {**raw, "num_attention_heads": None}, "config.json lacks the field 'num_attention_heads'"),
        (lambda raw: {**raw, "num_key_value_heads": -1}, "num_key_value_heads must be an integer >= 1, got -1"),
        (lambda raw: {**raw, "vocab_size": 0}, "vocab_size must be an integer >= 1, got 0"),
        (lambda raw: {**raw, "rope_scaling": [1]}, "config.json has a field of the wrong type"),
        (lambda raw: {**raw, "model_type": ["llama"]}, "unsupported architecture"),
    ],
)
def test_a_target_config_of_the_wrong_type_is_one_line(change, message, tiny, tmp_path, capsys, no_loading):
    target = write_target_config(tiny, tmp_path, change)
    err = one_line_error(capsys, generate.main, ["--target", target, "--prompt", "hi"])
    assert message in err


def test_a_head_config_of_the_wrong_type_is_one_line(tiny, tmp_path, capsys, no_loading):
    head = tmp_path / "head"
    head.mkdir()
    (head / "config.json").write_text(json.dumps({"draft_vocab_size": 32, "hidden_size": [64]}))
    err = one_line_error(capsys, generate.main, ["--target", str(tiny), "--draft", str(head), "--prompt", "hi"])
    assert "head config.json: hidden_size must be an integer, got [64]" in err


OUT_OF_RANGE = [
    (generate, ["--max-new-tokens", "-1"], "--max-new-tokens must be at least 1, got -1"),
    (generate, ["--max-new-tokens", str(10**30)], "--max-new-tokens: must be at most 2147483647"),
    (generate, ["--batch-size", "0"], "--batch-size must be at least 1, got 0"),
    (generate, ["--batch-size", str(2**40)], "--batch-size: must be at most 2147483647"),
    (generate, ["--seed", str(2**70)], "--seed: must be at most 9223372036854775807"),
    (generate, ["--top-k", str(2**31)], "--top-k: must be at most 2147483647"),
    (generate, ["--proposer", "ngram", "--ngram-min", "0"], "--ngram-min and --ngram-max need 1 <= min <= max"),
    (generate, ["--max-new-tokens", "x"], "--max-new-tokens: expected an integer, got 'x'"),
    (bench, ["--limit", "-1"], "--limit must be 0 (all prompts) or more"),
    (bench, ["--max-new-tokens", "0"], "--max-new-tokens must be at least 1"),
    (bench, ["--repeats", "0"], "--repeats: must be at least 1"),
    (bench, ["--batch-sizes", f"1,{2**40}"], "expected positive integers (up to 2147483647)"),
    (convert, ["random-head", "--draft-vocab", "-5", "--out", "o"], "--draft-vocab: must be at least 0, got -5"),
    (convert, ["random-head", "--seed", str(2**64), "--out", "o"], "--seed: must be at most"),
]


@pytest.mark.parametrize("module, extra, message", OUT_OF_RANGE, ids=[" ".join(c[1][:2]) for c in OUT_OF_RANGE])
def test_integer_flags_out_of_range_are_one_line(module, extra, message, tiny, capsys, no_loading):
    base = {generate: ["--target", str(tiny), "--prompt", "hi"], bench: ["--target", str(tiny), "--suite", "mt_bench"],
            convert: []}[module]
    argv = [*extra, "--target", str(tiny)] if module is convert else [*base, *extra]
    assert message in one_line_error(capsys, module.main, argv)


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--distributed", "--coordinator", "localhost", "--num-processes", "2", "--process-id", "0"],
         "--coordinator wants HOST:PORT"),
        (["--distributed", "--coordinator", "h:99999", "--num-processes", "2", "--process-id", "0"],
         "a port in 1..65535"),
        (["--distributed", "--coordinator", "h:1234", "--num-processes", "0", "--process-id", "0"],
         "--num-processes: must be at least 1"),
        (["--distributed", "--coordinator", "h:1234", "--num-processes", "2", "--process-id", "2"],
         "--process-id must be in 0..1, got 2"),
        (["--distributed", "--coordinator", "h:1234"], "needs all of --coordinator"),
        (["--process-id", "0"], "go with --distributed"),
        (["--mesh", "data=two"], "--mesh expects data=D,model=M"),
        (["--mesh", "data=64"], "needs 64 devices, but"),
    ],
)
def test_malformed_distributed_and_mesh_flags(extra, message, tiny, capsys, no_loading):
    err = one_line_error(capsys, generate.main, ["--target", str(tiny), "--no-draft", "--prompt", "hi", *extra])
    assert message in err


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--max-new-tokens", "255", "--prompt", "abc"], "exceeds the model's context length of 256 tokens"),
        (["--max-new-tokens", "2", "--prompt", "hi", "--logit-bias", '{"500": 1}'], "the vocabulary has 97 tokens"),
        (["--max-new-tokens", "2", "--prompt", "hi", "--mesh", "data=2"], "not a multiple of the mesh's data axis"),
        (["--max-new-tokens", "2", "--prompt", "hi", "--mesh", "model=3"], "which the mesh's model axis (3) does not"),
    ],
)
def test_what_the_readme_promises_is_checked_before_weights_load(extra, message, tiny, capsys, no_loading):
    err = one_line_error(capsys, generate.main, ["--target", str(tiny), "--no-draft", "--raw", *extra])
    assert message in err


def test_bench_checks_every_batch_size_against_the_mesh_before_loading(tiny, tmp_path, capsys, no_loading):
    (tmp_path / "p.jsonl").write_text('{"prompt": "hi"}\n')
    err = one_line_error(capsys, bench.main, ["--target", str(tiny), "--no-draft", "--raw", "--suite",
                                              str(tmp_path / "p.jsonl"), "--batch-sizes", "2,3", "--mesh", "data=2",
                                              "--out", str(tmp_path / "out")])
    assert "--batch-size 3 is not a multiple of the mesh's data axis (2)" in err


def test_unwritable_locations_are_one_line(tiny, tmp_path, capsys, monkeypatch, no_loading):
    afile = tmp_path / "afile"
    afile.write_text("")
    err = one_line_error(capsys, bench.main, ["--target", str(tiny), "--no-draft", "--suite", "mt_bench",
                                              "--out", str(afile / "results")])
    assert f"--out {str(afile / 'results')!r} is under {str(afile)!r}, which is a file" in err
    err = one_line_error(capsys, convert.main, ["random-head", "--target", str(tiny), "--out", str(afile / "h")])
    assert "which is a file; choose another location" in err
    monkeypatch.setenv("XDG_CACHE_HOME", str(afile))
    monkeypatch.delenv("JAXSPEC_COMPILE_CACHE")
    err = one_line_error(capsys, generate.main, ["--target", str(tiny), "--no-draft", "--prompt", "hi"])
    assert "cannot create the compile cache directory" in err and "--no-compile-cache" in err


def test_stdout_on_a_full_disk_is_one_line(tiny, tmp_path, capsys, monkeypatch):
    """/dev/full: every write fails with ENOSPC, as stdout redirected to a full disk does."""
    full = open("/dev/full", "w")  # noqa: SIM115 (closed below)
    monkeypatch.setattr(sys, "stdout", full)
    try:
        err = one_line_error(capsys, convert.main, ["random-head", "--target", str(tiny), "--out", str(tmp_path / "h")])
    finally:
        monkeypatch.undo()
        full.close()
    assert "No space left on device: (the output stream); free some space" in err
    full = open("/dev/full", "w")  # noqa: SIM115 (closed below)
    monkeypatch.setattr(sys, "stdout", full)
    try:  # --help printed into a full disk exited 0, silently
        err = one_line_error(capsys, bench.main, ["--help"])
    finally:
        monkeypatch.undo()
        full.close()
    assert "No space left on device" in err


def test_training_refuses_a_mesh_larger_than_the_devices_and_an_out_under_a_file(tmp_path, capsys, no_loading):
    import jax

    data = tmp_path / "data"
    data.mkdir()
    train_data.write_shard(data / "shard-00000.npz", [[1, 2, 3]], [1], ["a"], [True])
    cfg = {"data": str(data), "out": str(tmp_path / "run"),
           "train": {"num_draft_steps": 2, "batch_size": 2, "seq_len": 8, "steps": 1},
           "mesh": {"data": jax.device_count() * 2, "fsdp": 1}}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    err = one_line_error(capsys, launch.main, ["--config", str(path)])
    assert f"needs {jax.device_count() * 2} devices, but {jax.device_count()} are visible" in err
    (tmp_path / "afile").write_text("")
    err = one_line_error(capsys, launch.main, ["--config", str(path), "mesh.data=1", f"out={tmp_path / 'afile' / 'r'}"])
    assert "which is a file; choose another location" in err
    assert not (tmp_path / "run").exists()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_server_checks_its_port_and_model_length_before_loading(tiny, capsys, no_loading):
    """A port past 65535 listened on another one (the OS wraps it); a port in use failed in uvicorn after loading
    and compiling, exit 3; --max-model-len past the context was checked after loading."""
    import socket

    err = one_line_error(capsys, serve.main, ["--target", str(tiny), "--no-draft", "--port", "99999"])
    assert "--port: must be at most 65535, got 99999" in err
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        err = one_line_error(capsys, serve.main, ["--target", str(tiny), "--no-draft", "--port", str(port)])
    assert f"cannot listen on 127.0.0.1:{port}" in err and "choose another --port" in err
    err = one_line_error(capsys, serve.main, ["--target", str(tiny), "--no-draft", "--port", str(free_port())])
    assert "--max-model-len 2048 exceeds the model's context length 256" in err  # the default, on a 256 context
    fits = ["--target", str(tiny), "--no-draft", "--port", str(free_port()), "--max-model-len", "64"]
    err = one_line_error(capsys, serve.main, [*fits, "--mesh", "data=2,model=1", "--slots", "3"])
    assert "--slots 3 is not a multiple of the mesh's data axis (2)" in err
    err = one_line_error(capsys, serve.main, [*fits, "--mesh", "data=2,model=1", "--distributed"])
    assert "drop --distributed" in err


def test_writers_refuse_a_directory_of_other_files(tiny, tmp_path, capsys, no_loading):
    """bench --out replaced a results.json it had not written; train.data and train.launch wrote into any
    directory; convert target refused even its own earlier output. Each refuses other files before loading, and
    a rerun may replace what the same command wrote."""
    foreign = tmp_path / "notes"
    foreign.mkdir()
    (foreign / "results.json").write_text('{"my": "precious"}')
    err = one_line_error(capsys, bench.main, ["--target", str(tiny), "--no-draft", "--raw", "--suite", "mt_bench",
                                              "--out", str(foreign)])
    assert f"--out {str(foreign)!r} is not empty and holds no suite report" in err and "--overwrite" in err
    (tmp_path / "p.jsonl").write_text('{"prompt": "hi"}\n')
    err = one_line_error(capsys, train_data.main, ["generate", "--target", str(tiny), "--prompts",
                                                   str(tmp_path / "p.jsonl"), "--out", str(foreign)])
    assert "holds no dataset" in err
    err = one_line_error(capsys, convert.main, ["target", "--target", str(tiny), "--out", str(foreign)])
    assert "holds no orbax target" in err
    data = tmp_path / "data"
    data.mkdir()
    train_data.write_shard(data / "shard-00000.npz", [[1, 2, 3]], [1], ["a"], [True])
    cfg = {"data": str(data), "out": str(foreign), "target": str(tiny),
           "train": {"num_draft_steps": 2, "batch_size": 2, "seq_len": 8, "steps": 1}}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    err = one_line_error(capsys, launch.main, ["--config", str(tmp_path / "run.yaml")])
    assert "is not empty and holds no training run" in err
    assert [p.name for p in foreign.iterdir()] == ["results.json"]
    assert (foreign / "results.json").read_text() == '{"my": "precious"}'
    from jaxspec.bench.suite import holds_suite_report, write_report

    report = {"suite": "s", "target": "t", "dtype": "float32", "prompts": 1, "max_new_tokens": 1, "machine": "m",
              "runs": [{"batch_size": 1, "method": "target-only", "tokens_per_second": 10.0}]}
    write_report(report, tmp_path / "report")
    assert holds_suite_report(tmp_path / "report") and not holds_suite_report(foreign)


def test_a_rerun_of_convert_target_replaces_its_own_output(tiny, tmp_path, capsys):
    out = tmp_path / "orbax"
    for _ in range(2):
        assert convert.main(["target", "--target", str(tiny), "--out", str(out)]) == 0
    assert (out / "jaxspec_orbax.json").is_file() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


@pytest.mark.parametrize("extra, message", [
    (["--json-schema", '{"type":'], "the JSON schema is not valid JSON"),
    (["--json-schema", "nosuch.json"], "--json-schema file 'nosuch.json' does not exist"),
    (["--regex", "("], "cannot be compiled to a token automaton"),
    (["--choice", ""], "choices must be a non-empty list of non-empty strings"),
])
def test_structured_output_flags_are_checked_before_loading(extra, message, tiny, tmp_path, capsys, monkeypatch,
                                                             no_loading):
    monkeypatch.chdir(tmp_path)
    err = one_line_error(capsys, generate.main, ["--target", str(tiny), "--no-draft", "--raw", "--prompt", "hi",
                                                 "--max-new-tokens", "2", *extra])
    assert message in err


def test_a_draft_and_a_step_cost_store_are_checked_before_loading(tiny, tmp_path, capsys, monkeypatch, no_loading):
    """A truncated head's safetensors and a JAXSPEC_STEP_COSTS naming a directory were errors after the target
    had loaded."""
    head = tmp_path / "head"
    assert convert.main(["random-head", "--target", str(tiny), "--out", str(head)]) == 0
    base = ["--target", str(tiny), "--raw", "--prompt", "hi", "--max-new-tokens", "2"]
    with monkeypatch.context() as env:  # read by automatic speculation, so checked where a draft is given
        env.setenv("JAXSPEC_STEP_COSTS", str(tmp_path))
        err = one_line_error(capsys, generate.main, [*base, "--draft", str(head)])
        assert "JAXSPEC_STEP_COSTS" in err and "is a directory" in err
        err = one_line_error(capsys, serve.main, ["--target", str(tiny), "--draft", str(head), "--port",
                                                  str(free_port()), "--max-model-len", "128"])
        assert "JAXSPEC_STEP_COSTS" in err and "is a directory" in err
    whole = (head / "model.safetensors").read_bytes()
    (head / "model.safetensors").write_bytes(whole[: len(whole) // 2])
    err = one_line_error(capsys, generate.main, [*base, "--draft", str(head)])
    assert "model.safetensors" in err and "corrupt or truncated safetensors file" in err


def test_a_truncated_shard_on_a_generation_rerun_is_one_line(tiny, tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": str(i), "prompt": f"q{i}"}) + "\n" for i in range(4)))
    out = tmp_path / "out"
    out.mkdir()
    train_data.write_shard(out / "shard-00000.npz", [[1, 2]] * 4, [1] * 4, ["0", "1", "2", "3"], [True] * 4)
    whole = (out / "shard-00000.npz").read_bytes()
    (out / "shard-00000.npz").write_bytes(whole[: len(whole) // 2])  # a disk that filled mid-write
    err = one_line_error(capsys, train_data.main, ["generate", "--prompts", str(prompts), "--out", str(out),
                                                   "--target", str(tiny), "--shard-size", "4"])
    assert "shard-00000.npz" in err and "delete it and run the command again" in err


def test_a_resume_falls_back_from_an_unreadable_checkpoint(tmp_path):
    """The newest checkpoint cannot be read (a full disk or a cut copy damaged it after orbax finalized it): the run
    resumes from the previous one kept, says which, and moves the unreadable one aside so later saves do not meet
    it; when none can be read, a one-line error and nothing moved."""
    import jax.numpy as jnp

    from jaxspec.errors import JaxspecError
    from train.checkpointing import RunCheckpoints

    state = {"w": jnp.arange(6.0).reshape(2, 3)}
    ckpt = RunCheckpoints(tmp_path / "checkpoints", keep=3)
    for step in (2, 4):
        ckpt.save(step, {"w": state["w"] + step}, {"next_step": step})
    ckpt.close()
    shutil.rmtree(tmp_path / "checkpoints" / "4" / "state")
    said = []
    ckpt = RunCheckpoints(tmp_path / "checkpoints", keep=3)
    step, restored, meta = ckpt.restore_latest(state, said.append)
    assert step == 2 and meta == {"next_step": 2} and np.array_equal(restored["w"], state["w"] + 2)
    assert "the checkpoint of step 4 cannot be read" in said[0] and "resuming from step 2" in said[0]
    assert (tmp_path / "checkpoints-unreadable" / "4").is_dir() and ckpt.latest_step() == 2
    ckpt.save(4, restored, {"next_step": 4})  # the step saved again: nothing in the way
    ckpt.close()
    for step in ("2", "4"):
        shutil.rmtree(tmp_path / "checkpoints" / step / "state")
    ckpt = RunCheckpoints(tmp_path / "checkpoints", keep=3)
    with pytest.raises(JaxspecError, match="no checkpoint in .* can be read .step 4"):
        ckpt.restore_latest(state, said.append)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["2", "4"]
    ckpt.close()


# --- property: random malformed input ----------------------------------------------------------------------------

JUNK = ["", "-1", "0", "x", "1e3", "nan", "2**70", str(2**63), "-9" * 12, "data=0", "h:", "\udcff", "[]", "{",
        "1,,", ",", "8,99,2", "99,2,2"]
FLAGS = {
    generate: ["--max-new-tokens", "--batch-size", "--seed", "--top-k", "--top-p", "--temperature", "--tree",
               "--num-speculative-tokens", "--mesh", "--logit-bias", "--min-p", "--ngram-min", "--process-id",
               "--coordinator", "--prompts-file"],
    bench: ["--limit", "--repeats", "--batch-sizes", "--chain-lengths", "--max-new-tokens", "--tree", "--accept-prob",
            "--mesh", "--kernel-vocab", "--num-speculative-tokens"],
    convert: ["--draft-vocab", "--seed", "--target", "--layout"],
    serve: ["--slots", "--port", "--max-model-len", "--chunk-steps", "--default-max-tokens", "--temperature",
            "--top-p", "--top-k", "--max-grammar-states", "--max-grammar-classes", "--seed", "--tree",
            "--num-speculative-tokens"],
    train_data: ["--limit", "--seed", "--shard-size", "--batch-size", "--max-new-tokens", "--host-index",
                 "--num-hosts", "--exclude"],
    launch: ["train.steps", "train.batch_size", "train.seq_len", "optim.learning_rate", "mesh.data", "head.init_from",
             "train.num_draft_steps", "target.quantize"],  # config overrides: key=value
}
MODULES = list(FLAGS)


def malformed_cases(count: int, seed: int = 46) -> list:
    """(module, argv) pairs: a valid base command with one to three flags given junk values (seeded)."""
    rng = random.Random(seed)
    cases = []
    while len(cases) < count:
        module = rng.choice(MODULES)
        flags = rng.sample(FLAGS[module], rng.randint(1, 3))
        if module is launch:
            extra = [f"{flag}={rng.choice(JUNK)}" for flag in flags]
        else:
            extra = [x for flag in flags for x in (flag, rng.choice(JUNK))]
        cases.append((module, extra))
    return cases


MALFORMED = malformed_cases(40)


@pytest.mark.parametrize("module, extra", MALFORMED,
                         ids=[f"{i}-{m.__name__.rsplit('.', 1)[-1]}" for i, (m, _) in enumerate(MALFORMED)])
def test_random_malformed_input_is_one_line(module, extra, tiny, tmp_path, capsys, monkeypatch, no_loading):
    monkeypatch.chdir(tmp_path)  # a junk --out lands here
    (tmp_path / "taken").write_text("")
    if module is convert:
        argv = ["random-head", "--target", str(tiny), "--out", "taken/h", *extra]
    elif module is serve:  # the default --max-model-len (2048) is past the tiny context (256)
        argv = ["--target", str(tiny), "--no-draft", "--port", str(free_port()), *extra]
    elif module is train_data:
        (tmp_path / "p.jsonl").write_text('{"prompt": "hi"}\n')
        argv = ["generate", "--target", str(tiny), "--prompts", "p.jsonl", "--out", "taken/d", *extra]
    elif module is launch:
        (tmp_path / "data").mkdir()
        train_data.write_shard(tmp_path / "data" / "shard-00000.npz", [[1, 2, 3]], [1], ["a"], [True])
        cfg = {"data": "data", "out": "taken/r", "target": str(tiny),
               "train": {"num_draft_steps": 2, "batch_size": 2, "seq_len": 8, "steps": 1}}
        (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
        argv = ["--config", "run.yaml", *extra]
    else:
        source = ["--prompt", "hi"] if module is generate else ["--suite", "mt_bench"]
        argv = ["--target", str(tiny), "--raw", *source, *extra]
        argv += ["--max-new-tokens", "300"] if "--max-new-tokens" not in extra else []  # over the context
    try:
        code = module.main(argv)
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1, (argv, err)
