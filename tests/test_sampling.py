"""Temperature / top-k / top-p filtering and sampling."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from jaxspec.errors import JaxspecError
from jaxspec.sampling import SamplingConfig, filtered_logits, sample
from pallas_kernels.primitives import first_argmax


def reference_filter(logits: np.ndarray, t: float, k: int, p: float) -> np.ndarray:
    """Row by row, the transformers definition: temperature, then top-k, then the smallest top-p nucleus."""
    out = []
    for row in logits / t:
        row = row.copy()
        if k:
            row[row < np.sort(row)[-k]] = -np.inf
        order = np.argsort(-row, kind="stable")
        probs = np.exp(row[order] - row[order][0])
        probs /= probs.sum()
        before = np.cumsum(probs) - probs
        drop = order[before >= p]
        row[drop] = -np.inf
        out.append(row)
    return np.stack(out)


@pytest.mark.parametrize("t, k, p", [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8), (0.5, 10, 0.5), (1.0, 1, 1.0), (2.0, 0, 0.05)])
def test_filter_matches_reference(t, k, p):
    logits = np.random.default_rng(0).normal(size=(4, 50)).astype(np.float32) * 3
    got = np.asarray(filtered_logits(jnp.asarray(logits), SamplingConfig(t, k, p)))
    want = reference_filter(logits, t, k, p)
    np.testing.assert_array_equal(np.isinf(got), np.isinf(want))
    finite = np.isfinite(want)
    np.testing.assert_allclose(got[finite], want[finite], rtol=1e-6)


def test_greedy_is_argmax():
    logits = jnp.asarray(np.random.default_rng(1).normal(size=(3, 20)), jnp.float32)
    np.testing.assert_array_equal(sample(logits, SamplingConfig(), jax.random.key(0)), np.argmax(logits, -1))


@pytest.mark.parametrize("shape", [(1, 49152), (3, 5, 16384), (2, 1), (4, 7)])
def test_first_argmax_is_jnp_argmax(shape):
    """The CPU's two-pass argmax gives jnp.argmax's index bit for bit: random rows (ties made likely by rounding
    to few values), rows with NaN (the first NaN), infinities, all -inf, and signed zeros; jitted and not."""
    x = np.round(np.asarray(jax.random.normal(jax.random.key(len(shape)), shape)) * 2) / 2  # many ties
    x = np.asarray(x, np.float32)
    flat = x.reshape(-1, shape[-1])
    n = shape[-1]
    flat[0, n // 2] = np.nan
    if flat.shape[0] > 1:
        flat[1, :] = -np.inf
    if flat.shape[0] > 2:
        flat[2, :3] = [-0.0, 0.0, -0.0]  # the first zero wins: argmax ties -0.0 with +0.0
        flat[2, 3:] = -1.0
    if flat.shape[0] > 3:
        flat[3, n - 1] = np.inf
        flat[3, 0] = np.inf
        flat[3, n // 2] = np.nan
    x = flat.reshape(shape)
    want = np.asarray(jnp.argmax(x, axis=-1))
    np.testing.assert_array_equal(np.asarray(first_argmax(x)), want)
    np.testing.assert_array_equal(np.asarray(jax.jit(first_argmax)(x)), want)
    assert first_argmax(x).dtype == jnp.int32


def test_samples_follow_the_filtered_distribution():
    logits = np.random.default_rng(2).normal(size=(12,)).astype(np.float32)
    cfg = SamplingConfig(0.8, 8, 0.9)
    n = 20000
    draws = sample(jnp.broadcast_to(jnp.asarray(logits), (n, 12)), cfg, jax.random.key(3))
    probs = np.asarray(jax.nn.softmax(filtered_logits(jnp.asarray(logits), cfg)), np.float64)
    probs /= probs.sum()
    counts = np.bincount(np.asarray(draws), minlength=12)
    assert counts[probs == 0].sum() == 0
    support = probs > 0
    assert stats.chisquare(counts[support], probs[support] * n).pvalue > 0.01


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(temperature=-0.5), "temperature must be a finite number >= 0"),
        (dict(temperature=float("nan")), "temperature must be a finite number >= 0"),
        (dict(temperature=float("inf")), "temperature must be a finite number >= 0"),
        (dict(temperature=1e-38), "temperature 1e-38 is below 1e-05, .* use 0 for greedy"),  # logits / T overflowed
        (dict(top_p=0.0), r"top-p must be in \(0, 1\]"),
        (dict(top_p=1.5), r"top-p must be in \(0, 1\]"),
        (dict(top_k=-1), "top-k must be >= 0"),
    ],
)
def test_invalid_parameters(kwargs, message):
    with pytest.raises(JaxspecError, match=message):
        SamplingConfig(**kwargs)


def test_smallest_temperature_keeps_logits_finite():
    """At the smallest accepted temperature, float32 logits of a real model's range stay finite after the division
    (at 1e-38 they became inf and then NaN, and the text differed from greedy)."""
    from jaxspec.sampling import MIN_TEMPERATURE

    logits = jnp.array([[-3e4, 0.0, 2.5e4]], jnp.float32)
    out = filtered_logits(logits, SamplingConfig(temperature=MIN_TEMPERATURE))
    assert bool(jnp.all(jnp.isfinite(out)))
