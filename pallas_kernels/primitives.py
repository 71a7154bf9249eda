"""The ground floor of the batch-invariant numerics: the arithmetic primitives that the target's layers
(`jaxspec.models.numerics`, which says why each is needed) and the kernels here (`invariant_attention.py`) share.
Each gives a row the same bits whatever shape or program it runs in: reductions by pairwise halving, products
rounded before anything adds to them, dots fenced against algebraic rewrites, and the dtype a model holds its
weights in. They depend on jax alone, so `pallas_kernels` never imports `jaxspec`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def held_dtype(dtype, backend: str | None = None) -> jnp.dtype:
    """The dtype a model holds its weights in when it computes in `dtype`: float32 for 16-bit models on CPU, with
    the same (16-bit) values; `dtype` elsewhere.

    Why: XLA:CPU has no 16-bit dot. It widens the whole weight to float32 on every call, and the widening is most
    of the cost (measured, SmolLM2's [1, 576] x [576, 49152] bfloat16 LM-head dot on 2 cores: 68 ms, 5 ms from a
    float32-held copy). A product of two bfloat16 values is exact in float32 and the sum is float32 either way, so
    widening only the activations (`contract`) computes a bfloat16 dot with float32 accumulation, rounded back to
    bfloat16: the bits XLA:CPU's own bfloat16 dot gave in every case measured, at the price of twice the memory."""
    dtype = jnp.dtype(dtype)
    if (backend or jax.default_backend()) == "cpu" and dtype.itemsize < 4 and jnp.issubdtype(dtype, jnp.floating):
        return jnp.dtype(jnp.float32)
    return dtype


def _halving(x: jax.Array, combine, pad_value: float, pair_reduce=None) -> jax.Array:
    n = x.shape[-1]
    width = 1 << max(n - 1, 0).bit_length()
    if pair_reduce is not None and x.dtype != jnp.float32:  # a 16-bit reduce may accumulate wider: other bits
        raise ValueError(f"materialized halvings take float32 values, not {x.dtype}")
    if width != n:
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, width - n)], constant_values=pad_value)
    while x.shape[-1] > 1:  # element i meets element i + half; one equal split (Pallas Triton has no value slicing)
        half = x.shape[-1] // 2
        if pair_reduce is not None and (half.bit_length() - 1) % MATERIALIZE_LEVELS == 0:
            x = pair_reduce(x.reshape(*x.shape[:-1], 2, half), axis=-2)  # the same pairs, as a reduce op
        else:
            x = combine(*jax.lax.split(x, (half,) * 2, axis=x.ndim - 1))
    return jnp.squeeze(x, -1)


MATERIALIZE_LEVELS = 5  # materialized halvings: down to 1 value and to every 32**k values (4096 -> 1024 -> 32 -> 1)


def halving_sum(x: jax.Array, *, materialize: bool = False) -> jax.Array:
    """Sum over the last axis by pairwise halving (zero-padded to a power of two): elementwise adds only, so each
    row's bits never depend on how many rows there are or how XLA tiles a reduction. (No reduce op at all: XLA:CPU
    hands large reduce fusions to YNNPACK, whose exp/add kernels give other bits than XLA's own.)

    materialize: the halvings down to one value and to every 32**k values are reduce ops over the pair axis
    instead of adds of the two halves. Same pairs, same bits (a reduce over two values gives 0 + a + b = a + b, all
    but a -0 sum, which comes out +0), and XLA:GPU writes a reduce's result out instead of fusing it into its
    consumers. Without it, XLA:GPU fused the whole tree of adds into the loop fusion that consumes the sum (an
    RMSNorm's scale, and the pad to row tiles after it) and recomputed the tree for every element that fusion
    writes: 4,096 x 2,047 adds per row at hidden 4,096, 17-70 us per norm on an H200 (2026-11-28), a quarter of a
    decode step. Between those boundaries each thread sums at most 32 of the level's values (a single reduce at the
    end would leave one thread per half of a row to sum all of it; which boundaries become kernels is XLA's
    choice). float32 values only (a 16-bit reduce may accumulate wider). For XLA-level code on GPU; never in a
    kernel body (a kernel computes what it is written as).
    """
    return _halving(x, jnp.add, 0.0, jnp.sum if materialize else None)


def halving_max(x: jax.Array, *, materialize: bool = False) -> jax.Array:
    """Max over the last axis by pairwise halving: exact in any order, and free of reduce ops (see halving_sum,
    which says what `materialize` is for)."""
    return _halving(x, jnp.maximum, -jnp.inf, jnp.max if materialize else None)


def fenced(fn, *operands):
    """fn(*operands) with optimization barriers on both sides. They stop XLA's algebraic simplifier, which runs before
    the barriers are expanded, from rewriting the dot with its neighbours (seen on XLA:CPU: a broadcast operand
    folded into a larger dot). They do not stop fusion: XLA:CPU and XLA:GPU both remove barriers before fusing, so
    what must not fuse is kept apart by other means (exact_mul, tiled_matmul's tiles)."""
    return jax.lax.optimization_barrier(fn(*jax.lax.optimization_barrier(operands)))


def exact_mul(a: jax.Array, b: jax.Array) -> jax.Array:
    """a * b, rounded before anything adds to it. XLA (LLVM) contracts `a * b + c` into one fused multiply-add when
    both ops land in one fusion, and which ops share a fusion depends on the surrounding program (measured on
    XLA:CPU: `jit(a * b + c)` equals the FMA; optimization barriers are removed before fusion there). Adding a zero
    XLA cannot fold (min(|a|, 0)) leaves LLVM only `fma(a, b, 0)`, which is the rounded product, so whatever adds
    this result next sees the same bits in every program. Every product that meets an add in the invariant path
    goes through here."""
    return a * b + jnp.minimum(jnp.abs(a), 0)


def first_argmax(x: jax.Array) -> jax.Array:
    """`jnp.argmax(x, axis=-1)` of float32 x as int32, the same index in every case (the first maximum; the first
    NaN in a row that has one; -0.0 ties +0.0), computed on CPU as an integer max and then the first index holding it.

    Why: XLA:CPU runs argmax's variadic (value, index) reduce as a scalar loop. Over SmolLM2's 49,152 logits on an
    AVX-512 CPU it took 240 us for one row and 490 us for a verify's three, against 54 and 130 for the two passes:
    half a millisecond of a ~21 ms speculative step. The float max alone is no key: XLA:CPU's vectorized max does
    not always propagate a NaN. So each value becomes an int32 in the floats' order (the sign-magnitude bits
    flipped below zero, both zeros 0, every NaN above +inf), a plain reduce XLA vectorizes. Elsewhere (GPU, TPU)
    `jnp.argmax` stays: its reduce is fast there, and one pass reads the logits once."""

    def two_passes(x):
        x = jnp.where(x == 0, 0.0, x).astype(jnp.float32)  # -0.0 → +0.0: argmax ties them
        bits = jax.lax.bitcast_convert_type(x, jnp.int32)
        key = jnp.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # ordered as the floats are
        key = jnp.where(jnp.isnan(x), jnp.iinfo(jnp.int32).max, key)
        top = jnp.max(key, axis=-1, keepdims=True)
        index = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
        return jnp.min(jnp.where(key == top, index, x.shape[-1]), axis=-1)

    return jax.lax.platform_dependent(
        x, cpu=two_passes, default=lambda x: jnp.argmax(x, axis=-1).astype(jnp.int32)
    )
