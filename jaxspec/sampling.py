"""Temperature, top-k, top-p and min-p (a per-request value, `jaxspec.processors`), shared by target-only and
speculative decoding so both see the same distribution."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from jaxspec.errors import JaxspecError
from jaxspec.processors import min_p_filter


# The smallest positive temperature: logits / T must stay finite in float32 (|logit| / 1e-5 does up to 3e33), and
# vLLM also treats temperatures under 1e-5 as greedy (its _SAMPLING_EPS). Below it a tiny T turned logits into inf,
# then NaN, and produced other text than greedy.
MIN_TEMPERATURE = 1e-5


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """temperature 0 is greedy; top_k 0 and top_p 1 switch those filters off. Static under jit (hashable)."""

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


def filtered_logits(logits: jax.Array, cfg: SamplingConfig, min_p: jax.Array | None = None) -> jax.Array:
    """Apply temperature, then top-k, then top-p, then min-p (the transformers order) to float32 logits [B, ..., V].
    min_p [B]: per-row values (`jaxspec.processors`; None is off).

    Filtered-out tokens get -inf, so softmax of the result is the distribution sampling draws from.
    """
    logits = logits.astype(jnp.float32)
    if cfg.greedy:
        return logits
    logits = logits / cfg.temperature
    vocab = logits.shape[-1]
    if 0 < cfg.top_k < vocab:
        kth = jax.lax.top_k(logits, cfg.top_k)[0][..., -1:]  # [..., 1]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if cfg.top_p < 1.0:
        sorted_logits = jnp.sort(logits, axis=-1)[..., ::-1]  # descending
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        mass_before = jnp.cumsum(probs, axis=-1) - probs
        keep = mass_before < cfg.top_p  # always keeps the most likely token
        threshold = jnp.min(jnp.where(keep, sorted_logits, jnp.inf), axis=-1, keepdims=True)
        logits = jnp.where(logits < threshold, -jnp.inf, logits)
    if min_p is not None:
        logits = min_p_filter(logits, min_p)
    return logits


def sample(logits: jax.Array, cfg: SamplingConfig, key: jax.Array, min_p: jax.Array | None = None) -> jax.Array:
    """One token per row from logits [B, V] → [B] int32 (argmax when greedy)."""
    if cfg.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return jax.random.categorical(key, filtered_logits(logits, cfg, min_p), axis=-1).astype(jnp.int32)
