"""The tree-attention Pallas kernel (interpret mode on CPU) against its jax.numpy reference, on fresh random inputs."""

import zlib

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.tree_attention import _pow2, tree_attention, tree_attention_reference


def random_tree_mask(rng, t: int) -> np.ndarray:
    """The ancestor mask of a random tree over t nodes in topological order (node 0 the root)."""
    parent = [-1] + [int(rng.integers(0, i)) for i in range(1, t)]
    mask = np.zeros((t, t), bool)
    for i in range(t):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parent[j]
    return mask


# (batch, T, Hq, Hkv, head_dim, capacity, dtype, mask kind): every T, GQA ratio, head_dim and dtype of the issue.
CASES = [
    (2, 1, 4, 4, 64, 64, "float32", "causal"),
    (3, 4, 6, 2, 64, 128, "float32", "tree"),
    (2, 16, 8, 2, 128, 96, "bfloat16", "tree"),
    (2, 60, 8, 1, 64, 256, "float32", "tree"),
    (2, 64, 4, 4, 128, 128, "bfloat16", "random"),
    (1, 64, 8, 1, 128, 512, "bfloat16", "causal"),
    (4, 16, 3, 1, 64, 80, "float32", "random"),
    (2, 4, 32, 8, 128, 64, "bfloat16", "tree"),
]


