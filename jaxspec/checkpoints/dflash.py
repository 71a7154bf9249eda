"""DFlash drafter checkpoints in z-lab's layout (BLOCK_DRAFTERS.md §1.6): read them, and write them.

config.json: a Qwen3 config (`hidden_size`, `num_hidden_layers`, heads, `intermediate_size`, `rms_norm_eps`,
`rope_theta`...) with `architectures ["DFlashDraftModel"]`, `block_size` (top level in older checkpoints, in
`dflash_config` in newer ones), `dflash_config.mask_token_id` and `dflash_config.target_layer_ids` (the OUTPUT of
those target layers), and `num_target_layers`. Weights: `fc.weight [H, n·Ht]`, `hidden_norm.weight`, `norm.weight`,
`layers.{i}.{input_layernorm,post_attention_layernorm}.weight`, `layers.{i}.self_attn.{q,k,v,o}_proj.weight`,
`layers.{i}.self_attn.{q,k}_norm.weight`, `layers.{i}.mlp.{gate,up,down}_proj.weight`, torch [out, in] layout, no
`model.` prefix; no embedding and no LM head (the target's are shared).

Not read: z-lab's DFlash2 tensors (`attention_conv`, `mlp_conv`, `candidate_selector`), sliding-window drafter
layers (Qwen3.6 drafters' `layer_types`), a `mask_embedding.pt` override, and DeepSpec's anchor-predicting layout,
which is not drop-in for z-lab inference (§3.1). Each is refused with a one-line error, never loaded half-way.

The mask token: z-lab's Qwen3 drafters use 151669 (`<|MASK|>`), a row of the padded embedding table past the
tokenizer's entries; the tokenizer need not know it, because the engine embeds the id directly and never decodes it.
A drafter whose mask id is outside the target's vocabulary is refused.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np

from jaxspec.checkpoints.heads import head_params, read_head_config, read_tensors
from jaxspec.checkpoints.hf import assign, numpy_dtype
from jaxspec.checkpoints.verifier import RECORD_KEY, check_acceptance, verifier_record
from jaxspec.config import DFlashConfig, TargetConfig, _rope_from_hf, build_target_layer_ids, hf_fields, hf_int
from jaxspec.errors import JaxspecError
from jaxspec.files import make_dir
from jaxspec.models.dflash import DFlashDrafter

ARCHITECTURE = "DFlashDraftModel"
MASK_ID_KEYS = ("mask_token_id", "dspark_noise_token_id", "pard_token", "ptd_token_id")  # vLLM's lookup order


def is_dflash(raw: dict[str, Any]) -> bool:
    """Whether a draft's config.json describes a DFlash drafter (and not an EAGLE-3 head)."""
    return ARCHITECTURE in (raw.get("architectures") or []) or isinstance(raw.get("dflash_config"), dict)


def dflash_config_from_hf(raw: dict[str, Any], target: TargetConfig) -> DFlashConfig:
    what = "drafter config.json"
    with hf_fields(what):
        extra = raw.get("dflash_config") or {}
        if not isinstance(extra, dict):
            raise JaxspecError(f"{what}: dflash_config must be a JSON object")
        dflash2 = "DFlash2DraftModel" in (raw.get("architectures") or [])
        if dflash2 or extra.get("projector_type") not in (None, "linear"):
            raise JaxspecError(f"{what}: only DFlash-1 drafters (architecture {ARCHITECTURE}, a linear fc projector) "
                               "are supported")
        types = raw.get("layer_types") or []
        if any(t != "full_attention" for t in types) or raw.get("use_sliding_window"):
            raise JaxspecError(f"{what}: sliding-window drafter layers are not supported yet (layer_types {types})")
        block = extra.get("block_size", raw.get("block_size"))
        if block is None:
            raise JaxspecError(f"{what} names no block_size (top level or in dflash_config); add the one the drafter "
                               "was trained with")
        block = hf_int({"block_size": block}, "block_size", what=what)
        mask = next((m for m in (extra.get(k, raw.get(k)) for k in MASK_ID_KEYS) if m is not None), None)
        if mask is None:
            raise JaxspecError(f"{what} names no mask token (dflash_config.mask_token_id); add the id the drafter was "
                               "trained with")
        mask = hf_int({"mask_token_id": mask}, "mask_token_id", what=what)
        layers = hf_int(raw, "num_hidden_layers", what=what)
        n_target = hf_int(raw, "num_target_layers", target.num_layers, what=what)
        if n_target != target.num_layers:
            raise JaxspecError(f"drafter was trained on a target of {n_target} layers; this target has "
                               f"{target.num_layers}")
        ids = extra.get("target_layer_ids")
        ids = build_target_layer_ids(n_target, layers) if ids is None else tuple(int(i) for i in ids)
        heads = hf_int(raw, "num_attention_heads", what=what)
        hidden = hf_int(raw, "hidden_size", what=what)
        return DFlashConfig(
            hidden_size=hidden, num_layers=layers, num_heads=heads,
            num_kv_heads=hf_int(raw, "num_key_value_heads", heads, what=what),
            head_dim=hf_int(raw, "head_dim", hidden // heads, what=what),
            intermediate_size=hf_int(raw, "intermediate_size", what=what),
            vocab_size=hf_int(raw, "vocab_size", target.vocab_size, what=what),
            target_hidden_size=target.hidden_size, block_size=block, mask_token_id=mask, target_layer_ids=ids,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)), rope=_rope_from_hf(raw),
            max_position_embeddings=hf_int(raw, "max_position_embeddings", 40960, what=what),
            attention_bias=bool(raw.get("attention_bias", False)),
        )


