"""The training config of `python -m train.launch`: a typed schema of frozen dataclasses, checked as it is parsed.

A config is a YAML file whose top-level keys and sections mirror `RunConfig`, plus `key.sub=value` overrides from
the command line (the value is read as YAML: `train.steps=100`, `target=null`, `mesh={data: 2, fsdp: 1}`). Every
key is checked against the schema before anything runs: an unknown key (a typo), a missing required key, a value
of the wrong type or out of range is a one-line `JaxspecError` naming the key, its section and, for a typo, the
closest valid key. Nothing is silently ignored or defaulted in place of what was written.

Floats are also accepted in the exponent form YAML 1.1 reads as a string (`learning_rate: 3e-4`).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml

from jaxspec.errors import JaxspecError


def _setting(default: Any = dataclasses.MISSING, *, at_least: float | None = None, derived: str | None = None):
    """A field with an optional lower bound; `derived`: not settable, filled in from that other key."""
    metadata = {"min": at_least, "derived": derived}
    return dataclasses.field(default=default, metadata=metadata)


@dataclasses.dataclass(frozen=True)
class HeadSection:
    """`head:` the draft head's shape (the rest comes from the target)."""

    draft_vocab_size: int | None = _setting(None, at_least=0)  # null or 0: the target's vocabulary
    intermediate_size: int | None = _setting(None, at_least=1)  # null: the target's
    init_lm_head_from_target: bool = True  # lm_head = the target's rows for the draft vocabulary
    num_layers: int = _setting(1, at_least=1)  # decoder layers (speculators trains 1 to 4; vLLM loads any)
    fc_norm: bool = False  # EAGLE 3.1: one RMSNorm per target feature chunk before fc
    norm_output: bool = False  # EAGLE 3.1: the normed output is the next step's state
    # an exported head (any layout) to start from instead of random weights: its weights and draft vocabulary; a
    # longer training continued in a new run (the optimizer state starts afresh; set another train.seed for
    # other batches)
    init_from: str | None = None


@dataclasses.dataclass(frozen=True)
class DFlashSection:
    """`dflash:` a block drafter's shape and objective (`drafter: dflash`); null: as `DFlashConfig.for_target`
    shapes it for the target (its layers' widths, z-lab's feature layers)."""

    num_layers: int = _setting(1, at_least=1)  # decoder layers (z-lab's drafters: 5 for 8B targets)
    block_size: int = _setting(8, at_least=2)  # B: one forward drafts B - 1 tokens
    intermediate_size: int | None = _setting(None, at_least=1)  # null: the target's
    target_layer_ids: tuple[int, ...] | None = None  # z-lab ids (the outputs of these decoder layers); null: default
    mask_token_id: int | None = _setting(None, at_least=0)  # the block's filler token; null: the last vocabulary id
    num_anchors: int = _setting(16, at_least=1)  # blocks trained per sequence and step
    # slot k >= 1 weighs exp(-(k - 1) / loss_decay) (train/dflash.py): 7 for blocks of 16 in SpecForge, 4 for 7-8
    loss_decay: float = _setting(4.0, at_least=1e-6)
    # G: batches of rows of similar length, G batches at a time, each as wide as its longest row
    # (train/block_batches.py); 0: every batch train.seq_len wide
    group_by_length: int = _setting(0, at_least=0)


@dataclasses.dataclass(frozen=True)
class TargetSection:
    """`target:` the verifier the drafter learns to predict; `target: DIR` is short for `target: {path: DIR}`."""

    SHORTHAND: typing.ClassVar[str] = "path"  # the key a bare value sets (`_value`, `_apply_override`)
    path: str | None = None  # a Hugging Face model directory; null: the built-in SmolLM2-135M-Instruct
    # int8 or fp8: its decoder weights quantized at load as `--quantize` serves them (models/quantize.py), so the
    # drafter learns the quantized verifier's features and tokens; null: the checkpoint's own weights
    quantize: Literal["int8", "fp8"] | None = None


