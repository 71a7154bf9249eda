"""Hugging Face safetensors → a target model, streamed tensor by tensor (no torch, no second full copy)."""

from __future__ import annotations

import functools
import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from safetensors import SafetensorError, safe_open

from jaxspec.config import TargetConfig, load_target_config
from jaxspec.errors import JaxspecError
from jaxspec.files import read_json
from jaxspec.models.target import TargetModel, target_model
from jaxspec.models.numerics import held_dtype
from jaxspec.models.quantize import quantize_target, quantize_weight

# Buffers some exporters write that carry no weights.
_IGNORABLE_SUFFIXES = ("rotary_emb.inv_freq",)


def numpy_dtype(dtype) -> np.dtype:
    dtype = jnp.dtype(dtype)
    return np.dtype(ml_dtypes.bfloat16) if dtype == jnp.bfloat16 else np.dtype(dtype)


def tensor_index(model_dir: Path) -> dict[str, Path]:
    """Map every tensor name to the safetensors file that holds it (single file or sharded with an index)."""
    index_file = model_dir / "model.safetensors.index.json"
    if index_file.is_file():
        weight_map = read_json(index_file, "safetensors index").get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise JaxspecError(f"{str(index_file)!r} is not a valid safetensors index (no weight_map of file names)")
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


def check_weight_files(model_dir: Path) -> None:
    """The weight files' headers read, no tensor: missing weights, pickled-only ones, a corrupt or truncated
    safetensors file are one line before any weights load (the CLIs' `check_before_loading`). An orbax target is
    checked when it is restored."""
    from jaxspec.checkpoints.orbax_target import is_orbax_target

    if is_orbax_target(model_dir):
        return
    for path in sorted(set(tensor_index(model_dir).values())):
        with _open(path):
            pass


def check_safetensors_headers(directory: Path) -> None:
    """Every *.safetensors file's header in `directory` read, no tensor (a draft's weights, before the target
    loads; what else a draft holds, e.g. pickled weights, its loader checks)."""
    for path in sorted(Path(directory).glob("*.safetensors")):
        with _open(path):
            pass


def _open(path: Path):
    try:
        return safe_open(str(path), framework="numpy")
    except (SafetensorError, OSError, ValueError) as e:
        raise JaxspecError(f"cannot read {str(path)!r}: corrupt or truncated safetensors file ({e})") from None


def hf_key(path: tuple) -> tuple[str, bool]:
    """Checkpoint key of an NNX parameter path, and whether the checkpoint stores it transposed.

    LlamaModel's attributes mirror the Hugging Face module tree, so the key is the path itself; `kernel` [in, out]
    is stored by PyTorch as `weight` [out, in].
    """
    parts = [str(p) for p in path]
    if len(parts) == 1:  # an embedding table: embed_tokens, Gemma 4's embed_tokens_per_layer
        return f"model.{parts[0]}.weight", False
    prefix = ".".join(parts[:-1]) if parts[0] == "lm_head" else "model." + ".".join(parts[:-1])
    if parts[-1] == "kernel":
        return prefix + ".weight", True
    if parts[-1] == "scale" and parts[-2] != "router":  # an 8-bit kernel's per-channel scale, as compressed-tensors
        # names it (Gemma 4's router.scale is a weight of its own)
        return prefix + ".weight_scale", False
    return f"{prefix}.{parts[-1]}", False


def model_params(model: TargetModel) -> dict[str, tuple[nnx.Variable, bool]]:
    """Checkpoint key → (the model's parameter, stored transposed?). A mixture-of-experts target's stacked experts
    appear under `<layer>.mlp.experts.<gate_proj|up_proj|down_proj>`; `expert_sources` names the per-expert tensors
    a checkpoint holds them in."""
    out = {}
    mixtral = model.config.model_type == "mixtral"
    for path, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Param):
            key, transposed = hf_key(path)
            if mixtral:  # transformers' Mixtral calls its sparse MLP block_sparse_moe
                key = key.replace(".mlp.", ".block_sparse_moe.")
            out[key] = (node, transposed)
    return out


EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
MIXTRAL_EXPERT_NAMES = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


def expert_sources(params: dict[str, tuple[nnx.Variable, bool]], model_type: str) -> dict[str, list[str]]:
    """Stacked expert parameter key → the checkpoint's per-expert tensors, expert 0 first
    (`...experts.{j}.gate_proj.weight`, Mixtral's `...experts.{j}.w1.weight`), each stored [out, in] as PyTorch
    writes a Linear: the layout of the published checkpoints and of transformers' save_pretrained."""
    out = {}
    for key, (param, _) in params.items():
        prefix, _, name = key.rpartition(".")
        if not prefix.endswith(".experts") or name not in EXPERT_PROJECTIONS:
            continue
        stored = MIXTRAL_EXPERT_NAMES[name] if model_type == "mixtral" else name
        out[key] = [f"{prefix}.{j}.{stored}.weight" for j in range(param.shape[0])]
    return out


def gemma_fused_experts(params: dict[str, tuple[nnx.Variable, bool]], cfg: TargetConfig) -> dict[str, tuple]:
    """Gemma 4's stacked experts → (the checkpoint tensor, its rows or None): transformers stores a layer's experts
    fused, gate and up as the two halves of `experts.gate_up_proj` [E, 2I, H] and `experts.down_proj` [E, H, I],
    each expert [out, in]."""
    if cfg.gemma is None or cfg.moe is None:
        return {}
    width, out = cfg.moe.intermediate_size, {}
    for key in params:
        prefix, _, name = key.rpartition(".")
        if prefix.endswith(".experts") and name in EXPERT_PROJECTIONS:
            rows = {"gate_proj": slice(0, width), "up_proj": slice(width, 2 * width)}.get(name)
            out[key] = (key if rows is None else prefix + ".gate_up_proj", rows)
    return out


# Where a multimodal Gemma checkpoint keeps its text decoder: Gemma 4's and transformers >= 4.52's Gemma 3
# (`model.language_model.`), and Gemma 3 as Google published it (`language_model.model.`)
GEMMA_TEXT_PREFIXES = ("model.language_model.", "language_model.model.")
GEMMA_TOWERS = ("vision_tower.", "multi_modal_projector.", "audio_tower.", "embed_vision.", "embed_audio.")


def _gemma_text_prefix(index: dict[str, Path]) -> str | None:
    return next((p for p in GEMMA_TEXT_PREFIXES if p + "embed_tokens.weight" in index), None)


def checkpoint_names(params: dict[str, tuple[nnx.Variable, bool]], index: dict[str, Path],
                     cfg: TargetConfig) -> dict[str, tuple[nnx.Variable, bool]]:
    """`model_params` under the names this checkpoint uses: a multimodal Gemma checkpoint keeps its text decoder
    under one of GEMMA_TEXT_PREFIXES (its LM head is the tied table)."""
    prefix = _gemma_text_prefix(index) if cfg.gemma is not None else None
    if prefix is None:
        return params
    return {prefix + k.removeprefix("model.") if k.startswith("model.") else k: v for k, v in params.items()}


def _ignorable(key: str, cfg: TargetConfig) -> bool:
    """A tensor the checkpoint may hold that this target does not use: exporters' buffers; a tied LM head; for Gemma,
    the vision and audio towers of a multimodal checkpoint and Gemma 4's key/value weights of KV-shared layers
    (which transformers ignores too)."""
    if key.endswith(_IGNORABLE_SUFFIXES) or (key == "lm_head.weight" and cfg.tie_word_embeddings):
        return True
    if cfg.gemma is None:
        return False
    if key.startswith(GEMMA_TOWERS) or key.startswith("model.") and not key.startswith(
            ("model.layers.", "model.norm.", "model.embed_tokens", "model.per_layer_", *GEMMA_TEXT_PREFIXES)):
        return True  # model.vision_tower, model.audio_tower, model.embed_vision, vision_tower, ...
    parts = key
    for prefix in (*GEMMA_TEXT_PREFIXES, "model."):
        parts = parts.removeprefix(prefix)
    parts = parts.split(".")
    if len(parts) >= 4 and parts[0] == "layers" and parts[1].isdigit() and parts[2] == "self_attn":
        layer = int(parts[1])
        return (layer < cfg.num_layers and cfg.gemma.kv_source[layer] != layer
                and parts[3] in ("k_proj", "v_proj", "k_norm", "v_norm"))
    return False


