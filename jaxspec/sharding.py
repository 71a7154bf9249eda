"""Sharded inference over a `jax.sharding.Mesh` with a data axis (batch rows) and a model axis (tensor parallel).

Placement is Megatron-style and written as `PartitionSpec`s, so that XLA's SPMD partitioner inserts the
collectives: q/k/v, gate/up and the LM heads are split by output features (attention heads, MLP width, vocabulary),
o_proj and down_proj by input features, embeddings by vocabulary; norms and the head's fc are replicated. KV caches
are [batch, kv_heads, slots, head_dim] split as (data, model): each device holds its rows' entries for its own KV
heads, and every update in the jitted step keeps that sharding. The Pallas kernels run per shard in
`jax.shard_map` (pallas_kernels/*); the generators compile under `jax.set_mesh(mesh)` so that they can find it.

The model axis must divide the query heads, and either divide the KV heads or be a multiple of them (an error lists
the sizes that work; padding heads would waste the memory tensor parallelism is for). An axis wider than the KV
heads (Llama-3-70B's 8 KV heads on 16 chips) repeats each KV head r = model / kv_heads times in the cache
(`kv_head_replication`), so that each device holds the one KV head its query heads read: the cache is
[batch, model, slots, head_dim], split like any other. K and V are computed from the unrepeated k/v projections
exactly as on one device and repeated before the cache write; the attention then sees `model` KV heads of
num_heads / model query heads each, and the invariant attention's bits per query row do not depend on that group
size. A vocabulary, MLP width or k/v projection width that does not divide the axis stays replicated, said once
in the log (a k/v projection that does divide it is split by output features like q_proj, even where that cuts
a head: XLA gathers the K/V activations before the repeat).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxspec.errors import JaxspecError
from pallas_kernels.mesh_axes import DATA, MODEL
from pallas_kernels.dispatch import on_mesh

log = logging.getLogger(__name__)

_SPLIT_OUT = frozenset({"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "lm_head"})  # kernel [in, out]
_SPLIT_IN = frozenset({"o_proj", "down_proj"})
CACHE_SPEC = P(DATA, MODEL, None, None)  # [batch, kv_heads · kv_head_replication, slots, head_dim]


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    data: int = 1
    model: int = 1

    @property
    def size(self) -> int:
        return self.data * self.model

    @classmethod
    def parse(cls, text: str) -> MeshConfig:
        """'data=2,model=4' (either may be left out: 1)."""
        sizes = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            name, sep, value = part.partition("=")
            if not sep or name.strip() not in (DATA, MODEL) or not value.strip().isdigit() or int(value) < 1:
                raise JaxspecError(f"--mesh expects data=D,model=M with positive integers, got {text!r}")
            sizes[name.strip()] = int(value)
        return cls(**sizes)


def make_mesh(cfg: MeshConfig) -> jax.sharding.Mesh:
    """A (data, model) mesh over the first data·model devices (all processes' devices after
    `jax.distributed.initialize`)."""
    n = jax.device_count()
    if cfg.size > n:
        raise JaxspecError(
            f"--mesh data={cfg.data},model={cfg.model} needs {cfg.size} devices, but {n} are visible "
            f"({jax.default_backend()}; on CPU, "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={cfg.size} simulates them)"
        )
    if jax.process_count() > 1 and cfg.size != n:
        raise JaxspecError(
            f"a multi-host --mesh must use every process's devices: data × model = {n} "
            f"({jax.process_count()} processes × {jax.local_device_count()} devices), got {cfg.size}"
        )
    auto = (jax.sharding.AxisType.Auto,) * 2  # XLA propagates shardings (make_mesh defaults to Explicit axes)
    return jax.make_mesh((cfg.data, cfg.model), (DATA, MODEL), axis_types=auto, devices=jax.devices()[: cfg.size])


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def model_axis_fits(num_heads: int, num_kv_heads: int, model_axis: int) -> bool:
    """Whether attention splits over a model axis of this size: whole query heads per device, and either whole KV
    heads per device or one KV head repeated on model_axis / num_kv_heads devices."""
    return num_heads % model_axis == 0 and (num_kv_heads % model_axis == 0 or model_axis % num_kv_heads == 0)


def kv_head_replication(num_heads: int, num_kv_heads: int, model_axis: int) -> int:
    """How many times the KV cache repeats each KV head on a model axis of this size: model_axis / num_kv_heads when
    the axis is wider than the KV heads (and fits), so that each device holds the KV head its query heads read;
    1 otherwise (one device, or KV heads split over the axis). Head j of a repeated cache is KV head j // r."""
    if model_axis > num_kv_heads and model_axis_fits(num_heads, num_kv_heads, model_axis):
        return model_axis // num_kv_heads
    return 1


def cache_kv_heads(num_heads: int, num_kv_heads: int) -> int:
    """KV heads of a cache built now: num_kv_heads times `kv_head_replication` for the (data, model) mesh set for
    the function being traced (the generators trace under `jax.set_mesh`), num_kv_heads without one. Models call it
    from `init_cache`; their attention reads the repetition back from the cache's shape, so that a cache's layout
    is decided once, where it is made."""
    if not on_mesh():
        return num_kv_heads
    model_axis = jax.sharding.get_abstract_mesh().shape[MODEL]
    return num_kv_heads * kv_head_replication(num_heads, num_kv_heads, model_axis)