@dataclasses.dataclass(frozen=True)
class TrainSection:
    """`train:` the loop, its data, checkpoints, logs and evaluation."""

    num_draft_steps: int = _setting(at_least=1)  # TTT steps K (dflash: the chain evaluated, at most block_size - 1)
    batch_size: int = _setting(at_least=1)
    seq_len: int = _setting(at_least=2)  # packed row length: sequences go back to back; longer ones are cut
    steps: int = _setting(at_least=1)
    seed: int = 0
    # positions per packed row that run the draft steps (0: seq_len); bounds the loss-bearing tokens of a row
    trained_positions: int = _setting(0, at_least=0)
    checkpoint_every: int = _setting(100, at_least=1)
    keep_checkpoints: int = _setting(3, at_least=1)
    log_every: int = _setting(10, at_least=1)
    features: Literal["online", "offline"] = "online"  # offline: cached by `python -m train.data features`
    # the dtype a step computes in (train/precision.py): master weights and optimizer state keep the head's dtype;
    # auto: bfloat16 on GPU/TPU, and on CPU where a timed bfloat16 matmul beats float32 (AVX512-BF16 / AMX)
    compute_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    # the teacher's logits are divided by this before its softmax (train/ttt.py, ttt_loss); 0: its greedy token
    # alone, a hard label (greedy verification accepts only the target's top token)
    teacher_temperature: float = _setting(1.0, at_least=0.0)
    eval_every: int = _setting(0, at_least=0)  # 0: no evaluation
    eval_prompts: str | None = None  # a shipped set (mt_bench, gsm8k) or a prompts file; needed when eval_every > 0
    eval_num_prompts: int = _setting(8, at_least=1)
    eval_max_new_tokens: int = _setting(64, at_least=1)
    # held-out shard directories (python -m train.data generate, e.g. the target's responses to MT-Bench) scored
    # teacher-forced at each evaluation (train/heldout.py): every response position, a few seconds per 1k tokens
    eval_data: tuple[str, ...] | None = None  # null: none
    # trees ("TOTAL,DEPTH,TOPK") the engine also runs on eval_prompts at each evaluation: the exported head records
    # them, and `--num-speculative-tokens auto` weighs the trees its head records (a tree's acceptance is not a
    # chain's, so it is measured, not derived)
    eval_trees: tuple[str, ...] | None = None  # null: none

    @property
    def trees(self) -> dict:  # {spec: jaxspec.engine.tree.TreeConfig}, in eval_trees' order
        """eval_trees parsed: the config check, the launcher's checks, evaluations and export all read this."""
        from jaxspec.engine.tree import TreeConfig

        return {spec: TreeConfig.parse(spec) for spec in self.eval_trees or ()}


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """`optim:` AdamW with warmup and cosine decay over the run's steps, and global-norm clipping."""

    learning_rate: float = _setting(3e-4, at_least=0.0)
    warmup_steps: int = _setting(100, at_least=0)
    total_steps: int = _setting(10_000, at_least=1, derived="train.steps")
    weight_decay: float = _setting(0.0, at_least=0.0)
    b1: float = _setting(0.9, at_least=0.0)
    b2: float = _setting(0.95, at_least=0.0)
    grad_clip: float = _setting(0.5, at_least=0.0)
    freeze_lm_head: bool = False  # speculators initialise it from the target's rows and keep it frozen


@dataclasses.dataclass(frozen=True)
class MeshSection:
    """`mesh:` data × fsdp devices."""

    data: int = _setting(1, at_least=1)
    fsdp: int = _setting(1, at_least=1)


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """A whole training run: the top level of the YAML file."""

    # the dataset directory (python -m train.data generate --out), or a list of them trained on as one mix
    data: str | tuple[str, ...]
    out: str  # the run directory: checkpoints, metrics, exported heads
    train: TrainSection
    target: TargetSection = TargetSection()  # `target: DIR` or `target: {path: DIR, quantize: int8}`
    drafter: Literal["eagle3", "dflash"] = "eagle3"  # what is trained: an EAGLE-3 head or a DFlash block drafter
    head: HeadSection = HeadSection()  # drafter: eagle3
    dflash: DFlashSection = DFlashSection()  # drafter: dflash
    optim: OptimConfig = OptimConfig()
    mesh: MeshSection = MeshSection()
    distributed: bool = False  # multi-host: jax.distributed.initialize() first


