"""Gemma 4's assistant drafter (transformers' Gemma4AssistantForCausalLM, e.g. google/gemma-4-e2b-it-assistant) in
Flax NNX: a small Gemma 4 decoder with no KV cache of its own. Each draft step reads

    x = pre_projection(concat(target_embed(token), state))      state: the target's final (normed) hidden state
                                                                  first, then the assistant's post_projection output
and runs its layers at one fixed position (the root's) with queries only: every layer attends, without a causal
mask, to the TARGET's keys and values — those of the target's last sliding layer for a sliding layer (the last
`sliding_window` committed positions), of its last full layer for a full layer (all committed positions) — which the
engine hands the proposer as a view of the target's cache. Then the final norm and the LM head give the draft
token, and post_projection(normed output) the next step's state. The LM head is the assistant's own (tied) table,
or, with `use_ordered_embeddings`, the centroid-clustered head: the `centroid_intermediate_top_k` best of
`num_centroids` clusters of the vocabulary (`token_ordering`) are scored, every other token is below them.

Why it is worth a proposer: it reuses the target's cache (the MTP-style draft interface), so a draft step costs a
few narrow layers and no cache writes. Drafts only change speed, so everything here runs with XLA's plain numerics.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from jaxspec.config import TargetConfig, gemma_inv_freq
from jaxspec.errors import JaxspecError
from jaxspec.models.gemma import GemmaMLP, Norm
from jaxspec.models.layers import NEG_INF, apply_rope, group_queries, rope_cos_sin, ungroup_queries
from jaxspec.models.llama import Linear
from jaxspec.models.numerics import held_dtype, normal_weight


@dataclasses.dataclass(frozen=True)
class AssistantConfig:
    """A Gemma4AssistantConfig: its text decoder (a Gemma 4 layout whose layers all read shared keys and values) and
    how it meets its target."""

    text: TargetConfig  # the assistant's decoder (hidden size, heads, layer types, head sizes, RoPE, MLP widths)
    backbone_hidden_size: int  # the target's hidden size (its embedding and hidden state enter pre_projection)
    use_ordered_embeddings: bool = False  # the centroid-clustered LM head
    num_centroids: int = 2048
    centroid_top_k: int = 32


def target_cache_layers(target: TargetConfig) -> dict[str, int]:
    """Layer type → the index, in the target's cache, of the target layer whose keys and values the assistant's
    layers of that type read: the last layer of that type that computes them (transformers' `store` layers)."""
    layers = target.gemma.cache_layers
    out = {}
    for kind in ("sliding_attention", "full_attention"):
        producers = [n for n, i in enumerate(layers) if target.gemma.layer_types[i] == kind]
        if not producers:
            raise JaxspecError(f"the target has no {kind} layer whose keys and values a Gemma 4 assistant could read")
        out[kind] = producers[-1]
    return out


class AssistantAttention(nnx.Module):
    """Queries only: q_proj, q_norm, o_proj; keys and values come from the target's cache."""

    def __init__(self, text: TargetConfig, layer: int, *, dtype, rngs: nnx.Rngs | None):
        g = text.gemma
        self.sliding = g.sliding(layer)
        self.head_dim = text.head_dim if self.sliding else g.full_head_dim
        self.num_heads = text.num_heads
        self.window = g.sliding_window if self.sliding else None
        d = self.head_dim
        self.q_proj = Linear(text.hidden_size, text.num_heads * d, bias=False, dtype=dtype, rngs=rngs)
        self.q_norm = Norm(d, text.rms_norm_eps, dtype=dtype)
        self.o_proj = Linear(text.num_heads * d, text.hidden_size, bias=False, dtype=dtype, rngs=rngs)

    def __call__(self, x, cos, sin, k_cache, v_cache, committed):
        """x [B, T, H]; k/v_cache [B, Hkv·r, S, D] the target's; committed [B]: the slots holding keys (all of them
        for a full layer, the last window + 1 for a sliding one), seen by every query. → [B, T, H]."""
        b, t, _ = x.shape
        q = apply_rope(self.q_norm(self.q_proj(x).reshape(b, t, self.num_heads, self.head_dim)), cos, sin)
        hkv, s = k_cache.shape[1], k_cache.shape[2]
        slots = jnp.arange(s)[None, :]  # [1, S]
        visible = slots < committed[:, None]  # [B, S]
        if self.window is not None:  # transformers' bidirectional window (|q - kv| <= window, flipped to the
            # past: create_attention_masks) sees the last window + 1 keys, one more than the target's causal layer
            visible &= slots >= committed[:, None] - self.window - 1
        qg = group_queries(q, hkv).astype(jnp.float32)  # [B, Hkv, G·T, D]
        scores = jnp.einsum("bkqd,bksd->bkqs", qg, k_cache.astype(jnp.float32))  # scale 1.0 (q and k are normed)
        scores = jnp.where(visible[:, None, None, :], scores, NEG_INF)
        probs = jax.nn.softmax(scores, axis=-1).astype(v_cache.dtype).astype(jnp.float32)
        out = jnp.einsum("bkqs,bksd->bkqd", probs, v_cache.astype(jnp.float32))
        out = ungroup_queries(out, self.num_heads).astype(x.dtype)  # [B, T, Hq, D]
        return self.o_proj(out.reshape(b, t, self.num_heads * self.head_dim))


class AssistantLayer(nnx.Module):
    def __init__(self, text: TargetConfig, layer: int, *, dtype, rngs: nnx.Rngs | None):
        h, eps = text.hidden_size, text.rms_norm_eps
        self.self_attn = AssistantAttention(text, layer, dtype=dtype, rngs=rngs)
        self.mlp = GemmaMLP(h, text.gemma.mlp_widths[layer], dtype=dtype, rngs=rngs)
        for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):
            setattr(self, name, Norm(h, eps, dtype=dtype))
        self.layer_scalar = nnx.Param(jnp.ones((1,), held_dtype(dtype)))

    def __call__(self, x, cos, sin, k_cache, v_cache, committed):
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, k_cache, v_cache,
                                                             committed))
        x = x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        return x * self.layer_scalar[...].astype(x.dtype)


