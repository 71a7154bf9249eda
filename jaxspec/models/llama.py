"""The Llama-family target model in Flax NNX (Llama 2/3.x, SmolLM2, Qwen2/2.5, Qwen3, Mistral).

Decoder layers keep their weights stacked on a leading layer axis and run under `lax.scan`, so a 32-layer model
compiles one layer body. A forward takes an explicit KV cache and returns a new one; besides logits it returns the
EAGLE-3 auxiliary features: Hugging Face `hidden_states[l]` (the residual stream entering layer l) at
`config.aux_layer_ids`, concatenated to [B, T, n_aux * H].
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jaxspec.config import TargetConfig, rope_inv_freq
from jaxspec.models import kv_cache as kvc
from jaxspec.models.layers import apply_rope, attention, linear, rms_norm, rope_cos_sin, swiglu

# Per-layer weights in the stacked DecoderStack: name → (shape without the layer axis, initializer kind).
_LAYER_WEIGHTS = ("input_norm", "q_proj", "k_proj", "v_proj", "o_proj", "post_norm", "gate_proj", "up_proj", "down_proj")
_OPTIONAL_WEIGHTS = ("q_bias", "k_bias", "v_bias", "o_bias", "q_norm", "k_norm", "gate_bias", "up_bias", "down_bias")


def layer_weight_shapes(cfg: TargetConfig) -> dict[str, tuple[int, ...]]:
    """Shapes (without the layer axis) of every weight a decoder layer of this config has."""
    h, d, i = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    nq, nkv = cfg.num_heads * d, cfg.num_kv_heads * d
    shapes = {
        "input_norm": (h,),
        "q_proj": (nq, h),
        "k_proj": (nkv, h),
        "v_proj": (nkv, h),
        "o_proj": (h, nq),
        "post_norm": (h,),
        "gate_proj": (i, h),
        "up_proj": (i, h),
        "down_proj": (h, i),
    }
    if cfg.attention_bias:
        shapes.update(q_bias=(nq,), k_bias=(nkv,), v_bias=(nkv,))
    if cfg.o_proj_bias:
        shapes["o_bias"] = (h,)
    if cfg.qk_norm:
        shapes.update(q_norm=(d,), k_norm=(d,))
    if cfg.mlp_bias:
        shapes.update(gate_bias=(i,), up_bias=(i,), down_bias=(h,))
    return shapes


def _init(rngs: nnx.Rngs, name: str, shape: tuple[int, ...], dtype) -> jax.Array:
    if name.endswith("norm"):
        return jnp.ones(shape, dtype)
    if name.endswith("bias"):
        return jnp.zeros(shape, dtype)
    return (0.02 * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)


class DecoderStack(nnx.Module):
    """All decoder layers, each weight stacked to [num_layers, ...]."""

    def __init__(self, cfg: TargetConfig, *, dtype, rngs: nnx.Rngs):
        for name, shape in layer_weight_shapes(cfg).items():
            setattr(self, name, nnx.Param(_init(rngs, name, (cfg.num_layers, *shape), dtype)))

    def arrays(self) -> dict[str, jax.Array]:
        return {
            name: getattr(self, name)[...]
            for name in _LAYER_WEIGHTS + _OPTIONAL_WEIGHTS
            if getattr(self, name, None) is not None
        }


class TargetOutput(NamedTuple):
    logits: jax.Array  # [B, T or n, vocab] float32
    aux: jax.Array | None  # [B, T, n_aux * hidden] in the model dtype, or None
    cache: kvc.KVCache


def decoder_layer(
    cfg: TargetConfig,
    p: dict[str, jax.Array],
    x: jax.Array,  # [B, T, H]
    cos: jax.Array,  # [B, T, D]
    sin: jax.Array,  # [B, T, D]
    k_cache: jax.Array,  # [B, S, Hkv, D] this layer's cache
    v_cache: jax.Array,
    lengths: jax.Array,  # [B]
    mask: jax.Array,  # [B, T, S]
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One pre-norm decoder layer; returns (x_out, k_cache, v_cache) with the new tokens' K/V written."""
    b, t, _ = x.shape
    d, eps = cfg.head_dim, cfg.rms_norm_eps
    h = rms_norm(x, p["input_norm"], eps)
    q = linear(h, p["q_proj"], p.get("q_bias")).reshape(b, t, cfg.num_heads, d)
    k = linear(h, p["k_proj"], p.get("k_bias")).reshape(b, t, cfg.num_kv_heads, d)
    v = linear(h, p["v_proj"], p.get("v_bias")).reshape(b, t, cfg.num_kv_heads, d)
    if cfg.qk_norm:
        q = rms_norm(q, p["q_norm"], eps)
        k = rms_norm(k, p["k_norm"], eps)
    q = apply_rope(q, cos, sin)
    k = apply_rope(k, cos, sin)
    k_cache = kvc.write_block(k_cache, k, lengths)
    v_cache = kvc.write_block(v_cache, v, lengths)
    attn = attention(q, k_cache, v_cache, mask).reshape(b, t, cfg.num_heads * d)
    x = x + linear(attn, p["o_proj"], p.get("o_bias"))
    h = rms_norm(x, p["post_norm"], eps)
    x = x + swiglu(h, p["gate_proj"], p["up_proj"], p["down_proj"], (p.get("gate_bias"), p.get("up_bias"), p.get("down_bias")))
    return x, k_cache, v_cache


