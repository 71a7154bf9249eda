"""The target model class a config calls for: Gemma 4's decoder (models/gemma4.py) or the Llama family's
(models/llama.py), both with one interface (tokens, positions, cache → TargetOutput)."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from jaxspec.config import TargetConfig
from jaxspec.models.gemma4 import Gemma4Model
from jaxspec.models.llama import LlamaModel
from jaxspec.models.numerics import Numerics

TargetModel = LlamaModel | Gemma4Model


def target_model(cfg: TargetConfig, *, dtype=jnp.float32, rngs: nnx.Rngs | None,
                 numerics: Numerics | None | str = "default") -> TargetModel:
    """A target of `cfg`'s family; rngs=None builds shapes only (loaders fill every weight)."""
    cls = Gemma4Model if cfg.gemma4 is not None else LlamaModel
    return cls(cfg, dtype=dtype, rngs=rngs, numerics=numerics)
