"""The verification kernel (interpret mode) equals its reference exactly for the same draws, and the walk is lossless:
the first two emitted tokens follow the target's joint distribution (chi-square) for trees and chains."""

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from pallas_kernels.rejection import verify, verify_reference


def random_tree(rng, n: int, max_depth: int) -> np.ndarray:
    """Parents of a random tree over n nodes in topological order with depth ≤ max_depth."""
    parents, depth = [-1], [0]
    for i in range(1, n):
        choices = [j for j in range(i) if depth[j] < max_depth]
        p = int(rng.choice(choices))
        parents.append(p)
        depth.append(depth[p] + 1)
    return np.asarray(parents, np.int32)


def markov_tree_inputs(rng, table: np.ndarray, root: int, parents: np.ndarray, batch: int, peaked: bool):
    """Tree tokens drafted from a 'target' that is a Markov chain over the vocabulary (p after node n =
    table[token n]); siblings get distinct tokens, the likely ones when `peaked`."""
    n, v = len(parents), table.shape[0]
    tokens = np.zeros((batch, n), np.int32)
    tokens[:, 0] = root
    for row in range(batch):
        for node in range(1, n):
            par = parents[node]
            taken = set(tokens[row, 1:node][parents[1:node] == par].tolist())
            weights = table[tokens[row, par]].copy() if peaked else np.ones(v)
            weights[list(taken)] = 0
            tokens[row, node] = rng.choice(v, p=weights / weights.sum())
    probs = table[tokens]  # [B, N, V]
    return tokens, probs


def draft_inputs(rng, mode, batch, n, v, depth, *, variant="plain", dtype="float32"):
    """Verification inputs with a target that is a random Markov chain over the vocabulary → (args, q, depth).

    variant: "plain"; "ties" (integer logits, so probabilities repeat exactly, and constant noise: the race is
    decided by first indices, across blocks and chunks); "sparse" (each target row keeps its 5 likeliest tokens, the
    others get probability 0 as after top-k, drafts come from the unfiltered rows, and a third of the noise is
    exactly 0: those entries must not win); "fallback" (sparse, and chain q = p: a draft of probability 0 is
    rejected with no residual left, so the race falls back to p)."""
    logits = rng.normal(size=(v, v)) * 3.0
    if variant == "ties":
        logits = np.round(logits / 3.0)
    table = np.asarray(jax.nn.softmax(jnp.asarray(logits), axis=-1))
    if mode == "chain":
        parents = np.arange(n, dtype=np.int32) - 1
        depth = n - 1
    else:
        parents = random_tree(rng, n, depth)
    tokens, probs = markov_tree_inputs(rng, table, int(rng.integers(v)), parents, batch, peaked=True)
    if variant in ("sparse", "fallback"):
        kept = np.where(table >= np.sort(table, axis=1)[:, -min(5, v), None], table, 0.0)
        probs = (kept / kept.sum(axis=1, keepdims=True))[tokens]
    parents = np.broadcast_to(parents, (batch, n))
    q = None
    if mode == "chain":
        q = probs.copy() if variant == "fallback" else np.array(
            jax.nn.softmax(jnp.asarray(rng.normal(size=(batch, n, v))), axis=-1))
        q[:, -1] = 0.0
        q = jnp.asarray(q, dtype)
    if mode == "greedy":  # logits; make some drafts the argmax so that paths get accepted
        with np.errstate(divide="ignore"):
            probs = np.log(probs)
    uniforms = rng.random((batch, n))
    noise = np.ones((batch, v)) if variant == "ties" else rng.exponential(size=(batch, v))
    if variant in ("sparse", "fallback"):
        noise[rng.random((batch, v)) < 1 / 3] = 0.0
    args = (jnp.asarray(tokens), jnp.asarray(parents), jnp.asarray(probs, dtype), jnp.asarray(uniforms, jnp.float32),
            jnp.asarray(noise, jnp.float32))
    return args, q, depth


