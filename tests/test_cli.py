"""The generate CLI: output shapes, and one-line errors with exit code 2 for bad input."""

import json
import subprocess
import sys

import pytest
from hf_tiny import ByteTokenizer, make_tiny

from jaxspec import generate


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_cli")
    make_tiny("smollm2_tied", path, seed=5)
    return path


def run(capsys, *argv):
    with pytest.raises(SystemExit) as exc:
        generate.main(list(argv))
    captured = capsys.readouterr()
    return exc.value.code, captured.out, captured.err


def test_json_lines_in_input_order(tiny_dir, tmp_path, capsys, monkeypatch):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "a", "prompt": "x"}\n{"question_id": 7, "turns": ["y z", "ignored"]}\n{"id": "c", "prompt": "w w w"}\n')
    from jaxspec import prompts as prompts_mod

    monkeypatch.setattr(prompts_mod, "load_tokenizer", lambda _: ByteTokenizer())
    code = generate.main(["--target", str(tiny_dir), "--prompts-file", str(prompts), "--raw", "--json",
                          "--max-new-tokens", "5", "--batch-size", "2"])
    out = capsys.readouterr().out.strip().splitlines()
    assert code == 0
    records = [json.loads(line) for line in out]
    assert [r["id"] for r in records] == ["a", "7", "c"]
    for r in records:
        assert set(r) == {"id", "prompt", "text", "token_ids", "num_generated", "stats"}
        assert r["num_generated"] == len(r["token_ids"]) == 5
        assert r["stats"]["tokens_per_second"] > 0


@pytest.fixture(scope="module")
def tiny_head(tiny_dir, tmp_path_factory):
    from fit_head import head_config_for
    from flax import nnx

    from jaxspec.checkpoints.heads import export_head
    from jaxspec.checkpoints.hf import load_target
    from jaxspec.models.eagle3 import Eagle3Head

    target = load_target(tiny_dir)
    head = Eagle3Head(head_config_for(target), rngs=nnx.Rngs(0))
    path = tmp_path_factory.mktemp("tiny_head") / "head"
    export_head(head, path, layout="sglang", target=target.config, dtype="float32")
    return path


@pytest.mark.parametrize("extra, positions", [  # CI: a tree and the default (auto); an explicit chain: -m slow
    pytest.param(["--num-speculative-tokens", "3"], 3, marks=pytest.mark.slow), (["--tree", "6,3,2"], 3), ([], 5),
    pytest.param(["--num-speculative-tokens", "auto"], 5, marks=pytest.mark.slow),
])
def test_json_stats_with_a_draft_head(extra, positions, tiny_dir, tiny_head, capsys, monkeypatch):
    from jaxspec import prompts as prompts_mod

    monkeypatch.setattr(prompts_mod, "load_tokenizer", lambda _: ByteTokenizer())
    code = generate.main(["--target", str(tiny_dir), "--draft", str(tiny_head), "--prompt", "abc", "--raw",
                          "--json", "--max-new-tokens", "6", *extra])
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0 and 1 <= record["num_generated"] == len(record["token_ids"]) <= 6  # the config has EOS id 2
    stats = record["stats"]
    assert {"mean_accepted_length", "acceptance_per_position", "target_calls", "draft_calls"} <= set(stats)
    assert len(stats["acceptance_per_position"]) == positions and stats["target_calls"] >= 1
    if "--tree" not in extra and "3" not in extra:  # auto, the default: what it chose and on what basis
        assert stats["auto"]["num_speculative_tokens"] == positions and stats["auto"]["basis"] == "first batch"
        assert stats["auto"]["running_verify_steps"] == stats["verify_calls"]
    else:
        assert "auto" not in stats


@pytest.mark.slow  # the bench suite's CI case runs a chain and a tree
def test_bench_chain_and_tree_side_by_side(tiny_dir, tiny_head, tmp_path, capsys, monkeypatch):
    from jaxspec.bench import cli as bench
    from jaxspec import prompts as prompts_mod

    monkeypatch.setattr(prompts_mod, "load_tokenizer", lambda _: ByteTokenizer())
    monkeypatch.setattr(bench, "measure_bandwidth_gbs", lambda: 10.0)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "a", "prompt": "xy"}\n{"id": "b", "prompt": "zzz"}\n')
    code = bench.main(["--target", str(tiny_dir), "--draft", str(tiny_head), "--prompts-file", str(prompts), "--raw",
                       "--max-new-tokens", "5", "--num-speculative-tokens", "2", "--tree", "5,2,2", "--compare-hf",
                       "--components", "--json"])
    result = json.loads(capsys.readouterr().out)
    assert code == 0
    assert result["transformers"]["identical_outputs"] == "2/2"  # float32: the same greedy tokens as transformers
    methods = {sp["method"]: sp for sp in result["speculative"]}
    assert set(methods) == {"chain K=2", "tree 5,2,2"}
    for sp in methods.values():
        assert sp["identical_outputs"] == "2/2" and sp["tokens_per_second"] > 0
    assert methods["tree 5,2,2"]["verified_tokens"] == 5


