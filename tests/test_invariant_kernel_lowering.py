"""The invariant-attention Pallas kernel (pallas_kernels/invariant_attention.py) on CPU: at Llama-3.1-8B attention
shapes it lowers for CUDA with Triton and for TPUs with Mosaic (jax.export runs the Pallas GPU and TPU lowerings
without either device), and, where libtpu is installed, compiles for TPU v5e and v4 ahead of time (libtpu's
compiler, Mosaic's own passes included, runs without a TPU); it never loads more than one key block at a time, and
in interpret mode it gives the bits of its jax.numpy reference, on fresh random inputs: chains and trees, ragged
lengths, float32 and bfloat16. The same for the Triton variant's split (flash-decoding) form, whether the shapes pick
it (small T·B, long caches) or a test forces it. TPU interpret mode: tests/test_tpu_interpret.py."""

from __future__ import annotations

import functools
import importlib.util
import itertools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.engine.tree import random_parents, tree_from_parents
from pallas_kernels.invariant_attention import (
    SPLIT_MAX_PROGRAMS,
    invariant_attention,
    invariant_attention_reference,
    split_blocks,
)
from pallas_kernels.primitives import halving_max, halving_sum

# Llama-3.1-8B attention: 32 query heads over 8 KV heads (G = 4), head_dim 128
HQ, HKV, D = 32, 8, 128
KEY_BLOCK = 64
# the Triton call's custom-call target: jaxlib <= 0.10.2 hands XLA the Triton IR; later ones compile it to PTX first
TRITON_TARGETS = ("__gpu$xla.gpu.triton", "triton_kernel_call_ffi")


def bits(x) -> np.ndarray:
    x = np.asarray(x)
    return x.view({2: np.uint16, 4: np.uint32}[x.dtype.itemsize])


# --- numerics' halvings (written with lax.split so that Triton lowers them) pair elements as slices do -------------


