"""The KV cache: incremental decoding, ragged batches and arbitrary block masks agree with full forwards."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxspec.config import TargetConfig
from jaxspec.models import kv_cache as kvc
from jaxspec.models.llama import LlamaModel

CFG = TargetConfig(
    vocab_size=101, hidden_size=64, intermediate_size=128, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16
)


@pytest.fixture(scope="module")
def model():
    """Plain numerics: these tests are about what the cache and the masks let a token see, which both attention
    paths share (kv_cache.py); the invariant path's own semantics are tested in test_invariance.py (tree and chain
    verify against decode of each path), and run op by op here it is minutes slower."""
    return LlamaModel(CFG, rngs=nnx.Rngs(0), numerics=None)


def full_logits(model, row_tokens):
    t = len(row_tokens)
    out = model(jnp.asarray([row_tokens], jnp.int32), jnp.arange(t, dtype=jnp.int32)[None], model.init_cache(1, 64))
    return np.asarray(out.logits[0])


@pytest.mark.slow  # CI: every speculative test compares a ragged batch of 4 with the batch-1 target-only reference
def test_prefill_then_decode_equals_full_forward_ragged_batch(model):
    rng = np.random.default_rng(0)
    lengths = [5, 11, 1]
    decode_steps = 6
    rows = [rng.integers(0, CFG.vocab_size, n + decode_steps).tolist() for n in lengths]
    b, tp = len(rows), max(lengths)
    prompt = np.zeros((b, tp), np.int32)
    for i, n in enumerate(lengths):
        prompt[i, :n] = rows[i][:n]
    cache = model.init_cache(b, 32)
    out = model(jnp.asarray(prompt), jnp.broadcast_to(jnp.arange(tp, dtype=jnp.int32), (b, tp)), cache)
    cache = kvc.advance(out.cache, jnp.asarray(lengths))
    got = [[np.asarray(out.logits[i, n - 1])] for i, n in enumerate(lengths)]
    for s in range(decode_steps):
        tok = jnp.asarray([[rows[i][n + s]] for i, n in enumerate(lengths)], jnp.int32)
        out = model(tok, cache.lengths[:, None], cache)
        cache = kvc.advance(out.cache, 1)
        for i in range(b):
            got[i].append(np.asarray(out.logits[i, 0]))
    for i, n in enumerate(lengths):
        want = full_logits(model, rows[i])[n - 1 :]
        np.testing.assert_allclose(np.stack(got[i]), want, atol=1e-5, rtol=0)


def test_uncommitted_entries_are_never_read(model):
    """A forward whose tokens are not committed (rejected drafts) leaves later results unchanged."""
    rng = np.random.default_rng(1)
    prompt = rng.integers(0, CFG.vocab_size, (1, 8)).astype(np.int32)
    pos = jnp.arange(8, dtype=jnp.int32)[None]
    cache = kvc.advance(model(jnp.asarray(prompt), pos, model.init_cache(1, 32)).cache, 8)
    junk = jnp.asarray(rng.integers(0, CFG.vocab_size, (1, 5)), jnp.int32)
    dirty = model(junk, 8 + jnp.arange(5, dtype=jnp.int32)[None], cache).cache  # written, not committed
    nxt = jnp.asarray([[7]], jnp.int32)
    a = model(nxt, jnp.asarray([[8]], jnp.int32), cache).logits
    b = model(nxt, jnp.asarray([[8]], jnp.int32), dirty).logits
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.slow  # CI: test_spec_tree's trees equal target-only (a wrong mask changes the text), tree_from_parents
def test_tree_block_mask_equals_each_path_run_causally(model):
    """Tokens in one block with an ancestor mask see exactly their root-to-node path on top of the prefix."""
    rng = np.random.default_rng(2)
    prefix = rng.integers(0, CFG.vocab_size, 6).tolist()
    parents = [-1, 0, 0, 1, 1, 2, 5]  # a small tree, parents before children
    nodes = rng.integers(0, CFG.vocab_size, len(parents)).tolist()
    t = len(parents)
    mask = np.zeros((t, t), bool)
    depth = np.zeros(t, np.int32)
    for i, p in enumerate(parents):
        mask[i, i] = True
        if p >= 0:
            mask[i] |= mask[p]
            depth[i] = depth[p] + 1
    cache = model.init_cache(1, 32)
    cache = kvc.advance(model(jnp.asarray([prefix], jnp.int32), jnp.arange(6, dtype=jnp.int32)[None], cache).cache, 6)
    out = model(
        jnp.asarray([nodes], jnp.int32), jnp.asarray([6 + depth]), cache, block_mask=jnp.asarray(mask[None])
    )
    for i in range(t):
        path = [j for j in range(t) if mask[i, j]]  # ancestors in order (parents precede children)
        want = full_logits(model, prefix + [nodes[j] for j in path])[-1]
        np.testing.assert_allclose(np.asarray(out.logits[0, i]), want, atol=1e-5, rtol=0)


def test_block_attention_mask_layout():
    lengths = jnp.asarray([2, 0])
    block = jnp.asarray(np.tril(np.ones((3, 3), bool))[None].repeat(2, 0))
    m = np.asarray(kvc.block_attention_mask(lengths, 6, block))
    assert m[0].tolist() == [
        [True, True, True, False, False, False],
        [True, True, True, True, False, False],
        [True, True, True, True, True, False],
    ]
    assert m[1, 0].tolist() == [True, False, False, False, False, False]


@pytest.mark.parametrize("t", [1, 6])
def test_write_block_writes_each_rows_slots_and_drops_past_the_capacity(t):
    """write_block against a loop: ragged starts, a row at slot 0, rows whose block runs past the capacity (those
    slots drop, the rest are written) and one starting past it (nothing written); every other slot untouched."""
    b, h, s, d = 4, 3, 8, 5
    rng = np.random.default_rng(t)
    cache = rng.standard_normal((b, h, s, d)).astype(np.float32)
    new = rng.standard_normal((b, t, h, d)).astype(np.float32)
    lengths = np.asarray([0, 3, s - 2, s + 1], np.int32)
    want = cache.copy()
    for row in range(b):
        for j in range(t):
            if lengths[row] + j < s:
                want[row, :, lengths[row] + j] = new[row, j]
    got = kvc.write_block(jnp.asarray(cache), jnp.asarray(new), jnp.asarray(lengths))
    np.testing.assert_array_equal(np.asarray(got), want)


def test_write_block_on_a_mesh_writes_per_shard_without_a_collective():
    """Under a (data, model) mesh, rows split over data and heads over model as the cache is (sharding.CACHE_SPEC),
    the write is each shard's own: the same values as on one device, the cache's sharding kept, and no collective
    in the program (XLA's partitioner all-gathered a whole-array scatter's updates and indices)."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    from jaxspec import sharding

    mesh = sharding.make_mesh(sharding.MeshConfig(data=2, model=2))
    rng = np.random.default_rng(0)
    cache = rng.standard_normal((4, 4, 16, 8)).astype(np.float32)
    new = rng.standard_normal((4, 3, 4, 8)).astype(np.float32)
    lengths = np.asarray([0, 5, 14, 16], np.int32)  # the last two run past the capacity
    want = np.asarray(kvc.write_block(jnp.asarray(cache), jnp.asarray(new), jnp.asarray(lengths)))
    with jax.set_mesh(mesh):
        args = (jax.device_put(cache, NamedSharding(mesh, sharding.CACHE_SPEC)),
                jax.device_put(new, NamedSharding(mesh, P("data", None, "model"))),
                jax.device_put(lengths, NamedSharding(mesh, P("data"))))
        write = jax.jit(kvc.write_block)
        got = write(*args)
        program = write.lower(*args).compile().as_text()
    np.testing.assert_array_equal(np.asarray(got), want)
    assert got.sharding.spec == sharding.CACHE_SPEC
    assert not any(op in program for op in ("all-gather", "all-reduce", "all-to-all", "collective-permute"))
