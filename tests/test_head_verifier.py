"""Self-describing heads: export records the verifier (and an acceptance profile), loading refuses a head made for
another target and names every difference before any weights load, and `--draft DIR` alone runs on the verifier
the head names."""

import json
import os
from argparse import Namespace

import pytest
from flax import nnx
from hf_tiny import ByteTokenizer, make_tiny

from jaxspec import generate
from jaxspec.checkpoints import builtin
from jaxspec.checkpoints.heads import detect_layout, export_head, load_head, read_head_config
from jaxspec.checkpoints.verifier import RECORD_KEY, check_acceptance, head_record, locate_verifier, verifier_record
from jaxspec.cli.loading import head_aux_layer_ids, resolve_draft
from jaxspec.config import HeadConfig, TargetConfig, load_target_config
from jaxspec.errors import JaxspecError
from jaxspec.models.eagle3 import Eagle3Head

# Another tiny target: hidden size, vocabulary, depth and so default aux layers all differ from hf_tiny's (64, 97, 4).
OTHER = TargetConfig(vocab_size=120, hidden_size=48, intermediate_size=64, num_layers=8, num_heads=4, num_kv_heads=2,
                     head_dim=12)
PROFILE = [{"prompts": "mt_bench", "num_prompts": 8, "method": "chain K=3", "num_speculative_tokens": 3,
            "max_new_tokens": 16, "mean_accepted_length": 1.75, "acceptance_per_position": [0.5, 0.2, 0.05]}]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """<root>/models/tiny: a tiny Hugging Face target, for heads elsewhere under <root> to name by relative path."""
    root = tmp_path_factory.mktemp("verifier")
    make_tiny("smollm2_tied", root / "models" / "tiny", seed=5)
    return root


@pytest.fixture
def no_builtin(monkeypatch):
    """Fail the test if anything asks for the built-in target (which would build or download it)."""
    def refuse(*_, **__):
        raise AssertionError("the built-in target was asked for")

    monkeypatch.setattr(builtin, "ensure_default_target", refuse)


@pytest.fixture
def byte_tokenizer(monkeypatch):
    from jaxspec import prompts as prompts_mod

    monkeypatch.setattr(prompts_mod, "load_tokenizer", lambda _: ByteTokenizer())


def _head(target: TargetConfig) -> Eagle3Head:
    return Eagle3Head(HeadConfig.for_target(target, intermediate_size=32), rngs=nnx.Rngs(0))


def _run(capsys, main, argv):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    return exc.value.code, capsys.readouterr().err


@pytest.mark.parametrize("layout", ["speculators", "sglang", "eagle"])
def test_the_record_round_trips_in_each_layout(layout, tmp_path):
    path = export_head(_head(OTHER), tmp_path / layout, layout=layout, target=OTHER, dtype="float32",
                       verifier="org/other-model", acceptance=PROFILE)
    raw = read_head_config(path)
    assert detect_layout(raw) == layout
    verifier, acceptance = head_record(raw)
    assert verifier == verifier_record(OTHER, "org/other-model") and acceptance == PROFILE
    assert verifier["architectures"] == ["LlamaForCausalLM"] and verifier["aux_hidden_state_layer_ids"] == [2, 4, 5]
    if layout == "speculators":  # its own fields hold name and architectures; the jaxspec key only the rest
        assert raw["speculators_config"]["verifier"] == {"name_or_path": "org/other-model",
                                                         "architectures": ["LlamaForCausalLM"]}
        assert "name_or_path" not in raw[RECORD_KEY]["verifier"]
    else:
        assert raw[RECORD_KEY]["verifier"]["name_or_path"] == "org/other-model"
    assert load_head(path, OTHER).config.hidden_size == 48  # the record matches its own target