def sliced_halving(x, combine, pad_value):
    """The pairing rule spelled with value slices: element i meets element i + half at every level."""
    n = x.shape[-1]
    width = 1 << max(n - 1, 0).bit_length()
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, width - n)], constant_values=pad_value)
    while x.shape[-1] > 1:
        half = x.shape[-1] // 2
        x = combine(x[..., :half], x[..., half:])
    return x[..., 0]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_halvings_pair_elements_as_slices_do(dtype):
    """And so do the materialized halvings (reduce ops over the pairs at some levels: XLA-level code on GPU), float32
    only, with the one difference their docstring states: a sum of zeros that was -0 comes out +0."""
    rng = np.random.default_rng(0)
    for width in (1, 2, 3, 5, 8, 16, 33, 64, 100, 128, 2048, 4096):
        x = rng.standard_normal((3, 5, width)) * np.exp(rng.uniform(-20, 20, (3, 5, width)))
        x[0, 0, :: max(width // 3, 1)] = -np.inf  # masked scores
        x[1, :, :] = 0.0
        x[2, 1, :] = -0.0
        x = jnp.asarray(x, dtype)
        for mine, combine, pad in ((halving_sum, jnp.add, 0.0), (halving_max, jnp.maximum, -jnp.inf)):
            want = sliced_halving(x, combine, pad)
            for got in (mine(x), jax.jit(mine)(x)):
                assert got.shape == want.shape and got.dtype == want.dtype
                np.testing.assert_array_equal(bits(got), bits(want), err_msg=f"{mine.__name__} width {width}")
            if dtype != "float32":
                with pytest.raises(ValueError, match="float32"):
                    mine(x, materialize=True)
                continue
            if combine is jnp.add and width > 1:  # (one value is returned as it is)
                want = want + 0.0  # a -0 sum (row [2, 1] at power-of-two widths) -> +0, nothing else changes
            for got in (mine(x, materialize=True), jax.jit(functools.partial(mine, materialize=True))(x)):
                assert got.shape == want.shape and got.dtype == want.dtype
                np.testing.assert_array_equal(bits(got), bits(want), err_msg=f"{mine.__name__} width {width}")


# --- lowering for CUDA at Llama-3.1-8B shapes ----------------------------------------------------------------------


def llama_8b_structs(b: int, t: int, s: int, depth: int | None):
    """Abstract arguments: bf16 q [B, T, 32, 128], caches [B, 8, S, 128]; ancestors [B, T, depth + 1] for a tree."""
    args = [
        jax.ShapeDtypeStruct((b, t, HQ, D), jnp.bfloat16),
        jax.ShapeDtypeStruct((b, HKV, s, D), jnp.bfloat16),
        jax.ShapeDtypeStruct((b, HKV, s, D), jnp.bfloat16),
        jax.ShapeDtypeStruct((b,), jnp.int32),
        jax.ShapeDtypeStruct((b, t), jnp.int32),
    ]
    if depth is not None:
        args.append(jax.ShapeDtypeStruct((b, t, depth + 1), jnp.int32))
    return args


def attention_fn(tree: bool, backend: str | None = None, split: bool | int | None = None):
    if tree:
        return lambda q, k, v, lengths, positions, anc: invariant_attention(
            q, k, v, lengths, positions, anc, backend=backend, split=split
        )
    return lambda q, k, v, lengths, positions: invariant_attention(
        q, k, v, lengths, positions, backend=backend, split=split
    )


class TritonIRBuilt(Exception):
    """Raised by the stand-in Triton compiler below: the kernel lowered as far as Triton IR."""


def _stop_at_triton_ir(module: bytes, *args):
    raise TritonIRBuilt(len(module))


def export_for_cuda(fn, args) -> str | None:
    """→ the text of `fn` exported for CUDA. jaxlib 0.10.2 and older put the Triton IR in the module and leave its
    compilation to XLA on the GPU; newer ones compile it to PTX while lowering, with a compiler that only their CUDA
    plugin registers. Without one, a stand-in compiler (registered through jax._src: no public API does it) stops
    the export once the Triton IR is built, which is all the lowering this test can check on CPU: → None then."""
    export = jax.export.export(
        jax.jit(fn), platforms=["cuda"],
        # export's check is that a custom call's format stays stable across releases, not whether it lowers
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(name) for name in TRITON_TARGETS],
    )
    try:
        exported = export(*args)
    except TritonIRBuilt:  # the stand-in compiler, registered by an earlier call
        return None
    except RuntimeError as e:
        if "Triton compilation handler" not in str(e):
            raise
        try:  # private, so guarded: if it moves, the test says why it cannot check instead of failing
            from jax._src.lib import triton as triton_compilers

            if not triton_compilers.has_compilation_handler("cuda"):
                triton_compilers.register_compilation_handler("cuda", _stop_at_triton_ir)
        except (ImportError, AttributeError):
            pytest.skip("this jaxlib compiles Triton kernels while lowering, which needs its CUDA plugin")
        with pytest.raises(TritonIRBuilt):
            export(*args)
        return None
    assert exported.platforms == ("cuda",)
    return exported.mlir_module()


def export_for_tpu(fn, args) -> str:
    """→ the text of `fn` exported for TPUs: Pallas's Mosaic TPU lowering runs at export, on this CPU host."""
    exported = jax.export.export(jax.jit(fn), platforms=["tpu"])(*args)
    assert exported.platforms == ("tpu",)
    return exported.mlir_module()


TPU_TOPOLOGIES = ("v5e:2x2", "v4:2x2x1")  # an inference chip (one core) and a megacore one (two per chip)


@functools.cache
def _tpu_topology_device(topology: str):
    from jax.experimental import topologies

    return topologies.get_topology_desc(topology_name=topology, platform="tpu").devices[0]


def compile_for_tpu(fn, args, topology: str):
    """Compile `fn` ahead of time for one device of a TPU topology (jax.experimental.topologies): libtpu's compiler
    runs on this host without a TPU, Mosaic's passes (vector layouts, tiling and alignment checks, VMEM budget)
    included, which export alone does not run. Skips where libtpu is not installed (`pip install "jax[tpu]"`)."""
    if importlib.util.find_spec("libtpu") is None:
        pytest.skip("libtpu is not installed: the Mosaic TPU compiler is not available")
    sharding = jax.sharding.SingleDeviceSharding(_tpu_topology_device(topology))
    return jax.jit(fn, in_shardings=sharding, out_shardings=sharding).lower(*args).compile()


CHAIN_SHAPES = list(itertools.product((1, 8), (1, 6, 16, 60, 64), (256, 4096, 32768)))  # (B, T, S); T = 1: decode
TREE_SHAPES = list(itertools.product((1, 8), (6, 16, 60, 64), (256, 4096, 32768)))
LOWERING_SHAPES = [(*shape, False) for shape in CHAIN_SHAPES] + [(*shape, True) for shape in TREE_SHAPES]


def check_cuda_export(text: str | None, b: int, t: int, split: bool):
    """The exported module holds Triton calls only: the one-pass kernel, or the split form's two phases."""
    if text is not None:
        assert any(target in text for target in TRITON_TARGETS), "no Triton custom call in the exported module"
        assert "mosaic_gpu" not in text
        assert f"tensor<{b}x{t}x{HQ}x{D}xbf16>" in text  # the result
        names = ("invariant_attention_partials", "invariant_attention_fold")
        assert all((name in text) == split for name in names), f"split form expected: {split}"


@pytest.mark.parametrize("b,t,s,tree", LOWERING_SHAPES)
def test_lowers_for_cuda_with_triton(b, t, s, tree):
    """The form the shapes pick (split_blocks): split at small T·B on long caches, one pass otherwise."""
    depth = min(t, 8) - 1 if tree else None
    text = export_for_cuda(attention_fn(tree), llama_8b_structs(b, t, s, depth))
    check_cuda_export(text, b, t, split_blocks(t * HKV * b, s // KEY_BLOCK) > 0)


# the split form forced on at 8B shapes: decodes and 6-token verifies of 1 and 8 rows, long caches
SPLIT_SHAPES = list(itertools.product((1, 8), (1, 6), (4096, 16384, 32768), (False, True)))  # (B, T, S, tree)


@pytest.mark.parametrize("b,t,s,tree", SPLIT_SHAPES)
def test_split_form_lowers_for_cuda_with_triton(b, t, s, tree):
    depth = min(t, 8) - 1 if tree else None
    text = export_for_cuda(attention_fn(tree, split=True), llama_8b_structs(b, t, s, depth))
    check_cuda_export(text, b, t, True)


def test_split_rule():
    """Which form the shapes pick, and the split form's blocks per program (Llama-3.1-8B: 8 KV heads)."""
    nb = 16384 // KEY_BLOCK
    assert split_blocks(1 * HKV * 1, nb) == 4  # decode of one row: 64 programs of 4 blocks per KV head, 512 in all
    assert split_blocks(1 * HKV * 8, nb) == 16  # decode of 8 rows: 16 programs of 16 blocks per (row, KV head)
    assert split_blocks(6 * HKV * 1, nb) == 12  # a 6-token verify
    assert split_blocks(6 * HKV * 8, nb) == 0  # 384 programs: one pass
    assert split_blocks(1 * HKV * 1, 4096 // KEY_BLOCK) == 4
    assert split_blocks(1 * HKV * 1, 1024 // KEY_BLOCK) == 0  # a short cache: one pass
    assert split_blocks(SPLIT_MAX_PROGRAMS, nb) > 0 and split_blocks(SPLIT_MAX_PROGRAMS + 1, nb) == 0
    assert split_blocks(64 * HKV * 1, 2, split=True) == 2  # forced on: at most the row's blocks
    assert split_blocks(1 * HKV * 1, nb, split=False) == 0
    assert split_blocks(1, nb, split=3) == 3
    with pytest.raises(ValueError):
        split_blocks(1, nb, split=0)


def test_tpu_variant_has_no_split_form():
    with pytest.raises(ValueError, match="no split form"):
        jax.make_jaxpr(attention_fn(False, "tpu", split=True))(*llama_8b_structs(1, 1, 4096, None))


# the TPU shapes add a 60-token verify (T not a power of two) and committed lengths of 16k
TPU_SHAPES = LOWERING_SHAPES + [(8, 60, 16384, False), (8, 60, 16384, True), (1, 1, 16384, False)]


@pytest.mark.parametrize("b,t,s,tree", TPU_SHAPES)
def test_lowers_for_tpu_with_mosaic(b, t, s, tree):
    depth = min(t, 8) - 1 if tree else None
    text = export_for_tpu(attention_fn(tree, "tpu"), llama_8b_structs(b, t, s, depth))
    assert "tpu_custom_call" in text, "no Mosaic TPU custom call in the exported module"
    assert not any(target in text for target in TRITON_TARGETS)
    assert f"tensor<{b}x{t}x{HQ}x{D}xbf16>" in text  # the result


@pytest.mark.parametrize("topology", TPU_TOPOLOGIES)
@pytest.mark.parametrize("b,t,s,tree", [(1, 1, 256, False), (8, 64, 32768, False), (8, 64, 16384, True)])
def test_compiles_for_tpu(b, t, s, tree, topology):
    compile_for_tpu(attention_fn(tree, "tpu"), llama_8b_structs(b, t, s, min(t, 8) - 1 if tree else None), topology)


def _kernel_jaxprs(jaxpr):
    """Every pallas_call's kernel jaxpr inside `jaxpr` (a ClosedJaxpr), nested ones included."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            yield eqn.params["jaxpr"]
        for sub in _sub_jaxprs(eqn.params):
            yield from _kernel_jaxprs(sub)


def _sub_jaxprs(params):
    for value in params.values():
        for v in value if isinstance(value, (tuple, list)) else (value,):
            if hasattr(v, "eqns"):
                yield v
            elif hasattr(v, "jaxpr") and hasattr(v.jaxpr, "eqns"):
                yield v.jaxpr


def _reads(jaxpr):
    """Shapes of every ref read (`get`) in a kernel jaxpr, loops and conds included."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "get":
            yield eqn.outvars[0].aval.shape
        for sub in _sub_jaxprs(eqn.params):
            yield from _reads(sub)


@pytest.mark.parametrize("backend,split", [("cuda", False), ("cuda", True), ("tpu", None)])
@pytest.mark.parametrize("tree", [False, True])
def test_one_key_block_at_a_time(tree, backend, split):
    """The cache row is never loaded whole: every read in the kernel is at most one [Bk, D] block (TPU: of the VMEM
    buffers the DMAs fill). The split form's phase 1 reads as the one-pass kernel does, and its fold reads one block's
    partials at a time: [G', D] and [G'] (G' = 4 kept rows of 16)."""
    b, t, s = 1, 16, 32768
    jaxpr = jax.make_jaxpr(attention_fn(tree, backend, split))(*llama_8b_structs(b, t, s, 7 if tree else None))
    kernels = list(_kernel_jaxprs(jaxpr))
    assert len(kernels) == (2 if split else 1)
    for kernel in kernels:
        reads = list(_reads(kernel))
        assert reads and max(int(np.prod(shape)) for shape in reads) <= KEY_BLOCK * D, reads
    assert (KEY_BLOCK, D) in list(_reads(kernels[0]))
    if split:
        assert (HQ // HKV, D) in list(_reads(kernels[1]))


# --- interpret mode: the reference's bits ----------------------------------------------------------------------------




# (name, dtype, B, T, Hq, Hkv, D, S, lengths, tree depth or None, key_block, num_blocks)
CASES = [
    # decode, ragged rows; S not a whole number of blocks (the kernel pads the cache); a row at a block's last slot
    ("decode", "float32", 3, 1, 8, 2, 16, 130, (0, 63, 101), None, 64, None),
    # chain verify of 6 across a block boundary; MHA (G = 1)
    ("chain", "bfloat16", 2, 6, 4, 4, 32, 200, (60, 17), None, 64, None),
    # prefill of 20 tokens from position 0 (> the reference's 16-token chunks), blocks of 16, a static block bound
    ("prefill", "bfloat16", 2, 20, 8, 2, 16, 64, (0, 0), None, 16, 2),
    # G = 32 query heads per KV head (32 rows: more than the 16-row padding)
    ("wide", "float32", 1, 3, 32, 1, 16, 128, (70,), None, 64, None),
    # trees: tails over blocks n0 and n0 + 1, committed lengths just before a boundary and inside a block
    ("tree", "float32", 2, 9, 8, 2, 32, 256, (62, 130), 4, 64, None),
    ("tree", "bfloat16", 2, 12, 16, 2, 16, 192, (5, 126), 6, 64, None),
]


@pytest.mark.parametrize("name,dtype,b,t,hq,hkv,d,s,lengths,depth,key_block,num_blocks", CASES, ids=[
    f"{c[0]}-{c[1]}" for c in CASES
])
def test_interpret_equals_reference(name, dtype, b, t, hq, hkv, d, s, lengths, depth, key_block, num_blocks):
    check_equals_reference((name, dtype, b, t, hq, hkv, d, s, lengths, depth, key_block, num_blocks), interpret=True)


@pytest.mark.parametrize("name,dtype,b,t,hq,hkv,d,s,lengths,depth,key_block,num_blocks", CASES, ids=[
    f"{c[0]}-{c[1]}" for c in CASES
])
def test_split_form_interpret_equals_reference(name, dtype, b, t, hq, hkv, d, s, lengths, depth, key_block,
                                               num_blocks):
    """The split form, forced on with one block per program, on the same cases: G = 1 (the chain: one row kept),
    4 and 8 (masked stores of 4 and 8 of the 16 rows), 32 (wide: all 32 rows kept, unmasked stores), blocks of 16
    with a static block bound (the prefill), trees."""
    check_equals_reference((name, dtype, b, t, hq, hkv, d, s, lengths, depth, key_block, num_blocks), interpret=True,
                           split=1)


def case_inputs(name, dtype, b, t, hq, hkv, d, s, lengths, depth):
    """A CASES entry's arguments (q, k_cache, v_cache, lengths, positions, ancestors), from a seed of its name."""
    rng = np.random.default_rng(zlib.crc32(f"{name} {dtype}".encode()))
    keys = jax.random.split(jax.random.key(int(rng.integers(2**31))), 3)
    q = (2 * jax.random.normal(keys[0], (b, t, hq, d))).astype(dtype)
    k_cache = (2 * jax.random.normal(keys[1], (b, hkv, s, d))).astype(dtype)  # random past the lengths too
    v_cache = jax.random.normal(keys[2], (b, hkv, s, d)).astype(dtype)
    lengths = jnp.asarray(lengths, jnp.int32)
    if depth is None:
        ancestors = None
        positions = lengths[:, None] + jnp.arange(t, dtype=jnp.int32)
    else:
        parents = np.stack([random_parents(rng, t, depth) for _ in range(b)])
        tree = tree_from_parents(jnp.zeros((b, t), jnp.int32), jnp.asarray(parents), depth)
        ancestors, positions = tree.ancestors, lengths[:, None] + tree.depths
    return q, k_cache, v_cache, lengths, positions, ancestors


def check_equals_reference(case, **kernel_opts):
    """The kernel (`invariant_attention(..., **kernel_opts)`) on a CASES entry gives the reference's bits."""
    name, dtype, *shape, key_block, num_blocks = case
    args = case_inputs(name, dtype, *shape)
    opts = {"key_block": key_block, "num_blocks": num_blocks}
    want = jax.jit(functools.partial(invariant_attention_reference, **opts))(*args)
    got = invariant_attention(*args, **opts, **kernel_opts)
    q = args[0]
    assert got.shape == want.shape == q.shape and got.dtype == want.dtype == q.dtype
    np.testing.assert_array_equal(bits(got), bits(want), err_msg=f"{name} {dtype}")
    assert np.isfinite(np.asarray(got, np.float32)).all()


# Gemma 4 31B's attention: sliding layers (32 query / 16 KV heads of 256, a window of 1024) and full layers (32 / 4
# heads of 512), both with unscaled scores; Gemma 2 27B's sliding layers (32 / 16 heads of 128, a window of 4096,
# scores scaled by 144^-1/2 and capped at 50)
GEMMA_LAYERS = {"gemma4-sliding": (32, 16, 256, 1024, 1.0, None), "gemma4-full": (32, 4, 512, None, 1.0, None),
                "gemma2-sliding": (32, 16, 128, 4096, 144**-0.5, 50.0)}


@pytest.mark.parametrize("layer", list(GEMMA_LAYERS))
@pytest.mark.parametrize("b,t,s", [(1, 1, 8192), (8, 6, 4096)])
def test_gemma_attention_lowers_for_cuda_and_tpu(layer, b, t, s):
    """The window, scale and soft cap are static arguments: the kernel lowers with them for CUDA (its one-pass and
    split forms) and for TPUs, at Gemma's head sizes (Gemma 4's full layers' 512-wide heads too)."""
    hq, hkv, d, window, scale, softcap = GEMMA_LAYERS[layer]
    args = [jax.ShapeDtypeStruct((b, t, hq, d), jnp.bfloat16), jax.ShapeDtypeStruct((b, hkv, s, d), jnp.bfloat16),
            jax.ShapeDtypeStruct((b, hkv, s, d), jnp.bfloat16), jax.ShapeDtypeStruct((b,), jnp.int32),
            jax.ShapeDtypeStruct((b, t), jnp.int32)]

    def fn(backend, split=None):
        return lambda q, k, v, lengths, positions: invariant_attention(
            q, k, v, lengths, positions, backend=backend, split=split, scale=scale, window=window, softcap=softcap)

    for split in (False, True):
        text = export_for_cuda(fn(None, split), args)
        if text is not None:
            assert f"tensor<{b}x{t}x{hq}x{d}xbf16>" in text
    text = export_for_tpu(fn("tpu"), args)
    assert "tpu_custom_call" in text and f"tensor<{b}x{t}x{hq}x{d}xbf16>" in text
