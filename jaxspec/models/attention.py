"""Masked attention of T new query tokens over a KV cache, with XLA's own numerics: the draft head's attention
(drafts only change speed, so the fastest numerics serve) and the target's under `--numerics plain`. The target's
default attention is the batch-invariant one in `pallas_kernels/invariant_attention.py`.

Each sequence b has `lengths[b]` committed cache slots (ragged, 0 allowed) that every new token sees, and a window
of W uncommitted key/value entries (the new tokens themselves for a verify; all tree levels drafted so far for the
head) that new token t sees where `mask[b, t, w]` is set: a causal mask for chains, an ancestor mask for trees.

    out[b, t, h] = softmax over {slots s < lengths[b]} ∪ {w : mask[b, t, w]} of q·k / sqrt(D), applied to v

A row that sees nothing gets zeros. Cache slots past the committed length must hold finite values (caches are
zero-initialized and only written with finite K/V). GQA: query head h reads KV head h // (Hq / Hkv).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxspec.models.layers import group_queries, ungroup_queries

NEG_INF = -1e30  # finite: a fully masked row stays NaN-free


def masked_attention(
    q: jax.Array,  # [B, T, Hq, D]
    k_cache: jax.Array,  # [B, Hkv, S, D]
    v_cache: jax.Array,  # [B, Hkv, S, D]
    lengths: jax.Array,  # [B] int32 committed slots
    k_win: jax.Array,  # [B, Hkv, W, D] the uncommitted window
    v_win: jax.Array,  # [B, Hkv, W, D]
    mask: jax.Array,  # [B, T, W] bool
    *,
    scale: float | None = None,  # the scores' scale; None: D^-½
    window: int | None = None,  # sliding window (with positions): a query at p sees p - window < position <= p
    positions: jax.Array | None = None,  # [B, T] the queries' positions, which are the window entries' too (W = T)
    softcap: float | None = None,  # scaled scores capped at softcap·tanh(s / softcap) (Gemma 2)
) -> jax.Array:
    """→ [B, T, Hq, D] in q's dtype, in plain jax.numpy (XLA partitions it like any other op on a mesh). Committed
    slot s holds position s; with a sliding window the W entries must be the new tokens themselves (`positions`)."""
    b, t, hq, d = q.shape
    hkv, s = k_cache.shape[1], k_cache.shape[2]
    if window is not None:
        prefix_pos = jnp.arange(s)[None, None, :]  # [1, 1, S]
        query_pos = positions[:, :, None]  # [B, T, 1]
        within = (prefix_pos > query_pos - window) & (prefix_pos < lengths[:, None, None])  # [B, T, S]
        mask = mask & (positions[:, None, :] > query_pos - window)  # [B, T, W]
    else:
        within = None
    # float32 math on the inputs' values (for bfloat16: exact products, float32 accumulation).
    # Prefix and window are scored separately and share one softmax, so the cache is never copied.
    g = hq // hkv
    qg = group_queries(q, hkv).astype(jnp.float32)  # [B, Hkv, G·T, D]
    prefix = jnp.arange(s)[None, None, :] < lengths[:, None, None] if within is None else within  # [B, 1|T, S]
    visible = jnp.concatenate([jnp.broadcast_to(prefix, (b, t, s)), mask], axis=2)  # [B, T, S + W]
    scores = jnp.concatenate([
        jnp.einsum("bkqd,bksd->bkqs", qg, k_cache.astype(jnp.float32)),
        jnp.einsum("bkqd,bksd->bkqs", qg, k_win.astype(jnp.float32)),
    ], axis=-1).reshape(b, hkv, g, t, -1) * (d**-0.5 if scale is None else scale)  # [B, Hkv, G, T, S + W]
    if softcap is not None:
        scores = jnp.tanh(scores / softcap) * softcap
    scores = jnp.where(visible[:, None, None], scores, NEG_INF)
    probs = jax.nn.softmax(scores, axis=-1)
    probs = jnp.where(jnp.any(visible, axis=-1)[:, None, None, :, None], probs, 0.0)
    probs = probs.astype(v_cache.dtype).astype(jnp.float32)  # probabilities rounded to v's dtype, as a fused kernel would
    probs = probs.reshape(b, hkv, g * t, -1)  # [B, Hkv, G·T, S + W]
    out = jnp.einsum("bkqs,bksd->bkqd", probs[..., :s], v_cache.astype(jnp.float32))
    out = out + jnp.einsum("bkqs,bksd->bkqd", probs[..., s:], v_win.astype(jnp.float32))  # [B, Hkv, G·T, D]
    return ungroup_queries(out, hq).astype(q.dtype)  # [B, T, Hq, D]