def load_config(path: str | Path, overrides: list[str] = ()) -> RunConfig:
    """The checked config of a YAML file with `key.sub=value` overrides applied in order."""
    file = Path(path)
    if not file.is_file():
        raise JaxspecError(
            f"config {str(path)!r} does not exist" if not file.exists() else f"config {str(path)!r} is not a file"
        )
    where = f"config {str(path)!r}"
    try:
        text = file.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise JaxspecError(f"cannot read {where}: {e}") from None
    raw = _yaml(text, where)
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise JaxspecError(f"{where}: expected key: value lines at the top level, got {_show(raw)}")
    _convert(RunConfig, raw, (), where, partial=True)  # the file's own mistakes are reported as the file's
    for item in overrides:
        _apply_override(raw, item)
    return parse_config(raw, where + (" with overrides" if overrides else ""))


def parse_config(raw: dict, where: str = "config") -> RunConfig:
    """The checked `RunConfig` of a mapping (a parsed YAML file): errors start with `where`."""
    missing = _missing(RunConfig, raw, ())
    if missing:
        raise JaxspecError(f"{where}: missing required key{'s' if len(missing) > 1 else ''} {', '.join(missing)}")
    cfg = _convert(RunConfig, raw, (), where, partial=False)
    t = cfg.train
    if t.eval_every and not (t.eval_prompts or t.eval_data):
        raise JaxspecError(
            f"{where}: train.eval_every = {t.eval_every} needs train.eval_prompts (mt_bench, gsm8k or a prompts file) "
            "or train.eval_data (held-out shard directories)"
        )
    if t.eval_trees and not t.eval_prompts:
        raise JaxspecError(f"{where}: train.eval_trees are run on train.eval_prompts: set it (mt_bench, gsm8k or a "
                           "prompts file)")
    try:
        t.trees  # noqa: B018 (parsed here so that a bad spec fails before anything loads)
    except JaxspecError as e:
        raise JaxspecError(f"{where}: train.eval_trees: {e}") from None
    names = [Path(d).name for d in t.eval_data or ()]
    if len(set(names)) < len(names):
        raise JaxspecError(f"{where}: train.eval_data directories need distinct names (their scores are logged by "
                           f"name), got {', '.join(names)}")
    if cfg.drafter == "dflash":
        _check_dflash(cfg, raw, where)
    elif "dflash" in raw:
        raise JaxspecError(f"{where}: the dflash: section shapes a block drafter; set drafter: dflash to train one, or "
                           "remove it")
    if t.trained_positions > t.seq_len:
        raise JaxspecError(
            f"{where}: train.trained_positions = {t.trained_positions} exceeds train.seq_len = {t.seq_len} "
            "(0 means seq_len)"
        )
    return dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, total_steps=t.steps))


def _check_dflash(cfg: RunConfig, raw: dict, where: str) -> None:
    """What a DFlash run does not do (yet), refused before anything loads rather than ignored."""
    t, d = cfg.train, cfg.dflash
    if t.num_draft_steps > d.block_size - 1:
        raise JaxspecError(f"{where}: train.num_draft_steps = {t.num_draft_steps} exceeds what a block of "
                           f"dflash.block_size = {d.block_size} drafts ({d.block_size - 1})")
    unsupported = {
        "head": "head" in raw and "the head: section shapes an EAGLE-3 head; a DFlash drafter's is dflash:",
        "train.features": t.features != "online" and "offline features are EAGLE-3's; DFlash computes them online",
        "train.eval_trees": bool(t.eval_trees) and "a DFlash drafter's training evaluation runs chains",
        "train.trained_positions": bool(t.trained_positions) and "DFlash trains dflash.num_anchors blocks per row "
                                                                 "instead",
    }
    for key, why in unsupported.items():
        if why:
            raise JaxspecError(f"{where}: {key} is not for drafter: dflash ({why}); remove it")


