"""The CPU row attention (pallas_kernels/row_attention.py, cpu_attention.cc) against its jax.numpy specification, bit
for bit, and the invariance it exists for: a token's rows get the same bits decoded alone, verified among others,
in a tree, in any batch and at any cache capacity."""

from __future__ import annotations

import ctypes

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import cpu_library
from pallas_kernels import row_attention as ra

pytestmark = pytest.mark.skipif(not cpu_library.available(),
                                reason=f"CPU kernels unavailable: {cpu_library.unavailable_reason()}")


def _bits(x) -> np.ndarray:
    return np.asarray(x.astype(jnp.float32)).view(np.uint32)


def _inputs(seed, b, t, hq, h, s, d, dtype=jnp.float32, lengths=None):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((b, t, hq, d)), jnp.float32).astype(dtype)
    k = jnp.asarray(2 * rng.standard_normal((b, h, s, d)), jnp.float32).astype(dtype)
    v = jnp.asarray(rng.standard_normal((b, h, s, d)), jnp.float32).astype(dtype)
    if lengths is None:
        lengths = rng.integers(0, s - t + 1, b)
    lengths = jnp.asarray(lengths, jnp.int32)
    return q, k, v, lengths, lengths[:, None] + jnp.arange(t, dtype=jnp.int32)


def _tree(seed, b, t, lengths, depth):
    """Random trees of t nodes (node 0 the root), at most `depth` levels: ancestors [B, T, depth] by depth (slot
    offsets past the committed length) and positions [B, T]."""
    rng = np.random.default_rng(seed)
    anc, pos = np.zeros((b, t, depth), np.int32), np.zeros((b, t), np.int32)
    for row in range(b):
        parent, level = [-1], [0]
        for i in range(1, t):
            choices = [j for j in range(i) if level[j] < depth - 1]
            parent.append(int(rng.choice(choices)))
            level.append(level[parent[-1]] + 1)
        for i in range(t):
            chain, j = [], i
            while j >= 0:
                chain.append(j)
                j = parent[j]
            anc[row, i, : len(chain)] = chain[::-1]
            pos[row, i] = int(lengths[row]) + level[i]
    return jnp.asarray(anc), jnp.asarray(pos)


def _both(q, k, v, lengths, pos, anc=None, **kw):
    got = jax.jit(lambda *a: ra.row_attention(*a, **kw))(q, k, v, lengths, pos, anc)
    want = jax.jit(lambda *a: ra.row_attention_reference(*a, **kw))(q, k, v, lengths, pos, anc)
    return got, want


# (B, T, Hq, H, S, D): SmolLM2's heads (9 / 3, D 64), GQA 4:1 at D 128, MHA, head dims that are not whole vectors
# of any instruction set (48: not a power of two; 8: under one vector), one slot, ragged lengths throughout
SHAPES = [(1, 1, 9, 3, 256, 64), (2, 6, 9, 3, 130, 64), (3, 4, 8, 2, 64, 128), (2, 3, 4, 4, 40, 16),
          (2, 5, 6, 3, 33, 48), (1, 2, 2, 1, 17, 8), (2, 1, 3, 1, 1, 64)]


@pytest.mark.parametrize("b,t,hq,h,s,d", SHAPES)
def test_kernel_equals_reference_bit_for_bit(b, t, hq, h, s, d):
    got, want = _both(*_inputs(1, b, t, hq, h, s, d))
    np.testing.assert_array_equal(_bits(got), _bits(want))


def test_boundaries_and_options_bit_for_bit():
    """The first and the last slot, a sliding window (a block of its keys and a part), a scale of 1.0 (Gemma 4),
    bfloat16 caches (probabilities rounded to bfloat16 before they meet the values), and a tree."""
    for lengths in ([0, 0], [255, 250]):
        q, k, v, lengths, pos = _inputs(2, 2, 1, 9, 3, 256, 64, lengths=lengths)
        got, want = _both(q, k, v, lengths, pos)
        np.testing.assert_array_equal(_bits(got), _bits(want), err_msg=f"lengths {lengths}")
    for kw in ({"window": 33}, {"window": 1}, {"scale": 1.0}):
        got, want = _both(*_inputs(3, 2, 5, 8, 2, 150, 64), **kw)
        np.testing.assert_array_equal(_bits(got), _bits(want), err_msg=str(kw))
    got, want = _both(*_inputs(4, 2, 4, 8, 2, 100, 64, dtype=jnp.bfloat16))
    assert got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(_bits(got), _bits(want))
    q, k, v, lengths, _ = _inputs(5, 2, 7, 9, 3, 200, 64)
    anc, pos = _tree(5, 2, 7, np.asarray(lengths), 4)
    got, want = _both(q, k, v, lengths, pos, anc)
    np.testing.assert_array_equal(_bits(got), _bits(want))


