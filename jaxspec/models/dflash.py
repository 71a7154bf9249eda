"""The DFlash block drafter in Flax NNX (z-lab, arXiv 2602.06036; BLOCK_DRAFTERS.md §1).

    ctx = hidden_norm(fc(concat(target features)))          the context, [.., n_aux * Ht] -> [.., H]
    x   = embed([root, MASK, ..., MASK])                     the block, B tokens, the target's embedding table
    per layer:  K = [k_norm(k_proj(ctx)); k_norm(k_proj(x))] with RoPE at each token's position, V likewise,
                x += o_proj(attention(q_norm(q_proj(input_layernorm(x))), K, V))   no mask inside the block
                x += mlp(post_attention_layernorm(x))
    drafts = argmax(target.lm_head(norm(x[1:])))             slot k drafts the token k positions after the root

The context's keys and values depend only on the target's features, never on drafts, so the drafter's cache holds
context only: a step writes the features of the tokens the target just verified, and the block's own keys and
values are never stored (nothing to roll back when drafts are rejected). Attribute names follow z-lab's checkpoints
(`layers.{i}.self_attn.q_proj`, `fc`, `hidden_norm`, `norm`), so loading maps keys to parameter paths by name.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxspec.config import DFlashConfig, rope_inv_freq
from jaxspec.models import kv_cache as kvc
from jaxspec.models.layers import apply_rope, attention, rope_cos_sin
from jaxspec.models.llama import MLP, Attention, Linear, RMSNorm
from jaxspec.sharding import cache_kv_heads


class DFlashLayer(nnx.Module):
    def __init__(self, cfg: DFlashConfig, *, dtype, rngs: nnx.Rngs | None):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.self_attn = Attention(cfg, dtype=dtype, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.mlp = MLP(cfg, dtype=dtype, rngs=rngs)

    def context_kv(self, ctx: jax.Array, cos: jax.Array, sin: jax.Array) -> tuple[jax.Array, jax.Array]:
        """The context's keys (k_norm, RoPE) and values [B, T, Hkv, D] in this layer, from ctx [B, T, H]."""
        attn = self.self_attn
        b, t, _ = ctx.shape
        k = attn.k_proj(ctx).reshape(b, t, attn.cfg.num_kv_heads, attn.cfg.head_dim)
        v = attn.v_proj(ctx).reshape(b, t, attn.cfg.num_kv_heads, attn.cfg.head_dim)
        if attn.k_norm is not None:
            k = attn.k_norm(k)
        return apply_rope(k, cos, sin), v

    def __call__(self, x, cos, sin, k_ctx, v_ctx, ctx_mask, block_mask):
        """x [B, T, H] the block tokens; k_ctx, v_ctx [B, Hkv·r, S, D] the context cache; ctx_mask [B, T, S] which of
        its slots each block token sees; block_mask [B, T, T] which block tokens it sees."""
        attn = self.self_attn
        b, t, _ = x.shape
        q, k, v = attn.project(self.input_layernorm(x), cos, sin)  # [B, T, Hq, D], [B, T, Hkv, D] x 2
        k = kvc.repeat_heads(k, k_ctx.shape[1]).transpose(0, 2, 1, 3)  # [B, Hkv·r, T, D]
        v = kvc.repeat_heads(v, v_ctx.shape[1]).transpose(0, 2, 1, 3)
        keys = jnp.concatenate([k_ctx.astype(k.dtype), k], axis=2)  # [B, Hkv·r, S + T, D]
        values = jnp.concatenate([v_ctx.astype(v.dtype), v], axis=2)
        mask = jnp.concatenate([ctx_mask, block_mask], axis=2)  # [B, T, S + T]
        out = attention(q, keys, values, mask).reshape(b, t, attn.cfg.num_heads * attn.cfg.head_dim)
        x = x + attn.o_proj(out)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDrafter(nnx.Module):
    def __init__(self, cfg: DFlashConfig, *, dtype=jnp.float32, rngs: nnx.Rngs | None):
        self.config = cfg
        self.dtype = jnp.dtype(dtype)
        self.fc = Linear(cfg.num_aux * cfg.target_hidden_size, cfg.hidden_size, bias=False, dtype=dtype, rngs=rngs)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.layers = nnx.List([DFlashLayer(cfg, dtype=dtype, rngs=rngs) for _ in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)

    def init_cache(self, batch: int, capacity: int) -> kvc.KVCache:
        """The context cache, empty: one K and one V per layer, KV heads repeated under a wide model axis as the
        target's are (LlamaModel.init_cache)."""
        cfg = self.config
        kv_heads = cache_kv_heads(cfg.num_heads, cfg.num_kv_heads)
        return kvc.init_cache(cfg.num_layers, batch, capacity, kv_heads, cfg.head_dim, self.dtype)

    def _rope(self, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        return rope_cos_sin(positions, jnp.asarray(rope_inv_freq(self.config)))

    def write_context(self, features: jax.Array, positions: jax.Array, cache: kvc.KVCache) -> kvc.KVCache:
        """Write the context of target features [B, T, n_aux * Ht] at `positions` [B, T] into every layer's cache at
        slots lengths + t (not committed: the caller advances the lengths by the entries it keeps)."""
        ctx = self.hidden_norm(self.fc(features.astype(self.dtype)))  # [B, T, H]
        cos, sin = self._rope(positions)
        ks, vs = [], []
        for layer, k_cache, v_cache in zip(self.layers, cache.k, cache.v):
            k, v = layer.context_kv(ctx, cos, sin)
            ks.append(kvc.write_block(k_cache, kvc.repeat_heads(k, k_cache.shape[1]), cache.lengths))
            vs.append(kvc.write_block(v_cache, kvc.repeat_heads(v, v_cache.shape[1]), cache.lengths))
        return cache._replace(k=tuple(ks), v=tuple(vs))

    def __call__(
        self,
        block_emb: jax.Array,  # [B, T, H] the block tokens' embeddings (the target's table)
        positions: jax.Array,  # [B, T] int32
        cache: kvc.KVCache,  # the context
        ctx_mask: jax.Array | None = None,  # [B, T, S] bool; None: every committed slot (< cache.lengths)
        block_mask: jax.Array | None = None,  # [B, T, T] bool; None: the whole block (drafting one block)
    ) -> jax.Array:
        """The block's final states [B, T, H] after `norm` (the target's LM head turns them into logits). Drafting
        runs one block against the committed context; training runs many blocks at once, each seeing the context
        before its anchor and itself (`train.dflash`), through the same layers."""
        b, t, _ = block_emb.shape
        cos, sin = self._rope(positions)
        if ctx_mask is None:
            slots = jnp.arange(cache.capacity)[None, None, :]
            ctx_mask = jnp.broadcast_to(slots < cache.lengths[:, None, None], (b, t, cache.capacity))
        if block_mask is None:
            block_mask = jnp.ones((b, t, t), jnp.bool_)
        x = block_emb.astype(self.dtype)
        for layer, k_cache, v_cache in zip(self.layers, cache.k, cache.v):
            x = layer(x, cos, sin, k_cache, v_cache, ctx_mask, block_mask)
        return self.norm(x)