@pytest.mark.parametrize("tree", ["8,2", "40,2,3", "a,b,c"])
def test_bad_tree_spec(tree, tiny_dir, capsys):
    code, _, err = run(capsys, "--target", str(tiny_dir), "--prompt", "hi", "--tree", tree)
    assert code == 2 and "--tree" in err


def test_bad_speculative_tokens(tiny_dir, capsys):
    code, _, err = run(capsys, "--target", str(tiny_dir), "--prompt", "hi", "--num-speculative-tokens", "some")
    assert code == 2 and "expected a number of drafts or 'auto', got 'some'" in err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--target", "/nonexistent/model", "--prompt", "hi"], "does not exist"),
        (["--target", "{tmp}", "--prompt", "hi"], "has no config.json"),
        (["--target", "{tiny}", "--prompt", "hi", "--temperature", "-1"], "temperature must be a finite number >= 0"),
        (["--target", "{tiny}", "--prompt", "hi", "--top-p", "1.5"], "top-p must be in"),
        (["--target", "{tiny}", "--prompt", "hi", "--top-k", "-2"], "top-k must be >= 0"),
        (["--target", "{tiny}", "--prompts-file", "/nonexistent.jsonl"], "does not exist"),
        (["--target", "{tiny}", "--prompt", "hi", "--draft", "/nonexistent/head"], "draft head path"),
        (["--target", "{tiny}", "--prompt", "hi", "--draft", "{tmp}"], "has no config.json"),
        (["--target", "{tiny}", "--prompt", "hi", "--proposer", "ngram", "--num-speculative-tokens", "auto"],
         "give --proposer ngram a number"),
    ],
)
def test_bad_input_is_one_line_exit_2(argv, message, tiny_dir, tmp_path, capsys):
    argv = [a.format(tmp=tmp_path, tiny=tiny_dir) for a in argv]
    code, out, err = run(capsys, *argv)
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("error: ") and message in err


def test_bad_checkpoints(tiny_dir, tmp_path, capsys):
    import shutil

    bad = tmp_path / "gpt2"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    code, _, err = run(capsys, "--target", str(bad), "--prompt", "hi")
    assert code == 2 and "unsupported architecture GPT2LMHeadModel" in err

    trunc = tmp_path / "trunc"
    shutil.copytree(tiny_dir, trunc)
    weights = trunc / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    code, _, err = run(capsys, "--target", str(trunc), "--prompt", "hi")
    assert code == 2 and "corrupt or truncated safetensors" in err

    missing = tmp_path / "missing"
    shutil.copytree(tiny_dir, missing)
    (missing / "model.safetensors").unlink()
    code, _, err = run(capsys, "--target", str(missing), "--prompt", "hi")
    assert code == 2 and "has no *.safetensors weights" in err


