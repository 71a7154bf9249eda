"""The EAGLE-3 draft head in Flax NNX (DESIGN_NOTES §1).

    f = fc(features)                                  features = concat(h[a], h[b], h[c]) of the target, [.., 3Ht]
    u = concat(input_layernorm(embed(x)), hidden_norm(s))          [.., 2H], s = f at the first step
    y = r + o_proj(attention(u))                      r = s, or hidden_norm(s) when norm_before_residual
    o = y + mlp(post_attention_layernorm(y))
    o = decoder_layer_i(o)   i = 1 .. num_layers - 1  plain Llama layers (multi-layer heads, BLOCK_DRAFTERS §4)
    logits = lm_head(norm(o))                         over the draft vocabulary; target id = i + d2t[i]
    s' = o, or norm(o) with norm_output (EAGLE 3.1)   the next step's state

The embedding table is the target's (frozen) unless the checkpoint ships its own. Attribute names follow the
checkpoints (`midlayer.self_attn.q_proj` ...), so that loading maps keys to parameter paths by name; the layers
after the first are `later_layers.{i-1}`, stored as `layers.{i}` (checkpoints/heads.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxspec.config import HeadConfig, rope_inv_freq
from jaxspec.models import kv_cache as kvc
from jaxspec.models.layers import rope_cos_sin
from jaxspec.models.llama import MLP, Attention, DecoderLayer, Linear, RMSNorm
from jaxspec.models.numerics import normal_weight
from jaxspec.sharding import cache_kv_heads


class Buffer(nnx.Variable):
    """A non-trainable array saved with the head (the d2t vocabulary map)."""


class Eagle3Layer(nnx.Module):
    def __init__(self, cfg: HeadConfig, *, dtype, rngs: nnx.Rngs | None):
        h = cfg.hidden_size
        self.cfg = cfg
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps, dtype=dtype)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps, dtype=dtype)
        self.self_attn = Attention(cfg, dtype=dtype, rngs=rngs, d_in=2 * h)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps, dtype=dtype)
        self.mlp = MLP(cfg, dtype=dtype, rngs=rngs)

    def __call__(self, emb, state, cos, sin, k_cache, v_cache, lengths, mask, write_offset=0, empty_cache=False,
                 positions=None):
        u, residual = self.attention_input(emb, state)
        attn, k_cache, v_cache = self.self_attn(
            u, cos, sin, k_cache, v_cache, lengths, mask, write_offset, empty_cache, positions=positions
        )
        return self.finish(residual, attn), k_cache, v_cache

    def attention_input(self, emb: jax.Array, state: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(u [B, T, 2H] that attention reads, the residual stream [B, T, H]) from the token embeddings and the state.
        The training-time test (`train.ttt`) runs the layer as attention_input → self_attn.project → its own
        attention → self_attn.o_proj → finish, so that training and drafting share this code."""
        normed_state = self.hidden_norm(state)
        u = jnp.concatenate([self.input_layernorm(emb), normed_state], axis=-1)  # [B, T, 2H]
        return u, (normed_state if self.cfg.norm_before_residual else state)

    def finish(self, residual: jax.Array, attn: jax.Array) -> jax.Array:
        """The layer's output (the next state) [B, T, H] from the residual and attention's o_proj output."""
        y = residual + attn
        return y + self.mlp(self.post_attention_layernorm(y))