# --- checking ---------------------------------------------------------------------------------------------------

_FLOAT = re.compile(r"[-+]?(\d+(\.\d*)?|\.\d+)([eE][-+]?\d+)?")


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping (PyYAML would keep the last silently)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, typing.Hashable) and key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"key {key!r} is given twice", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _yaml(text: str, where: str):
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        at = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        raise JaxspecError(f"{where} is not valid YAML: {problem}{at}") from None


def _fields(cls) -> dict[str, tuple[Any, dataclasses.Field]]:
    hints = typing.get_type_hints(cls)
    return {f.name: (hints[f.name], f) for f in dataclasses.fields(cls)}


def _settable(cls) -> list[str]:
    return [name for name, (_, f) in _fields(cls).items() if not f.metadata.get("derived")]


def _section_name(path: tuple[str, ...]) -> str:
    return f"in section {'.'.join(path)!r}" if path else "at the top level"


def _unknown_key(cls, key, path: tuple[str, ...], where: str) -> JaxspecError:
    fields = _fields(cls)
    if isinstance(key, str) and key in fields and fields[key][1].metadata.get("derived"):
        derived = fields[key][1].metadata["derived"]
        return JaxspecError(f"{where}: {'.'.join((*path, key))} is not a setting: it is set from {derived}")
    valid = _settable(cls)
    close = difflib.get_close_matches(str(key), valid, n=1)
    hint = f"did you mean {close[0]!r}?" if close else f"valid keys: {', '.join(valid)}"
    return JaxspecError(f"{where}: unknown key {str(key)!r} {_section_name(path)}; {hint}")


def _show(value) -> str:
    kinds = {
        str: "a string",
        bool: "a boolean",
        int: "an integer",
        float: "a number",
        list: "a list",
        dict: "a mapping",
        type(None): "null",
    }
    text = "null" if value is None else repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    kind = kinds.get(type(value), type(value).__name__)
    return text if value is None else f"{text} ({kind})"


def _expected(tp) -> str:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_expected(a) for a in typing.get_args(tp))
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin is tuple:
        return f"a non-empty list ({_expected(typing.get_args(tp)[0])} each)"
    if dataclasses.is_dataclass(tp):
        return "a section of key: value lines"
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string", type(None): "null"}[tp]


def _value(tp, value, path: tuple[str, ...], where: str, field: dataclasses.Field | None = None, partial=False):
    """`value` checked (and, for floats and sections, converted) against type `tp`; raises a one-line error."""
    name = ".".join(path)
    origin = typing.get_origin(tp)
    ok, out = False, value
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        if len(args) == 1:
            return _value(args[0], value, path, where, field, partial)
        for arg in args:  # the first alternative the value fits (str | tuple[str, ...]: a name or a list of them)
            try:
                return _value(arg, value, path, where, field, partial)
            except JaxspecError:
                pass
    elif origin is tuple:  # tuple[X, ...]: a YAML list of X
        (item,) = (a for a in typing.get_args(tp) if a is not Ellipsis)
        if isinstance(value, list) and value:
            return tuple(_value(item, v, (*path[:-1], f"{path[-1]}[{i}]"), where, None, partial)
                         for i, v in enumerate(value))
    elif origin is Literal:
        choices = typing.get_args(tp)
        if value in choices and type(value) is type(choices[0]):
            return value
        close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise JaxspecError(f"{where}: {name} must be {_expected(tp)}, got {_show(value)}{hint}")
    elif dataclasses.is_dataclass(tp):
        if value is None:  # an empty section (only comments under it): its defaults
            value = {}
        if isinstance(value, str) and hasattr(tp, "SHORTHAND"):  # `target: DIR`
            value = {tp.SHORTHAND: value}
        if isinstance(value, dict):
            return _convert(tp, value, path, where, partial)
    elif tp is bool:
        ok = isinstance(value, bool)
    elif tp is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif tp is float:
        numeric = isinstance(value, str) and _FLOAT.fullmatch(value.strip())  # YAML 1.1 reads 3e-4 as a string
        ok = numeric or (isinstance(value, (int, float)) and not isinstance(value, bool))
        if ok:
            out = float(value)
            if not math.isfinite(out):  # a NaN or infinite rate trained to NaN losses and exported a NaN head
                raise JaxspecError(f"{where}: {name} must be a finite number, got {value!r}")
    elif tp is str:
        ok = isinstance(value, str)
    if not ok:
        raise JaxspecError(f"{where}: {name} must be {_expected(tp)}, got {_show(value)}")
    low = field.metadata.get("min") if field is not None else None
    if low is not None and out < low:
        raise JaxspecError(f"{where}: {name} must be at least {low}, got {value!r}")
    return out