@pytest.mark.slow  # a subprocess on SmolLM2; in CI the check itself: test_bad_input (before any weights load)
@pytest.mark.smollm2
def test_prompt_too_long_for_context_subprocess():
    """Through a real process: one line on stderr, exit code 2, no traceback."""
    proc = subprocess.run(
        [sys.executable, "-m", "jaxspec.generate", "--raw", "--prompt", "hello " * 9000, "--max-new-tokens", "8"],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 2, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: prompt 0 has") and "context length of 8192" in last
    assert "Traceback" not in proc.stderr


# The whole suite (batch 1 and 2; target-only, a chain, a tree, auto and transformers: 9 runs, ~3.5 minutes on 2
# cores) and every method at batch 1 (4 runs, ~2 minutes: a suite always has a tree, 16,5,4 by default) run with
# `-m slow`; CI runs the report's machinery on the cheapest suite, forced acceptance (target-only and one chain: no
# tree or auto with --accept-prob); trees and auto have their own tests.
SUITES = [
    pytest.param(["--batch-sizes", "1", "--chain-lengths", "2", "--accept-prob", "1.0"], (1,),
                 ("target-only", "chain K=2 (forced p=1.0)"), id="forced"),
    pytest.param(["--batch-sizes", "1", "--chain-lengths", "2", "--tree", "5,2,2"], (1,),
                 ("target-only", "chain K=2", "tree 5,2,2", "auto"), id="batch1", marks=pytest.mark.slow),
    pytest.param(["--batch-sizes", "1,2", "--chain-lengths", "2", "--tree", "5,2,2", "--compare-hf"], (1, 2),
                 ("target-only", "chain K=2", "tree 5,2,2", "auto"), id="whole", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("flags,batches,methods", SUITES)
def test_bench_suite_writes_json_markdown_and_plots(tiny_dir, tiny_head, tmp_path, capsys, monkeypatch, flags,
                                                    batches, methods):
    import jax

    from jaxspec.bench import cli as bench
    from jaxspec.bench import suite as bench_suite
    from jaxspec import prompts as prompts_mod

    monkeypatch.setattr(prompts_mod, "load_tokenizer", lambda _: ByteTokenizer())
    written, cleared = [], []  # runs in the report at each write; cache clears
    write_report = bench_suite.write_report
    monkeypatch.setattr(bench_suite, "write_report", lambda r, d: written.append(len(r["runs"])) or write_report(r, d))
    clear_caches = jax.clear_caches
    monkeypatch.setattr(jax, "clear_caches", lambda: cleared.append(1) or clear_caches())
    out = tmp_path / "report"
    code = bench.main(["--target", str(tiny_dir), "--draft", str(tiny_head), "--suite", "mt_bench", "--limit", "2",
                       "--raw", "--max-new-tokens", "5", *flags, "--out", str(out)])
    assert code == 0
    # the report is on disk after every run (a suite cut short keeps what it measured), and every run's compiled
    # programs are released before the next (XLA:CPU's memory maps would otherwise pile up to the process limit)
    hf_runs = int("--compare-hf" in flags)
    total = len(batches) * len(methods) + hf_runs
    assert written == list(range(1, total + 1)) and len(cleared) == total
    result = json.loads((out / "results.json").read_text())
    if hf_runs:
        (hf,) = [r for r in result["runs"] if r["method"] == "transformers generate"]
        assert hf["batch_size"] == 1 and hf["tokens_per_second"] > 0 and hf["identical_outputs"] == "2/2"
        result["runs"].remove(hf)
    assert result["suite"] == "mt_bench" and result["prompts"] == 2
    runs = {(r["batch_size"], r["method"]): r for r in result["runs"]}
    assert set(runs) == {(b, m) for b in batches for m in methods}
    assert "identical_outputs" not in runs[(1, "target-only")]
    if 2 in batches:
        assert runs[(2, "target-only")]["identical_outputs"] == "2/2 (to batch 1)"  # batch-invariant numerics
    for b in batches if "auto" in methods else ():  # a head without a recorded profile: the first batch drafts
        auto = runs[(b, "auto")]  # the default chain to measure one
        assert auto["identical_outputs"] == "2/2" and auto["auto_last"]["basis"] in ("observed", "first batch")
        assert sum(auto["auto_choices"].values()) == 2 // b
    for (b, method), r in runs.items():
        assert r["tokens_per_second"] > 0
        if method not in ("target-only", "auto"):
            forced = "forced" in method  # every draft accepted, whatever the target says: not its text
            assert r["identical_outputs"] == "2/2" or forced
            assert not forced or r["acceptance_per_position"] == [1.0, 1.0]
            hist = r["accepted_drafts_histogram"]
            assert len(hist) == 3 and sum(hist) == r["verify_steps"] > 0
            assert len(r["acceptance_per_position"]) == 2
            assert sum(r["rejections"].values()) == r["verify_steps"]  # one outcome per verify step
            full, cut = r["rejections"]["all_accepted"], r["rejections"]["cut_by_stop"]
            assert full <= hist[-1] <= full + cut  # steps that accepted every draft, unless the stop cut them
    table = (out / "results.md").read_text()
    assert "| batch | method | tokens/s |" in table and table.count("\n| ") >= total
    assert "auto" not in methods or ("- batch 1: auto ran " in table and "running acceptance" in table)
    assert "| batch | method | all accepted | outside draft vocab |" in table  # the rejection table
    for name in ("tokens_per_second.png", "acceptance_by_position.png", "accepted_lengths.png"):
        data = (out / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_suite_prompt_sets_ship_with_the_package():
    from jaxspec.prompts import suite_prompts

    mt, gsm, he = suite_prompts("mt_bench"), suite_prompts("gsm8k"), suite_prompts("humaneval")
    assert (len(mt), len(gsm), len(he)) == (80, 1319, 164)
    assert mt[0][0] == "81" and "travel blog post" in mt[0][1]
    assert "Janet" in gsm[0][1] and he[0][0] == "HumanEval/0" and "def has_close_elements" in he[0][1]


def test_generate_on_a_data_mesh_equals_one_device(tiny_dir, capsys, monkeypatch):
    from jaxspec import prompts as prompts_mod

    monkeypatch.setattr(prompts_mod, "load_tokenizer", lambda _: ByteTokenizer())
    outputs = []
    for mesh in ([], ["--mesh", "data=2"]):
        code = generate.main(["--target", str(tiny_dir), "--prompt", "abc", "--raw", "--json", "--max-new-tokens",
                              "6", "--batch-size", "2", *mesh])
        outputs.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1])["token_ids"])
        assert code == 0
    assert outputs[0] == outputs[1]


@pytest.mark.parametrize("mesh, message", [
    ("model=3", "has 4 query and 1 KV heads, which the mesh's model axis (3) does not fit (it must divide the query "
                "heads and divide or be a multiple of the KV heads); use model in [1, 2, 4]"),
    ("data=16", "needs 16 devices"),
    ("data=2,pipe=2", "--mesh expects data=D,model=M"),
])
def test_bad_meshes_are_one_line_errors(mesh, message, tiny_dir, capsys, monkeypatch):
    from jaxspec import prompts as prompts_mod

    monkeypatch.setattr(prompts_mod, "load_tokenizer", lambda _: ByteTokenizer())
    code, _, err = run(capsys, "--target", str(tiny_dir), "--prompt", "abc", "--raw", "--batch-size", "2",
                       "--mesh", mesh)
    error_lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(error_lines) == 1 and message in error_lines[0]


def test_convert_a_head_between_layouts_and_generate_with_it(tiny_dir, tiny_head, tmp_path, capsys, monkeypatch):
    from jaxspec import convert
    from jaxspec import prompts as prompts_mod

    monkeypatch.setattr(prompts_mod, "load_tokenizer", lambda _: ByteTokenizer())
    outputs = []
    for layout in ("speculators", "eagle"):
        out = tmp_path / layout
        assert convert.main(["head", "--draft", str(tiny_head), "--out", str(out), "--layout", layout,
                             "--target", str(tiny_dir), "--dtype", "float32"]) == 0
        capsys.readouterr()
        assert generate.main(["--target", str(tiny_dir), "--draft", str(out), "--prompt", "abc", "--raw", "--json",
                              "--max-new-tokens", "6"]) == 0
        outputs.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1]))
    assert outputs[0]["token_ids"] == outputs[1]["token_ids"]
    assert outputs[0]["stats"]["acceptance_per_position"] == outputs[1]["stats"]["acceptance_per_position"]


