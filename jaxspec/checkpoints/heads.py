"""EAGLE-3 head checkpoints: detect and load the EAGLE, SpecForge/SGLang and vLLM speculators layouts
(DESIGN_NOTES §2), validate them against the target, and export heads to the speculators and SGLang layouts.

| layout      | architectures                      | config                               | layer keys  | aux layer ids       |
|-------------|------------------------------------|--------------------------------------|-------------|---------------------|
| eagle       | LlamaForCausalLM + draft_vocab_size | flat Llama (rope_theta often absent) | midlayer.*  | default             |
| sglang      | LlamaForCausalLMEagle3             | flat + eagle_config                  | midlayer.*  | output-of-layer (+1)|
| speculators | Eagle3Speculator / Eagle3DraftModel | transformer_layer_config nested      | layers.0.*  | input-of-layer      |

Multi-layer heads (`num_hidden_layers` > 1) store layers 1.. as `layers.{i}.*` in every layout; EAGLE 3.1's
`fc_norm` / `norm_output` are read from the config (`fc_norm` also from its tensors) and written back.

A head exported by jaxspec describes the verifier it was exported for (`verifier.py`); loading compares that
record with the target before any weights are read (`validate_head`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxspec.checkpoints.hf import assign, numpy_dtype
from jaxspec.checkpoints.verifier import (
    RECORD_KEY,
    SPECULATORS_VERIFIER_KEYS,
    check_acceptance,
    head_record,
    verifier_mismatch,
    verifier_record,
)
from jaxspec.config import HeadConfig, TargetConfig, _rope_from_hf, hf_fields, hf_int
from jaxspec.errors import JaxspecError
from jaxspec.files import read_json
from jaxspec.models.eagle3 import Buffer, Eagle3Head

LAYOUTS = ("eagle", "sglang", "speculators")
_OPTIONAL_KEYS = ("t2d", "embed_tokens.weight")  # t2d is implied by d2t; the embedding may come from the target
def read_head_config(path: str | Path) -> dict[str, Any]:
    """A head directory's config.json, parsed; a missing directory, file or bad JSON is a one-line error."""
    path = Path(path)
    if not path.exists():
        raise JaxspecError(f"draft head path {str(path)!r} does not exist")
    if not path.is_dir():
        raise JaxspecError(f"draft head path {str(path)!r} is a file; pass the head's directory (config.json and "
                           "weights)")
    config = path / "config.json"
    if not config.is_file():
        raise JaxspecError(f"draft head directory {str(path)!r} has no config.json")
    return read_json(config, "the draft head's config.json")


def detect_layout(raw: dict[str, Any]) -> str:
    archs = set(raw.get("architectures") or [])
    if raw.get("speculators_model_type") in ("eagle3", "peagle") or archs & {"Eagle3Speculator", "Eagle3DraftModel"}:
        return "speculators"
    if "LlamaForCausalLMEagle3" in archs:
        return "sglang"
    if "draft_vocab_size" in raw:
        return "eagle"
    raise JaxspecError(
        "config.json does not describe an EAGLE-3 head (expected speculators_model_type 'eagle3' or 'peagle', "
        "architecture LlamaForCausalLMEagle3, or a Llama config with draft_vocab_size)"
    )


def head_config_from_hf(raw: dict[str, Any], keys: set[str] = frozenset()) -> tuple[str, HeadConfig]:
    what = "head config.json"
    with hf_fields(what):
        layout = detect_layout(raw)
        if layout == "speculators":
            layer = dict(raw.get("transformer_layer_config") or {})
            if not layer:
                raise JaxspecError("speculators config.json lacks transformer_layer_config")
            aux = raw.get("eagle_aux_hidden_state_layer_ids")  # input-of-layer convention already
            flat = {**layer, **{k: raw[k] for k in ("draft_vocab_size", "target_hidden_size") if k in raw}}
        else:
            flat = raw
            aux = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
            if aux is not None:
                aux = [int(i) + 1 for i in aux]  # "output of layer i" = hidden_states[i + 1]
        hidden = hf_int(flat, "hidden_size", what=what)
        heads = hf_int(flat, "num_attention_heads", what=what)
        vocab = hf_int(flat, "vocab_size", what=what)
        cfg = HeadConfig(
            hidden_size=hidden,
            num_heads=heads,
            num_kv_heads=hf_int(flat, "num_key_value_heads", 0, what) or heads,
            head_dim=hf_int(flat, "head_dim", 0, what) or hidden // max(heads, 1),
            intermediate_size=hf_int(flat, "intermediate_size", what=what),
            vocab_size=vocab,
            draft_vocab_size=hf_int(flat, "draft_vocab_size", 0, what) or vocab,
            target_hidden_size=hf_int(flat, "target_hidden_size", 0, what) or hidden,
            rms_norm_eps=float(flat.get("rms_norm_eps", 1e-6)),
            rope=_rope_from_hf({"rope_theta": 10000.0, **flat}),
            max_position_embeddings=hf_int(flat, "max_position_embeddings", 2048, what),
            norm_before_residual=bool(raw.get("norm_before_residual", False)),
            norm_before_fc=bool(raw.get("norm_before_fc", False)) or "input_norm.weight" in keys,
            fc_norm=bool(raw.get("fc_norm", False)) or "fc_norm.0.weight" in keys,
            norm_output=bool(raw.get("norm_output", flat.get("norm_output", False))),
            num_layers=hf_int(flat, "num_hidden_layers", 1, what),
            mask_token_id=_parallel_drafting_token(raw, layout, what),
            has_embed_tokens="embed_tokens.weight" in keys,
            aux_layer_ids=tuple(int(i) for i in aux) if aux is not None else None,
        )
    return layout, cfg


