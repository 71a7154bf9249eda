"""`jaxspec.engine.proposers.ngram.ngram_match`, the device-side matcher of the prompt-lookup proposer: exact agreement with a
literal plain-Python reference on random ragged batches over small vocabularies (frequent repeats), hand-written
cases of each rule, garbage past a row's length, one trace for any lengths, and no [B, L, L] intermediates."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.engine.proposers.ngram import ngram_match


def reference(tokens: list[int], num_draft: int, min_n: int, max_n: int) -> tuple[list[int], int]:
    """The semantics, literally: one row's tokens (its first len entries) -> (drafts, match_n)."""
    size = len(tokens)
    for n in range(max_n, min_n - 1, -1):
        if n > size:
            continue
        suffix = tokens[size - n :]
        for s in range(size - 1 - n, -1, -1):  # s + n <= len - 1, most recent first
            if tokens[s : s + n] == suffix:
                drafts = []
                for j in range(num_draft):
                    # history[s + n + j] while inside the history, else the copy's own earlier draft
                    drafts.append(tokens[s + n + j] if s + n + j < size else drafts[j - (size - s - n)])
                return drafts, n
    return [tokens[-1] if tokens else 0] * num_draft, 0


def check(history: np.ndarray, length: np.ndarray, num_draft: int, min_n: int, max_n: int, fn=None):
    fn = fn or jax.jit(functools.partial(ngram_match, num_draft=num_draft, min_n=min_n, max_n=max_n))
    drafts, match_n = fn(jnp.asarray(history, jnp.int32), jnp.asarray(length, jnp.int32))
    assert drafts.dtype == jnp.int32 and match_n.dtype == jnp.int32
    assert drafts.shape == (history.shape[0], num_draft) and match_n.shape == (history.shape[0],)
    for b in range(history.shape[0]):
        want_drafts, want_n = reference(history[b, : length[b]].tolist(), num_draft, min_n, max_n)
        assert (drafts[b].tolist(), int(match_n[b])) == (want_drafts, want_n), (b, history[b, : length[b]].tolist())
    return np.asarray(drafts), np.asarray(match_n)


def match(rows: list[list[int]], num_draft: int, min_n: int, max_n: int, seq: int | None = None, fill: int = 0):
    """Runs `ngram_match` on hand-written rows padded with `fill`; checks the reference too."""
    seq = seq or max(max(len(r) for r in rows), 1)
    history = np.full((len(rows), seq), fill, np.int32)
    for b, r in enumerate(rows):
        history[b, : len(r)] = r
    return check(history, np.array([len(r) for r in rows], np.int32), num_draft, min_n, max_n)


# --- against the reference ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "min_n, max_n, num_draft", [(1, 1, 1), (1, 3, 4), (2, 2, 3), (2, 5, 6), (3, 8, 5), (1, 8, 30), (4, 4, 2)]
)
def test_random_batches_match_the_reference(min_n, max_n, num_draft):
    rng = np.random.default_rng(1000 * min_n + 10 * max_n + num_draft)
    batch, seq = 24, 24
    fn = jax.jit(functools.partial(ngram_match, num_draft=num_draft, min_n=min_n, max_n=max_n))
    matched = set()
    for trial in range(6):
        vocab = (2, 3, 5)[trial % 3]
        history = rng.integers(0, vocab, (batch, seq)).astype(np.int32)
        length = rng.integers(0, seq + 1, batch).astype(np.int32)
        length[:5] = [0, 1, 2, seq, seq]
        _, match_n = check(history, length, num_draft, min_n, max_n, fn)
        matched |= set(match_n.tolist())
    assert 0 in matched and max_n in matched  # both ends of the range were exercised