class MaskedEmbedder(nnx.Module):
    """The centroid-clustered LM head: `centroids` [H, C] scores the clusters, `token_ordering` [V] lists the
    vocabulary cluster by cluster (V / C tokens each)."""

    def __init__(self, cfg: AssistantConfig, *, dtype, rngs: nnx.Rngs | None):
        h = cfg.text.hidden_size
        self.centroids = Linear(h, cfg.num_centroids, bias=False, dtype=dtype, rngs=rngs)
        self.token_ordering = nnx.Param(jnp.arange(cfg.text.vocab_size, dtype=jnp.int32))
        self.top_k = cfg.centroid_top_k
        self.num_centroids = cfg.num_centroids

    def __call__(self, x: jax.Array, table: jax.Array) -> jax.Array:
        """x [B, T, H] normed, table [V, H] → logits [B, T, V]: the top-k clusters' tokens scored against the table,
        every other token below the lowest of them (transformers fills them with that minimum − 1)."""
        b, t, _ = x.shape
        v = table.shape[0]
        _, top = jax.lax.top_k(self.centroids(x), self.top_k)  # [B, T, k]
        clusters = self.token_ordering[...].reshape(self.num_centroids, v // self.num_centroids)
        chosen = clusters[top].reshape(b, t, -1)  # [B, T, k·V/C] token ids
        scores = jnp.einsum("bth,btnh->btn", x, table[chosen].astype(x.dtype))
        floor = jnp.min(scores, axis=-1, keepdims=True) - 1.0
        out = jnp.broadcast_to(floor, (b, t, v))
        rows = jnp.arange(b)[:, None, None], jnp.arange(t)[None, :, None]
        return out.at[rows[0], rows[1], chosen].set(scores)


class Gemma4Assistant(nnx.Module):
    """The assistant's weights under transformers' names (`model.layers.{i}...`, `pre_projection`,
    `post_projection`, `masked_embedding.*`) and one draft step (`__call__`)."""

    def __init__(self, cfg: AssistantConfig, *, dtype=jnp.float32, rngs: nnx.Rngs | None):
        text = cfg.text
        self.config = cfg
        self.dtype = jnp.dtype(dtype)
        self.embed_tokens = nnx.Param(normal_weight(rngs, (text.vocab_size, text.hidden_size), dtype))  # tied head
        self.layers = nnx.List([AssistantLayer(text, i, dtype=dtype, rngs=rngs) for i in range(text.num_layers)])
        self.norm = Norm(text.hidden_size, text.rms_norm_eps, dtype=dtype)
        self.pre_projection = Linear(2 * cfg.backbone_hidden_size, text.hidden_size, bias=False, dtype=dtype,
                                     rngs=rngs)
        self.post_projection = Linear(text.hidden_size, cfg.backbone_hidden_size, bias=False, dtype=dtype, rngs=rngs)
        self.masked_embedding = nnx.data(MaskedEmbedder(cfg, dtype=dtype, rngs=rngs)
                                         if cfg.use_ordered_embeddings else None)

    def __call__(self, inputs: jax.Array, positions: jax.Array, cache_k: dict[str, jax.Array],
                 cache_v: dict[str, jax.Array], committed: jax.Array) -> tuple[jax.Array, jax.Array]:
        """inputs [B, T, 2·Hb] (the target's embedding of the token, then the state), positions [B, T]; cache_k/v:
        layer type → the target's [B, Hkv·r, S, D] keys / values; committed [B]. → (logits [B, T, V] float32, the
        next state [B, T, Hb])."""
        text = self.config.text
        g = text.gemma
        x = self.pre_projection(inputs.astype(self.dtype))
        rope = {kind: rope_cos_sin(positions, jnp.asarray(gemma_inv_freq(d, freqs)))
                for kind, d, freqs in (("sliding_attention", text.head_dim, g.sliding_rope),
                                       ("full_attention", g.full_head_dim, g.full_rope))}
        for i, layer in enumerate(self.layers):
            kind = g.layer_types[i]
            x = layer(x, *rope[kind], cache_k[kind], cache_v[kind], committed)
        x = self.norm(x)
        table = self.embed_tokens[...]
        if self.masked_embedding is not None:
            logits = self.masked_embedding(x, table)
        else:
            logits = jnp.einsum("bth,vh->btv", x, table.astype(x.dtype))
        return logits.astype(jnp.float32), self.post_projection(x)