def _check_keys(expected: dict, index: dict[str, Path], model_dir: Path, cfg: TargetConfig) -> None:
    missing = sorted(set(expected) - set(index))
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise JaxspecError(f"{str(model_dir)!r} lacks tensors {', '.join(missing[:5])}{more}")
    unexpected = sorted(k for k in set(index) - set(expected) if not _ignorable(k, cfg))
    if unexpected:
        more = f" and {len(unexpected) - 5} more" if len(unexpected) > 5 else ""
        raise JaxspecError(
            f"{str(model_dir)!r} has tensors this {cfg.model_type} config does not use: "
            f"{', '.join(unexpected[:5])}{more} (wrong config.json?)"
        )


def load_target(
    model_dir: str | Path, *, dtype=jnp.float32, aux_layer_ids: tuple[int, ...] | None = None, mesh=None,
    quantize: str | None = None,
) -> TargetModel:
    """Build a target model (Llama family or Gemma 4, `target_model`) from a Hugging Face directory (or one
    converted to orbax by `jaxspec.convert target`),
    casting every tensor to `dtype` as it is read. With a (data, model) `mesh`, an orbax checkpoint is restored
    straight into the mesh's parameter shardings (safetensors are read on the host and placed later). quantize:
    int8 or fp8 to quantize the decoder's matmul weights (`--quantize`, models/quantize.py), where every command that
    runs a target (generation, benchmarks, training data, training) applies it alike; from safetensors each kernel
    is quantized as it is read, so the float weights are never all on the device at once (an 8B bfloat16 target
    quantized to int8 peaks near its 8 GB, not 16 + 8)."""
    model_dir = Path(model_dir)
    from jaxspec.checkpoints.orbax_target import is_orbax_target, load_target_orbax

    if is_orbax_target(model_dir):  # `convert` writes float targets only
        model = load_target_orbax(model_dir, dtype=dtype, aux_layer_ids=aux_layer_ids, mesh=mesh)
        return quantize_target(model, quantize) if quantize else model
    cfg = load_target_config(model_dir, aux_layer_ids)
    index = tensor_index(model_dir)
    model = target_model(cfg, dtype=dtype, rngs=None)  # shapes only: every weight is read below
    scheme = checkpoint_quantization(model_dir)
    if scheme and quantize:
        raise JaxspecError(f"{str(model_dir)!r} is stored quantized ({scheme}); drop --quantize (target.quantize in "
                           "a training config)")
    if scheme or quantize:  # 8-bit kernels and their scales: read as stored, or made from each float kernel read
        quantize_target(model, scheme or quantize)
    params = checkpoint_names(model_params(model), index, cfg)
    # --quantize: kernel key → its scale's key, both set from the float weight as it is read
    made = {k.removesuffix("_scale"): k for k in params if k.endswith(".weight_scale")} if quantize else {}
    read = [k for k in params if k not in made.values()]
    fused = gemma_fused_experts(params, cfg)  # Gemma 4's experts: a layer's in two tensors
    stacked = {k: v for k, v in expert_sources(params, cfg.model_type).items() if k not in fused}  # one per expert
    stored = [name for k in read for name in ([fused[k][0]] if k in fused else stacked.get(k, [k]))]
    _check_keys(dict.fromkeys(stored), index, model_dir, cfg)
    np_dtype = numpy_dtype(dtype)
    views: dict[Path, dict[str, np.ndarray]] = {}
    for path in sorted(set(index[key] for key in stored)):
        with _open(path):  # the library checks the header first: a corrupt file is one line
            pass
        views[path] = tensor_views(path)

    def view_of(key: str) -> np.ndarray:
        view = views[index[key]][key]
        if isinstance(view, str):  # a dtype jaxspec does not read (tensor_views)
            raise JaxspecError(f"tensor {key!r} in {str(index[key])!r} has dtype {view}, which jaxspec does not read")
        return view

    def prepared(key: str) -> jax.Array | tuple[jax.Array, jax.Array]:
        param, transposed = params[key]
        if key in fused:  # [E, in, out] from the rows of one [E, out, in] tensor
            name, rows = fused[key]
            view = view_of(name)
            view = view if rows is None else view[:, rows]
            if view.ndim != 3 or view.shape[0] != param.shape[0]:
                raise JaxspecError(f"tensor {name!r} has shape {tuple(view_of(name).shape)}; config.json asks for "
                                   f"{param.shape[0]} experts")
            one = jax.ShapeDtypeStruct(param.shape[1:], param.dtype)
            return jnp.stack([prepare(view[j], one, True, np_dtype, f"tensor {name!r}", "config.json")
                              for j in range(param.shape[0])])
        if key in stacked:  # [E, in, out] from E tensors [out, in]
            one = jax.ShapeDtypeStruct(param.shape[1:], param.dtype)
            return jnp.stack([prepare(view_of(name), one, True, np_dtype, f"tensor {name!r}", "config.json")
                              for name in stacked[key]])
        view = view_of(key)
        what = f"tensor {key!r}"
        if key.endswith(".weight_scale"):
            return channel_scale(view, param.shape[0], what)
        if key in made:  # the float kernel as a float model holds it, then its 8-bit values and scale
            held = jax.ShapeDtypeStruct(param.shape, held_dtype(np_dtype))
            return quantize_weight(prepare(view, held, transposed, np_dtype, what, "config.json"), quantize,
                                   held=param.dtype)
        return prepare(view, param, transposed, np_dtype, what, "config.json")

    # Reads (page cache → device) overlap with the casts and transposes of other tensors; the values are set here.
    with ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1)) as pool:
        for key, value in zip(read, pool.map(prepared, read)):
            if key in made:
                params[key][0].set_value(value[0])
                params[made[key]][0].set_value(value[1])
            else:
                params[key][0].set_value(value)
    return model