def test_long_rows_match_the_reference():
    """Periodic stretches and random text at L = 300: long matches, long periods, n past several shifts."""
    rng = np.random.default_rng(7)
    batch, seq = 6, 300
    history = rng.integers(0, 4, (batch, seq)).astype(np.int32)
    history[1, :] = np.tile(rng.integers(0, 50, 37), 9)[:seq]  # period 37
    history[2, 100:200] = history[2, :100]  # a copied span
    history[3, :] = rng.integers(0, 1000, seq)  # almost surely no match
    length = np.array([seq, 250, 200, seq, 151, 9], np.int32)
    _, match_n = check(history, length, 12, 2, 7)
    assert match_n[1] == 7 and match_n[2] == 7 and match_n[3] == 0


# --- hand-written cases ---------------------------------------------------------------------------------------------


def test_copy_continues_periodically():
    a, b, c = 1, 2, 3
    drafts, match_n = match([[a, b, c, a, b]], num_draft=5, min_n=2, max_n=2)
    assert drafts.tolist() == [[c, a, b, c, a]] and match_n.tolist() == [2]
    drafts, match_n = match([[a, b, c, a, b]], num_draft=2, min_n=1, max_n=3)  # n = 3: [c a b] has no occurrence
    assert drafts.tolist() == [[c, a]] and match_n.tolist() == [2]


def test_most_recent_occurrence_wins():
    # [5 1] occurs at s = 0 (followed by 2) and s = 3 (followed by 3); the suffix is [5 1].
    drafts, match_n = match([[5, 1, 2, 5, 1, 3, 7, 5, 1]], num_draft=2, min_n=2, max_n=2)
    assert drafts.tolist() == [[3, 7]] and match_n.tolist() == [2]


def test_longer_match_beats_a_more_recent_shorter_one():
    # the suffix [4 5 1]: n = 3 occurs at s = 0 (followed by 2), n = 2 [5 1] most recently at s = 5 (followed by 8)
    row = [4, 5, 1, 2, 9, 5, 1, 8, 4, 5, 1]
    drafts, match_n = match([row], num_draft=2, min_n=1, max_n=4)
    assert drafts.tolist() == [[2, 9]] and match_n.tolist() == [3]
    drafts, match_n = match([row], num_draft=2, min_n=1, max_n=2)
    assert drafts.tolist() == [[8, 4]] and match_n.tolist() == [2]


def test_occurrence_may_overlap_the_suffix():
    x = 6
    # n = 2: s <= len - 1 - n = 1, so s = 1 (overlapping the suffix at 2..3) is the most recent; it is followed by x.
    drafts, match_n = match([[x, x, x, x]], num_draft=3, min_n=2, max_n=2)
    assert drafts.tolist() == [[x, x, x]] and match_n.tolist() == [2]
    drafts, match_n = match([[x, x, x, x]], num_draft=3, min_n=1, max_n=5)
    assert match_n.tolist() == [3]  # n = 4 needs s + 4 <= 3
    drafts, match_n = match([[1, 2, 1, 2, 1]], num_draft=5, min_n=1, max_n=4)  # [1 2 1] at s = 0, period 2
    assert drafts.tolist() == [[2, 1, 2, 1, 2]] and match_n.tolist() == [3]


def test_no_match_repeats_the_last_token():
    drafts, match_n = match([[1, 2, 3, 4], [7], [], [3, 3]], num_draft=3, min_n=2, max_n=3, seq=6, fill=9)
    assert drafts.tolist() == [[4, 4, 4], [7, 7, 7], [0, 0, 0], [3, 3, 3]]
    assert match_n.tolist() == [0, 0, 0, 0]  # [3 3]: n = 2 needs len >= 3
    drafts, match_n = match([[3, 3]], num_draft=2, min_n=1, max_n=3)
    assert drafts.tolist() == [[3, 3]] and match_n.tolist() == [1]