def check_walk(result, tokens, parents):
    """The path is a real root-to-node path, the emitted drafts are its tokens, and -1 fills the rest."""
    a, emitted, path = (np.asarray(x) for x in result)
    for row in range(tokens.shape[0]):
        for j in range(1, a[row] + 1):
            assert parents[row, path[row, j]] == path[row, j - 1]
            assert emitted[row, j - 1] == tokens[row, path[row, j]]
        assert (emitted[row, a[row] + 1 :] == -1).all() and (path[row, a[row] + 1 :] == -1).all()


@pytest.mark.parametrize("mode", ["greedy", "tree", "chain"])
@pytest.mark.parametrize("batch,n,v,depth", [  # CI: the smallest and the largest; the blocked cases below
    (1, 1, 7, 1), pytest.param(3, 6, 13, 3, marks=pytest.mark.slow),  # cover the shapes between
    pytest.param(4, 16, 50, 6, marks=pytest.mark.slow), (2, 60, 257, 8)])
def test_kernel_equals_reference_exactly(mode, batch, n, v, depth):
    rng = np.random.default_rng(zlib.crc32(f"{mode}-{batch}-{n}-{v}".encode()))
    args, q, depth = draft_inputs(rng, mode, batch, n, v, depth)
    want = verify_reference(*args, q, mode=mode, max_depth=depth)
    got = verify(*args, q, mode=mode, max_depth=depth, interpret=True)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    check_walk(want, np.asarray(args[0]), np.asarray(args[1]))


# (mode, B, N, V, tree depth, vocab_block, chunk_blocks, variant, dtype): small blocks, so that rows span several
# blocks and chunks; V not a multiple of the block (the last block overlaps the one before), a multiple of it, and
# below it; N = 1 (nothing to accept); chunks whose blocks run out before chunk_blocks
BLOCKED_CASES = [
    ("tree", 3, 9, 100, 3, 16, 2, "plain", "float32"),  # 7 blocks (the 7th at 84), 4 chunks, the last one block
    ("tree", 2, 16, 64, 2, 8, 3, "ties", "float32"),  # wide fan-out: several children per block
    ("tree", 2, 12, 45, 4, 8, 2, "sparse", "float32"),
    ("tree", 1, 1, 33, 1, 8, 3, "plain", "float32"),  # N = 1
    ("tree", 2, 6, 5, 3, 16, 2, "plain", "float32"),  # V < block: blocks of 4, the second at 1
    ("chain", 2, 6, 64, 0, 16, 2, "plain", "float32"),  # 4 whole blocks, 2 chunks
    ("chain", 3, 6, 90, 0, 16, 2, "fallback", "float32"),
    ("chain", 2, 5, 70, 0, 8, 3, "sparse", "float32"),
    ("chain", 2, 16, 300, 0, 32, 3, "plain", "bfloat16"),
    ("chain", 1, 1, 33, 0, 8, 3, "ties", "float32"),  # N = 1
    ("greedy", 2, 9, 37, 4, 8, 1, "ties", "float32"),
]


@pytest.mark.parametrize("mode,batch,n,v,depth,block,chunk,variant,dtype", BLOCKED_CASES,
                         ids=[f"{c[0]}-{c[7]}-{c[3]}" for c in BLOCKED_CASES])
def test_blocked_kernel_equals_reference(mode, batch, n, v, depth, block, chunk, variant, dtype):
    rng = np.random.default_rng(zlib.crc32(f"blocked-{mode}-{variant}-{n}-{v}".encode()))
    args, q, depth = draft_inputs(rng, mode, batch, n, v, depth, variant=variant, dtype=dtype)
    want = verify_reference(*args, q, mode=mode, max_depth=depth)
    got = verify(*args, q, mode=mode, max_depth=depth, interpret=True, vocab_block=block, chunk_blocks=chunk)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    check_walk(want, np.asarray(args[0]), np.asarray(args[1]))
    if mode != "greedy":  # the target's own token is one p allows (zero noise never draws a zero weight)
        a, emitted, path = (np.asarray(x) for x in want)
        rows = np.arange(batch)
        final = np.asarray(args[2], np.float32)[rows, path[rows, a], emitted[rows, a]]
        assert (final > 0).all()