class LlamaModel(nnx.Module):
    """Token ids → logits and EAGLE-3 features, through an explicit KV cache."""

    def __init__(self, cfg: TargetConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.config = cfg
        self.dtype = jnp.dtype(dtype)
        self.embed = nnx.Param(_init(rngs, "embed", (cfg.vocab_size, cfg.hidden_size), dtype))
        self.layers = DecoderStack(cfg, dtype=dtype, rngs=rngs)
        self.norm = nnx.Param(jnp.ones((cfg.hidden_size,), dtype))
        self.lm_head = nnx.data(
            None
            if cfg.tie_word_embeddings
            else nnx.Param(_init(rngs, "lm_head", (cfg.vocab_size, cfg.hidden_size), dtype))
        )

    def init_cache(self, batch: int, capacity: int) -> kvc.KVCache:
        cfg = self.config
        return kvc.init_cache(cfg.num_layers, batch, capacity, cfg.num_kv_heads, cfg.head_dim, self.dtype)

    def embed_tokens(self, tokens: jax.Array) -> jax.Array:
        return jnp.take(self.embed[...], tokens, axis=0)

    def logits(self, hidden: jax.Array) -> jax.Array:
        """Final norm and LM head on pre-norm hidden states [..., H] → float32 logits [..., V]."""
        h = rms_norm(hidden, self.norm[...], self.config.rms_norm_eps)
        head = self.embed[...] if self.lm_head is None else self.lm_head[...]
        return linear(h, head).astype(jnp.float32)

    def __call__(
        self,
        tokens: jax.Array,  # [B, T] int32
        positions: jax.Array,  # [B, T] int32
        cache: kvc.KVCache,
        *,
        block_mask: jax.Array | None = None,  # [B, T, T] bool among the new tokens; None = causal
        logit_indices: jax.Array | None = None,  # [B, n] which of the T positions get logits; None = all
        return_aux: bool = False,
    ) -> TargetOutput:
        cfg = self.config
        b, t = tokens.shape
        if block_mask is None:
            block_mask = kvc.causal_block_mask(b, t)
        mask = kvc.block_attention_mask(cache.lengths, cache.capacity, block_mask)  # [B, T, S]
        cos, sin = rope_cos_sin(positions, jnp.asarray(rope_inv_freq(cfg)))
        x = self.embed_tokens(tokens).astype(self.dtype)  # [B, T, H]
        aux_ids = jnp.asarray(cfg.aux_layer_ids, jnp.int32)
        aux0 = jnp.zeros((len(cfg.aux_layer_ids), b, t, cfg.hidden_size), self.dtype) if return_aux else None

        def body(carry, layer):
            x, k_all, v_all, aux = carry
            p, index = layer
            if return_aux:  # hidden_states[index] is this layer's input
                aux = jnp.where((aux_ids == index)[:, None, None, None], x[None], aux)
            k_l = jax.lax.dynamic_index_in_dim(k_all, index, 0, keepdims=False)
            v_l = jax.lax.dynamic_index_in_dim(v_all, index, 0, keepdims=False)
            x, k_l, v_l = decoder_layer(cfg, p, x, cos, sin, k_l, v_l, cache.lengths, mask)
            k_all = jax.lax.dynamic_update_index_in_dim(k_all, k_l, index, 0)
            v_all = jax.lax.dynamic_update_index_in_dim(v_all, v_l, index, 0)
            return (x, k_all, v_all, aux), None

        layers = (self.layers.arrays(), jnp.arange(cfg.num_layers, dtype=jnp.int32))
        (x, k_all, v_all, aux), _ = jax.lax.scan(body, (x, cache.k, cache.v, aux0), layers)
        if logit_indices is not None:
            x = jnp.take_along_axis(x, logit_indices[:, :, None], axis=1)  # [B, n, H]
        if return_aux:
            aux = jnp.moveaxis(aux, 0, 2).reshape(b, t, -1)  # [B, T, n_aux * H]
        return TargetOutput(self.logits(x), aux, cache._replace(k=k_all, v=v_all))