def checkpoint_quantization(model_dir: Path) -> str | None:
    """"fp8" for a compressed-tensors FP8 checkpoint (`quantization_config`: quant_method compressed-tensors,
    format float-quantized, 8-bit float weights with a per-channel or per-tensor scale, the LM head ignored), as
    RedHatAI's `*-FP8-dynamic` models are; None for an unquantized one. Anything else quantized is a one-line
    error: jaxspec does not read it, and running it as if unquantized would be silently wrong. Activations stay in
    the compute dtype (models/quantize.py): a dynamic activation scheme needs nothing stored; static activation
    scales would, and are refused."""
    config = read_json(model_dir / "config.json", "the target's config.json")
    qc = config.get("quantization_config")
    if not qc:
        return None
    where = f"{str(model_dir)!r}: quantization_config"
    method, fmt = qc.get("quant_method"), qc.get("format")
    if method != "compressed-tensors" or fmt != "float-quantized":
        raise JaxspecError(
            f"{where} is {method}/{fmt}; jaxspec reads compressed-tensors float-quantized (FP8) checkpoints only: use "
            "the unquantized model with --quantize int8|fp8"
        )
    for name, group in (qc.get("config_groups") or {}).items():
        w, acts = group.get("weights") or {}, group.get("input_activations")
        if (w.get("num_bits"), w.get("type"), w.get("symmetric", True)) != (8, "float", True) or w.get(
                "strategy") not in ("channel", "tensor"):
            raise JaxspecError(
                f"{where}.config_groups.{name}.weights is {w}; jaxspec reads symmetric 8-bit float weights with a "
                "channel or tensor scale"
            )
        if acts and not acts.get("dynamic", False):
            raise JaxspecError(f"{where}.config_groups.{name}: static activation scales are not read by jaxspec")
    if "lm_head" not in (qc.get("ignore") or []) and not config.get("tie_word_embeddings", False):
        raise JaxspecError(f"{where} quantizes the LM head, which jaxspec does not read; use the unquantized model")
    return "fp8"