def check_drafter_fits(drafter: DFlashConfig, target: TargetConfig, *, built: bool = True) -> None:
    """The drafter reads the target's vocabulary and hidden size, and layers the target has; `built`: the target
    was also built to return those layers' features (a loader checks before the target is built for it)."""
    if drafter.vocab_size != target.vocab_size:
        raise JaxspecError(f"drafter vocabulary {drafter.vocab_size} != target vocabulary {target.vocab_size}")
    if drafter.target_hidden_size != target.hidden_size:
        raise JaxspecError(f"drafter expects target hidden size {drafter.target_hidden_size}, the target has "
                           f"{target.hidden_size}")
    if drafter.hidden_size != target.hidden_size:
        raise JaxspecError(f"drafter hidden size {drafter.hidden_size} != target hidden size {target.hidden_size} (a "
                           "DFlash drafter embeds with the target's table and drafts with its LM head)")
    for i in drafter.target_layer_ids:
        if not 0 <= i < target.num_layers - 1:
            raise JaxspecError(
                f"drafter reads the output of target layer {i}; jaxspec reads the outputs of layers "
                f"0..{target.num_layers - 2} (the last layer's output is the final norm's input)"
            )
    if built and tuple(drafter.aux_layer_ids) != tuple(target.aux_layer_ids):
        raise JaxspecError(
            f"drafter reads the outputs of target layers {drafter.target_layer_ids}, but the target was built to "
            f"return hidden_states {target.aux_layer_ids} (load it with aux_layer_ids={drafter.aux_layer_ids})"
        )


def load_dflash(path: str | Path, target: TargetConfig, *, dtype=jnp.float32) -> DFlashDrafter:
    """A z-lab DFlash drafter directory, checked against the target's config before any weight is read."""
    path = Path(path)
    raw = read_head_config(path)
    if not is_dflash(raw):
        raise JaxspecError(f"{str(path)!r} is not a DFlash drafter (its config.json has no architecture "
                           f"{ARCHITECTURE} and no dflash_config)")
    cfg = dflash_config_from_hf(raw, target)
    check_drafter_fits(cfg, target, built=False)  # the target is loaded for it afterwards (aux_layer_ids)
    tensors = read_tensors(path, allow_pickle=False)
    drafter = DFlashDrafter(cfg, dtype=dtype, rngs=None)  # shapes only: every weight is read below
    params = head_params(drafter)
    missing = sorted(set(params) - set(tensors))
    if missing:
        raise JaxspecError(f"DFlash drafter {str(path)!r} lacks tensors {', '.join(missing[:5])}")
    unexpected = sorted(set(tensors) - set(params))
    if unexpected:
        raise JaxspecError(f"DFlash drafter {str(path)!r} has tensors a DFlash-1 drafter does not: "
                           f"{', '.join(unexpected[:5])}")
    np_dtype = numpy_dtype(dtype)
    for key, (param, transposed) in params.items():
        assign(param, tensors[key], transposed, np_dtype, f"drafter tensor {key!r}", "its config")
    return drafter


def export_dflash(
    drafter: DFlashDrafter, out_dir: str | Path, *, target: TargetConfig, dtype="bfloat16",
    verifier: str | None = None, acceptance: list[dict] | None = None, quantization: str | None = None,
) -> Path:
    """Write a drafter in z-lab's layout (config.json and model.safetensors), loadable by `load_dflash` and by
    the z-lab/vLLM/SGLang loaders, with jaxspec's record (the `jaxspec` key the published layouts have no field for,
    as `export_head` writes it): the verifier it was trained for (`verifier`: a Hub id, a path or the built-in
    target's name) and, optionally, its acceptance profile (`check_acceptance`)."""
    from safetensors.numpy import save_file

    cfg = drafter.config
    if cfg.rope.rope_type != "default":
        raise JaxspecError(f"exporting a drafter with {cfg.rope.rope_type} RoPE scaling is not supported yet")
    out = Path(out_dir)
    make_dir(out, "the drafter's output directory")
    np_dtype = numpy_dtype(dtype)
    tensors = {}
    for key, (param, transposed) in head_params(drafter).items():
        value = np.asarray(jnp.asarray(param[...]).astype(np_dtype))
        tensors[key] = np.ascontiguousarray(value.T if transposed else value)
    save_file(tensors, str(out / "model.safetensors"))
    rope = cfg.rope
    config = {
        "architectures": [ARCHITECTURE], "model_type": "qwen3", "block_size": cfg.block_size,
        "num_target_layers": target.num_layers,
        "dflash_config": {"mask_token_id": cfg.mask_token_id, "target_layer_ids": list(cfg.target_layer_ids)},
        "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
        "intermediate_size": cfg.intermediate_size, "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": rope.theta,
        "max_position_embeddings": cfg.max_position_embeddings, "vocab_size": cfg.vocab_size,
        "layer_types": ["full_attention"] * cfg.num_layers, "tie_word_embeddings": False,
        "attention_bias": cfg.attention_bias, "torch_dtype": str(np.dtype(np_dtype)),
    }
    record = verifier_record(target, verifier, cfg.aux_layer_ids, quantization)
    config[RECORD_KEY] = {"verifier": record, **({"acceptance": check_acceptance(acceptance)} if acceptance else {})}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out
