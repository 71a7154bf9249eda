"""A fixed-capacity KV cache as an explicit pytree, with a committed length per row.

A forward over T new tokens writes their K/V at slots [length, length + T) of each row but does not commit them:
the caller advances `lengths` by the number of tokens it keeps (all of a prompt, one decoded token, the accepted
part of a draft). Entries past `lengths` are never read by the mask and are overwritten by the next forward, which
is the invariant speculative decoding relies on.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxspec.sharding import CACHE_SPEC
from pallas_kernels.dispatch import on_mesh
from pallas_kernels.mesh_axes import DATA, MODEL


class KVCache(NamedTuple):
    k: tuple[jax.Array, ...]  # one [batch, kv_heads, capacity, head_dim] array per layer (kv_heads: repeat_heads)
    v: tuple[jax.Array, ...]  # one [batch, kv_heads, capacity, head_dim] array per layer
    lengths: jax.Array  # [batch] int32, committed tokens per row

    @property
    def capacity(self) -> int:
        return self.k[0].shape[2]


def constrain(cache: KVCache) -> KVCache:
    """Inside jit: keep a KV cache split as (data, model) when a mesh with those axes is set, else unchanged."""
    if not on_mesh():
        return cache
    wsc = jax.lax.with_sharding_constraint
    return KVCache(
        tuple(wsc(x, CACHE_SPEC) for x in cache.k),
        tuple(wsc(x, CACHE_SPEC) for x in cache.v),
        wsc(cache.lengths, P(DATA)),
    )


def init_cache(num_layers: int, batch: int, capacity: int, num_kv_heads: int, head_dim: int, dtype) -> KVCache:
    shape = (batch, num_kv_heads, capacity, head_dim)
    k = tuple(jnp.zeros(shape, dtype) for _ in range(num_layers))
    v = tuple(jnp.zeros(shape, dtype) for _ in range(num_layers))
    return KVCache(k, v, jnp.zeros((batch,), jnp.int32))


def repeat_heads(new: jax.Array, cache_heads: int) -> jax.Array:
    """New keys or values [B, T, Hkv, D] laid out for a cache of `cache_heads` KV heads: each head repeated
    r = cache_heads / Hkv times (head j is KV head j // r), as a cache is built under a model axis wider than the
    KV heads (sharding.kv_head_replication); unchanged when r = 1. A copy, so the values keep their bits."""
    hkv = new.shape[2]
    if cache_heads == hkv:
        return new
    if cache_heads % hkv:
        raise ValueError(f"a cache of {cache_heads} KV heads cannot hold repeats of {hkv}")
    return jnp.repeat(new, cache_heads // hkv, axis=2)  # [B, T, cache_heads, D]


def advance(cache: KVCache, num_tokens: jax.Array) -> KVCache:
    """Commit `num_tokens` [batch] (or a scalar) of the entries written by the last forward."""
    return cache._replace(lengths=cache.lengths + jnp.asarray(num_tokens, jnp.int32))


def block_attention_mask(lengths: jax.Array, capacity: int, block_mask: jax.Array) -> jax.Array:
    """Which cache slots each of T new tokens may attend to.

    lengths: [B] committed tokens; block_mask: [B, T, T] bool among the new tokens (causal for prefill and chains,
    an ancestor mask for trees). Returns [B, T, capacity] bool: the whole committed prefix, plus the new tokens'
    slots [length, length + T) as the block mask allows.
    """
    t = block_mask.shape[-1]
    slots = jnp.arange(capacity)[None, None, :]  # [1, 1, S]
    rel = slots - lengths[:, None, None]  # [B, 1, S] offset into the new block
    committed = rel < 0
    in_block = (rel >= 0) & (rel < t)
    allowed = jnp.take_along_axis(
        block_mask, jnp.broadcast_to(jnp.clip(rel, 0, t - 1), (block_mask.shape[0], t, capacity)), axis=2
    )
    return committed | (in_block & allowed)


def ancestors_from_mask(block_mask: jax.Array, levels: int) -> jax.Array:
    """Each new token's ancestor at depth 0..levels-1 from an ancestor mask [B, T, T] (row i: i and its ancestors;
    a token's depth is how many ancestors it has) → [B, T, levels] int32 block indices, 0 past its depth. What
    invariant attention reads in position order (pallas_kernels/invariant_attention.py)."""
    depths = jnp.sum(block_mask, axis=-1) - 1  # [B, T]
    at_depth = block_mask[:, :, None, :] & (depths[:, None, None, :] == jnp.arange(levels)[None, None, :, None])
    return jnp.argmax(at_depth, axis=-1).astype(jnp.int32)


def causal_block_mask(batch: int, t: int) -> jax.Array:
    return jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (batch, t, t))


def read_window(cache: jax.Array, lengths: jax.Array, width: int) -> jax.Array:
    """The uncommitted slots [lengths[b], lengths[b] + width) of a layer's cache [B, Hkv, S, D] → [B, Hkv, W, D]
    (slots past the capacity read the last one; callers mask them)."""
    slots = jnp.minimum(lengths[:, None] + jnp.arange(width)[None, :], cache.shape[2] - 1)  # [B, W]
    return jnp.take_along_axis(cache, slots[:, None, :, None], axis=2)


def write_block(cache: jax.Array, new: jax.Array, lengths: jax.Array) -> jax.Array:
    """Write new [B, T, Hkv, D] into a layer's cache [B, Hkv, S, D] at slots lengths[b] + t; out of range drops.

    One scatter whose indices name every (row, head, slot) and whose window is one key or value vector [D], the
    cache's minor dimension: XLA:TPU updates such a scatter in place in the cache's own layout. Indexed by (row,
    slot) with the heads as a window [Hkv, D] straddling the slot dimension, it copied each layer's K and V caches
    into an [S, Hkv, D] layout and back around the scatter (a 6-token verify of Llama-3.1-8B at 8,192 committed
    on a v5e, `jaxspec.bench --compiled-cost`: 18.90 → 17.63 GB a step; BENCHMARKS.md). Under a (data, model)
    mesh it runs per shard in `jax.shard_map` (rows over data, heads over model, as the cache is split: no
    collective), where XLA's partitioner all-gathered the updates and indices of a whole-array scatter."""
    if not on_mesh():
        return _write_block(cache, new, lengths)
    mesh = jax.sharding.get_abstract_mesh()
    if cache.shape[0] % mesh.shape[DATA] or cache.shape[1] % mesh.shape[MODEL]:  # not split evenly: XLA's way
        return _write_block(cache, new, lengths)
    new_spec = P(DATA, None, MODEL, None)  # [B, T, Hkv, D]
    write = jax.shard_map(_write_block, in_specs=(CACHE_SPEC, new_spec, P(DATA)), out_specs=CACHE_SPEC,
                          check_vma=False)
    return write(cache, new, lengths)


def _write_block(cache: jax.Array, new: jax.Array, lengths: jax.Array) -> jax.Array:
    b, t = new.shape[:2]
    rows = jnp.arange(b)[:, None, None]  # [B, 1, 1]
    heads = jnp.arange(cache.shape[1])[None, :, None]  # [1, Hkv, 1]
    slots = (lengths[:, None] + jnp.arange(t)[None, :])[:, None, :]  # [B, 1, T]
    return cache.at[rows, heads, slots].set(new.transpose(0, 2, 1, 3).astype(cache.dtype), mode="drop")


def compact(cache: KVCache, lengths: jax.Array, path: jax.Array) -> KVCache:
    """Move the accepted tree path's entries to contiguous slots: slot lengths + path[b, j] → lengths + j for
    every layer (path [B, D+1] of node indices, -1 past the accepted length: those slots stay). All reads happen
    before the writes, and path[j] ≥ j, so no entry is overwritten before it is read."""
    width = path.shape[1]
    j = jnp.arange(width, dtype=jnp.int32)[None, :]
    src = lengths[:, None] + jnp.where(path >= 0, path, j)  # [B, D+1]

    def move(layer):  # [B, Hkv, S, D]
        src_c = jnp.minimum(src, layer.shape[2] - 1)
        moved = jnp.take_along_axis(layer, src_c[:, None, :, None], axis=2)  # [B, Hkv, D+1, Dh]
        return write_block(layer, moved.transpose(0, 2, 1, 3), lengths)  # to slots lengths + j, in place on TPU

    return cache._replace(k=tuple(move(x) for x in cache.k), v=tuple(move(x) for x in cache.v))
