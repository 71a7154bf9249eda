import numpy as np
import pytest

from jaxspec.errors import JaxspecError
from train.vocab import build_vocab_map, coverage, token_counts


def test_counts_only_masked_tokens():
    counts = token_counts([[1, 2, 2, 3], [3, 3]], [[0, 1, 1, 1], [1, 0]], vocab_size=5)
    assert counts.tolist() == [0, 0, 2, 2, 0]


def test_map_selects_most_frequent_sorted_and_round_trips():
    rng = np.random.default_rng(0)
    counts = rng.integers(0, 1000, 300)
    d2t, t2d = build_vocab_map(counts, 64)
    selected = np.arange(64) + d2t
    assert np.all(np.diff(selected) > 0) and t2d.sum() == 64 and np.all(t2d[selected])
    assert counts[selected].min() >= np.sort(counts)[-64]
    assert coverage(counts, t2d) == pytest.approx(counts[selected].sum() / counts.sum())
    full_d2t, full_t2d = build_vocab_map(counts, 300)
    assert np.all(full_d2t == 0) and full_t2d.all() and coverage(counts, full_t2d) == 1.0


def test_bad_size():
    with pytest.raises(JaxspecError, match="draft vocabulary size 0"):
        build_vocab_map(np.ones(10), 0)


def test_prior_breaks_ties_among_unseen_tokens():
    counts = np.array([0, 5, 0, 0, 3, 0])
    prior = np.array([0, 9, 1, 7, 3, 2])
    d2t, t2d = build_vocab_map(counts, 4, prior)
    assert np.flatnonzero(t2d).tolist() == [1, 3, 4, 5]  # 1 and 4 by count, then the unseen 3 and 5 by prior