@pytest.mark.parametrize("batch,t,hq,hkv,d,capacity,dtype,kind", CASES)
def test_kernel_matches_reference(batch, t, hq, hkv, d, capacity, dtype, kind):
    rng = np.random.default_rng(zlib.crc32(f"{batch}-{t}-{hq}-{d}-{capacity}-{kind}".encode()))
    dt = jnp.dtype(dtype)

    def arr(*shape):
        return jnp.asarray(rng.normal(size=shape), jnp.float32).astype(dt)

    q = arr(batch, t, hq, d)
    k_cache, v_cache = arr(batch, hkv, capacity, d), arr(batch, hkv, capacity, d)
    k_win, v_win = arr(batch, hkv, t, d), arr(batch, hkv, t, d)
    # Ragged committed lengths: 0, the last one that leaves room for the window, and random ones between.
    edge = [0, capacity - t]
    lengths = jnp.asarray([edge[i] if i < 2 else int(rng.integers(1, capacity - t)) for i in range(batch)], jnp.int32)
    if kind == "causal":
        mask = np.broadcast_to(np.tril(np.ones((t, t), bool)), (batch, t, t))
    elif kind == "tree":
        mask = np.stack([random_tree_mask(rng, t) for _ in range(batch)])
    else:  # arbitrary, including rows that see no window entry at all
        mask = rng.random((batch, t, t)) < 0.3
    mask = jnp.asarray(mask)
    poison = jnp.full((batch, hkv, _pow2(t * (hq // hkv)), d), jnp.nan, dt)

    got = tree_attention(q, k_cache, v_cache, lengths, k_win, v_win, mask, interpret=True, poison=poison)
    want = tree_attention_reference(q, k_cache, v_cache, lengths, k_win, v_win, mask)
    assert got.shape == want.shape == q.shape and got.dtype == dt
    assert not np.isnan(np.asarray(got, np.float32)).any(), "some outputs were not written"
    tol = 2e-5 if dtype == "float32" else 2e-2
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=tol, rtol=tol)


def test_rows_that_see_nothing_are_zero_and_slots_past_the_length_are_ignored():
    rng = np.random.default_rng(7)
    b, t, h, d, s = 2, 4, 2, 64, 32
    q = jnp.asarray(rng.normal(size=(b, t, h, d)), jnp.float32)
    k_cache = jnp.full((b, h, s, d), 1e4, jnp.float32).at[:, :, :5].set(1.0)  # large values past the committed slots
    v_cache = jnp.full((b, h, s, d), 1e4, jnp.float32).at[:, :, :5].set(2.0)
    k_win = jnp.asarray(rng.normal(size=(b, h, t, d)), jnp.float32)
    v_win = jnp.asarray(rng.normal(size=(b, h, t, d)), jnp.float32)
    lengths = jnp.asarray([0, 5], jnp.int32)
    mask = jnp.zeros((b, t, t), bool).at[1].set(jnp.eye(t, dtype=bool))
    for fn in (lambda *a: tree_attention(*a, interpret=True), tree_attention_reference):
        out = np.asarray(fn(q, k_cache, v_cache, lengths, k_win, v_win, mask))
        assert not np.isnan(out).any()
        np.testing.assert_array_equal(out[0], 0.0)  # no prefix, no window entry visible
        assert np.abs(out[1]).max() > 0
        assert np.abs(out).max() < 100  # nothing of the 1e4 slots leaked in
    poisoned = (jnp.full_like(k_cache, jnp.nan).at[:, :, :5].set(1.0), jnp.full_like(v_cache, jnp.nan).at[:, :, :5].set(2.0))
    out = tree_attention(q, *poisoned, lengths, k_win, v_win, mask, interpret=True)  # the kernel: even NaN there
    np.testing.assert_allclose(np.asarray(out), np.asarray(tree_attention_reference(q, k_cache, v_cache, lengths, k_win, v_win, mask)), atol=1e-5)


def test_reference_equals_the_models_full_mask_attention():
    """The window formulation is the cache formulation the model used before: new K/V written at the committed
    length and a [B, T, S] mask over the whole cache."""
    from jaxspec.models import kv_cache as kvc
    from jaxspec.models.layers import attention

    rng = np.random.default_rng(11)
    b, t, hq, hkv, d, s = 3, 6, 4, 2, 64, 32
    q = jnp.asarray(rng.normal(size=(b, t, hq, d)), jnp.float32)
    k_cache = jnp.asarray(rng.normal(size=(b, hkv, s, d)), jnp.float32)
    v_cache = jnp.asarray(rng.normal(size=(b, hkv, s, d)), jnp.float32)
    k_new = jnp.asarray(rng.normal(size=(b, t, hkv, d)), jnp.float32)
    v_new = jnp.asarray(rng.normal(size=(b, t, hkv, d)), jnp.float32)
    lengths = jnp.asarray([0, 9, s - t], jnp.int32)
    mask = jnp.asarray(np.stack([random_tree_mask(rng, t) for _ in range(b)]))
    k_full, v_full = kvc.write_block(k_cache, k_new, lengths), kvc.write_block(v_cache, v_new, lengths)
    want = attention(q, k_full, v_full, kvc.block_attention_mask(lengths, s, mask))
    got = tree_attention_reference(q, k_cache, v_cache, lengths, k_new.transpose(0, 2, 1, 3), v_new.transpose(0, 2, 1, 3), mask)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)


def test_an_empty_prefix_is_the_window_alone():
    """The prefill form (no committed cache passed at all) equals a zero-length committed prefix."""
    rng = np.random.default_rng(5)
    b, t, hq, hkv, d = 2, 8, 4, 2, 64
    q = jnp.asarray(rng.normal(size=(b, t, hq, d)), jnp.float32)
    k_win = jnp.asarray(rng.normal(size=(b, hkv, t, d)), jnp.float32)
    v_win = jnp.asarray(rng.normal(size=(b, hkv, t, d)), jnp.float32)
    mask = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
    lengths = jnp.zeros((b,), jnp.int32)
    full = jnp.asarray(rng.normal(size=(b, hkv, 16, d)), jnp.float32)
    want = tree_attention_reference(q, full, full, lengths, k_win, v_win, mask)
    empty = full[:, :, :0]
    np.testing.assert_allclose(np.asarray(tree_attention_reference(q, empty, empty, lengths, k_win, v_win, mask)), np.asarray(want), atol=1e-6)
    np.testing.assert_allclose(np.asarray(tree_attention(q, empty, empty, lengths, k_win, v_win, mask, interpret=True)), np.asarray(want), atol=1e-5)
