"""Mixed precision for drafter training (EAGLE-3 heads, DFlash drafters): the step computes in a narrower dtype
than the weights it updates.

The head's master weights and the optimizer state stay in the dtype they were built in (float32); every step
computes the head's forward and backward with a copy cast to `compute_dtype`, and the frozen target runs in that
dtype throughout (its features and teacher logits only need their values). Norms, softmax, the attention scores and
the loss stay in float32 (jaxspec.models.layers, train.ttt), and the gradient reaching the master weights is
float32 — the usual bf16 recipe of the EAGLE and SpecForge trainers on GPUs.

Why `auto` measures on CPU: whether a bfloat16 matmul is faster there depends on the processor. With AVX512-BF16 /
AMX, XLA:CPU (YNNPACK) runs a bfloat16 dot accumulated in float32 at 1,000-1,700 GFLOP/s against ~315 for float32
([4096, 576] x [576, 1536] and similar, BENCHMARKS.md); on the AVX2 CPU of earlier sessions 16-bit decode dots
were several times slower than float32 ones (jaxspec.models.numerics.held_dtype); training shapes were not timed
there. On GPUs and TPUs `auto` takes bfloat16 without timing; this path has not yet run on either.
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
from flax import nnx

BF16_MARGIN = 0.8  # on CPU, bfloat16 only when its timed matmul takes at most this share of float32's


def resolve_compute_dtype(setting: str, rows: int, hidden: int, columns: int, backend: str | None = None) -> str:
    """The dtype a step computes in for `train.compute_dtype` = setting. auto: bfloat16 on accelerators; on CPU
    the faster of float32 and bfloat16 for a [rows, hidden] x [hidden, columns] matmul (the head's LM head, the
    largest matmul of a step), timed once per process and shape."""
    if setting != "auto":
        return setting
    backend = backend or jax.default_backend()
    if backend != "cpu":
        return "bfloat16"
    f32 = _matmul_seconds(rows, hidden, columns, "float32")
    bf16 = _matmul_seconds(rows, hidden, columns, "bfloat16")
    return "bfloat16" if bf16 <= BF16_MARGIN * f32 else "float32"


@functools.cache
def _matmul_seconds(rows: int, hidden: int, columns: int, dtype: str) -> float:
    """Best of 3 timed [rows, hidden] x [hidden, columns] matmuls in dtype, float32 results, after one to compile."""
    a = jnp.ones((rows, hidden), dtype)
    b = jnp.ones((hidden, columns), dtype)
    dot = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32))
    dot(a, b).block_until_ready()
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        dot(a, b).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return best


def cast_floats(tree, dtype, keep: tuple[str, ...] = ()):
    """tree with every floating-point leaf cast to dtype (integer buffers such as a head's d2t untouched), except
    leaves named in `keep` (a quantized target's float32 per-channel scales: the values its matmuls were made with)
    and 8-bit floats (a quantized target's e4m3 weights: each dot widens them to its input's dtype itself)."""
    dtype = jnp.dtype(dtype)

    def cast(path, x):
        named = any(getattr(k, "key", None) in keep for k in path)
        wide_float = jnp.issubdtype(x.dtype, jnp.floating) and jnp.dtype(x.dtype).itemsize > 1
        return x.astype(dtype) if wide_float and not named else x

    return jax.tree_util.tree_map_with_path(cast, tree)


def computing_in(module: nnx.Module, dtype) -> nnx.Module:
    """A copy of a target (LlamaModel), head (Eagle3Head) or DFlash drafter that computes in dtype: its
    floating-point weights cast to it — as plain arrays of dtype, not held wider as a loaded 16-bit model's are on
    CPU, since here the narrow matmul is the point — and its activations kept in it (the module's `dtype`). The
    original is untouched; weights already in dtype are shared with it, not copied (an 8B target loaded in bfloat16
    stays 16 GB)."""
    from jaxspec.models.llama import Linear

    graphdef, state = nnx.split(module)
    copy = nnx.merge(graphdef, cast_floats(state, dtype, keep=("scale",)))
    copy.dtype = jnp.dtype(dtype)
    if jnp.dtype(dtype).itemsize < 4:  # 16-bit products, float32 sums, in the forward and the backward
        for _, sub in nnx.iter_graph(copy):
            if isinstance(sub, Linear):
                sub.accumulate = jnp.float32
        if hasattr(copy, "accumulate"):  # a target's tied LM head (`llama.head_logits`): a DFlash drafter's logits
            copy.accumulate = jnp.float32
    return copy
