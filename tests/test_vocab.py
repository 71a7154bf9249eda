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


def test_coverage_report_compares_sizes_on_held_out_and_evaluation_shards(tmp_path, capsys):
    """`python -m train.vocab`: one row per size; coverage grows with the size and reaches 1 on the full vocabulary."""
    from train.data import write_shard
    from train.vocab import main

    rng = np.random.default_rng(0)
    for name, n in (("train", 60), ("eval", 10)):
        (tmp_path / name).mkdir()
        seqs = [rng.zipf(1.5, 30).clip(0, 199).tolist() for _ in range(n)]
        write_shard(tmp_path / name / "shard-00000.npz", seqs, [4] * n, [str(i) for i in range(n)], [True] * n)
    assert main(["--data", str(tmp_path / "train"), "--eval", str(tmp_path / "eval"), "--sizes", "4,16,200"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and line[2].isdigit()]
    cells = [[float(c) for c in row.strip("| ").split(" | ")[1:]] for row in rows]
    assert len(cells) == 3 and all(len(c) == 2 for c in cells)
    for col in (0, 1):
        assert cells[0][col] <= cells[1][col] <= cells[2][col] == 1.0
    with pytest.raises(SystemExit) as exc:
        main(["--data", str(tmp_path / "train"), "--sizes", "8k"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "--sizes" in err and "expected positive integers" in err and "'8k'" in err
