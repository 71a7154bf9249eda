"""The CPU row matmul: x [R, K] @ w [K, N] with every row's bits independent of R, at about one weight pass for any R.

Why it exists. Batch-invariant numerics need a token's logits to be the same bits whether it is decoded alone or
verified among K+1 (numerics.py). XLA:CPU cannot give that cheaply: its one-row dot is a matrix-vector product of
its own, and every dot of 2 or more rows goes to another library (YNNPACK, or Eigen's GEMM) that sums in another
order (measured, SmolLM2's shapes, JAX 0.10, an AVX-512 CPU: rows of 2-32-row dots agree with each other, never
with the one-row dot). So the target ran every matmul on one-row tiles, and a verify of T tokens paid T weight
passes: 3.5 decode steps for a chain of 5 drafts, more than speculation can win back on a CPU.

This kernel computes each output as one left-to-right chain over k of rounded products, `acc = acc + x[r, k] *
w[k, n]` from 0 (cpu_rows.cc), so a row's bits are a function of its own values alone, by construction: the same
for R = 1 and R = 64, on any thread, with any instruction set. It streams the weights once per call, holding a tile
of sums in registers (8 rows x 48 columns with AVX-512, 6 x 16 to 1 x 48 with AVX2: sized to the register file,
since a tile that spills runs several times slower), so R rows cost about what one costs while memory is the bound
(measured in BENCHMARKS.md, "The CPU row kernel"). The weights are laid out as panels of 16 columns, each
panel's K rows contiguous (`pack_panels`), which a model holds once beside its own weights (jaxspec.models.llama):
in bfloat16 where the weight's values all are bfloat16 values (a bfloat16 target, an fp8-quantized one, a head
trained in bfloat16) and in int8 where they all are int8 values (an int8-quantized target), widened exactly in the
kernel, so the same sums from half or a quarter of the bytes.

`row_matmul_reference` is the same chain in jax.numpy (a scan over k of rounded products): the same bits, slowly;
the tests compare the two bit for bit.

How it is built: an XLA FFI custom call compiled with the row attention into one library on first use
(pallas_kernels/cpu_library.py, whose `available`, `build` and `ENV_VAR` this module re-exports). Where no
compiler works the target keeps XLA's one-row tiles; JAXSPEC_CPU_ROW_KERNEL=off turns the kernels off.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.cpu_library import ENV_VAR, BuildError, available, build, enabled, unavailable_reason  # noqa: F401
from pallas_kernels.primitives import exact_mul

LANES = 16  # columns per panel (cpu_rows.cc kLanes)
TARGET = "jaxspec_row_matmul"  # float32 panels; TARGET + "_bf16" / "_s8": bfloat16 / int8 (cpu_library.TARGETS)
SUFFIXES = {jnp.dtype(jnp.float32): "", jnp.dtype(jnp.bfloat16): "_bf16", jnp.dtype(jnp.int8): "_s8"}


def pack_panels(w: jax.Array, *, out_in: bool = False, dtype=jnp.float32) -> jax.Array:
    """w [K, N] (or [N, K] with out_in: a tied embedding table used as the LM head) → panels [P, K, 16] in `dtype`
    (float32, or bfloat16 / int8 for a weight whose values all are bfloat16 values / int8 values:
    `exact_panel_dtype`), P = ceil(N / 16), the columns zero-padded to whole panels: panel p holds columns
    16p .. 16p+15, row k of them at [p, k]."""
    w = w.astype(jnp.float32)
    if out_in:
        w = w.T
    k, n = w.shape
    p = -(-n // LANES)
    w = jnp.pad(w, ((0, 0), (0, p * LANES - n)))
    return w.reshape(k, p, LANES).transpose(1, 0, 2).astype(dtype)


def exact_panel_dtype(w: jax.Array):
    """The narrowest panels that hold the (concrete) weight w's values exactly: int8 where every value is an integer
    in [-128, 127] (an int8-quantized target's values, `quantize.held_dtype_for`), bfloat16 where every value is a
    bfloat16 value (a bfloat16 model's weights held as float32 on CPU, fp8 values, a head trained in bfloat16),
    else float32. The kernel widens int8 and bfloat16 panels exactly as it loads them, so all give the same sums,
    from a quarter or half the bytes. Checked on the host, in numpy, so no compiler can fold the test away; inside
    a trace (a step program holding its own weights), or spread over processes (not all on this host), the values
    are not read: float32."""
    if isinstance(w, jax.core.Tracer) or not getattr(w, "is_fully_addressable", True):
        return jnp.float32
    if w.dtype == jnp.int8:
        return jnp.int8
    values = np.asarray(w, dtype=np.float32)
    if w.dtype != jnp.bfloat16 and np.any(values.view(np.uint32) & 0xFFFF):
        return jnp.float32  # most float32 weights: one cheap test (every int8 value is a bfloat16 value too)
    # a -0.0 becomes +0.0, which changes no sum: the chain starts at +0.0 and, rounding to nearest (XLA never sets
    # another mode), never holds -0.0 (x + -x and +0 + -0 give +0.0), so a zero product of either sign leaves it be
    if np.all((values == np.round(values)) & (values >= -128) & (values <= 127)):
        return jnp.int8
    return jnp.bfloat16


def row_matmul(x: jax.Array, panels: jax.Array, n: int) -> jax.Array:
    """x [..., K] float32 times the weight held as `panels` [P, K, 16] (float32, bfloat16 or int8) → float32 [..., n]
    (n ≤ 16P: the weight's real columns), on the kernel. Every row's bits are `row_matmul_reference`'s for that
    row alone."""
    lead, k = x.shape[:-1], x.shape[-1]
    rows = 1
    for d in lead:
        rows *= d
    target = TARGET + SUFFIXES[jnp.dtype(panels.dtype)]
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((rows, panels.shape[0] * LANES), jnp.float32))
    y = call(x.reshape(rows, k).astype(jnp.float32), panels)
    return y[:, :n].reshape(*lead, n)


def row_matmul_reference(x: jax.Array, panels: jax.Array, n: int) -> jax.Array:
    """jax.numpy specification of `row_matmul`: the chain over k of rounded products, the same bits."""
    lead, k = x.shape[:-1], x.shape[-1]
    xs = x.reshape(-1, k).astype(jnp.float32)  # [R, K]
    w = panels.transpose(1, 0, 2).reshape(k, -1).astype(jnp.float32)  # [K, 16P]

    def step(acc, kw):
        xk, wk = kw  # [R], [16P]
        return acc + exact_mul(xk[:, None], wk[None, :]), None

    acc, _ = jax.lax.scan(step, jnp.zeros((xs.shape[0], w.shape[1]), jnp.float32), (xs.T, w))
    return acc[:, :n].reshape(*lead, n)