def _required(f: dataclasses.Field) -> bool:
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING


def _missing(cls, raw, path: tuple[str, ...]) -> list[str]:
    """The dotted names of the required keys absent from a mapping, sections included (a section left out
    entirely counts as all its required keys)."""
    out = []
    for name, (tp, f) in _fields(cls).items():
        value = raw.get(name) if isinstance(raw, dict) else None
        if dataclasses.is_dataclass(tp):
            if value is None or isinstance(value, dict):
                out += _missing(tp, value or {}, (*path, name))
        elif _required(f) and not (isinstance(raw, dict) and name in raw):
            out.append(".".join((*path, name)))
    return out


def _convert(cls, raw: dict, path: tuple[str, ...], where: str, partial: bool):
    """A `cls` built from a mapping; with partial, only the keys present are checked (a dict of them is returned).
    Required keys are checked by `_missing` first."""
    fields = _fields(cls)
    for key in raw:
        if key not in fields or fields[key][1].metadata.get("derived"):
            raise _unknown_key(cls, key, path, where)
    values = {key: _value(fields[key][0], v, (*path, key), where, fields[key][1], partial) for key, v in raw.items()}
    return values if partial else cls(**values)


def _apply_override(raw: dict, item: str) -> None:
    """Apply one `key.sub=value` override to the parsed YAML, checking the key path and the value."""
    where = f"override {item!r}"
    if "=" not in item:
        raise JaxspecError(f"{where} is not key=value (e.g. train.steps=100)")
    key, text = item.split("=", 1)
    parts = key.strip().split(".")
    if not all(parts):
        raise JaxspecError(f"{where}: {key.strip()!r} is not a key (e.g. train.steps=100)")
    cls, node = RunConfig, raw
    for i, part in enumerate(parts):
        fields = _fields(cls)
        if part not in fields or fields[part][1].metadata.get("derived"):
            raise _unknown_key(cls, part, tuple(parts[:i]), where)
        tp, field = fields[part]
        shorthand = getattr(tp, "SHORTHAND", None)
        if i == len(parts) - 1:
            value = _yaml(text, where + ": its value") if text.strip() else None
            _value(tp, value, tuple(parts), where, field, partial=True)
            if shorthand and isinstance(node.get(part), dict) and (value is None or isinstance(value, str)):
                node[part] = {**node[part], shorthand: value}  # `target=DIR` keeps the file's target.quantize
            else:
                node[part] = value
            return
        if not dataclasses.is_dataclass(tp):
            raise JaxspecError(f"{where}: {'.'.join(parts[: i + 1])} is a value, not a section")
        if shorthand and isinstance(node.get(part), str):  # `target: DIR` in the file, then `target.quantize=...`
            node[part] = {shorthand: node[part]}
        elif not isinstance(node.get(part), dict):  # absent, or an empty section
            node[part] = {}
        cls, node = tp, node[part]
