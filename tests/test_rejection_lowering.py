"""The verification kernel (pallas_kernels/rejection.py) on CPU: it lowers for CUDA with Triton and for TPUs with
Mosaic at Llama-3 and SmolLM2 vocabularies for every mode (jax.export runs the Pallas GPU and TPU lowerings without
either device), and, where libtpu is installed, compiles for TPU v5e and v4 ahead of time; its kernel reads the
vocabulary one block at a time, and nothing outside it gathers whole [V] rows (the Triton variant; the TPU one
gathers the final node's row of 16-bit operands, see `_verify_tpu`). Interpret-mode equality with the reference is
in tests/test_rejection.py, TPU interpret mode in tests/test_tpu_interpret.py."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_invariant_kernel_lowering import (
    TPU_TOPOLOGIES,
    TRITON_TARGETS,
    _kernel_jaxprs,
    _reads,
    _sub_jaxprs,
    compile_for_tpu,
    export_for_cuda,
    export_for_tpu,
)

from pallas_kernels.rejection import VOCAB_BLOCK, verify

VOCABS = (128256, 49152)  # Llama 3, SmolLM2
MODES = ("greedy", "tree", "chain")


def depth_of(mode: str, n: int) -> int:
    """Chains (greedy and chain sampling) verify K = N - 1 drafts; trees of N nodes are at most 10 deep."""
    return min(n - 1, 10) if mode == "tree" else n - 1


def verify_structs(mode: str, b: int, n: int, v: int, dtype=jnp.float32):
    """Abstract arguments: tokens, parents [B, N]; probs (greedy: logits) [B, N, V]; uniforms [B, N]; noise [B, V]
    (greedy: [B, 1], as jaxspec.engine.accept passes it); chain: q [B, N, V]."""
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


def verify_fn(mode: str, n: int, backend: str | None = None):
    return lambda *args: verify(*args, mode=mode, max_depth=depth_of(mode, n), backend=backend)


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


@pytest.mark.parametrize("mode,b,n,v", SHAPES)
def test_lowers_for_tpu_with_mosaic(mode, b, n, v):
    """Greedy needs no kernel on TPUs (the walk is XLA's there); tree and chain run the race in one Mosaic call."""
    text = export_for_tpu(verify_fn(mode, n, "tpu"), verify_structs(mode, b, n, v))
    assert text.count("tpu_custom_call") == (0 if mode == "greedy" else 1)
    assert not any(target in text for target in TRITON_TARGETS)
    assert f"tensor<{b}x{depth_of(mode, n) + 1}xi32>" in text  # emitted and path


def test_lowers_for_tpu_with_bfloat16_probabilities():
    text = export_for_tpu(verify_fn("chain", 6, "tpu"), verify_structs("chain", 8, 6, 128256, jnp.bfloat16))
    assert "tpu_custom_call" in text


@pytest.mark.parametrize("topology", TPU_TOPOLOGIES)
@pytest.mark.parametrize("mode,dtype", [("tree", jnp.float32), ("chain", jnp.bfloat16)])
def test_compiles_for_tpu(mode, dtype, topology):
    compile_for_tpu(verify_fn(mode, 60, "tpu"), verify_structs(mode, 8, 60, 128256, dtype), topology)


def _gathers(jaxpr):
    """Output shapes of every gather in a jaxpr, nested ones included (not inside Pallas kernels)."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "gather":
            yield eqn.outvars[0].aval.shape
        if eqn.primitive.name != "pallas_call":
            for sub in _sub_jaxprs(eqn.params):
                yield from _gathers(sub)


@pytest.mark.parametrize("backend", ["cuda", "tpu"])
@pytest.mark.parametrize("mode", MODES)
def test_one_vocabulary_block_at_a_time(mode, backend):
    """The kernel never loads more than one block of a row (TPU: of the VMEM buffers the DMAs fill), and the wrapper
    gathers elements (B·N node probabilities, B final tokens), never [V] rows (float32 operands)."""
    b, n, v = 8, 60, 128256
    jaxpr = jax.make_jaxpr(verify_fn(mode, n, backend))(*verify_structs(mode, b, n, v))
    gathers = list(_gathers(jaxpr.jaxpr))
    assert all(int(np.prod(shape)) <= b * n for shape in gathers), gathers
    kernels = list(_kernel_jaxprs(jaxpr))
    if backend == "tpu" and mode == "greedy":  # no kernel: the walk and the argmax are XLA's
        assert not kernels
        return
    (kernel,) = kernels
    reads = list(_reads(kernel))
    assert reads and max(int(np.prod(shape)) for shape in reads) <= VOCAB_BLOCK, reads
    if mode != "greedy":  # greedy reads no vocabulary: its argmax is XLA's, before the kernel
        assert ((VOCAB_BLOCK,) if backend == "cuda" else (1, VOCAB_BLOCK)) in reads