def check_fits(mesh: jax.sharding.Mesh, configs: dict, batch_size: int, batch_flag: str = "--batch-size") -> None:
    """Head counts must fit the model axis (`model_axis_fits`) and the batch (`batch_flag`: a server's --slots)
    the data axis; `configs` maps a name ('target', 'draft head') to a TargetConfig or HeadConfig."""
    m, d = mesh.shape[MODEL], mesh.shape[DATA]
    if batch_size % d:
        raise JaxspecError(f"{batch_flag} {batch_size} is not a multiple of the mesh's data axis ({d})")
    for name, cfg in configs.items():
        layout = getattr(cfg, "gemma", None)  # Gemma 4's full layers have KV heads of their own
        if layout is not None and not model_axis_fits(cfg.num_heads, layout.full_kv_heads, m):
            raise JaxspecError(f"the {name}'s full-attention layers have {cfg.num_heads} query and "
                               f"{layout.full_kv_heads} KV heads, which the mesh's model axis ({m}) does not fit")
        if not model_axis_fits(cfg.num_heads, cfg.num_kv_heads, m):
            fits = [x for x in _divisors(cfg.num_heads) if model_axis_fits(cfg.num_heads, cfg.num_kv_heads, x)]
            raise JaxspecError(
                f"the {name} has {cfg.num_heads} query and {cfg.num_kv_heads} KV heads, which the mesh's model axis "
                f"({m}) does not fit (it must divide the query heads and divide or be a multiple of the KV heads); "
                f"use model in {fits}"
            )


def _names(path) -> list[str]:
    """Module path of a leaf of an nnx.State (its Variable's own `.value` key dropped)."""
    names = [str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path]
    return names[:-1] if names and names[-1] == "value" else names


def param_spec(names: list[str], shape: tuple[int, ...], model_size: int) -> P:
    """The PartitionSpec of one parameter, from its module path (Hugging Face names) and shape."""
    leaf, owner = names[-1], names[-2] if len(names) > 1 else ""
    if owner == "experts" and len(shape) == 3:  # a sparse layer's stacked experts [E, in, out]
        return expert_spec(names, shape, model_size)
    if leaf == "embed_tokens" and len(shape) == 2:
        spec, dim = P(MODEL, None), 0
    elif owner in _SPLIT_OUT and leaf == "kernel":
        spec, dim = P(None, MODEL), 1
    elif owner in _SPLIT_OUT and leaf in ("bias", "scale"):  # scale: an int8 kernel's, per output channel
        spec, dim = P(MODEL), 0
    elif owner in _SPLIT_IN and leaf == "kernel":
        spec, dim = P(MODEL, None), 0
    else:
        return P()
    if shape[dim] % model_size:
        log.info("%s %s: dimension %d does not divide the model axis (%d); replicated", ".".join(names), shape,
                 shape[dim], model_size)
        return P()
    return spec


def expert_spec(names: list[str], shape: tuple[int, ...], model_size: int) -> P:
    """Stacked experts [E, in, out]: split by expert over the model axis where it divides them (expert
    parallelism: each device runs its own experts' tiles, models/moe.py); else by the expert width like a dense
    MLP (gate/up by output, down by input features), which XLA partitions; else replicated."""
    if shape[0] % model_size == 0:
        return P(MODEL, None, None)
    width_dim = 1 if names[-1] == "down_proj" else 2
    if shape[width_dim] % model_size == 0:
        log.info("%s %s: %d experts do not divide the model axis (%d); split by expert width", ".".join(names),
                 shape, shape[0], model_size)
        return P(None, MODEL, None) if width_dim == 1 else P(None, None, MODEL)
    log.info("%s %s: neither the experts nor their width divide the model axis (%d); replicated", ".".join(names),
             shape, model_size)
    return P()


def param_shardings(params, mesh: jax.sharding.Mesh):
    """NamedShardings by `param_spec` for a pytree of parameters (an nnx.State or its pure dict; arrays or
    ShapeDtypeStructs)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, x: NamedSharding(mesh, param_spec(_names(path), x.shape, mesh.shape[MODEL])), params
    )


def shard_params(params, mesh: jax.sharding.Mesh):
    """Place parameters on the mesh by `param_spec` (arrays already placed so are left where they are)."""
    return jax.device_put(params, param_shardings(params, mesh))


def to_host(x: jax.Array) -> np.ndarray:
    """The whole array as numpy on this host; on a multi-host mesh gathered from every process (small per-row
    state only: tokens, counts, flags)."""
    if x.is_fully_addressable:
        return np.asarray(x)
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def mesh_context(mesh: jax.sharding.Mesh | None):
    """`jax.set_mesh(mesh)` for tracing and compiling, or nothing without a mesh."""
    return jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext()
