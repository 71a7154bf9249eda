"""Layer math shared by the target and the draft head, as pure functions of arrays (the modules holding the
weights are in llama.py). Norms, RoPE and softmax run in float32 whatever the model dtype.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxspec.models.numerics import exact_mul

NEG_INF = -1e30  # finite, so that a fully masked row gives zeros instead of NaN


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm as Hugging Face computes it: normalize in float32, cast back, then scale."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight.astype(x.dtype) * xf.astype(x.dtype)  # the weight may be held wider (numerics.held_dtype)


def rope_cos_sin(positions: jax.Array, inv_freq: jax.Array, invariant: bool = False) -> tuple[jax.Array, jax.Array]:
    """cos/sin tables for `positions` [B, T] → two [B, T, head_dim] float32 arrays. `invariant`: the angle is rounded
    before cos/sin, so that XLA cannot contract the product into cos/sin's own arithmetic in some programs and not
    others (seen on XLA:CPU)."""
    if invariant:
        freqs = exact_mul(positions.astype(jnp.float32)[..., None], inv_freq)  # [B, T, D/2]
    else:
        freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, D/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)  # [B, T, D]
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array, invariant: bool = False) -> jax.Array:
    """Rotate-half RoPE (the Hugging Face layout) on x [B, T, heads, D] with cos/sin [B, T, D]. `invariant`: the two
    products are rounded before the add (no FMA contraction, which XLA applies or not depending on the program)."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    cos = cos[:, :, None, :].astype(x.dtype)
    sin = sin[:, :, None, :].astype(x.dtype)
    if invariant:
        return exact_mul(x, cos) + exact_mul(rotated, sin)
    return x * cos + rotated * sin


def attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """Masked GQA attention in plain jax.numpy.

    q: [B, T, Hq, D]; k, v: [B, Hkv, S, D]; mask: [B, T, S] bool (True = may attend). Returns [B, T, Hq, D].
    """
    b, t, hq, d = q.shape
    hkv = k.shape[1]
    qg = q.reshape(b, t, hkv, hq // hkv, d)  # [B, T, Hkv, G, D]
    scores = jnp.einsum("btkgd,bksd->bkgts", qg, k, preferred_element_type=jnp.float32)
    scores = scores * (d**-0.5)
    scores = jnp.where(mask[:, None, None, :, :], scores, NEG_INF)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bkgts,bksd->btkgd", probs.astype(v.dtype), v)
    return out.reshape(b, t, hq, d)


def group_queries(q: jax.Array, kv_heads: int) -> jax.Array:
    """q [B, T, Hq, D] → [B, Hkv, G·T, D]: the query heads that share a KV head and their tokens on one axis, so
    that scores [B, Hkv, G·T, S] and the probabilities' product with V [B, Hkv, S, D] are batched matmuls in the
    layout each next op reads. XLA:CPU otherwise copies the [.., G, T, S] probabilities into another layout for the
    second product, which cost more than both products (SmolLM2 training rows of 8 × 512: 65 ms per layer)."""
    b, t, hq, d = q.shape
    g = hq // kv_heads
    return q.reshape(b, t, kv_heads, g, d).transpose(0, 2, 3, 1, 4).reshape(b, kv_heads, g * t, d)


def ungroup_queries(x: jax.Array, heads: int) -> jax.Array:
    """The inverse of `group_queries` for a per-query result x [B, Hkv, G·T, ...] → [B, T, Hq, ...]."""
    b, kv_heads, gt = x.shape[:3]
    g = heads // kv_heads
    x = x.reshape(b, kv_heads, g, gt // g, *x.shape[3:])
    return jnp.moveaxis(x, 3, 1).reshape(b, gt // g, heads, *x.shape[4:])


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def accumulating_matmul(x: jax.Array, w: jax.Array, accumulate) -> jax.Array:
    """x [..., K] @ w [K, N] → [..., N] in x's dtype, accumulated in `accumulate` (float32 for 16-bit x and w), and
    so are the two products of its gradient: the cotangent is rounded to x's dtype first, so each of the three dots
    multiplies 16-bit operands. Why not plain autodiff of a dot with `preferred_element_type`: its gradient dots
    meet a float32 cotangent with a 16-bit operand, which XLA widens to float32 products — and on CPUs with
    AVX512-BF16 / AMX a 16-bit dot with float32 accumulation is several times faster than a float32 one."""
    return _accumulating_dot(x, w, ((x.ndim - 1,), (0,)), accumulate).astype(x.dtype)


def _accumulating_dot(a, b, contracting, accumulate):
    return jax.lax.dot_general(a, b, (contracting, ((), ())), preferred_element_type=accumulate)


def _accumulating_matmul_fwd(x, w, accumulate):
    return accumulating_matmul(x, w, accumulate), (x, w)


def _accumulating_matmul_bwd(accumulate, saved, g):
    x, w = saved
    g = g.astype(x.dtype)  # [..., N]
    dx = _accumulating_dot(g, w, ((g.ndim - 1,), (1,)), accumulate).astype(x.dtype)  # [..., K]
    rows = tuple(range(x.ndim - 1))
    dw = _accumulating_dot(x, g, (rows, rows), accumulate).astype(w.dtype)  # [K, N]
    return dx, dw


accumulating_matmul.defvjp(_accumulating_matmul_fwd, _accumulating_matmul_bwd)