def _parallel_drafting_token(raw: dict[str, Any], layout: str, what: str) -> int | None:
    """A P-EAGLE head's mask token (BLOCK_DRAFTERS.md §3.2): speculators' `mask_token_id` with
    speculators_model_type "peagle", else the HF-style `pard_token` / `ptd_token_id`; None for an EAGLE-3 head."""
    if layout == "speculators":
        return hf_int(raw, "mask_token_id", what=what) if raw.get("speculators_model_type") == "peagle" else None
    key = next((k for k in ("pard_token", "ptd_token_id") if raw.get(k) is not None), None)
    return None if key is None else hf_int(raw, key, what=what)


def validate_head(cfg: HeadConfig, target: TargetConfig, verifier: dict[str, Any] | None = None) -> None:
    """Static checks that a head fits a target; each error names both values. verifier: the head's record of the
    verifier it was exported for (`head_record`), compared first so that every difference is named at once."""
    mismatch = verifier_mismatch(verifier, cfg, target)
    if mismatch:
        raise JaxspecError(mismatch)
    if cfg.vocab_size != target.vocab_size:
        raise JaxspecError(f"draft head vocabulary {cfg.vocab_size} != target vocabulary {target.vocab_size}")
    if cfg.target_hidden_size != target.hidden_size:
        raise JaxspecError(
            f"draft head expects target hidden size {cfg.target_hidden_size}, the target has {target.hidden_size}"
        )
    if not cfg.has_embed_tokens and cfg.hidden_size != target.hidden_size:
        raise JaxspecError(
            f"draft head hidden size {cfg.hidden_size} != target hidden size {target.hidden_size}, and the head has "
            "no embedding table of its own"
        )
    ids = cfg.aux_layer_ids if cfg.aux_layer_ids is not None else target.aux_layer_ids
    if len(ids) != cfg.num_aux:
        raise JaxspecError(f"draft head reads {len(ids)} target layers {tuple(ids)}, expected {cfg.num_aux}")
    for i in ids:
        if not 0 <= i < target.num_layers:
            raise JaxspecError(
                f"draft head reads target layer {i} (hidden_states index), outside the target's 0..{target.num_layers - 1}"
            )


def internal_key(key: str) -> str:
    """A checkpoint key as the head's parameter path names it: the first layer is `midlayer.` (EAGLE and SGLang
    write it so, speculators `layers.0.`), layer i >= 1 of a multi-layer head `later_layers.{i-1}.` (stored as
    `layers.{i}.` in every layout, as vLLM reads them)."""
    head, dot, rest = key.partition(".")
    index, dot2, tail = rest.partition(".")
    if head == "layers" and dot and dot2 and index.isdigit():
        i = int(index)
        return f"midlayer.{tail}" if i == 0 else f"later_layers.{i - 1}.{tail}"
    return key


def checkpoint_key(key: str, layout: str) -> str:
    """The inverse of `internal_key` for a layout."""
    if key.startswith("midlayer.") and layout == "speculators":
        return "layers.0." + key[len("midlayer."):]
    if key.startswith("later_layers."):
        index, _, tail = key[len("later_layers."):].partition(".")
        return f"layers.{int(index) + 1}.{tail}"
    return key


def _param_key(path: tuple) -> tuple[str, bool]:
    """Checkpoint key of a head parameter path (speculators-style `layers.0.` is handled by the caller)."""
    parts = [str(p) for p in path]
    if parts == ["embed_tokens"]:
        return "embed_tokens.weight", False
    if parts == ["d2t"]:
        return "d2t", False
    if parts[-1] == "kernel":
        return ".".join(parts[:-1]) + ".weight", True
    return ".".join(parts), False