def test_a_head_for_another_target_is_refused_before_weights_load(models, tmp_path, monkeypatch):
    tiny = models / "models" / "tiny"
    path = export_head(_head(OTHER), tmp_path / "other", layout="eagle", target=OTHER, dtype="float32",
                       verifier="org/other-model")
    from jaxspec.checkpoints import dflash, heads  # noqa: F401  dflash imported first: a module that binds
    # heads.read_tensors by name while the patch is on would keep the lambda for every later test of the process

    monkeypatch.setattr(heads, "read_tensors", lambda *_: pytest.fail("head weights were read"))
    want = ("draft head was exported for the verifier 'org/other-model' with hidden size 48, vocabulary 120, 8 layers, "
            "aux layers (2, 4, 5); this target has hidden size 64, vocabulary 97, 4 layers, aux layers (2, 2, 1): "
            "run it with that verifier (--target DIR), or use a head exported for this target")
    with pytest.raises(JaxspecError) as exc:
        load_head(path, load_target_config(tiny))
    assert str(exc.value) == want
    with pytest.raises(JaxspecError) as exc:
        head_aux_layer_ids(str(path), tiny)
    assert str(exc.value) == want
    # Without the record, the checks of before: the first of them names one difference.
    raw = read_head_config(path)
    del raw[RECORD_KEY]
    (path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(JaxspecError, match=r"^draft head vocabulary 120 != target vocabulary 97$"):
        head_aux_layer_ids(str(path), tiny)


def test_the_cli_refuses_it_with_exit_code_2(models, tmp_path, capsys, monkeypatch):
    from jaxspec.checkpoints import hf

    tiny = models / "models" / "tiny"
    monkeypatch.setattr(hf, "load_target", lambda *_, **__: pytest.fail("the target's weights were loaded"))
    path = export_head(_head(OTHER), tmp_path / "other", layout="sglang", target=OTHER, dtype="float32",
                       verifier="org/other-model")
    code, err = _run(capsys, generate.main, ["--target", str(tiny), "--draft", str(path), "--prompt", "hi", "--raw"])
    assert code == 2 and err.count("\n") == 1 and err.startswith("error: draft head was exported for the verifier")
    assert "with hidden size 48, vocabulary 120, 8 layers; this target has hidden size 64, vocabulary 97, 4 layers" in err


def test_draft_alone_runs_on_the_verifier_the_head_names(models, capsys, monkeypatch, no_builtin, byte_tokenizer):
    from jaxspec import convert
    from jaxspec.bench import cli as bench

    monkeypatch.chdir(models)
    head = models / "heads" / "random"
    # A relative --target is recorded relative to the head directory.
    assert convert.main(["random-head", "--out", "heads/random", "--target", "models/tiny"]) == 0
    assert head_record(read_head_config(head))[0]["name_or_path"] == os.path.join("..", "..", "models", "tiny")
    monkeypatch.chdir(models / "heads")  # the name resolves from the head, not from where the command runs
    capsys.readouterr()
    assert generate.main(["--draft", "random", "--prompt", "abc", "--raw", "--json", "--max-new-tokens", "4",
                          "--num-speculative-tokens", "2"]) == 0
    captured = capsys.readouterr()
    record = json.loads(captured.out.strip().splitlines()[-1])
    assert record["num_generated"] >= 1 and len(record["stats"]["acceptance_per_position"]) == 2
    assert f"target: {os.path.join('..', 'models', 'tiny')} (the verifier the head's config names)" in captured.err
    # bench resolves the target the same way (stopped where it would load it: generation is tested above).
    loaded = []

    def stop(target_dir, *_, **__):
        loaded.append(target_dir)
        raise JaxspecError("stop here")

    monkeypatch.setattr(bench, "load_target_and_tokenizer", stop)
    # --raw: the prompts are encoded before the target loads now, and the stand-in tokenizer has no chat template
    code, err = _run(capsys, bench.main, ["--draft", "random", "--suite", "mt_bench", "--limit", "1", "--raw"])
    assert code == 2 and err.endswith("error: stop here\n") and "the verifier the head's config names" in err
    assert [p.resolve() for p in loaded] == [(models / "models" / "tiny").resolve()]


def test_a_missing_verifier_is_a_one_line_error(models, tmp_path, capsys, no_builtin):
    from jaxspec.bench import cli as bench

    tiny_cfg = load_target_config(models / "models" / "tiny")
    path = export_head(_head(tiny_cfg), tmp_path / "h", layout="speculators", target=tiny_cfg, dtype="float32",
                       verifier="org/not-here")
    for main, extra in ((generate.main, ["--prompt", "hi"]), (bench.main, ["--suite", "mt_bench", "--limit", "1"])):
        code, err = _run(capsys, main, ["--draft", str(path), *extra])
        assert code == 2 and err.count("\n") == 1, err
        assert err == (f"error: draft head {str(path)!r} was exported for the verifier 'org/not-here', which is "
                       "neither a local directory (absolute or relative to the head) nor the built-in target; pass "
                       "that verifier as --target DIR\n")
    # An explicit --target always wins; the record's fields match it, so the head passes the checks.
    args = Namespace(no_draft=False, draft=str(path), target=str(models / "models" / "tiny"))
    assert resolve_draft(args) == str(path) and args.target == str(models / "models" / "tiny")
    assert head_aux_layer_ids(str(path), models / "models" / "tiny") == (2, 2, 1)


def test_convert_keeps_the_record_and_rewrites_a_relative_verifier(models, capsys, monkeypatch):
    from jaxspec import convert

    tiny = models / "models" / "tiny"
    tiny_cfg = load_target_config(tiny)
    src = export_head(_head(tiny_cfg), models / "heads" / "src", layout="sglang", target=tiny_cfg, dtype="float32",
                      verifier=os.path.join("..", "..", "models", "tiny"), acceptance=PROFILE)
    monkeypatch.chdir(models)
    assert convert.main(["head", "--draft", "heads/src", "--out", "elsewhere/deeper/out", "--layout", "speculators",
                         "--dtype", "float32"]) == 0  # no --target: the verifier the source names
    out = models / "elsewhere" / "deeper" / "out"
    raw = read_head_config(out)
    verifier, acceptance = head_record(raw)
    assert verifier["name_or_path"] == os.path.join("..", "..", "..", "models", "tiny") and acceptance == PROFILE
    assert locate_verifier(raw, out).resolve() == tiny.resolve() == locate_verifier(read_head_config(src), src).resolve()
    assert convert.main(["head", "--draft", str(src), "--out", str(models / "hub"), "--layout", "eagle",
                         "--target", str(tiny), "--verifier", "org/tiny"]) == 0
    assert head_record(read_head_config(models / "hub"))[0]["name_or_path"] == "org/tiny"


def test_the_shipped_head_names_the_built_in_target():
    raw = read_head_config(builtin.default_head_dir())
    verifier, acceptance = head_record(raw)
    assert raw["speculators_config"]["verifier"]["name_or_path"] == builtin.NAME
    assert locate_verifier(raw, builtin.default_head_dir()) is None  # None: the built-in target
    assert {k: verifier[k] for k in ("model_type", "hidden_size", "vocab_size", "num_hidden_layers",
                                     "aux_hidden_state_layer_ids")} == {
        "model_type": "llama", "hidden_size": 576, "vocab_size": 49152, "num_hidden_layers": 30,
        "aux_hidden_state_layer_ids": [2, 15, 27]}
    assert check_acceptance(acceptance) and {m["prompts"] for m in acceptance} == {"mt_bench", "gsm8k"}


@pytest.mark.parametrize("profile, message", [
    ({"prompts": "x"}, "must be a list"),
    ([{"mean_accepted_length": 2.0}], "lacks 'prompts'"),
    ([{"prompts": "x", "mean_accepted_length": 0.5}], "mean_accepted_length must be a number >= 1"),
    ([{"prompts": "x", "mean_accepted_length": 2, "acceptance_per_position": [1.5]}], r"rates in \[0, 1\]"),
    ([{"prompts": "x", "mean_accepted_length": 2, "method": "tree 12,5"}], r"entry 0: method 'tree 12,5'"),
    ([{"prompts": "x", "mean_accepted_length": 2, "num_speculative_tokens": 0}], "positive integer"),
])
def test_bad_acceptance_profiles_are_refused(profile, message, tmp_path):
    with pytest.raises(JaxspecError, match=message):
        export_head(_head(OTHER), tmp_path / "h", layout="sglang", target=OTHER, acceptance=profile)
    assert not (tmp_path / "h").exists()
