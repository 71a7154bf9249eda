"""The target model class a config calls for: the Gemma decoder (models/gemma.py: Gemma 2, 3, 4) or the Llama family's
(models/llama.py), both with one interface (tokens, positions, cache → TargetOutput)."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from jaxspec.config import TargetConfig
from jaxspec.models.gemma import GemmaModel
from jaxspec.models.llama import LlamaModel
from jaxspec.models.numerics import Numerics

TargetModel = LlamaModel | GemmaModel


def target_model(cfg: TargetConfig, *, dtype=jnp.float32, rngs: nnx.Rngs | None,
                 numerics: Numerics | None | str = "default") -> TargetModel:
    """A target of `cfg`'s family; rngs=None builds shapes only (loaders fill every weight)."""
    cls = GemmaModel if cfg.gemma is not None else LlamaModel
    return cls(cfg, dtype=dtype, rngs=rngs, numerics=numerics)
