"""Sequence packing for head training: every sequence once per epoch, within the row and trained-row budgets,
deterministic in (seed, step), with positions and segments that restart per sequence."""

import numpy as np
import pytest

from train.packing import PackedBatches, trained_positions


def dataset(n=60, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        length, prompt = int(rng.integers(6, 40)), int(rng.integers(1, 12))
        mask = (np.arange(length) >= prompt).astype(np.int32)
        out.append((rng.integers(0, 100, length).astype(np.int32), mask))
    return out


def test_trained_positions_are_those_with_a_loss():
    mask = np.array([0, 0, 0, 0, 1, 1, 1, 0])
    # step k of position t is trained where mask[t+2+k]; K = 2 → t in {1, 2, 3, 4}
    assert trained_positions(mask, 2).tolist() == [1, 2, 3, 4]
    assert trained_positions(mask, 1).tolist() == [2, 3, 4]
    assert trained_positions(np.zeros(5, int), 3).size == 0


@pytest.mark.parametrize("seq_len,capacity", [(48, None), (64, 40), (40, 30)])
def test_each_epoch_packs_every_sequence_once_within_budgets(seq_len, capacity):
    seqs = dataset()
    pb = PackedBatches(seqs, seq_len, 4, 3, seed=1, capacity=capacity)
    for epoch in (0, 1):
        rows = pb.epoch_rows(epoch)
        assert sorted(i for r in rows for i in r) == list(range(len(seqs)))
        for r in rows:
            assert sum(pb.lengths[i] for i in r) <= seq_len
            assert sum(len(pb.trained_per_sequence[i]) for i in r) <= pb.capacity
    assert pb.epoch_rows(0) != pb.epoch_rows(1)  # reshuffled each epoch
    # packing leaves little room: one of the two budgets (tokens, trained positions) is nearly used up
    n = len(pb.epoch_rows(0))
    fill = max(pb.lengths.sum() / (n * seq_len), sum(len(p) for p in pb.trained_per_sequence) / (n * pb.capacity))
    assert fill > 0.8


def test_batches_are_deterministic_and_laid_out_per_sequence():
    seqs = dataset()
    a, b = PackedBatches(seqs, 64, 3, 2, seed=5, capacity=48), PackedBatches(seqs, 64, 3, 2, seed=5, capacity=48)
    for step in (0, 7, 31):  # step 31 reaches into a later epoch
        x, y = a(step), b(step)
        for name in ("ids", "loss_mask", "positions", "segments", "trained"):
            np.testing.assert_array_equal(getattr(x, name), getattr(y, name))
    batch = a(3)
    for r, members in enumerate(a.rows_of_step(3)):
        start, used = 0, 0
        for seg, i in enumerate(members, start=1):
            ids, mask = seqs[i]
            n = len(ids)
            np.testing.assert_array_equal(batch.ids[r, start : start + n], ids)
            np.testing.assert_array_equal(batch.loss_mask[r, start : start + n], mask)
            np.testing.assert_array_equal(batch.positions[r, start : start + n], np.arange(n))
            assert (batch.segments[r, start : start + n] == seg).all()
            p = trained_positions(mask, 2)
            np.testing.assert_array_equal(batch.trained[r, used : used + len(p)], start + p)
            start, used = start + n, used + len(p)
        assert (batch.segments[r, start:] == 0).all() and (batch.trained[r, used:] == 63).all()
    assert batch.real_tokens == sum(len(seqs[i][0]) for m in a.rows_of_step(3) for i in m)


def test_steps_walk_the_epochs_without_gaps():
    seqs = dataset(20)
    pb = PackedBatches(seqs, 48, 2, 1, seed=0)
    per_epoch = [len(pb.epoch_rows(e)) for e in range(3)]
    seen = [row for step in range(sum(per_epoch) // 2) for row in pb.rows_of_step(step)]
    flat = [r for e in range(3) for r in pb.epoch_rows(e)]
    assert seen == flat[: len(seen)]
    assert pb.epoch_of_step(0) == 0 and pb.epoch_of_step(per_epoch[0] / 2) == pytest.approx(1.0, abs=0.5)


def test_long_sequences_are_cut_to_the_row_and_to_the_trained_budget():
    seqs = dataset()
    pb = PackedBatches(seqs, 16, 2, 2, seed=0)
    assert pb.lengths.max() == 16 and pb(0).ids.shape == (2, 16)
    pb = PackedBatches(seqs, 40, 2, 2, seed=0, capacity=4)
    assert max(len(p) for p in pb.trained_per_sequence) <= 4
    for i, (ids, mask) in enumerate(seqs):  # cut just before the position past the budget, not earlier
        full = trained_positions(mask[:40], 2)
        if len(full) > 4:
            assert pb.lengths[i] == full[4] + 2 and len(pb.trained_per_sequence[i]) == 4


def test_late_steps_do_not_repack_early_epochs():
    """Row counts of past epochs are kept: a step deep in the run packs only the epochs it touches once."""
    import train.packing as packing

    seqs = dataset(20)
    pb = PackedBatches(seqs, 48, 2, 1, seed=0)
    calls = []
    real = packing.first_fit
    packing.first_fit = lambda *a: calls.append(1) or real(*a)
    try:
        late = 5 * len(pb.epoch_rows(0))  # batch 2: around epoch 10
        for step in range(late, late + 5):
            pb.rows_of_step(step)
        first = len(calls)
        for step in range(late + 5, late + 10):
            pb.rows_of_step(step)
    finally:
        packing.first_fit = real
    epochs = len(pb.row_counts)
    assert first <= epochs and len(calls) - first <= 2  # each epoch packed once on the way; then only new ones
    assert pb.settings["num_sequences"] == 20 and pb.settings["trained_positions"] == 48
