"""The train step: learns, and gives the same result on 8 fake CPU devices (data=2, fsdp=4) as on one."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fit_head import head_config_for
from flax import nnx
from spec_fixtures import tiny_target

from jaxspec.models.eagle3 import Eagle3Head
from train.step import (
    Batch,
    OptimConfig,
    batch_sharding,
    make_mesh,
    make_optimizer,
    param_sharding,
    split_head,
    train_step,
)


def setup(freeze_lm_head=False):
    target = tiny_target(logit_scale=15.0)  # a peaked teacher, so that the soft cross-entropy can fall
    head = Eagle3Head(head_config_for(target, draft_vocab_size=64), rngs=nnx.Rngs(0))
    tgd, tparams = nnx.split(target)
    hgd, params, frozen = split_head(head, freeze_lm_head)
    tx = make_optimizer(OptimConfig(learning_rate=3e-3, warmup_steps=2, total_steps=50))
    rng = np.random.default_rng(0)
    batch = Batch(jnp.asarray(rng.integers(0, 101, (8, 24)), jnp.int32), jnp.asarray(rng.integers(0, 2, (8, 24)), jnp.int32))
    return tgd, tparams, hgd, params, frozen, tx, batch


def run(steps, tgd, tparams, hgd, params, frozen, tx, batch, mesh=None):
    step = jax.jit(functools.partial(train_step, tgd, head_graphdef=hgd, tx=tx, num_steps=3))
    if mesh is not None:
        tparams = jax.device_put(tparams, param_sharding(mesh, tparams))
        params = jax.device_put(params, param_sharding(mesh, params))
        frozen = jax.device_put(frozen, param_sharding(mesh, frozen))
        batch = jax.device_put(batch, batch_sharding(mesh))
    opt_state = tx.init(params)
    losses = []
    for _ in range(steps):
        params, opt_state, loss, metrics = step(tparams, params=params, frozen=frozen, opt_state=opt_state, batch=batch)
        losses.append(float(loss))
    return params, losses, metrics


def test_loss_decreases_and_embeddings_stay_frozen():
    parts = setup()
    params, losses, metrics = run(15, *parts)
    assert losses[-1] < 0.9 * losses[0]  # 15 steps from a random head
    assert "embed_tokens" not in str(jax.tree_util.tree_structure(params))
    assert {"acc_0", "cond_acc_2", "tau"} <= set(metrics)


def test_freeze_lm_head_keeps_it_out_of_training():
    parts = setup(freeze_lm_head=True)
    assert "lm_head" not in str(jax.tree_util.tree_structure(parts[3]))


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (fake) devices")
def test_sharded_step_equals_single_device():
    parts = setup()
    single, single_losses, _ = run(3, *parts)
    mesh = make_mesh(2, 4)
    sharded, sharded_losses, _ = run(3, *parts, mesh=mesh)
    np.testing.assert_allclose(sharded_losses, single_losses, rtol=1e-5)
    q = sharded["midlayer"]["self_attn"]["q_proj"]["kernel"]
    assert len({s.device for s in q[...].addressable_shards}) == 8 and q[...].sharding.spec != jax.sharding.PartitionSpec()
    for a, b in zip(jax.tree.leaves(single), jax.tree.leaves(sharded)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5, rtol=1e-4)


@pytest.mark.slow  # ~35 s; CI: packed rows equal each sequence alone (test_ttt), and train.launch trains packed rows
def test_packed_step_equals_the_padded_step():
    """Online features on packed rows (the target attends within each sequence, positions restart) and draft
    steps on trained rows only: the same loss and the same update as the sequences padded one per row."""
    from train.packing import PackedBatches

    tgd, tparams, hgd, params, frozen, tx, _ = setup()
    rng = np.random.default_rng(1)
    seqs = []
    for _ in range(6):
        n, prompt = int(rng.integers(8, 20)), int(rng.integers(2, 6))
        seqs.append((rng.integers(0, 101, n).astype(np.int32), (np.arange(n) >= prompt).astype(np.int32)))
    rows = len(PackedBatches(seqs, 48, 1, 3, seed=0, capacity=40).epoch_rows(0))
    assert rows < 6  # several sequences share a row
    packed = PackedBatches(seqs, 48, rows, 3, seed=0, capacity=40)  # one step = the whole first epoch
    members = [i for row in packed.rows_of_step(0) for i in row]
    assert sorted(members) == list(range(6))
    pb = packed(0)
    ids, mask = np.zeros((6, 20), np.int32), np.zeros((6, 20), np.int32)
    for r, i in enumerate(members):
        ids[r, : len(seqs[i][0])], mask[r, : len(seqs[i][1])] = seqs[i]
    step = jax.jit(functools.partial(train_step, tgd, head_graphdef=hgd, tx=tx, num_steps=3))
    opt_state = tx.init(params)
    out_packed = step(tparams, params=params, frozen=frozen, opt_state=opt_state, batch=Batch(
        *(jnp.asarray(x) for x in (pb.ids, pb.loss_mask)), None, None,
        *(jnp.asarray(x) for x in (pb.positions, pb.segments, pb.trained))))
    out_padded = step(tparams, params=params, frozen=frozen, opt_state=opt_state,
                      batch=Batch(jnp.asarray(ids), jnp.asarray(mask)))
    assert float(out_packed[2]) == pytest.approx(float(out_padded[2]), rel=1e-5)
    for a, b in zip(jax.tree.leaves(out_packed[0]), jax.tree.leaves(out_padded[0])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-4)