def test_garbage_past_length_never_matters():
    rows = [[5, 6, 7, 1, 2], [1, 2, 3, 1, 2], [4], [], [8, 9, 8], [1, 2, 1, 2, 1, 2]]
    seq, num_draft = 16, 6
    length = np.array([len(r) for r in rows], np.int32)
    clean = np.zeros((len(rows), seq), np.int32)
    for b, r in enumerate(rows):
        clean[b, : len(r)] = r
    want = check(clean, length, num_draft, 1, 4)
    rng = np.random.default_rng(3)
    paddings = [
        lambda b: np.array((rows[b] * seq)[:seq] if rows[b] else [1] * seq),  # the row again: every suffix recurs
        lambda b: np.array(([1, 2] * seq)[:seq]),  # the suffixes of rows 0, 1 and 5, with a different follower
        lambda b: rng.integers(0, 10, seq),
    ]
    for pad in paddings:
        dirty = clean.copy()
        for b in range(len(rows)):
            dirty[b, length[b] :] = pad(b)[: seq - length[b]]
        got = check(dirty, length, num_draft, 1, 4)
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_array_equal(got[1], want[1])


# --- jit, shapes and arguments --------------------------------------------------------------------------------------


def test_one_trace_serves_any_lengths():
    traces = []

    @functools.partial(jax.jit, static_argnames=("num_draft", "min_n", "max_n"))
    def fn(history, length, *, num_draft, min_n, max_n):
        traces.append(None)  # runs once per trace
        return ngram_match(history, length, num_draft=num_draft, min_n=min_n, max_n=max_n)

    rng = np.random.default_rng(5)
    history = rng.integers(0, 3, (8, 20)).astype(np.int32)
    call = functools.partial(fn, num_draft=4, min_n=1, max_n=3)
    for length in ([20, 19, 0, 1, 2, 10, 5, 7], [3, 0, 20, 20, 11, 4, 2, 1]):
        check(history, np.array(length, np.int32), 4, 1, 3, call)
    assert len(traces) == 1


def test_memory_is_linear_in_the_context():
    """At B = 64, L = 32k (traced, not run) no intermediate is larger than the [B, L] history."""
    batch, seq = 64, 32768
    jaxpr = jax.make_jaxpr(functools.partial(ngram_match, num_draft=8, min_n=1, max_n=8))(
        jax.ShapeDtypeStruct((batch, seq), jnp.int32), jax.ShapeDtypeStruct((batch,), jnp.int32)
    )

    def sizes(jaxpr):
        for eqn in jaxpr.eqns:
            for var in eqn.outvars:
                yield int(np.prod(var.aval.shape))
            for param in eqn.params.values():  # the bodies of nested jits (jnp's helpers), closed or not
                inner = getattr(param, "jaxpr", param)
                if hasattr(inner, "eqns"):
                    yield from sizes(inner)

    assert max(sizes(jaxpr.jaxpr)) <= batch * seq


def test_runs_on_a_long_context():
    batch, seq = 2, 32768
    rng = np.random.default_rng(11)
    history = rng.integers(0, 30000, (batch, seq)).astype(np.int32)
    history[0, 30000:30010] = history[0, 100:110]  # the suffix of row 0 (len 30010) recurs at s = 102 (n = 8)
    drafts, match_n = ngram_match(jnp.asarray(history), jnp.array([30010, seq], jnp.int32), num_draft=4, min_n=2,
                                  max_n=8)
    assert match_n.tolist()[0] == 8 and drafts[0].tolist() == history[0, 110:114].tolist()


@pytest.mark.parametrize("min_n, max_n, num_draft", [(0, 2, 3), (3, 2, 3), (1, 2, 0), (-1, -1, 1)])
def test_bad_arguments_raise_at_trace_time(min_n, max_n, num_draft):
    with pytest.raises(ValueError, match="ngram_match"):
        ngram_match(jnp.zeros((2, 8), jnp.int32), jnp.zeros((2,), jnp.int32), num_draft=num_draft, min_n=min_n,
                    max_n=max_n)


def test_bad_shapes_raise():
    with pytest.raises(ValueError, match="history"):
        ngram_match(jnp.zeros((2, 8), jnp.int32), jnp.zeros((3,), jnp.int32), num_draft=2, min_n=1, max_n=2)