def test_greedy_accepts_exactly_the_argmax_path():
    v = 10
    logits = np.full((1, 5, v), -5.0, np.float32)
    parents = np.asarray([[-1, 0, 0, 1, 2]], np.int32)
    tokens = np.asarray([[9, 3, 4, 7, 8]], np.int32)
    logits[0, 0, 4] = 1.0  # root's argmax is 4: node 2
    logits[0, 2, 8] = 1.0  # node 2's argmax is 8: node 4
    logits[0, 4, 6] = 1.0  # bonus after node 4
    args = (jnp.asarray(tokens), jnp.asarray(parents), jnp.asarray(logits), jnp.zeros((1, 5)), jnp.ones((1, v)))
    a, emitted, path = verify_reference(*args, mode="greedy", max_depth=2)
    assert int(a[0]) == 2 and emitted[0].tolist() == [4, 8, 6] and path[0].tolist() == [0, 2, 4]


def _joint_chi_square(first, second, table, root):
    v = table.shape[0]
    expected = table[root][:, None] * table  # [V, V]: p(x1) · p(x2 | x1)
    counts = np.zeros((v, v))
    np.add.at(counts, (first, second), 1)
    n = len(first)
    keep = expected.ravel() * n >= 5
    obs, exp = counts.ravel()[keep], expected.ravel()[keep] * n
    exp = exp * obs.sum() / exp.sum()
    return stats.chisquare(obs, exp).pvalue


@pytest.mark.parametrize("mode,parents", [
    ("tree", [-1, 0, 0, 0, 1, 1, 2, 4]),  # wide and deep
    pytest.param("tree", [-1, 0, 1, 2], marks=pytest.mark.slow),  # a chain walked with the target-only rule (CI:
    # the wide tree's walk; a chain's with q)
    ("chain", [-1, 0, 1, 2]),  # Leviathan with draft probabilities
])
def test_sampling_is_lossless(mode, parents):
    """≥ 20 000 independent verifications; the first two tokens (the second from the next step's target draw when
    only one is emitted) follow p(x1 | root) · p(x2 | x1)."""
    rng = np.random.default_rng(17)
    v, n_samples, root = 6, 24_000, 2
    table = rng.dirichlet(np.full(v, 0.7), size=v).astype(np.float32)
    parents = np.asarray(parents, np.int32)
    n = len(parents)
    tokens, probs = markov_tree_inputs(rng, table, root, parents, n_samples, peaked=True)
    q = None
    if mode == "chain":  # a draft distribution unlike the target, drafts sampled from it
        qt = rng.dirichlet(np.full(v, 1.0), size=v).astype(np.float32)
        for node in range(1, n):
            prev = tokens[:, node - 1]
            cdf = np.cumsum(qt[prev], axis=1)
            tokens[:, node] = np.minimum((rng.random((n_samples, 1)) > cdf).sum(1), v - 1)
        probs = table[tokens]
        q = qt[tokens]
        q[:, -1] = 0.0
        q = jnp.asarray(q)
    a, emitted, _ = verify_reference(
        jnp.asarray(tokens), jnp.asarray(np.broadcast_to(parents, (n_samples, n))), jnp.asarray(probs),
        jnp.asarray(rng.random((n_samples, n)), jnp.float32),
        jnp.asarray(rng.exponential(size=(n_samples, v)), jnp.float32), q, mode=mode, max_depth=n - 1,
    )
    a, emitted = np.asarray(a), np.asarray(emitted)
    first = emitted[:, 0]
    next_draw = np.array([rng.choice(v, p=table[x] / table[x].sum()) for x in first])
    second = np.where(a >= 1, emitted[:, 1], next_draw)
    assert _joint_chi_square(first, second, table, root) > 0.01
    assert a.mean() > 0.3  # drafts do get accepted (the test is not just the fallback)