def head_params(head: Eagle3Head) -> dict[str, tuple[nnx.Variable, bool]]:
    out = {}
    for path, node in nnx.iter_graph(head):
        if isinstance(node, (nnx.Param, Buffer)):
            key, transposed = _param_key(path)
            out[key] = (node, transposed)
    return out


def read_tensors(path: Path, allow_pickle: bool) -> dict[str, np.ndarray]:
    from safetensors import SafetensorError, safe_open

    files = sorted(path.glob("*.safetensors"))
    if files:
        tensors = {}
        for f in files:
            try:
                with safe_open(str(f), framework="numpy") as handle:
                    for key in handle.keys():
                        tensors[key] = handle.get_tensor(key)
            except (SafetensorError, OSError, ValueError) as e:
                raise JaxspecError(f"cannot read {str(f)!r}: corrupt or truncated safetensors file ({e})") from None
        return tensors
    bins = sorted(path.glob("*.bin"))
    if not bins:
        raise JaxspecError(f"{str(path)!r} has no *.safetensors (or *.bin) weights")
    if not allow_pickle:
        raise JaxspecError(
            f"{str(path)!r} holds only pickled weights ({bins[0].name}), which can run code when loaded; "
            "pass --allow-pickle to load them anyway, or convert them to safetensors"
        )
    try:
        import torch
    except ImportError:
        raise JaxspecError("loading a .bin head needs torch (pip install torch)") from None
    tensors = {}
    for f in bins:
        for key, value in torch.load(f, map_location="cpu", weights_only=True).items():
            tensors[key] = value.float().numpy() if value.is_floating_point() else value.numpy()
    return tensors


def load_head(path: str | Path, target: TargetConfig, *, dtype=jnp.float32, allow_pickle: bool = False) -> Eagle3Head:
    """Load a head in any of the three layouts, checked against the target config."""
    path = Path(path)
    raw = read_head_config(path)
    verifier = head_record(raw)[0]
    mismatch = verifier_mismatch(verifier, head_config_from_hf(raw)[1], target)  # before any tensor is read
    if mismatch:
        raise JaxspecError(mismatch)
    tensors = read_tensors(path, allow_pickle)
    tensors = {internal_key(k): v for k, v in tensors.items()}
    if "mask_hidden" in tensors:  # P-EAGLE's [1, n_aux·Ht]; SpecForge writes [1, 1, n_aux·Ht]
        tensors["mask_hidden"] = tensors["mask_hidden"].reshape(1, -1)
    layout, cfg = head_config_from_hf(raw, set(tensors))
    validate_head(cfg, target, verifier)
    if "mask_hidden" in tensors and cfg.mask_token_id is None:
        raise JaxspecError(
            f"draft head {str(path)!r} has P-EAGLE's mask_hidden but its config names no parallel-drafting token "
            "(speculators: speculators_model_type 'peagle' and mask_token_id; other layouts: pard_token)"
        )
    if layout == "sglang" and cfg.draft_vocab_size != cfg.vocab_size and "d2t" not in tensors:
        raise JaxspecError("SGLang head lacks the d2t tensor its draft vocabulary needs")

    head = Eagle3Head(cfg, dtype=dtype, rngs=None)  # shapes only: every weight is read below
    params = head_params(head)
    expected = set(params)
    if cfg.draft_vocab_size == cfg.vocab_size:
        expected.discard("d2t")  # identity map; speculators omits it
    named = lambda keys: ", ".join(sorted(checkpoint_key(k, layout) for k in keys)[:5])  # noqa: E731 as stored
    missing = expected - set(tensors)
    if missing:
        raise JaxspecError(f"draft head {str(path)!r} lacks tensors {named(missing)}")
    unexpected = set(tensors) - set(params) - set(_OPTIONAL_KEYS)
    if unexpected:
        raise JaxspecError(f"draft head {str(path)!r} has unexpected tensors {named(unexpected)}")
    np_dtype = numpy_dtype(dtype)
    for key, (param, transposed) in params.items():
        if key == "d2t":
            d2t = tensors.get("d2t", np.zeros((cfg.draft_vocab_size,), np.int64))
            if d2t.shape != (cfg.draft_vocab_size,):
                raise JaxspecError(f"d2t has shape {d2t.shape}, expected ({cfg.draft_vocab_size},)")
            ids = np.arange(cfg.draft_vocab_size) + d2t
            if ids.min() < 0 or ids.max() >= cfg.vocab_size:
                raise JaxspecError("d2t maps draft ids outside the target vocabulary (corrupt head?)")
            param.set_value(jnp.asarray(d2t.astype(np.int32)))
            continue
        assign(param, tensors[key], transposed, np_dtype, f"draft head tensor {key!r}", "its config")
    return head


