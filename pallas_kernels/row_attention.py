"""The CPU row attention: the target's attention on CPU (decode, verify and prefill), one custom call per layer,
each query row's bits its own by construction (cpu_attention.cc), reading only the keys each token sees.

Why it exists. The invariant attention (`invariant_attention_reference`) compiles on XLA:CPU into ~22 small kernels
per layer (the blocks' dots, their halving maxima and sums, exponentials, the fold), each a few microseconds of
dispatch for a few thousand values, and it reads every key block up to the cache's capacity, seen or not: alone at
SmolLM2's shapes (9 query / 3 KV heads) 103 / 156 µs a layer for 1 / 6 tokens at 256 slots, 511 / 937 µs at 1,024.
On CPU that fixed cost is most of what a verify adds to a decode besides its rows' share of the weights, so it is
what speculation must win back (BENCHMARKS.md, "The CPU row attention": the target's forward at 256 slots 23.6 ->
19.4 ms a decode and 26.1 -> 20.2 ms a verify of 3 tokens, interleaved).

What it computes, per (sequence, KV head, token) and each of the G query heads of that KV head: the scores of the
keys the token sees, in position order (a tree node's ancestors past the committed length gathered by its
`ancestors`), each a halving sum of rounded products; their max; exp_c of each score minus the max, times the scale;
the denominator and the weighted values as left-to-right sums in position order; the values divided by the
denominator through its reciprocal (cpu_attention.cc spells it out). These are canonical operations of their own,
not the block fold's of invariant_attention.py: a token's bits here are not the reference attention's bits, but they
are the same whether it is decoded alone, verified in a chain or a tree, prefilled, or sits in any batch, which is
what the numerics promise (jaxspec/models/numerics.py). Prefills run on it too: at 128 prompt tokens the block-fold
reference took 1.26 ms a layer, this 0.39 ms (256 tokens: 4.83 and 1.32).

exp_c is Cephes' expf as adds and multiplies, the same in C++ and here: jax.numpy's exp is XLA's own polynomial,
which a C++ kernel cannot reproduce.

`row_attention_reference` is the specification in jax.numpy (a gather of each token's keys in position order and
scans over positions): the same bits, slowly; the tests compare the two bit for bit. No soft-capping (Gemma 2),
which stays on the reference attention.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.cpu_library import available, unavailable_reason  # the same library as the row matmul
from pallas_kernels.primitives import exact_mul, halving_sum

TARGET = "jaxspec_row_attention"  # float32 caches; TARGET + "_bf16": bfloat16 caches (cpu_library.TARGETS)
CACHE_DTYPES = (jnp.float32, jnp.bfloat16)

LOG2E = np.float32(1.44269504088896341)
C1, C2 = np.float32(0.693359375), np.float32(-2.12194440e-4)  # ln 2 = C1 - C2, C1 with few bits: n·C1 exact
POLY = tuple(np.float32(c) for c in (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2,
                                     1.6666665459e-1, 5.0000001201e-1))
EXP_FLOOR = np.float32(-80.0)  # exp_c is 0 below: every other result is a normal float


def exp_c(x: jax.Array) -> jax.Array:
    """exp of float32 x ≤ 0 as cpu_attention.cc's exp_c computes it, bit for bit: n = round(x·log2 e) (ties to
    even), r = (x - n·C1) - n·C2, Cephes' polynomial by Horner steps, times 2^n from its exponent bits; 0 below
    EXP_FLOOR. Every product is rounded before it meets an add (exact_mul)."""
    x = x.astype(jnp.float32)
    n = jnp.round(exact_mul(x, LOG2E))
    r = x - exact_mul(n, C1)
    r = r - exact_mul(n, C2)
    z = exact_mul(r, r)
    y = exact_mul(r, POLY[0]) + POLY[1]
    for c in POLY[2:]:
        y = exact_mul(y, r) + c
    y = (exact_mul(y, z) + r) + np.float32(1.0)
    ni = jnp.where(x < EXP_FLOOR, 0, n.astype(jnp.int32))
    two_n = jax.lax.bitcast_convert_type((ni + 127) << 23, jnp.float32)
    return jnp.where(x < EXP_FLOOR, np.float32(0.0), y * two_n)


def supports(cache_dtype, softcap: float | None) -> bool:
    """Whether the kernel runs this attention: float32 or bfloat16 caches (`cache_dtype`), no soft-capping."""
    return softcap is None and any(jnp.dtype(cache_dtype) == d for d in CACHE_DTYPES)


def row_attention(
    q: jax.Array,  # [B, T, Hq, D]
    k_cache: jax.Array,  # [B, H, S, D] this call's K/V already written (write before read); H divides Hq
    v_cache: jax.Array,  # [B, H, S, D]
    lengths: jax.Array,  # [B] committed slots
    positions: jax.Array,  # [B, T] each query's absolute position (its slot, for chains)
    ancestors: jax.Array | None = None,  # [B, T, A] tree: slot offset past `lengths` of query t's ancestor at
    # depth j (itself at j = depth_t); None: the new tokens sit at their positions
    *,
    scale: float | None = None,  # the scores' scale; None: D^-½
    window: int | None = None,  # sliding window: a query at p sees keys at p - window < position <= p
) -> jax.Array:
    """→ [B, T, Hq, D] in q's dtype, on the kernel: `row_attention_reference`'s bits."""
    if not available():  # builds and registers the library on first use
        raise RuntimeError(f"the CPU row attention is unavailable: {unavailable_reason()}")
    b, t, hq, d = q.shape
    target = TARGET + ("_bf16" if k_cache.dtype == jnp.bfloat16 else "")
    tree = ancestors is not None
    anc = ancestors.astype(jnp.int32) if tree else jnp.zeros((b, t, 1), jnp.int32)
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((b, t, hq, d), jnp.float32))
    out = call(q.astype(jnp.float32), k_cache, v_cache.astype(k_cache.dtype), lengths.astype(jnp.int32),
               positions.astype(jnp.int32), anc, scale=np.float32(d**-0.5 if scale is None else scale),
               window=np.int64(window or 0), tree=tree)
    return out.astype(q.dtype)


def row_attention_reference(q, k_cache, v_cache, lengths, positions, ancestors=None, *, scale: float | None = None,
                            window: int | None = None) -> jax.Array:
    """jax.numpy specification of `row_attention` (same signature, same bits): every position 0 .. S-1 of each
    token, the invisible ones contributing exact zeros to its sums (x + 0 = x for the non-negative denominator and
    for the values' sums, which start at +0)."""
    b, t, hq, d = q.shape
    h, s = k_cache.shape[1], k_cache.shape[2]
    g = hq // h
    scale = np.float32(d**-0.5 if scale is None else scale)
    pos = positions.astype(jnp.int32)[:, :, None]  # [B, T, 1]
    p_all = jnp.arange(s, dtype=jnp.int32)[None, None]  # [1, 1, S] positions
    visible = (p_all <= pos) & (pos >= 0)
    if window is not None:
        visible &= p_all > pos - window
    slots = jnp.broadcast_to(p_all, (b, t, s))
    if ancestors is not None:
        depth = ancestors.shape[2]
        committed = lengths.astype(jnp.int32)[:, None, None]
        rel = jnp.clip(p_all - committed, 0, depth - 1)
        anc = jnp.take_along_axis(ancestors.astype(jnp.int32), jnp.broadcast_to(rel, (b, t, s)), axis=2)
        slots = jnp.where(p_all < committed, p_all, committed + anc)
        visible &= p_all < committed + depth
    slots = jnp.clip(slots, 0, s - 1)  # [B, T, S]

    def gather(cache):  # [B, H, S, D] -> [B, H, T, S, D] in float32
        idx = jnp.broadcast_to(slots[:, None, :, :, None], (b, h, t, s, 1))
        return jnp.take_along_axis(cache[:, :, None], idx, axis=3).astype(jnp.float32)

    kg, vg = gather(k_cache), gather(v_cache)
    qg = q.astype(jnp.float32).reshape(b, t, h, g, d).transpose(0, 2, 1, 3, 4)  # [B, H, T, G, D]
    scores = halving_sum(exact_mul(qg[:, :, :, :, None, :], kg[:, :, :, None]))  # [B, H, T, G, S]
    vis = visible[:, None, :, None, :]  # [B, 1, T, 1, S]
    m = jnp.max(jnp.where(vis, scores, -jnp.inf), axis=-1, keepdims=True)
    e = jnp.where(vis, exp_c(exact_mul(jnp.where(vis, scores - m, 0.0), scale)), 0.0)  # [B, H, T, G, S]
    ev = e.astype(v_cache.dtype).astype(jnp.float32)

    def step(carry, i):  # position i of every row, in order
        l, a = carry
        return (l + e[..., i], a + exact_mul(ev[..., i, None], vg[:, :, :, None, i])), None

    zeros = (jnp.zeros(e.shape[:-1], jnp.float32), jnp.zeros((*e.shape[:-1], d), jnp.float32))
    (l, a), _ = jax.lax.scan(step, zeros, jnp.arange(s))
    inv = jnp.where(l > 0, 1.0 / jnp.where(l > 0, l, 1.0), 0.0)
    out = a * inv[..., None]  # [B, H, T, G, D]
    return out.transpose(0, 2, 1, 3, 4).reshape(b, t, hq, d).astype(q.dtype)
