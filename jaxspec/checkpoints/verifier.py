"""The verifier record of an EAGLE-3 head: which target a head was exported for, and how often its drafts were
accepted — so that loading can refuse a head made for another target before reading any weights, and `--draft DIR`
alone can find its target.

A head exported by jaxspec describes itself: the verifier it was exported for (name or path, architecture, hidden
size, vocabulary, number of layers, the layers it reads) and, when known, how often its drafts were accepted.
The speculators layout keeps the verifier's name and architectures in its own `speculators_config.verifier`; the
rest, and the whole record in the other two layouts, goes under the top-level key `jaxspec` (other loaders ignore
unknown keys):

    "jaxspec": {"verifier": {"name_or_path", "architectures", "model_type", "hidden_size", "vocab_size",
                             "num_hidden_layers", "aux_hidden_state_layer_ids"},
                "acceptance": [{"prompts", "mean_accepted_length", "acceptance_per_position", "method", ...}]}

A relative name_or_path is relative to the head's directory; the built-in target is named by its name
(`builtin.NAME`). Loading compares the record with the target before any weights are read (`validate_head`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from jaxspec.config import HeadConfig, TargetConfig, TreeConfig
from jaxspec.errors import JaxspecError

RECORD_KEY = "jaxspec"  # a head config's own key for what the published layouts have no field for
# Hugging Face architecture of each supported model type (a verifier's `architectures`)
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                 "qwen3_moe": "Qwen3MoeForCausalLM", "gemma2": "Gemma2ForCausalLM",
                 "gemma3_text": "Gemma3ForCausalLM", "gemma4_text": "Gemma4ForCausalLM"}
SPECULATORS_VERIFIER_KEYS = ("name_or_path", "architectures")  # what speculators' VerifierConfig defines


def verifier_record(
    target: TargetConfig, name_or_path: str | None, aux_layer_ids=None, quantization: str | None = None
) -> dict[str, Any]:
    """What a head records about the verifier it is exported for. aux_layer_ids: Hugging Face hidden_states indices
    the head reads (default: the target's); quantization: int8 or fp8 when it was trained against the target with
    its weights quantized (`target.quantize`), recorded so that a user knows which verifier it was made for."""
    aux = aux_layer_ids if aux_layer_ids is not None else target.aux_layer_ids
    return ({"quantization": quantization} if quantization else {}) | {
        "name_or_path": name_or_path,
        "architectures": [ARCHITECTURES.get(target.model_type, "LlamaForCausalLM")],
        "model_type": target.model_type,
        "hidden_size": target.hidden_size,
        "vocab_size": target.vocab_size,
        "num_hidden_layers": target.num_layers,
        "aux_hidden_state_layer_ids": [int(i) for i in aux],
    }


def head_record(raw: dict[str, Any]) -> tuple[dict[str, Any] | None, list[dict[str, Any]] | None]:
    """(verifier record, acceptance profile) of a head config; None where it has none. The speculators layout's own
    verifier fields win over the jaxspec record's (a user may point name_or_path at a Hub id for vLLM); a
    speculators head from elsewhere has only those (older speculators versions also wrote hidden_size and
    vocab_size there, which are compared too)."""
    extra = raw.get(RECORD_KEY)
    extra = extra if isinstance(extra, dict) else {}
    verifier = extra.get("verifier")
    verifier = dict(verifier) if isinstance(verifier, dict) else {}
    layout_verifier = (raw.get("speculators_config") or {}).get("verifier")
    if isinstance(layout_verifier, dict):
        verifier.update({k: v for k, v in layout_verifier.items() if v is not None})
    acceptance = extra.get("acceptance")
    return (verifier or None), (acceptance if isinstance(acceptance, list) else None)


def _record_int(record: dict[str, Any], key: str) -> int | None:
    value = record.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise JaxspecError(f"the head config's verifier record has {key}={value!r}, expected an integer")
    return value


def verifier_mismatch(verifier: dict[str, Any] | None, cfg: HeadConfig, target: TargetConfig) -> str | None:
    """One line naming each way the target differs from the verifier a head was exported for, or None. Only the
    fields the record has are compared; the name is not (the same model sits at different paths)."""
    if not verifier:
        return None
    model_type = verifier.get("model_type")
    if model_type is None:  # a record from elsewhere: its architecture, where it is one jaxspec knows
        archs = verifier.get("architectures") or []
        by_arch = {a: t for t, a in ARCHITECTURES.items()}
        model_type = by_arch.get(archs[0]) if isinstance(archs, list) and len(archs) == 1 else None
    aux = verifier.get("aux_hidden_state_layer_ids")
    if aux is not None:
        if not isinstance(aux, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in aux):
            raise JaxspecError(f"the head config's verifier record has aux_hidden_state_layer_ids={aux!r}, "
                               "expected a list of integers")
        # Only a head whose config does not name its layers (the EAGLE layout) reads the target's default ones:
        # then the layers it was trained on must be those. A head naming them is checked against the target's
        # depth by validate_head.
        aux = tuple(aux) if cfg.aux_layer_ids is None else None
    fields = [
        ("architecture {}", model_type, target.model_type),
        ("hidden size {}", _record_int(verifier, "hidden_size"), target.hidden_size),
        ("vocabulary {}", _record_int(verifier, "vocab_size"), target.vocab_size),
        ("{} layers", _record_int(verifier, "num_hidden_layers"), target.num_layers),
        ("aux layers {}", aux, tuple(target.aux_layer_ids)),
    ]
    diffs = [(text.format(theirs), text.format(ours)) for text, theirs, ours in fields
             if theirs is not None and theirs != ours]
    if not diffs:
        return None
    name = verifier.get("name_or_path")
    who = f"the verifier {name!r}" if name else "a verifier"
    return (
        f"draft head was exported for {who} with {', '.join(d[0] for d in diffs)}; this target has "
        f"{', '.join(d[1] for d in diffs)}: run it with that verifier (--target DIR), or use a head exported for "
        "this target"
    )


def locate_verifier(raw: dict[str, Any], head_dir: str | Path) -> Path | None:
    """The local directory of the verifier a head's config names (absolute, or relative to the head directory), or
    None when it names none or names the built-in target. A verifier named but not found here is a one-line error
    saying to pass --target (nothing is downloaded)."""
    from jaxspec.checkpoints.builtin import NAME

    verifier = head_record(raw)[0] or {}
    name = verifier.get("name_or_path")
    if not name:
        return None
    if not isinstance(name, str):
        raise JaxspecError(f"the head config's verifier name_or_path is {name!r}, expected a string")
    path = Path(name).expanduser()
    if not path.is_absolute():
        path = Path(os.path.normpath(Path(head_dir) / path))
    if (path / "config.json").is_file():
        return path
    if name == NAME:
        return None
    raise JaxspecError(
        f"draft head {str(head_dir)!r} was exported for the verifier {name!r}, which is neither a local directory "
        "(absolute or relative to the head) nor the built-in target; pass that verifier as --target DIR"
    )


def verifier_name(target: str | os.PathLike | None, head_dir: str | Path) -> str:
    """The name_or_path a head exported into head_dir records for the target it was made with (a --target value):
    the built-in target's name for None; an absolute path as given; a relative one rewritten relative to head_dir,
    where loading looks for it."""
    from jaxspec.checkpoints.builtin import NAME

    if target is None:
        return NAME
    path = Path(target).expanduser()
    if path.is_absolute():
        return str(target)
    return os.path.relpath(path.resolve(), Path(head_dir).resolve())


def check_acceptance(profile: Any) -> list[dict[str, Any]]:
    """An acceptance profile as export writes it: a list of measurements, each naming its prompts and giving the
    mean accepted length (tokens per verify, bonus included), with optional per-position rates and the method, K,
    prompt count and token budget they were measured with."""
    where = "acceptance profile"
    if not isinstance(profile, list):
        raise JaxspecError(f"the {where} must be a list of measurements, got {type(profile).__name__}")
    for i, m in enumerate(profile):
        if not isinstance(m, dict):
            raise JaxspecError(f"{where} entry {i} is not an object")
        if not isinstance(m.get("prompts"), str) or not m["prompts"]:
            raise JaxspecError(f"{where} entry {i} lacks 'prompts' (the prompt set it was measured on)")
        mal = m.get("mean_accepted_length")
        if isinstance(mal, bool) or not isinstance(mal, (int, float)) or mal < 1:
            raise JaxspecError(f"{where} entry {i}: mean_accepted_length must be a number >= 1, got {mal!r}")
        rates = m.get("acceptance_per_position")
        if rates is not None and (not isinstance(rates, list) or not all(
                isinstance(r, (int, float)) and not isinstance(r, bool) and 0 <= r <= 1 for r in rates)):
            raise JaxspecError(f"{where} entry {i}: acceptance_per_position must be a list of rates in [0, 1]")
        method = m.get("method")
        if isinstance(method, str) and method.startswith("tree "):  # a candidate of automatic speculation
            try:
                TreeConfig.parse(method[len("tree "):])
            except JaxspecError as e:
                raise JaxspecError(f"{where} entry {i}: method {method!r}: {e}") from None
        for key in ("num_speculative_tokens", "num_prompts", "max_new_tokens"):
            value = m.get(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise JaxspecError(f"{where} entry {i}: {key} must be a positive integer, got {value!r}")
    return profile
