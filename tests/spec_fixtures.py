"""Tiny targets for speculative-engine tests, and heads fitted to them (cached per process)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from fit_head import fit_head, head_config_for
from flax import nnx

from jaxspec.config import TargetConfig
from jaxspec.models.eagle3 import Eagle3Head
from jaxspec.models.llama import LlamaModel

PROMPTS = [[5, 17, 3, 9], [44, 2, 61, 8, 19, 23, 7, 1, 90, 12, 4], [33], [70, 71, 72, 73, 74, 75]]


@functools.cache
def tiny_target(
    vocab: int = 101, embed_scale: float = 20.0, logit_scale: float = 1.0, seed: int = 0, context: int = 2048
) -> LlamaModel:
    """A random 4-layer target whose embeddings dominate its residual stream, so that its next token depends mostly
    on the current one: predictable enough for a briefly fitted head to reach multi-token acceptance.
    `logit_scale` sharpens its distributions for sampling tests (random weights give near-uniform ones). `context`
    (the context length) does not change the weights."""
    cfg = TargetConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16,
        max_position_embeddings=context,
    )
    model = LlamaModel(cfg, rngs=nnx.Rngs(seed))
    model.embed_tokens.set_value(model.embed_tokens[...] * embed_scale)
    model.lm_head.kernel.set_value(model.lm_head.kernel[...] * logit_scale)
    return model


@functools.cache
def fitted_head(vocab: int = 101, embed_scale: float = 20.0, logit_scale: float = 1.0) -> Eagle3Head:
    return fit_head(tiny_target(vocab, embed_scale, logit_scale), steps=400)


@functools.cache
def random_head(vocab: int = 101) -> Eagle3Head:
    return Eagle3Head(head_config_for(tiny_target(vocab)), rngs=nnx.Rngs(7))


@functools.cache
def fitted_drafter(vocab: int = 101, embed_scale: float = 20.0, logit_scale: float = 1.0):
    """A DFlash drafter (blocks of 4) fitted to `tiny_target` with the training objective."""
    from fit_head import fit_dflash

    return fit_dflash(tiny_target(vocab, embed_scale, logit_scale), steps=120)  # ~10 s; accepts ~3.2 of 4 at K=3


@functools.cache
def random_drafter(vocab: int = 101):
    from fit_head import dflash_config_for

    from jaxspec.models.dflash import DFlashDrafter

    return DFlashDrafter(dflash_config_for(tiny_target(vocab)), rngs=nnx.Rngs(7))


def in_dtype(module, dtype):
    """The same weights in another dtype, held as a loaded model holds them (a fresh skeleton filled with the cast
    parameters; buffers such as a head's d2t keep the skeleton's: identity for a full draft vocabulary)."""
    from jaxspec.models.numerics import hold

    out = type(module)(module.config, dtype=dtype, rngs=None)
    nnx.update(out, jax.tree.map(lambda x: hold(x, dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x,
                                 nnx.state(module, nnx.Param)))
    return out
