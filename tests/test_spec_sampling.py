"""Speculative sampling is lossless: the joint distribution of the first two tokens equals the target's."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from scipy import stats
from spec_fixtures import fitted_head, tiny_target

from jaxspec.engine.generation import Generator
from jaxspec.sampling import SamplingConfig, filtered_logits
from jaxspec.engine.generator import SpeculativeGenerator
from jaxspec.engine.tree import TreeConfig

VOCAB, N = 16, 20000
PROMPT = [3, 7, 1, 12]
SHAPE = dict(vocab=VOCAB, embed_scale=20.0, logit_scale=15.0)


@functools.cache
def plain_target():
    """These tests check the sampling algorithm, not bits: the target with plain XLA numerics keeps 20 000 draws
    fast (batch-invariant numerics have their own tests, tests/test_invariance.py)."""
    model = nnx.clone(tiny_target(**SHAPE))
    model.numerics = None
    return model


def exact_joint(sampling: SamplingConfig):
    """P(x1, x2) [V, V] and the head's first-draft distribution q(x | x1) [V, V], computed directly."""
    target, head = plain_target(), fitted_head(**SHAPE)
    n = len(PROMPT)
    seqs = jnp.asarray([PROMPT + [x1] for x1 in range(VOCAB)], jnp.int32)  # every possible first token
    pos = jnp.broadcast_to(jnp.arange(n + 1, dtype=jnp.int32), seqs.shape)
    out = target(seqs, pos, target.init_cache(VOCAB, n + 1), return_aux=True)
    probs = jax.nn.softmax(filtered_logits(out.logits, sampling), axis=-1)
    p1, p2 = np.asarray(probs[0, n - 1], np.float64), np.asarray(probs[:, n], np.float64)
    # The head's first draft reads pairs (g_t, x_{t+1}) for t < n, the last being (g_{n-1}, x1).
    logits, _, _ = head(seqs[:, 1:], head.project(out.aux[:, :n]), pos[:, :n], head.init_cache(VOCAB, n), target.embed_tokens[...])
    q = np.asarray(jax.nn.softmax(filtered_logits(logits[:, -1], sampling), axis=-1), np.float64)
    return p1[:, None] * p2, p2, q


def chi_square_p(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = probs.ravel() / probs.sum() * counts.sum()
    observed = counts.ravel()
    assert observed[expected == 0].sum() == 0, "a sample outside the support"
    big = expected >= 5
    obs = np.append(observed[big], observed[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    assert keep.sum() >= 5, "too few outcomes for a meaningful test"
    return stats.chisquare(obs[keep], exp[keep]).pvalue


def first_two(completions) -> np.ndarray:
    counts = np.zeros((VOCAB, VOCAB))
    for c in completions:
        counts[c.token_ids[0], c.token_ids[1]] += 1
    return counts


@pytest.mark.parametrize(
    "sampling",
    [pytest.param(SamplingConfig(1.0), marks=pytest.mark.slow), pytest.param(SamplingConfig(1.5, top_k=6), marks=pytest.mark.slow),
     pytest.param(SamplingConfig(2.0, top_p=0.9), marks=pytest.mark.slow)],
    ids=str,
)  # CI: a chain's chi-square with top-p under a grammar (tests/test_grammar.py), top-k in the tree case below
def test_joint_distribution_and_acceptance_rate(sampling):
    target, head = plain_target(), fitted_head(**SHAPE)
    joint, p2, q = exact_joint(sampling)
    prompts = [PROMPT] * N

    spec = SpeculativeGenerator(target, head, num_draft=3, batch_size=N).generate(
        prompts, max_new_tokens=2, sampling=sampling, seed=11
    )
    assert chi_square_p(first_two(spec), joint) > 0.01

    plain = Generator(target, batch_size=N).generate(prompts, max_new_tokens=2, sampling=sampling, seed=12)
    assert chi_square_p(first_two(plain), joint) > 0.01

    # One verify per row: the first draft is accepted with probability Σ_x1 P(x1) Σ_x min(p(x|x1), q(x|x1)).
    p1 = joint.sum(axis=1)
    expected = float(np.sum(p1 * np.minimum(p2, q).sum(axis=1)))
    rate = np.mean([c.stats["acceptance_per_position"][0] for c in spec])
    assert 0.05 < expected < 0.95, expected  # both branches (accept, resample) are exercised
    assert abs(rate - expected) < 4 * np.sqrt(expected * (1 - expected) / N) + 1e-3


@pytest.mark.parametrize("sampling", [pytest.param(SamplingConfig(1.0), marks=pytest.mark.slow),
                                      SamplingConfig(1.5, top_k=6)], ids=str)
def test_tree_sampling_is_lossless(sampling):
    """Trees verified with the target-only sibling walk: the first two tokens follow the target's joint."""
    target, head = plain_target(), fitted_head(**SHAPE)
    joint, _, _ = exact_joint(sampling)
    gen = SpeculativeGenerator(target, head, tree=TreeConfig(8, 3, 3), batch_size=N)
    spec = gen.generate([PROMPT] * N, max_new_tokens=2, sampling=sampling, seed=13)
    assert chi_square_p(first_two(spec), joint) > 0.01
    first_accepted = np.mean([c.stats["acceptance_per_position"][0] for c in spec])
    assert 0.05 < first_accepted < 0.98  # both branches (a child accepted, the residual draw) are exercised


@pytest.mark.slow  # ~70 s; the algorithm does not depend on the target's weights, this checks an int8 one end to end
def test_an_int8_target_samples_losslessly(monkeypatch):
    """The chain case above with the target's matmul weights in int8 (models/quantize.py): its own joint, exactly
    computed from the int8 target, is what speculative sampling draws from."""
    from jaxspec.models.quantize import quantize_target

    quantized = quantize_target(nnx.clone(plain_target()), "int8")
    monkeypatch.setitem(globals(), "plain_target", lambda: quantized)
    test_joint_distribution_and_acceptance_rate(SamplingConfig(2.0, top_p=0.9))