@pytest.mark.slow
def test_bench_forced_acceptance_is_labelled_and_chain_only(tiny_dir, tiny_head, tmp_path, capsys, monkeypatch):
    from jaxspec.bench import cli as bench
    from jaxspec import prompts as prompts_mod

    monkeypatch.setattr(prompts_mod, "load_tokenizer", lambda _: ByteTokenizer())
    monkeypatch.setattr(bench, "measure_bandwidth_gbs", lambda: 10.0)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "a", "prompt": "xy"}\n')
    base = ["--target", str(tiny_dir), "--draft", str(tiny_head), "--prompts-file", str(prompts), "--raw",
            "--max-new-tokens", "5", "--num-speculative-tokens", "2", "--accept-prob", "1.0", "--json"]
    assert bench.main(base) == 0
    (run,) = json.loads(capsys.readouterr().out)["speculative"]
    assert run["method"] == "chain K=2 (forced p=1.0)" and run["tokens_per_second"] > 0
    with pytest.raises(SystemExit) as exc:
        bench.main([*base, "--tree", "5,2,2"])
    assert exc.value.code == 2 and "applies to chains only" in capsys.readouterr().err


@pytest.mark.parametrize("mesh", [[], ["--mesh", "data=2,model=1"]])
def test_bench_load_time_compares_safetensors_and_orbax(mesh, tiny_dir, tmp_path, capsys):
    from jaxspec import convert
    from jaxspec.bench import cli as bench

    out = tmp_path / "orbax"
    assert convert.main(["target", "--target", str(tiny_dir), "--out", str(out)]) == 0
    capsys.readouterr()
    code = bench.main(["--target", str(tiny_dir), "--load-time", str(out), "--repeats", "2", "--json", *mesh])
    result = json.loads(capsys.readouterr().out)
    assert code == 0 and result["identical_parameters"] is True
    assert result["mesh"] == ({"data": 2, "model": 1} if mesh else None)
    assert all(len(t) == 2 and min(t) > 0 for t in result["seconds"].values())
    # the ratio of the unrounded medians, rounded to 0.01; the medians are reported rounded to 0.001 s, which on a
    # tiny model (a few ms) moves their ratio by far more than a relative tolerance allows: bound it by the roundings
    s, o, half = result["median_seconds"]["safetensors"], result["median_seconds"]["orbax"], 0.0005
    low, high = max(s - half, 0.0) / (o + half), (s + half) / max(o - half, 1e-9)
    assert low - 0.005 <= result["orbax_speedup"] <= high + 0.005
    with pytest.raises(SystemExit) as exc:
        bench.main(["--target", str(tiny_dir), "--load-time", str(tiny_dir)])
    assert exc.value.code == 2 and "is not an orbax target; make one with" in capsys.readouterr().err