def export_head(
    head: Eagle3Head, out_dir: str | Path, *, layout: str, target: TargetConfig, dtype="bfloat16",
    verifier: str | None = None, acceptance: list[dict[str, Any]] | None = None, quantization: str | None = None,
) -> Path:
    """Write a head as config.json + model.safetensors in the speculators, SGLang/SpecForge or EAGLE layout, with
    the record of its verifier (`target`, named `verifier`: a Hub id, a path absolute or relative to out_dir, or the
    built-in target's name; `verifier_name` makes one from a --target value) and, optionally, its acceptance
    profile (`check_acceptance`)."""
    from safetensors.numpy import save_file

    if acceptance is not None:
        check_acceptance(acceptance)
    if layout not in LAYOUTS:
        raise JaxspecError(f"export layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
    cfg = head.config
    if layout == "eagle" and cfg.aux_layer_ids not in (None, tuple(target.aux_layer_ids)):
        raise JaxspecError(
            f"the EAGLE layout cannot record which target layers a head reads, and this head reads "
            f"{tuple(cfg.aux_layer_ids)} instead of the default {tuple(target.aux_layer_ids)}; export it as "
            "'sglang' or 'speculators'"
        )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    np_dtype = numpy_dtype(dtype)
    tensors: dict[str, np.ndarray] = {}
    for key, (param, transposed) in head_params(head).items():
        value = np.asarray(param[...])
        if key == "d2t":
            if layout == "speculators" and cfg.draft_vocab_size == cfg.vocab_size:
                continue
            tensors["d2t"] = value.astype(np.int64)
            t2d = np.zeros((cfg.vocab_size,), bool)
            t2d[np.arange(cfg.draft_vocab_size) + value] = True
            tensors["t2d"] = t2d
            continue
        if key == "embed_tokens.weight" and layout in ("sglang", "eagle"):
            continue  # SGLang and EAGLE heads share the target's embeddings
        value = value.T if transposed else value
        tensors[checkpoint_key(key, layout)] = np.ascontiguousarray(value.astype(np_dtype))
    aux = cfg.aux_layer_ids if cfg.aux_layer_ids is not None else target.aux_layer_ids
    record = verifier_record(target, verifier, aux, quantization)
    layer = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "num_hidden_layers": cfg.num_layers,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope.theta,
        "max_position_embeddings": target.max_position_embeddings,  # vLLM stops drafting beyond this
        "vocab_size": cfg.vocab_size,
        "tie_word_embeddings": False,
        "torch_dtype": str(np.dtype(np_dtype)) if dtype != "bfloat16" else "bfloat16",
    }
    if cfg.rope.rope_type != "default":
        r = cfg.rope
        layer["rope_scaling"] = {
            "rope_type": r.rope_type, "factor": r.factor, "low_freq_factor": r.low_freq_factor,
            "high_freq_factor": r.high_freq_factor, "original_max_position_embeddings": r.original_max_position_embeddings,
        }
    if layout == "speculators":
        config = {
            "architectures": ["Eagle3Speculator"],
            "speculators_model_type": "eagle3",
            "speculators_config": {
                "algorithm": "eagle3",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 5}],
                "default_proposal_method": "greedy",
                "verifier": {k: record[k] for k in SPECULATORS_VERIFIER_KEYS},
            },
            "transformer_layer_config": layer,
            "draft_vocab_size": cfg.draft_vocab_size,
            "norm_before_residual": cfg.norm_before_residual,
            "target_hidden_size": cfg.target_hidden_size,
            "eagle_aux_hidden_state_layer_ids": list(aux),
        }
    elif layout == "eagle":  # the EAGLE repo: a flat Llama config, default aux layers
        config = {
            **layer,
            "draft_vocab_size": cfg.draft_vocab_size,
            "target_hidden_size": cfg.target_hidden_size,
            "norm_before_residual": cfg.norm_before_residual,
        }
    else:
        config = {
            **layer,
            "architectures": ["LlamaForCausalLMEagle3"],
            "draft_vocab_size": cfg.draft_vocab_size,
            "target_hidden_size": cfg.target_hidden_size,
            "norm_before_residual": cfg.norm_before_residual,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in aux]},
        }
    if cfg.norm_before_fc:
        config["norm_before_fc"] = True
    if cfg.fc_norm:
        config["fc_norm"] = True
    if cfg.norm_output:
        config["norm_output"] = True
    if cfg.mask_token_id is not None:  # P-EAGLE: the head drafts a chain in one forward
        if layout == "speculators":
            config["speculators_model_type"] = "peagle"
            config["mask_token_id"] = cfg.mask_token_id
        else:
            config["pard_token"] = cfg.mask_token_id
    own = {k: v for k, v in record.items() if layout != "speculators" or k not in SPECULATORS_VERIFIER_KEYS}
    config[RECORD_KEY] = {"verifier": own, **({"acceptance": acceptance} if acceptance else {})}
    save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out