class Eagle3Head(nnx.Module):
    def __init__(self, cfg: HeadConfig, *, dtype=jnp.float32, rngs: nnx.Rngs | None):
        h, n_feat = cfg.hidden_size, cfg.num_aux * cfg.target_hidden_size
        self.config = cfg
        self.dtype = jnp.dtype(dtype)
        self.input_norm = nnx.data(RMSNorm(n_feat, cfg.rms_norm_eps, dtype=dtype) if cfg.norm_before_fc else None)
        self.fc_norm = nnx.data(
            nnx.List([RMSNorm(cfg.target_hidden_size, cfg.rms_norm_eps, dtype=dtype) for _ in range(cfg.num_aux)])
            if cfg.fc_norm
            else None
        )
        self.fc = Linear(n_feat, h, bias=False, dtype=dtype, rngs=rngs)
        self.embed_tokens = nnx.data(
            nnx.Param(normal_weight(rngs, (cfg.vocab_size, h), dtype)) if cfg.has_embed_tokens else None
        )
        self.midlayer = Eagle3Layer(cfg, dtype=dtype, rngs=rngs)
        self.later_layers = nnx.List([DecoderLayer(cfg, dtype=dtype, rngs=rngs) for _ in range(cfg.num_layers - 1)])
        self.norm = RMSNorm(h, cfg.rms_norm_eps, dtype=dtype)
        self.lm_head = Linear(h, cfg.draft_vocab_size, bias=False, dtype=dtype, rngs=rngs)
        self.d2t = Buffer(jnp.zeros((cfg.draft_vocab_size,), jnp.int32))  # target id = draft id + d2t[draft id]
        # P-EAGLE: the features whose projection is the state of every parallel-drafting slot [1, n_aux·Ht]
        self.mask_hidden = nnx.data(
            nnx.Param(normal_weight(rngs, (1, n_feat), dtype)) if cfg.mask_token_id is not None else None
        )

    def init_cache(self, batch: int, capacity: int) -> kvc.KVCache:
        """An empty cache of the head's layers, KV heads repeated under a wide model axis as the target's are."""
        cfg = self.config
        kv_heads = cache_kv_heads(cfg.num_heads, cfg.num_kv_heads)
        return kvc.init_cache(cfg.num_layers, batch, capacity, kv_heads, cfg.head_dim, self.dtype)

    def project(self, features: jax.Array) -> jax.Array:
        """Target features [B, T, n_aux * Ht] → the first step's state [B, T, H]."""
        x = features.astype(self.dtype)
        if self.fc_norm is not None:
            chunks = jnp.split(x, self.config.num_aux, axis=-1)
            x = jnp.concatenate([norm(c) for norm, c in zip(self.fc_norm, chunks)], axis=-1)
        if self.input_norm is not None:
            x = self.input_norm(x)
        return self.fc(x)

    def logits(self, out: jax.Array) -> jax.Array:
        """Draft logits [.., V_d] float32 of the last layer's output [.., H]."""
        return self.lm_head(self.norm(out)).astype(jnp.float32)

    def next_state(self, out: jax.Array) -> jax.Array:
        """The state the next draft step reads, from the last layer's output [.., H]: the output itself, or with
        EAGLE 3.1's `norm_output` the normed output the lm_head reads."""
        return self.norm(out) if self.config.norm_output else out

    def to_target_ids(self, draft_ids: jax.Array) -> jax.Array:
        return draft_ids + self.d2t[...][draft_ids]

    def __call__(
        self,
        tokens: jax.Array,  # [B, T] int32 target ids
        state: jax.Array,  # [B, T, H]
        positions: jax.Array,  # [B, T] int32
        cache: kvc.KVCache,  # one entry per layer (init_cache)
        embed_table: jax.Array | None,  # [V, H] the target's embeddings, when the head has none
        *,
        block_mask: jax.Array | None = None,  # [B, T, W] over the uncommitted slots from cache.lengths; None = causal
        logit_indices: jax.Array | None = None,  # [B, n] positions that get logits; None = all
        write_offset: int | jax.Array = 0,  # new entries go to slots lengths + write_offset + t (tree levels)
        empty_cache: bool = False,  # nothing committed yet (prefill)
    ) -> tuple[jax.Array, jax.Array, kvc.KVCache]:
        """→ (draft logits [B, T or n, V_d] float32, the next step's state [B, T, H] (`next_state`), cache).

        A tree level passes write_offset = where its entries start in the window and a block_mask over the whole
        window (W slots: the earlier levels' entries and its own), so each node sees exactly its ancestors."""
        b, t = tokens.shape
        table = self.embed_tokens[...] if self.embed_tokens is not None else embed_table
        emb = jnp.take(table, tokens, axis=0).astype(self.dtype)
        # a causal call writes token t at slot lengths + t, which is its position: the slots a row attention reads
        slots = positions if block_mask is None and isinstance(write_offset, int) and write_offset == 0 else None
        if block_mask is None:
            block_mask = kvc.causal_block_mask(b, t)
        cos, sin = rope_cos_sin(positions, jnp.asarray(rope_inv_freq(self.config)))
        out, k, v = self.midlayer(
            emb, state.astype(self.dtype), cos, sin, cache.k[0], cache.v[0], cache.lengths, block_mask, write_offset,
            empty_cache, positions=slots,
        )
        ks, vs = [k], [v]
        for i, layer in enumerate(self.later_layers, start=1):
            out, k, v = layer(
                out, cos, sin, cache.k[i], cache.v[i], cache.lengths, block_mask, empty_cache, positions=slots,
                write_offset=write_offset,
            )
            ks.append(k)
            vs.append(v)
        picked = out if logit_indices is None else jnp.take_along_axis(out, logit_indices[:, :, None], axis=1)
        logits = self.logits(picked)
        return logits, self.next_state(out), cache._replace(k=tuple(ks), v=tuple(vs))
