"""The target model class a config calls for: the Gemma decoder (models/gemma.py: Gemma 2, 3, 4) or the Llama family's
(models/llama.py), both with one interface (tokens, positions, cache → TargetOutput)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

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


def with_aux_layers(model: TargetModel, aux_layer_ids: Sequence[int]) -> TargetModel:
    """The same target returning the features of other layers (`TargetConfig.aux_layer_ids`): a second module over
    the very same weight arrays, nothing copied. Two drafters of one target that read different layers (an EAGLE-3
    head's three, a DFlash drafter's five) each get the target they need."""
    graphdef, state = nnx.split(model)
    view = nnx.merge(graphdef, state)
    view.config = dataclasses.replace(model.config, aux_layer_ids=tuple(aux_layer_ids))
    return view