# CI: the kernels in interpret mode per mesh shard (tests/test_mesh.py) and against the references
# (tests/test_invariant_kernel_lowering.py)
@pytest.mark.parametrize("extra", [pytest.param(["--num-speculative-tokens", "3"], marks=pytest.mark.slow),
                                   pytest.param(["--tree", "6,3,2"], marks=pytest.mark.slow)])
def test_kernels_pallas_gives_the_references_output_and_the_log_says_which(extra, tiny_dir, tiny_head, capsys,
                                                                           monkeypatch):
    """`--kernels pallas` on CPU runs the attention and verification kernels in interpret mode: same tokens as the
    references, chain and tree, and the log line names what ran."""
    from jaxspec import prompts as prompts_mod

    monkeypatch.setattr(prompts_mod, "load_tokenizer", lambda _: ByteTokenizer())
    outputs = {}
    for kernels in ("reference", "pallas"):
        code = generate.main(["--target", str(tiny_dir), "--draft", str(tiny_head), "--prompt", "abc", "--raw",
                              "--json", "--max-new-tokens", "8", "--batch-size", "2", "--kernels", kernels, *extra])
        captured = capsys.readouterr()
        assert code == 0
        outputs[kernels] = json.loads(captured.out.strip().splitlines()[-1])["token_ids"]
        want = "interpret mode" if kernels == "pallas" else "jax.numpy references"
        assert any(line.startswith("kernels: ") and want in line for line in captured.err.splitlines()), captured.err
    assert outputs["pallas"] == outputs["reference"]


def test_a_bad_kernels_environment_variable_is_a_one_line_error(tiny_dir, capsys, monkeypatch):
    monkeypatch.setenv("JAXSPEC_KERNELS", "triton")
    code, _, err = run(capsys, "--target", str(tiny_dir), "--prompt", "abc", "--raw")
    error_lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(error_lines) == 1 and "JAXSPEC_KERNELS='triton'" in error_lines[0]


def test_memory_report_on_stderr_and_in_json(tiny_dir, tiny_head, capsys, monkeypatch):
    from jaxspec import prompts as prompts_mod

    monkeypatch.setattr(prompts_mod, "load_tokenizer", lambda _: ByteTokenizer())
    code = generate.main(["--target", str(tiny_dir), "--draft", str(tiny_head), "--prompt", "abc", "--raw", "--json",
                          "--max-new-tokens", "4", "--memory-report"])
    captured = capsys.readouterr()
    memory = json.loads(captured.out.strip().splitlines()[-1])["memory"]
    assert code == 0 and memory["target_parameters"] > 0 and memory["head_kv_cache"] > 0
    assert "draft head KV cache" in captured.err and "peak of the compiled step" in captured.err
