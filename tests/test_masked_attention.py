"""The plain masked attention of the draft head and of `--numerics plain` (jaxspec/models/attention.py)."""

import jax.numpy as jnp
import numpy as np

from jaxspec.models.attention import masked_attention


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
    out = np.asarray(masked_attention(q, k_cache, v_cache, lengths, k_win, v_win, mask))
    assert not np.isnan(out).any()
    np.testing.assert_array_equal(out[0], 0.0)  # no prefix, no window entry visible
    assert np.abs(out[1]).max() > 0
    assert np.abs(out).max() < 100  # nothing of the 1e4 slots leaked in


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
    got = masked_attention(q, k_cache, v_cache, lengths, k_new.transpose(0, 2, 1, 3), v_new.transpose(0, 2, 1, 3), mask)
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
    want = masked_attention(q, full, full, lengths, k_win, v_win, mask)
    empty = full[:, :, :0]
    np.testing.assert_allclose(np.asarray(masked_attention(q, empty, empty, lengths, k_win, v_win, mask)), np.asarray(want), atol=1e-6)