def channel_scale(view: np.ndarray, channels: int, what: str) -> jax.Array:
    """A compressed-tensors weight scale ([out, 1] per channel, [1] or [] per tensor) as float32 [out]."""
    flat = np.asarray(view, np.float32).reshape(-1)
    if flat.size not in (1, channels):
        raise JaxspecError(
            f"{what} has shape {tuple(view.shape)}: expected one scale per output channel ({channels}) or one"
        )
    return jnp.asarray(np.broadcast_to(flat, (channels,)))


# safetensors dtype names (the format's header) → numpy dtypes.
_SAFETENSORS_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
}


def tensor_views(path: Path) -> dict[str, np.ndarray | str]:
    """Every tensor of a safetensors file as a read-only view of the file mapped into memory: no copy until a
    tensor is placed on a device. The library's numpy API (`safe_open(...).get_tensor`) copies each tensor into
    fresh host memory first, and first-touch page faults made that copy half of a load (0.6 GB/s on a 2-core VM).
    The format: an 8-byte little-endian header length, a JSON header of {name: {dtype, shape, data_offsets}}, then
    the data; the header is checked by `safe_open` before this is called. A tensor of a dtype numpy cannot view
    is its dtype's name instead, an error only if it is read (a file may hold tensors the model does not use)."""
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
    mapped = np.memmap(path, mode="r")
    views = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        dtype = _SAFETENSORS_DTYPES.get(entry["dtype"])
        if dtype is None:
            views[name] = entry["dtype"]
            continue
        begin, end = entry["data_offsets"]
        count = (end - begin) // np.dtype(dtype).itemsize
        views[name] = np.frombuffer(mapped, dtype, count, 8 + size + begin).reshape(entry["shape"])
    return views


@functools.partial(jax.jit, static_argnames=("np_dtype", "held", "transposed"))
def _cast(array: jax.Array, np_dtype, held, transposed: bool) -> jax.Array:
    """The model dtype's values, held as the model holds them (numerics.held_dtype), [in, out] when transposed:
    one fused XLA pass (numpy's strided bfloat16 copy is ~3x slower)."""
    value = array.astype(np_dtype).astype(held)
    return value.T if transposed else value


def prepare(array: np.ndarray, param: nnx.Variable, transposed: bool, np_dtype, what: str, source: str) -> jax.Array:
    """A parameter's value from a checkpoint array (stored [out, in] when transposed), its shape checked."""
    shape = tuple(reversed(array.shape)) if transposed else tuple(array.shape)
    if shape != tuple(param.shape):
        want = tuple(reversed(param.shape)) if transposed else tuple(param.shape)
        raise JaxspecError(f"{what} has shape {tuple(array.shape)}, but {source} implies {want}")
    if not transposed and array.dtype == np.dtype(np_dtype) == np.dtype(param.dtype):
        # nothing to cast: a copy, never a view of the mapped file (a CPU device_put may alias a host buffer)
        return jax.device_put(array, may_alias=False)
    return _cast(array, np.dtype(np_dtype), np.dtype(param.dtype), transposed)


def assign(param: nnx.Variable, array: np.ndarray, transposed: bool, np_dtype, what: str, source: str) -> None:
    """Set a parameter from a checkpoint array (stored [out, in] when transposed), checking its shape."""
    param.set_value(prepare(array, param, transposed, np_dtype, what, source))