def test_a_rows_bits_are_its_own():
    """A token's rows: the same bits decoded alone, as the third token of a verify of 6, beside another sequence,
    and in a cache of twice the capacity (whose extra slots hold other values); a tree node's are those of the
    chain of its ancestors."""
    q, k, v, lengths, pos = _inputs(6, 2, 6, 9, 3, 128, 64, lengths=[40, 77])
    fn = jax.jit(ra.row_attention)
    verify = fn(q, k, v, lengths, pos)
    alone = fn(q[1:, 2:3], k[1:], v[1:], lengths[1:], pos[1:, 2:3])
    np.testing.assert_array_equal(_bits(verify[1:, 2:3]), _bits(alone))
    noise = jnp.full((2, 3, 128, 64), 7.0)
    wide = fn(q, jnp.concatenate([k, noise], 2), jnp.concatenate([v, noise], 2), lengths, pos)
    np.testing.assert_array_equal(_bits(wide), _bits(verify))
    # a tree whose node 3 has ancestors 0 -> 1 -> 3: its keys at slots L, L+1, L+3 are the chain's at L .. L+2
    anc = jnp.asarray([[[0, 0, 0], [0, 1, 0], [0, 2, 0], [0, 1, 3]]] * 2, jnp.int32)
    tree_pos = lengths[:, None] + jnp.asarray([0, 1, 1, 2], jnp.int32)
    tree = fn(q[:, :4], k, v, lengths, tree_pos, anc)
    chain_k = k.at[:, :, lengths[0] + 2].set(k[:, :, lengths[0] + 3])  # the chain 0, 1, 3 in slot order
    chain_v = v.at[:, :, lengths[0] + 2].set(v[:, :, lengths[0] + 3])
    one = fn(q[:1, 3:4], chain_k[:1], chain_v[:1], lengths[:1], lengths[:1, None] + 2)
    np.testing.assert_array_equal(_bits(tree[:1, 3:4]), _bits(one))


def test_close_to_softmax_attention():
    """Not bits, but sense: within float32 rounding of a float64 softmax attention."""
    q, k, v, lengths, pos = _inputs(7, 2, 3, 8, 2, 90, 64)
    got = np.asarray(jax.jit(ra.row_attention)(q, k, v, lengths, pos))
    qn, kn, vn = (np.asarray(x, np.float64) for x in (q, k, v))
    for row in range(2):
        for t in range(3):
            p = int(pos[row, t])
            for head in range(8):
                s = kn[row, head // 4, : p + 1] @ qn[row, t, head] / 8.0
                w = np.exp(s - s.max())
                want = (w / w.sum()) @ vn[row, head // 4, : p + 1]
                np.testing.assert_allclose(got[row, t, head], want, rtol=2e-5, atol=2e-6)


def test_exp_c_is_exp():
    x = jnp.linspace(-80.0, 0.0, 200_001, dtype=jnp.float32)
    got = np.asarray(jax.jit(ra.exp_c)(x), np.float64)
    want = np.exp(np.asarray(x, np.float64))
    assert np.max(np.abs(got - want) / want) < 2.5e-7  # ~2 ulp
    assert float(ra.exp_c(jnp.float32(0.0))) == 1.0 and float(ra.exp_c(jnp.float32(-80.5))) == 0.0


def test_supports():
    k = jnp.zeros((1, 1, 4, 8))
    assert ra.supports(k.dtype, None) and ra.supports(jnp.bfloat16, None)
    assert not ra.supports(k.dtype, 50.0) and not ra.supports(jnp.float16, None)


def test_every_instruction_sets_vectors_give_the_reference_bits():
    """The library built for AVX2 (no AVX-512) and for SSE (no AVX) as well: their vectors are 8 and 4 floats
    wide, so the halving inside a vector runs other shuffles (cpu_attention.cc halving_lanes)."""
    import platform

    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("narrower builds are x86 only")
    q, k, v, lengths, pos = _inputs(8, 2, 3, 8, 2, 70, 64)
    qd, kd, vd, _, _ = _inputs(8, 2, 3, 8, 2, 70, 48)
    for i, flags in enumerate([("-mno-avx512f",), ("-mno-avx",)]):
        try:
            library = cpu_library.build(extra_flags=flags)
        except cpu_library.BuildError as e:
            pytest.skip(f"the compiler does not build {flags}: {e}")
        name = f"jaxspec_row_attention_test_{i}"
        jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(ctypes.cdll.LoadLibrary(str(library)).JaxspecRowAttention),
                                    platform="cpu")
        for args in ((q, k, v), (qd, kd, vd)):
            out = jax.ShapeDtypeStruct(args[0].shape, jnp.float32)
            call = jax.jit(lambda a, b_, c, n, p: jax.ffi.ffi_call(name, out)(
                a, b_, c, n, p, jnp.zeros((*p.shape, 1), jnp.int32), scale=np.float32(args[0].shape[-1] ** -0.5),
                window=np.int64(0), tree=False))
            got = call(*args, lengths, pos)
            want = ra.row_attention_reference(*args, lengths, pos)
            np.testing.assert_array_equal(_bits(got), _bits(want), err_msg=f"{flags} D={args[0].shape[-1]}")
