"""Gemma 4 assistant checkpoints (transformers' Gemma4AssistantForCausalLM: config.json with model_type
gemma4_assistant and a gemma4_text text_config, safetensors) → models/gemma4_assistant.Gemma4Assistant, checked
against the target whose keys and values it reads."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxspec.checkpoints.hf import numpy_dtype, prepare, tensor_index, tensor_views
from jaxspec.config import TargetConfig, hf_fields, hf_int, target_config_from_hf
from jaxspec.errors import JaxspecError
from jaxspec.files import read_json
from jaxspec.models.gemma4_assistant import AssistantConfig, Gemma4Assistant, target_cache_layers


def is_gemma4_assistant(raw: dict[str, Any]) -> bool:
    return raw.get("model_type") == "gemma4_assistant"


def assistant_config_from_hf(raw: dict[str, Any]) -> AssistantConfig:
    """Parse a Gemma4AssistantConfig. Its decoder is read as a Gemma 4 text decoder whose own keys and values are
    never computed (every layer reads the target's), so its KV sharing is parsed as none."""
    text = raw.get("text_config")
    if not isinstance(text, dict):
        raise JaxspecError("assistant config.json: a gemma4_assistant config without a text_config object")
    if raw.get("tie_word_embeddings", True) is False:
        raise JaxspecError("assistant config.json: tie_word_embeddings is false; jaxspec reads assistants whose LM "
                           "head is their embedding table (Google's are)")
    with hf_fields("assistant config.json"):
        if hf_int(text, "hidden_size_per_layer_input", 0) or text.get("enable_moe_block") or text.get(
                "use_double_wide_mlp"):
            raise JaxspecError("assistant config.json: per-layer inputs, experts and double-wide MLPs are not part of "
                               "a Gemma 4 assistant")
        decoder = target_config_from_hf({**text, "model_type": "gemma4_text", "num_kv_shared_layers": 0})
        return AssistantConfig(
            text=decoder, backbone_hidden_size=hf_int(raw, "backbone_hidden_size"),
            use_ordered_embeddings=bool(raw.get("use_ordered_embeddings", False)),
            num_centroids=hf_int(raw, "num_centroids", 2048),
            centroid_top_k=hf_int(raw, "centroid_intermediate_top_k", 32),
        )


def check_assistant_fits(cfg: AssistantConfig, target: TargetConfig) -> None:
    """One line for each way the assistant cannot read this target: not a Gemma 4 target, another hidden size or
    vocabulary, or its sliding / full layers' head sizes and KV heads unlike the target's layers it reads."""
    if target.model_type != "gemma4_text":
        raise JaxspecError("a Gemma 4 assistant drafts for Gemma 4 targets only (it reads the target's keys and "
                           f"values); the target is {target.model_type}")
    problems = []
    if cfg.backbone_hidden_size != target.hidden_size:
        problems.append(f"backbone_hidden_size {cfg.backbone_hidden_size} vs the target's {target.hidden_size}")
    if cfg.text.vocab_size != target.vocab_size:
        problems.append(f"vocabulary {cfg.text.vocab_size} vs the target's {target.vocab_size}")
    a, g = cfg.text.gemma, target.gemma
    if cfg.text.head_dim != target.head_dim or a.full_head_dim != g.full_head_dim:
        problems.append(f"head sizes {cfg.text.head_dim}/{a.full_head_dim} vs the target's "
                        f"{target.head_dim}/{g.full_head_dim}")
    for kv in (target.num_kv_heads, g.full_kv_heads):
        if cfg.text.num_heads % kv:
            problems.append(f"{cfg.text.num_heads} query heads cannot share the target's {kv} KV heads")
    if a.sliding_window != g.sliding_window:
        problems.append(f"sliding window {a.sliding_window} vs the target's {g.sliding_window}")
    if cfg.use_ordered_embeddings and cfg.text.vocab_size % cfg.num_centroids:
        problems.append(f"{cfg.num_centroids} centroids do not divide the vocabulary {cfg.text.vocab_size}")
    if problems:
        raise JaxspecError("the Gemma 4 assistant does not fit the target: " + "; ".join(problems))
    target_cache_layers(target)  # both layer types have a layer computing keys and values (else one line)


def _checkpoint_key(path: tuple) -> tuple[str, bool]:
    """transformers' key of an assistant parameter path, and whether it is stored transposed ([out, in])."""
    parts = [str(p) for p in path]
    if parts[0] in ("embed_tokens", "layers", "norm"):
        parts = ["model", *parts]
    if parts[-1] == "kernel":
        return ".".join(parts[:-1]) + ".weight", True
    if parts == ["model", "embed_tokens"]:
        return "model.embed_tokens.weight", False
    return ".".join(parts), False


def load_assistant(directory: str | Path, target: TargetConfig, *, dtype=jnp.float32) -> Gemma4Assistant:
    """A Gemma 4 assistant from its directory, checked against the target before any weight is read."""
    directory = Path(directory)
    raw = read_json(directory / "config.json", "the assistant's config.json")
    if not is_gemma4_assistant(raw):
        raise JaxspecError(f"{str(directory)!r} is not a Gemma 4 assistant (config.json model_type "
                           f"{raw.get('model_type')!r}, expected gemma4_assistant)")
    cfg = assistant_config_from_hf(raw)
    check_assistant_fits(cfg, target)
    model = Gemma4Assistant(cfg, dtype=dtype, rngs=None)
    index = tensor_index(directory)
    if "model.embed_tokens.weight" not in index and "lm_head.weight" in index:  # the tied table saved as the head
        index["model.embed_tokens.weight"] = index["lm_head.weight"]
        rename = {"model.embed_tokens.weight": "lm_head.weight"}
    else:
        rename = {}
    views = {path: tensor_views(path) for path in set(index.values())}
    np_dtype = numpy_dtype(dtype)
    missing = []
    for path, node in nnx.iter_graph(model):
        if not isinstance(node, nnx.Param):
            continue
        key, transposed = _checkpoint_key(path)
        if key not in index:
            missing.append(key)
            continue
        array = views[index[key]][rename.get(key, key)]
        if path[-1] == "token_ordering":
            node.set_value(jnp.asarray(np.asarray(array, np.int32)))
        else:
            node.set_value(prepare(array, node, transposed, np_dtype, f"tensor {key!r}", "the assistant's config.json"))
    if missing:
        raise JaxspecError(f"{str(directory)!r} lacks tensors {', '.join(sorted(missing)[:5])}")
    return model
