"""Bad input fails fast: every flag and prompt line is checked before a model loads, contradictory flags are
refused, a head that does not fit the target is caught from the two config files, and `--help` documents every
flag with its default."""

import argparse
import json

import pytest
from hf_tiny import make_tiny, write_char_tokenizer

from jaxspec import convert, generate
from jaxspec.bench import cli as bench


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_validation")
    make_tiny("smollm2_tied", path, seed=4)
    return path


@pytest.fixture(scope="module")
def tiny_head(tiny_dir, tmp_path_factory):
    from fit_head import head_config_for
    from flax import nnx

    from jaxspec.checkpoints.heads import export_head
    from jaxspec.checkpoints.hf import load_target
    from jaxspec.models.eagle3 import Eagle3Head

    target = load_target(tiny_dir)
    path = tmp_path_factory.mktemp("tiny_validation_head") / "head"
    export_head(Eagle3Head(head_config_for(target), rngs=nnx.Rngs(0)), path, layout="sglang", target=target.config,
                dtype="float32")
    return path


@pytest.fixture
def no_loading(monkeypatch):
    """Loading a model fails the test: the checks under test must come first."""

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the bad input was caught")

    monkeypatch.setattr(generate, "load_target_and_tokenizer", refuse)
    monkeypatch.setattr(bench, "load_target_and_tokenizer", refuse)


def one_line_error(capsys, main, argv) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    return err


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--max-new-tokens", "0"], "--max-new-tokens must be at least 1"),
        (["--batch-size", "0"], "--batch-size must be at least 1"),
        (["--num-speculative-tokens", "100"], "--num-speculative-tokens must be between 1 and 32"),
        (["--num-speculative-tokens", "0"], "--num-speculative-tokens must be between 1 and 32"),
        (["--tree", "8,3,2", "--num-speculative-tokens", "3"], "drop --num-speculative-tokens"),
        (["--no-draft", "--tree", "8,3,2"], "--no-draft runs the target alone, --tree drafts"),
        (["--no-draft", "--num-speculative-tokens", "3"], "--no-draft runs the target alone"),
        (["--prompt-lookup", "on", "--tree", "8,3,2"], "--prompt-lookup on drafts beside a drafter's chains"),
        (["--proposer", "ngram", "--prompt-lookup", "on"], "--proposer ngram is prompt lookup alone"),
        (["--no-draft", "--prompt-lookup", "on"], "--prompt-lookup on drafts beside a drafter, --no-draft"),
        (["--prompt-lookup-tokens", "0"], "--prompt-lookup-tokens must be between 1 and 32"),
        (["--prompt-lookup", "off", "--prompt-lookup-tokens", "6"], "--prompt-lookup-tokens sets the chains"),
        (["--tree", "8,3,2", "--prompt-lookup-tokens", "6"], "which --tree runs without"),
        (["--repetition-penalty", "0"], "repetition penalty must be a finite number > 0"),
        (["--presence-penalty", "nan"], "presence penalty must be a finite number"),
        (["--min-p", "1.5"], "min-p must be in [0, 1]"),
        (["--logit-bias", "[1, 2]"], "--logit-bias wants a JSON object of token id to bias"),
        (["--logit-bias", '{"x": 1}'], "--logit-bias wants a JSON object of token id to bias"),
        (["--logit-bias", '{"-3": 1}'], "logit bias: token ids must be integers >= 0"),
    ],
)
def test_generate_flags_are_checked_before_loading(extra, message, tiny_dir, capsys, no_loading):
    err = one_line_error(capsys, generate.main, ["--target", str(tiny_dir), "--prompt", "hi", *extra])
    assert message in err


