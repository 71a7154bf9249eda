"""The training CLIs at their edges: the config schema, missing inputs, help texts. Parsing only, no training."""

import argparse
import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from jaxspec.errors import JaxspecError
from train import data as train_data
from train import heldout, launch
from train.config import (
    HeadSection,
    MeshSection,
    OptimConfig,
    RunConfig,
    TargetSection,
    TrainSection,
    load_config,
    parse_config,
)

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = sorted((ROOT / "configs").glob("*.yaml"))

MINIMAL = {"data": "d", "out": "o", "train": {"num_draft_steps": 3, "batch_size": 2, "seq_len": 16, "steps": 4}}


def write(tmp_path: Path, cfg, name="run.yaml") -> Path:
    path = tmp_path / name
    path.write_text(cfg if isinstance(cfg, str) else yaml.safe_dump(cfg))
    return path


def fails(capsys, main, argv) -> str:
    """main(argv) exits with code 2 and one line on stderr, no traceback: that line."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2, err
    assert "Traceback" not in err and err.startswith("error: ") and err.count("\n") == 1, err
    return err


def launch_fails(capsys, tmp_path, cfg, *overrides) -> str:
    return fails(capsys, launch.main, ["--config", str(write(tmp_path, cfg)), *overrides])


@pytest.mark.parametrize("path", SHIPPED, ids=[p.name for p in SHIPPED])
def test_shipped_configs_parse(path):
    cfg = load_config(path)
    raw = yaml.safe_load(path.read_text())
    assert isinstance(cfg, RunConfig)
    for section in ("train", "head", "optim", "mesh"):  # every value written is the value used
        for key, value in (raw.get(section) or {}).items():
            value = tuple(value) if isinstance(value, list) else value  # YAML lists are tuples in the frozen config
            assert getattr(getattr(cfg, section), key) == value, f"{section}.{key}"
    assert cfg.optim.total_steps == cfg.train.steps
    assert load_config(path, ["train.steps=7", "optim.learning_rate=1e-3"]).optim.total_steps == 7


def test_minimal_config_takes_the_defaults(tmp_path):
    cfg = load_config(write(tmp_path, {**MINIMAL, "mesh": None}))
    assert cfg.target.path is None and cfg.target.quantize is None and cfg.distributed is False
    assert cfg.head == HeadSection() and cfg.mesh == MeshSection()
    assert cfg.optim == dataclasses.replace(OptimConfig(), total_steps=4)
    assert cfg.train == TrainSection(num_draft_steps=3, batch_size=2, seq_len=16, steps=4)


def test_overrides_are_typed_and_exponent_floats_parse(tmp_path):
    path = write(tmp_path, {**MINIMAL, "optim": {"learning_rate": "3e-4"}})  # how YAML 1.1 reads `3e-4`
    assert load_config(path).optim.learning_rate == pytest.approx(3e-4)
    cfg = load_config(
        path,
        [
            "train.steps=9",
            "optim.b1=1",
            "target=null",
            "mesh={data: 2, fsdp: 1}",
            "head.draft_vocab_size=64",
            "train.features=offline",
        ],
    )
    assert cfg.train.steps == 9 and cfg.optim.total_steps == 9 and cfg.optim.b1 == 1.0
    assert isinstance(cfg.optim.b1, float) and cfg.mesh == MeshSection(data=2, fsdp=1)
    assert cfg.head.draft_vocab_size == 64 and cfg.train.features == "offline"


def test_target_is_a_path_or_a_section_with_its_quantization(tmp_path, capsys):
    """`target: DIR` is short for `target: {path: DIR}`; an override of either key keeps the other."""
    path = write(tmp_path, {**MINIMAL, "target": "models/t"})
    assert load_config(path).target == TargetSection(path="models/t")
    assert load_config(path, ["target.quantize=int8"]).target == TargetSection(path="models/t", quantize="int8")
    both = write(tmp_path, {**MINIMAL, "target": {"path": "models/t", "quantize": "fp8"}}, "both.yaml")
    assert load_config(both, ["target=models/u"]).target == TargetSection(path="models/u", quantize="fp8")
    assert load_config(both, ["target=null"]).target == TargetSection(quantize="fp8")
    assert load_config(path, ["target.quantize=null"]).target == TargetSection(path="models/t")
    err = launch_fails(capsys, tmp_path, MINIMAL, "target.quantize=int4")
    assert "target.quantize must be one of" in err and "int8" in err
    err = launch_fails(capsys, tmp_path, {**MINIMAL, "target": {"pth": "models/t"}})
    assert "unknown key 'pth' in section 'target'; did you mean 'path'?" in err


def test_unknown_keys_name_the_section_and_the_closest_key(tmp_path, capsys):
    cfg = {**MINIMAL, "optimm": {"learning_rate": 0.001}}
    err = launch_fails(capsys, tmp_path, cfg)
    assert "unknown key 'optimm' at the top level; did you mean 'optim'?" in err
    cfg = {**MINIMAL, "train": {**MINIMAL["train"], "stpes": 5}}
    assert "unknown key 'stpes' in section 'train'; did you mean 'steps'?" in launch_fails(capsys, tmp_path, cfg)
    err = launch_fails(capsys, tmp_path, MINIMAL, "optim.learning_rte=0.1")  # was a TypeError traceback
    assert "override 'optim.learning_rte=0.1'" in err and "did you mean 'learning_rate'?" in err
    err = launch_fails(capsys, tmp_path, MINIMAL, "optim.zzz=1")  # nothing close: the valid keys are listed
    assert "unknown key 'zzz' in section 'optim'; valid keys: learning_rate," in err
    err = launch_fails(capsys, tmp_path, MINIMAL, "optim.total_steps=5")
    assert "optim.total_steps is not a setting: it is set from train.steps" in err


def test_missing_required_keys_are_named(tmp_path, capsys):
    cfg = {"data": "d", "train": {"num_draft_steps": 3, "batch_size": 2}}  # was a KeyError traceback
    err = launch_fails(capsys, tmp_path, cfg)
    assert "missing required keys out, train.seq_len, train.steps" in err
    err = launch_fails(capsys, tmp_path, {"data": "d", "out": "o"})
    assert "missing required keys train.num_draft_steps, train.batch_size, train.seq_len, train.steps" in err
    err = launch_fails(capsys, tmp_path, {**MINIMAL, "train": {**MINIMAL["train"], "eval_every": 5}})
    assert "train.eval_every = 5 needs train.eval_prompts" in err


def test_held_out_sets_need_distinct_names(tmp_path, capsys):
    """train.eval_data: each set's scores are logged under its directory's name; null turns it off."""
    train = {**MINIMAL["train"], "eval_every": 5}
    err = launch_fails(capsys, tmp_path, {**MINIMAL, "train": {**train, "eval_data": ["a/mt_bench", "b/mt_bench"]}})
    assert "train.eval_data directories need distinct names" in err
    cfg = parse_config({**MINIMAL, "train": {**train, "eval_data": ["a/mt_bench", "a/gsm8k"]}})
    assert cfg.train.eval_data == ("a/mt_bench", "a/gsm8k")
    assert parse_config({**MINIMAL, "train": {**MINIMAL["train"], "eval_data": None}}).train.eval_data is None


def test_evaluated_trees_need_prompts_and_parse(tmp_path, capsys):
    """train.eval_trees: trees the engine also runs on eval_prompts (recorded for automatic speculation)."""
    train = {**MINIMAL["train"], "eval_every": 5, "eval_data": ["a/mt_bench"]}
    err = launch_fails(capsys, tmp_path, {**MINIMAL, "train": {**train, "eval_trees": ["12,5,3"]}})
    assert "train.eval_trees are run on train.eval_prompts" in err
    err = launch_fails(capsys, tmp_path, {**MINIMAL, "train": {**train, "eval_prompts": "mt_bench",
                                                                "eval_trees": ["12,5"]}})
    assert "train.eval_trees: --tree wants TOTAL,DEPTH,TOPK" in err
    cfg = parse_config({**MINIMAL, "train": {**train, "eval_prompts": "mt_bench", "eval_trees": ["12,5,3", "32,6,8"]}})
    assert cfg.train.eval_trees == ("12,5,3", "32,6,8")


def test_wrong_types_name_key_type_and_value(tmp_path, capsys):
    cfg = {**MINIMAL, "optim": {"learning_rate": "fast"}}
    err = launch_fails(capsys, tmp_path, cfg)
    assert "optim.learning_rate must be a number, got 'fast' (a string)" in err
    err = launch_fails(capsys, tmp_path, MINIMAL, "train.steps=many")
    assert "override 'train.steps=many': train.steps must be an integer, got 'many' (a string)" in err
    err = launch_fails(capsys, tmp_path, MINIMAL, "train.steps=2.5")
    assert "train.steps must be an integer, got 2.5 (a number)" in err
    err = launch_fails(capsys, tmp_path, MINIMAL, "optim.freeze_lm_head=1")
    assert "optim.freeze_lm_head must be true or false, got 1" in err
    err = launch_fails(capsys, tmp_path, MINIMAL, "train.features=ofline")
    assert "train.features must be one of 'online', 'offline', got 'ofline'" in err and "did you mean 'offline'" in err
    err = launch_fails(capsys, tmp_path, MINIMAL, "train.checkpoint_every=0")  # was a ZeroDivisionError mid-run
    assert "train.checkpoint_every must be at least 1, got 0" in err
    for rate in (".nan", ".inf"):  # a NaN rate trained to NaN losses, exited 0 and exported a NaN head
        err = launch_fails(capsys, tmp_path, MINIMAL, f"optim.learning_rate={rate}")
        assert "optim.learning_rate must be a finite number" in err, err
    err = launch_fails(capsys, tmp_path, {**MINIMAL, "optim": {"grad_clip": float("inf")}})
    assert "optim.grad_clip must be a finite number, got inf" in err
    assert "train must be a section" in launch_fails(capsys, tmp_path, {**MINIMAL, "train": 5})
    assert "train.steps is a value, not a section" in launch_fails(capsys, tmp_path, MINIMAL, "train.steps.x=1")
    assert "is not key=value" in launch_fails(capsys, tmp_path, MINIMAL, "train.steps")


def test_unreadable_configs(tmp_path, capsys):
    assert "does not exist" in fails(capsys, launch.main, ["--config", str(tmp_path / "nope.yaml")])
    err = launch_fails(capsys, tmp_path, "data: [d\nout: o\n")
    assert "is not valid YAML" in err and "line 2" in err
    err = launch_fails(capsys, tmp_path, "data: d\nout: o\ndata: e\n")
    assert "key 'data' is given twice (line 3" in err
    assert "expected key: value lines" in launch_fails(capsys, tmp_path, "- a\n- b\n")
    assert "its value is not valid YAML" in launch_fails(capsys, tmp_path, MINIMAL, "train.steps=[")


def test_launch_exits_2_without_traceback(tmp_path):
    path = write(tmp_path, {**MINIMAL, "optimm": {}})
    proc = subprocess.run(
        [sys.executable, "-m", "train.launch", "--config", str(path)],
        check=False,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2 and proc.stderr.startswith("error: ") and "did you mean 'optim'?" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_launch_checks_its_data_before_loading_the_target(tmp_path, capsys, monkeypatch):
    def no_target(_):
        raise AssertionError("the target was loaded")

    monkeypatch.setattr("jaxspec.cli.loading.resolve_target", no_target)
    cfg = {**MINIMAL, "data": str(tmp_path / "missing"), "out": str(tmp_path / "out")}
    assert f"data directory {cfg['data']!r} does not exist" in launch_fails(capsys, tmp_path, cfg)
    (tmp_path / "empty").mkdir()
    cfg["data"] = str(tmp_path / "empty")
    assert "holds no training shards" in launch_fails(capsys, tmp_path, cfg)
    # a list of datasets: each is checked, the missing one named
    cfg["data"] = [str(tmp_path / "empty"), str(tmp_path / "missing")]
    assert "holds no training shards" in launch_fails(capsys, tmp_path, cfg)
    assert not (tmp_path / "out").exists()


def test_data_is_a_directory_or_a_list_of_them():
    assert parse_config({**MINIMAL, "data": "d"}).data == "d"
    assert parse_config({**MINIMAL, "data": ["d", "e"]}).data == ("d", "e")
    for bad, shown in (([], "[] (a list)"), (["d", 3], "['d', 3] (a list)"), (5, "5 (an integer)")):
        with pytest.raises(JaxspecError, match=re.escape(
                f"data must be a string or a non-empty list (a string each), got {shown}")):
            parse_config({**MINIMAL, "data": bad})


def test_data_features_needs_shards(tmp_path, capsys):
    err = fails(capsys, train_data.main, ["features", "--data", str(tmp_path / "missing")])
    assert f"data directory {str(tmp_path / 'missing')!r} does not exist" in err
    (tmp_path / "empty").mkdir()
    assert "holds no data shards" in fails(capsys, train_data.main, ["features", "--data", str(tmp_path / "empty")])
    (tmp_path / "file").write_text("")
    assert "is not a directory" in fails(capsys, train_data.main, ["features", "--data", str(tmp_path / "file")])


def test_data_reads_fail_cleanly(tmp_path, capsys):
    (tmp_path / "shard-00000.npz").write_bytes(b"not a zip")
    with pytest.raises(Exception, match="cannot read") as exc:
        train_data.read_shards(tmp_path)
    assert type(exc.value).__name__ == "JaxspecError"
    np.savez(tmp_path / "shard-00000.npz", tokens=np.zeros(3, np.int32))
    with pytest.raises(Exception, match="lacks array 'offsets'"):
        train_data.read_shards(tmp_path)


def test_data_generate_checks_its_inputs_before_writing(tmp_path, capsys):
    out = tmp_path / "out"
    err = fails(capsys, train_data.main, ["generate", "--prompts", str(tmp_path / "nope.jsonl"), "--out", str(out)])
    assert "prompts file" in err and "does not exist" in err and not out.exists()
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "a", "prompt": "x"}\n')
    err = fails(
        capsys,
        train_data.main,
        ["generate", "--prompts", str(prompts), "--out", str(out), "--exclude", str(tmp_path / "eval.jsonl")],
    )
    assert "eval.jsonl" in err and not out.exists()
    err = fails(
        capsys, train_data.main, ["generate", "--prompts", str(prompts), "--out", str(out), "--exclude", str(prompts)]
    )
    assert "nothing to generate" in err and not out.exists()
    err = fails(
        capsys,
        train_data.main,
        ["generate", "--prompts", str(prompts), "--out", str(out), "--target", str(tmp_path / "no-target")],
    )
    assert "target path" in err and not out.exists()
    err = fails(capsys, train_data.main, ["generate", "--prompts", str(prompts), "--out", str(prompts)])
    assert "exists and is not a directory" in err
    err = fails(
        capsys, train_data.main, ["generate", "--prompts", str(prompts), "--out", str(out), "--host-index", "1"]
    )
    assert "--host-index must be in 0..0" in err
    with pytest.raises(SystemExit) as exc:  # argparse's own check: usage, then the error
        train_data.main(["generate", "--prompts", str(prompts), "--out", str(out), "--shard-size", "0"])
    assert exc.value.code == 2 and "--shard-size: must be at least 1, got 0" in capsys.readouterr().err


def _parsers(parser: argparse.ArgumentParser):
    yield parser.prog, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _parsers(sub)


@pytest.mark.parametrize("build", [launch.build_parser, train_data.build_parser, heldout.build_parser],
                         ids=["launch", "data", "heldout"])
def test_every_flag_has_help_with_its_default(build):
    for prog, parser in _parsers(build()):
        for action in parser._actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            name = "/".join(action.option_strings) or action.dest
            assert action.help, f"{prog} {name} has no help"
            assert "default" in action.help, f"{prog} {name}: the help does not state the default"
        assert "%(default)" not in parser.format_help()  # the %-formats expand


def test_the_head_section_builds_a_multi_layer_eagle31_head():
    """head.num_layers / fc_norm / norm_output reach the head train.launch builds (its TTT: tests/test_ttt.py)."""
    import numpy as np
    from spec_fixtures import tiny_target

    from train.config import HeadSection
    from train.launch import build_head

    head = build_head(tiny_target(), HeadSection(draft_vocab_size=48, num_layers=3, fc_norm=True, norm_output=True),
                      np.arange(101), seed=0)
    assert (head.config.num_layers, head.config.fc_norm, head.config.norm_output) == (3, True, True)
    assert len(head.later_layers) == 2 and head.fc_norm is not None


def test_a_resume_with_another_head_shape_is_refused_in_one_line(tmp_path):
    """train.launch records the head's shape with each checkpoint and compares it before restoring (orbax would
    fail on the tree's structure, naming no key); an older checkpoint without the record is not checked."""
    from train.launch import check_head_shape

    recorded = {"num_layers": 2, "draft_vocab_size": 48, "intermediate_size": 96, "fc_norm": True,
                "norm_output": True}
    check_head_shape(tmp_path, recorded, dict(recorded))
    check_head_shape(tmp_path, None, dict(recorded, num_layers=1))
    with pytest.raises(JaxspecError, match=r"trained with head.norm_output=True, head.num_layers=2; the config asks "
                                           r"for another head: restore them"):
        check_head_shape(tmp_path, recorded, dict(recorded, num_layers=1, norm_output=False))
