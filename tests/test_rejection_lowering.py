"""The verification kernel (pallas_kernels/rejection.py) on CPU: it lowers for CUDA with Triton at Llama-3 and
SmolLM2 vocabularies for every mode (jax.export runs the Pallas GPU lowering without a GPU), its kernel reads the
vocabulary one block at a time, and nothing outside it gathers whole [V] rows. Interpret-mode equality with the
reference is in tests/test_rejection.py."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_invariant_kernel_lowering import TRITON_TARGETS, _kernel_jaxprs, _reads, _sub_jaxprs, export_for_cuda

from pallas_kernels.rejection import VOCAB_BLOCK, verify

VOCABS = (128256, 49152)  # Llama 3, SmolLM2
MODES = ("greedy", "tree", "chain")


def depth_of(mode: str, n: int) -> int:
    """Chains (greedy and chain sampling) verify K = N - 1 drafts; trees of N nodes are at most 10 deep."""
    return min(n - 1, 10) if mode == "tree" else n - 1


def verify_structs(mode: str, b: int, n: int, v: int, dtype=jnp.float32):
    """Abstract arguments: tokens, parents [B, N]; probs (greedy: logits) [B, N, V]; uniforms [B, N]; noise [B, V]
    (greedy: [B, 1], as jaxspec.spec.accept passes it); chain: q [B, N, V]."""
    args = [
        jax.ShapeDtypeStruct((b, n), jnp.int32),
        jax.ShapeDtypeStruct((b, n), jnp.int32),
        jax.ShapeDtypeStruct((b, n, v), dtype),
        jax.ShapeDtypeStruct((b, n), jnp.float32),
        jax.ShapeDtypeStruct((b, 1 if mode == "greedy" else v), jnp.float32),
    ]
    if mode == "chain":
        args.append(jax.ShapeDtypeStruct((b, n, v), dtype))
    return args


def verify_fn(mode: str, n: int):
    return lambda *args: verify(*args, mode=mode, max_depth=depth_of(mode, n))


SHAPES = list(itertools.product(MODES, (1, 8), (1, 6, 16, 60, 64), VOCABS))  # (mode, B, N, V)


@pytest.mark.parametrize("mode,b,n,v", SHAPES)
def test_lowers_for_cuda_with_triton(mode, b, n, v):
    text = export_for_cuda(verify_fn(mode, n), verify_structs(mode, b, n, v))
    if text is not None:
        assert any(target in text for target in TRITON_TARGETS), "no Triton custom call in the exported module"
        assert "mosaic_gpu" not in text
        assert f"tensor<{b}x{depth_of(mode, n) + 1}xi32>" in text  # emitted and path


def test_lowers_for_cuda_with_bfloat16_probabilities():
    text = export_for_cuda(verify_fn("chain", 6), verify_structs("chain", 8, 6, 128256, jnp.bfloat16))
    if text is not None:
        assert any(target in text for target in TRITON_TARGETS)


@pytest.mark.xfail(strict=True, reason="not lowered for TPUs: the call carries Triton's CompilerParams (Mosaic TPU "
                   "asserts on them), and past that Mosaic TPU wants (8, 128)-tiled blocks")
def test_lowers_for_tpu():
    jax.export.export(jax.jit(verify_fn("tree", 6)), platforms=["tpu"])(*verify_structs("tree", 8, 6, 128256))


def _gathers(jaxpr):
    """Output shapes of every gather in a jaxpr, nested ones included (not inside Pallas kernels)."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "gather":
            yield eqn.outvars[0].aval.shape
        if eqn.primitive.name != "pallas_call":
            for sub in _sub_jaxprs(eqn.params):
                yield from _gathers(sub)


@pytest.mark.parametrize("mode", MODES)
def test_one_vocabulary_block_at_a_time(mode):
    """The kernel never loads more than one block of a row, and the wrapper gathers elements (B·N node
    probabilities, B final tokens), never [V] rows."""
    b, n, v = 8, 60, 128256
    jaxpr = jax.make_jaxpr(verify_fn(mode, n))(*verify_structs(mode, b, n, v))
    (kernel,) = list(_kernel_jaxprs(jaxpr))
    reads = list(_reads(kernel))
    assert reads and max(int(np.prod(shape)) for shape in reads) <= VOCAB_BLOCK, reads
    if mode != "greedy":  # greedy reads no vocabulary: its argmax is XLA's, before the kernel
        assert (VOCAB_BLOCK,) in reads
    gathers = list(_gathers(jaxpr.jaxpr))
    assert all(int(np.prod(shape)) <= b * n for shape in gathers), gathers