def test_tree_depth_is_bounded(tiny_dir, capsys, no_loading):
    with pytest.raises(SystemExit) as exit_info:
        generate.main(["--target", str(tiny_dir), "--prompt", "hi", "--tree", "40,40,2"])
    assert exit_info.value.code == 2 and "DEPTH is at most 32" in capsys.readouterr().err


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--suite", "nosuch"], "neither a built-in suite (mt_bench, gsm8k, humaneval, grounded) nor a prompts file"),
        (["--suite", "mt_bench", "--accept-prob", "2"], "--accept-prob is a probability"),
        (["--suite", "mt_bench", "--accept-prob", "0.5", "--tree", "8,3,2"], "--accept-prob applies to chains only"),
        (["--suite", "mt_bench", "--limit", "-1"], "--limit must be 0"),
        (["--suite", "mt_bench", "--chain-lengths", "3,40"], "--chain-lengths: 40 is more than 32"),
        (["--suite", "mt_bench", "--compare-numerics"], "--compare-numerics applies to single runs"),
        (["--suite", "mt_bench", "--no-draft", "--chain-lengths", "3"], "needs a draft head"),
    ],
)
def test_bench_flags_are_checked_before_loading(extra, message, tiny_dir, capsys, no_loading):
    err = one_line_error(capsys, bench.main, ["--target", str(tiny_dir), *extra])
    assert message in err


@pytest.mark.parametrize(
    "line, message",
    [
        ('{"prompt": 5}', "'prompt' must be a non-empty string, got 5"),
        ('{"prompt": "  "}', "'prompt' must be a non-empty string"),
        ('{"turns": []}', "'turns' must be a non-empty list of strings"),
        ('{"turns": [null]}', "'turns[0]' must be a non-empty string, got None"),
        ('{"text": "hi"}', "expected a 'turns', 'prompt' or 'question' field, found ['text']"),
        ('["hi"]', "expected a JSON object per line, got list"),
        ("{nope", "not valid JSON"),
    ],
)
def test_prompt_file_lines_are_checked(line, message, tiny_dir, tmp_path, capsys, no_loading):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "fine"}\n' + line + "\n")
    err = one_line_error(capsys, generate.main, ["--target", str(tiny_dir), "--prompts-file", str(path)])
    assert "prompts.jsonl:2: " in err and message in err


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("vocab_size", 120, "draft head vocabulary 120 != target vocabulary 97"),
        ("target_hidden_size", 32, "draft head expects target hidden size 32, the target has 64"),
        ("eagle_aux_hidden_state_layer_ids", [1, 2, 9], "outside the target's 0..3"),
    ],
)
def test_a_head_that_does_not_fit_is_refused_from_the_configs(
    field, value, message, tiny_dir, tiny_head, tmp_path, capsys, no_loading
):
    import shutil

    head = tmp_path / "head"
    shutil.copytree(tiny_head, head)
    config = json.loads((head / "config.json").read_text())
    if field.startswith("eagle_"):
        config["eagle_config"][field] = value
    else:
        config[field] = value
    (head / "config.json").write_text(json.dumps(config))
    err = one_line_error(capsys, generate.main, ["--target", str(tiny_dir), "--draft", str(head), "--prompt", "hi"])
    assert message in err


def test_a_target_without_tokenizer_gets_the_whole_reason(tiny_dir, capsys):
    err = one_line_error(capsys, generate.main, ["--target", str(tiny_dir), "--prompt", "hi", "--no-draft"])
    assert "cannot load a tokenizer" in err and "needs the model's tokenizer files" in err


@pytest.mark.slow
def test_the_closing_line_names_the_method_and_tokens_per_verify(tiny_dir, tiny_head, tmp_path, capsys):
    import shutil

    target = tmp_path / "with_tokenizer"
    shutil.copytree(tiny_dir, target)
    write_char_tokenizer(target)
    base = ["--target", str(target), "--prompt", "abc", "--raw", "--max-new-tokens", "6"]
    assert generate.main([*base, "--no-draft"]) == 0
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith("tokens/s; target-only]")
    assert generate.main([*base, "--draft", str(tiny_head), "--num-speculative-tokens", "3"]) == 0
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert "tokens/s; chain K=3, " in last and " tokens per verify step, prompt lookup drafted " in last
    assert last.endswith(" of them]")
    per_verify = float(last.split("chain K=3, ")[1].split()[0])
    assert 1.0 <= per_verify <= 4.0


