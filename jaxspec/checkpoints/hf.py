"""Hugging Face safetensors → LlamaModel, streamed tensor by tensor (no torch, no second full copy)."""

from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from safetensors import SafetensorError, safe_open

from jaxspec.config import TargetConfig, load_target_config
from jaxspec.errors import JaxspecError
from jaxspec.models.llama import LlamaModel, layer_weight_shapes

# Stacked-weight name in DecoderStack → key suffix under `model.layers.{i}.` in a Hugging Face checkpoint.
HF_LAYER_KEYS = {
    "input_norm": "input_layernorm.weight",
    "post_norm": "post_attention_layernorm.weight",
    "q_proj": "self_attn.q_proj.weight",
    "k_proj": "self_attn.k_proj.weight",
    "v_proj": "self_attn.v_proj.weight",
    "o_proj": "self_attn.o_proj.weight",
    "q_bias": "self_attn.q_proj.bias",
    "k_bias": "self_attn.k_proj.bias",
    "v_bias": "self_attn.v_proj.bias",
    "o_bias": "self_attn.o_proj.bias",
    "q_norm": "self_attn.q_norm.weight",
    "k_norm": "self_attn.k_norm.weight",
    "gate_proj": "mlp.gate_proj.weight",
    "up_proj": "mlp.up_proj.weight",
    "down_proj": "mlp.down_proj.weight",
    "gate_bias": "mlp.gate_proj.bias",
    "up_bias": "mlp.up_proj.bias",
    "down_bias": "mlp.down_proj.bias",
}
# Buffers some exporters write that carry no weights.
_IGNORABLE_SUFFIXES = ("rotary_emb.inv_freq",)


def numpy_dtype(dtype) -> np.dtype:
    dtype = jnp.dtype(dtype)
    return np.dtype(ml_dtypes.bfloat16) if dtype == jnp.bfloat16 else np.dtype(dtype)


def tensor_index(model_dir: Path) -> dict[str, Path]:
    """Map every tensor name to the safetensors file that holds it (single file or sharded with an index)."""
    index_file = model_dir / "model.safetensors.index.json"
    if index_file.is_file():
        try:
            weight_map = json.loads(index_file.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError):
            raise JaxspecError(f"{str(index_file)!r} is not a valid safetensors index (no weight_map)") from None
        index = {name: model_dir / fname for name, fname in weight_map.items()}
        for path in set(index.values()):
            if not path.is_file():
                raise JaxspecError(f"{str(index_file)!r} names {path.name!r}, which is missing")
        return index
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        if list(model_dir.glob("*.bin")) or list(model_dir.glob("*.pt")):
            raise JaxspecError(
                f"{str(model_dir)!r} has only pickled PyTorch weights; jaxspec reads safetensors "
                "(convert with transformers: model.save_pretrained(dir, safe_serialization=True))"
            )
        raise JaxspecError(f"{str(model_dir)!r} has no *.safetensors weights")
    index: dict[str, Path] = {}
    for path in files:
        with _open(path) as f:
            for name in f.keys():
                index[name] = path
    return index


def _open(path: Path):
    try:
        return safe_open(str(path), framework="numpy")
    except (SafetensorError, OSError, ValueError) as e:
        raise JaxspecError(f"cannot read {str(path)!r}: corrupt or truncated safetensors file ({e})") from None


def _expected_keys(cfg: TargetConfig) -> dict[str, tuple[int, ...]]:
    keys = {"model.embed_tokens.weight": (cfg.vocab_size, cfg.hidden_size), "model.norm.weight": (cfg.hidden_size,)}
    if not cfg.tie_word_embeddings:
        keys["lm_head.weight"] = (cfg.vocab_size, cfg.hidden_size)
    for name, shape in layer_weight_shapes(cfg).items():
        for i in range(cfg.num_layers):
            keys[f"model.layers.{i}.{HF_LAYER_KEYS[name]}"] = shape
    return keys


def _check_keys(cfg: TargetConfig, index: dict[str, Path], model_dir: Path) -> dict[str, tuple[int, ...]]:
    expected = _expected_keys(cfg)
    missing = sorted(set(expected) - set(index))
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise JaxspecError(f"{str(model_dir)!r} lacks tensors {', '.join(missing[:5])}{more}")
    unexpected = sorted(
        k
        for k in set(index) - set(expected)
        if not k.endswith(_IGNORABLE_SUFFIXES) and not (k == "lm_head.weight" and cfg.tie_word_embeddings)
    )
    if unexpected:
        more = f" and {len(unexpected) - 5} more" if len(unexpected) > 5 else ""
        raise JaxspecError(
            f"{str(model_dir)!r} has tensors this {cfg.model_type} config does not use: "
            f"{', '.join(unexpected[:5])}{more} (wrong config.json?)"
        )
    return expected


def load_target(
    model_dir: str | Path, *, dtype=jnp.float32, aux_layer_ids: tuple[int, ...] | None = None
) -> LlamaModel:
    """Build a LlamaModel from a Hugging Face directory, casting every tensor to `dtype` as it is read."""
    model_dir = Path(model_dir)
    cfg = load_target_config(model_dir, aux_layer_ids)
    index = tensor_index(model_dir)
    expected = _check_keys(cfg, index, model_dir)
    np_dtype = numpy_dtype(dtype)
    model = nnx.eval_shape(lambda: LlamaModel(cfg, dtype=dtype, rngs=nnx.Rngs(0)))

    with ExitStack() as stack:
        handles: dict[Path, object] = {}

        def read(name: str) -> np.ndarray:
            path = index[name]
            if path not in handles:
                handles[path] = stack.enter_context(_open(path))
            try:
                array = handles[path].get_tensor(name)
            except (SafetensorError, OSError, ValueError) as e:
                raise JaxspecError(f"cannot read tensor {name!r} from {str(path)!r}: {e}") from None
            if tuple(array.shape) != expected[name]:
                raise JaxspecError(
                    f"tensor {name!r} has shape {tuple(array.shape)}, but config.json implies {expected[name]}"
                )
            return array.astype(np_dtype, copy=False)

        model.embed.set_value(jnp.asarray(read("model.embed_tokens.weight")))
        model.norm.set_value(jnp.asarray(read("model.norm.weight")))
        if model.lm_head is not None:
            model.lm_head.set_value(jnp.asarray(read("lm_head.weight")))
        for name, shape in layer_weight_shapes(cfg).items():
            stacked = np.empty((cfg.num_layers, *shape), np_dtype)
            for i in range(cfg.num_layers):
                stacked[i] = read(f"model.layers.{i}.{HF_LAYER_KEYS[name]}")
            getattr(model.layers, name).set_value(jnp.asarray(stacked))
            del stacked
    return model


def device_dtype_default() -> str:
    """float32 on CPU, bfloat16 on accelerators."""
    return "float32" if jax.default_backend() == "cpu" else "bfloat16"
