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


@pytest.mark.parametrize("mode", ["greedy", "tree", "chain"])
@pytest.mark.parametrize("batch,n,v,depth", [(1, 1, 7, 1), (3, 6, 13, 3), (4, 16, 50, 6), (2, 60, 257, 8)])
def test_kernel_equals_reference_exactly(mode, batch, n, v, depth):
    rng = np.random.default_rng(zlib.crc32(f"{mode}-{batch}-{n}-{v}".encode()))
    table = np.asarray(jax.nn.softmax(jnp.asarray(rng.normal(size=(v, v)) * 3.0), axis=-1))
    if mode == "chain":
        parents = np.arange(n, dtype=np.int32) - 1
        depth = n - 1
    else:
        parents = random_tree(rng, n, depth)
    tokens, probs = markov_tree_inputs(rng, table, int(rng.integers(v)), parents, batch, peaked=True)
    parents = np.broadcast_to(parents, (batch, n))
    q = None
    if mode == "chain":
        q = np.array(jax.nn.softmax(jnp.asarray(rng.normal(size=(batch, n, v))), axis=-1))
        q[:, -1] = 0.0
        q = jnp.asarray(q)
    if mode == "greedy":  # logits; make some drafts the argmax so that paths get accepted
        probs = np.log(probs)
    args = (jnp.asarray(tokens), jnp.asarray(parents), jnp.asarray(probs, jnp.float32),
            jnp.asarray(rng.random((batch, n)), jnp.float32), jnp.asarray(rng.exponential(size=(batch, v)), jnp.float32))
    want = verify_reference(*args, q, mode=mode, max_depth=depth)
    got = verify(*args, q, mode=mode, max_depth=depth, interpret=True)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    a, emitted, path = (np.asarray(x) for x in want)
    for row in range(batch):  # the path is a real root-to-node path and the emitted drafts are its tokens
        for j in range(1, a[row] + 1):
            assert parents[row, path[row, j]] == path[row, j - 1]
            assert emitted[row, j - 1] == tokens[row, path[row, j]]
        assert (emitted[row, a[row] + 1 :] == -1).all() and (path[row, a[row] + 1 :] == -1).all()


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
    ("tree", [-1, 0, 1, 2]),  # a chain walked with the target-only rule
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