def parsers() -> dict[str, argparse.ArgumentParser]:
    from jaxspec.serve.__main__ import build_parser as serve_parser

    found = {"generate": generate.build_parser(), "bench": bench.build_parser(), "convert": convert.build_parser(),
             "serve": serve_parser()}
    for action in found["convert"]._actions:  # argparse keeps subparsers only here
        if isinstance(action, argparse._SubParsersAction):
            found |= {f"convert {name}": sub for name, sub in action.choices.items()}
    return found


@pytest.mark.parametrize("name", sorted(parsers()))
def test_help_documents_every_flag_and_its_default(name):
    parser = parsers()[name]
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        flag = "/".join(action.option_strings) or action.dest
        assert action.help, f"{name}: {flag} has no help text"
        default = action.default
        unset = default is None or default is False or default == [] or default is argparse.SUPPRESS
        if not unset and not action.required:  # (not `in (None, False)`: 0 == False)
            shown = ",".join(map(str, default)) if isinstance(default, list) else str(default)
            assert "default" in action.help and (shown in action.help or "%(default)" in action.help), (
                f"{name}: {flag} does not say its default {default!r}: {action.help!r}"
            )


@pytest.mark.parametrize("command", [["random-head"], ["target"], ["head", "--draft", "x", "--layout", "eagle"]])
def test_convert_refuses_an_output_path_that_is_a_file(command, tiny_dir, tmp_path, capsys):
    existing = tmp_path / "taken"
    existing.write_text("not a directory")
    err = one_line_error(capsys, convert.main, [*command, "--target", str(tiny_dir), "--out", str(existing)])
    assert "is an existing file; pass a directory path" in err


@pytest.mark.parametrize("command", ["random-head", "head"])
def test_convert_never_writes_over_what_it_did_not_write(command, tiny_dir, tiny_head, tmp_path, capsys):
    """A head command refuses a non-empty --out that holds no head (it replaced a model's config.json and weights
    without a word), replaces a head it wrote before, and with --overwrite replaces anything; a failed write leaves
    the old directory as it was."""
    source = ["--draft", str(tiny_head), "--layout", "speculators"] if command == "head" else []
    argv = [command, "--target", str(tiny_dir), *source]
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text('{"model_type": "llama"}')
    (model_dir / "model.safetensors").write_bytes(b"weights")
    err = one_line_error(capsys, convert.main, [*argv, "--out", str(model_dir)])
    assert "is not empty and holds no EAGLE-3 head" in err and "--overwrite" in err
    assert (model_dir / "model.safetensors").read_bytes() == b"weights"  # untouched

    head_dir = tmp_path / "head"
    assert convert.main([*argv, "--out", str(head_dir)]) == 0
    assert convert.main([*argv, "--out", str(head_dir)]) == 0  # its own earlier output: replaced
    assert json.loads((head_dir / "config.json").read_text())["speculators_model_type"] == "eagle3"
    assert convert.main([*argv, "--out", str(model_dir), "--overwrite"]) == 0
    assert sorted(p.name for p in model_dir.iterdir()) == sorted(p.name for p in head_dir.iterdir())
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging left behind


def test_a_failed_write_leaves_the_old_directory(tmp_path):
    from jaxspec.cli.outputs import written_whole

    out = tmp_path / "out"
    out.mkdir()
    (out / "kept").write_text("old")
    with pytest.raises(RuntimeError), written_whole(out) as staging:
        (staging / "new").write_text("half")
        raise RuntimeError("killed midway")
    assert [p.name for p in out.iterdir()] == ["kept"] and len(list(tmp_path.iterdir())) == 1
