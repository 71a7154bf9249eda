"""Temperature, top-k, top-p and min-p (a per-request value, `jaxspec.processors`), shared by target-only and
speculative decoding so both see the same distribution.

Each request has its own settings (`SamplingConfig`, host side). On the device they are per-row arrays
(`RowSampling`, carried in the generation state), so a batch mixes greedy and sampled rows and new values never
recompile: only whether a batch samples at all selects a program (`RowSampling` or None, all greedy). A greedy row
of a sampling batch takes the argmax of the same logits, so its output is the greedy one bit for bit.

Randomness is per row too: each row draws from its own key (`row_keys`: the seed folded with the prompt's index),
never from a batch-wide one, so a seeded request samples the same tokens whatever shares its batch or slot.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.errors import JaxspecError
from jaxspec.processors import min_p_filter
from pallas_kernels.primitives import first_argmax


# The smallest positive temperature: logits / T must stay finite in float32 (|logit| / 1e-5 does up to 3e33), and
# vLLM also treats temperatures under 1e-5 as greedy (its _SAMPLING_EPS). Below it a tiny T turned logits into inf,
# then NaN, and produced other text than greedy.
MIN_TEMPERATURE = 1e-5


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """One request's settings: temperature 0 is greedy; top_k 0 and top_p 1 switch those filters off."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if not self.temperature >= 0 or not math.isfinite(self.temperature):  # also rejects NaN
            raise JaxspecError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature}")
        if 0 < self.temperature < MIN_TEMPERATURE:
            raise JaxspecError(
                f"temperature {self.temperature:g} is below {MIN_TEMPERATURE:g}, where float32 logits divided by it "
                "can overflow to inf (and sampling to NaN); use 0 for greedy decoding"
            )
        if not 0 < self.top_p <= 1:
            raise JaxspecError(f"top-p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise JaxspecError(f"top-k must be >= 0 (0 = off), got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class RowSampling(NamedTuple):
    """Per-row settings of a batch on the device (padding rows greedy)."""

    temperature: jax.Array  # [B] float32, 0: greedy
    top_k: jax.Array  # [B] int32, 0: off
    top_p: jax.Array  # [B] float32, 1: off

    @property
    def sampled(self) -> jax.Array:
        """[B] bool: the rows that sample (the others take the argmax)."""
        return self.temperature > 0


def row_sampling(configs: Sequence[SamplingConfig], batch_size: int, always: bool = False) -> RowSampling | None:
    """Device arrays for one batch (rows past the configs greedy), or None when every row is greedy (the greedy
    programs) unless `always` (continuous batching: one program whoever joins)."""
    if not always and all(c.greedy for c in configs):
        return None
    temperature, top_p = np.zeros((batch_size,), np.float32), np.ones((batch_size,), np.float32)
    top_k = np.zeros((batch_size,), np.int32)
    for i, c in enumerate(configs):
        temperature[i], top_k[i], top_p[i] = c.temperature, c.top_k, c.top_p
    return RowSampling(jnp.asarray(temperature), jnp.asarray(top_k), jnp.asarray(top_p))


def row_keys(seed: int, indices: Sequence[int] | np.ndarray) -> jax.Array:
    """[len(indices)] PRNG keys: row i's is the seed's key folded with its index, so that a prompt's draws depend on
    the seed and its place in the prompt list only (not on the batch size or its batch-mates). Seeds are taken
    modulo 2**32 (what a JAX key holds without x64), so any integer a client sends is one."""
    base = jax.random.key(seed % 2**32)
    return jax.vmap(lambda i: jax.random.fold_in(base, i))(jnp.asarray(indices, jnp.uint32))


def split_rows(keys: jax.Array, n: int) -> jax.Array:
    """[B] keys → [n, B]: n fresh keys per row."""
    return jnp.moveaxis(jax.vmap(lambda k: jax.random.split(k, n))(keys), 1, 0)


def uniform_rows(keys: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """[B, *shape] float32 in [0, 1), row i from keys[i]."""
    return jax.vmap(lambda k: jax.random.uniform(k, shape))(keys)


def exponential_rows(keys: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """[B, *shape] float32 Exp(1) draws, row i from keys[i]."""
    return jax.vmap(lambda k: jax.random.exponential(k, shape, jnp.float32))(keys)


def categorical_rows(keys: jax.Array, logits: jax.Array) -> jax.Array:
    """[B] int32: row i drawn from softmax(logits[i]) ([B, V]) with keys[i]."""
    return jax.vmap(lambda k, x: jax.random.categorical(k, x))(keys, logits).astype(jnp.int32)


def _as_rows(cfg: SamplingConfig | RowSampling | None, batch: int) -> RowSampling | None:
    """Per-row arrays for a batch of `batch` rows; None when everything is greedy."""
    if isinstance(cfg, SamplingConfig):
        if cfg.greedy:
            return None
        full = lambda value, dtype: jnp.full((batch,), value, dtype)  # noqa: E731
        return RowSampling(full(cfg.temperature, jnp.float32), full(cfg.top_k, jnp.int32), full(cfg.top_p, jnp.float32))
    return cfg


def filtered_logits(
    logits: jax.Array, cfg: SamplingConfig | RowSampling | None, min_p: jax.Array | None = None
) -> jax.Array:
    """Apply temperature, then top-k, then top-p, then min-p (the transformers order) to float32 logits [B, ..., V],
    with one setting for every row (SamplingConfig) or each row's (RowSampling; greedy rows get temperature 1, their
    result is never sampled from). min_p [B]: per-row values (`jaxspec.processors`; None is off).

    Filtered-out tokens get -inf, so softmax of the result is the distribution sampling draws from."""
    logits = logits.astype(jnp.float32)
    if logits.ndim == 1:  # one distribution [V]
        return filtered_logits(logits[None], cfg, min_p)[0]
    rows = _as_rows(cfg, logits.shape[0])
    if rows is None:
        return logits

    def per_row(a):  # [B] -> [B, 1, ..., 1]
        return a.reshape(a.shape + (1,) * (logits.ndim - 1))

    logits = logits / per_row(jnp.where(rows.sampled, rows.temperature, 1.0))
    top_k, top_p = per_row(rows.top_k), per_row(rows.top_p)

    def filter_sorted(x):  # top-k, then the smallest top-p nucleus, from one descending sort
        ranked = jnp.sort(x, axis=-1)[..., ::-1]
        index = jnp.clip(top_k - 1, 0, x.shape[-1] - 1)
        kth = jnp.take_along_axis(ranked, jnp.broadcast_to(index, x.shape[:-1] + (1,)), axis=-1)  # [B, ..., 1]
        x = jnp.where((top_k > 0) & (x < kth), -jnp.inf, x)
        ranked = jnp.where((top_k > 0) & (ranked < kth), -jnp.inf, ranked)
        probs = jax.nn.softmax(ranked, axis=-1)
        keep = jnp.cumsum(probs, axis=-1) - probs < top_p  # always keeps the most likely token
        threshold = jnp.min(jnp.where(keep, ranked, jnp.inf), axis=-1, keepdims=True)
        return jnp.where((top_p < 1) & (x < threshold), -jnp.inf, x)

    # the sort only when some row asks for top-k or top-p
    logits = jax.lax.cond(jnp.any(rows.top_k > 0) | jnp.any(rows.top_p < 1), filter_sorted, lambda x: x, logits)
    if min_p is not None:
        logits = min_p_filter(logits, min_p)
    return logits


def sample(
    logits: jax.Array, cfg: SamplingConfig | RowSampling | None, keys: jax.Array, min_p: jax.Array | None = None
) -> jax.Array:
    """One token per row from logits [B, V] → [B] int32: the argmax for greedy rows, a draw with the row's own key
    (keys [B]; one key is split over the rows) for the others."""
    greedy = first_argmax(logits)  # jnp.argmax's index, faster on CPU
    rows = _as_rows(cfg, logits.shape[0])
    if rows is None:
        return greedy
    if keys.ndim == 0:
        keys = jax.random.split(keys, logits.shape[0])

    def draw():
        return jnp.where(rows.sampled, categorical_rows(keys, filtered_logits(logits, rows, min_p)), greedy)

    return jax.lax.cond(jnp.any(rows.sampled), draw, lambda: greedy)


def draw_draft(
    logits: jax.Array, argmax: jax.Array, rows: RowSampling, keys: jax.Array, min_p: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
    """A drafter's token per row from its logits [B, V'] and what it was drawn from: (token [B], a column of the
    logits; q [B, V'] float32). Rows that sample draw from their filtered distribution (q: that distribution);
    greedy rows keep `argmax` ([B]), with q = 0 — their acceptance is the greedy rule, which never reads q."""

    def draw():
        filtered = filtered_logits(logits, rows, min_p)
        q = jnp.where(rows.sampled[:, None], jax.nn.softmax(filtered, axis=-1), 0.0)
        return jnp.where(rows.sampled, categorical_rows(keys, filtered), argmax), q

    return jax.lax.cond(jnp.any(rows.sampled), draw, lambda: (argmax, jnp.zeros(logits.shape, jnp.float32)))
