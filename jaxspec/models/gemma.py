"""Gemma text decoders in Flax NNX: Gemma 4 (transformers' Gemma4TextModel / Gemma4ForCausalLM, and the language
model of Gemma4ForConditionalGeneration), and by configuration alone Gemma 3 (Gemma3ForCausalLM, the language model of
Gemma3ForConditionalGeneration) and Gemma 2 (Gemma2ForCausalLM), with the target interface of models/llama.py: an
explicit KV cache, EAGLE-3 features, and the batch-invariant numerics of numerics.py, so that speculation stays
bit-exact.

What Gemma 4 adds to a Llama decoder, each followed from transformers' code:
- two layer types (`config.gemma.layer_types`): sliding layers attend to the last `sliding_window` positions, with
  their own head_dim, KV heads and RoPE (default, theta 10k); full layers see the whole context with a wider head
  (global_head_dim) and proportional RoPE (only the first quarter of the pairs rotate). The window is a static
  argument of the invariant attention (kernel and reference), so a sliding layer's keys are masked by position in
  every program alike;
- q and k RMS-normed per head (weights multiplied as they are, not 1 + w), v normed without a weight, and the
  scores not scaled (scale 1.0): the norms set their size;
- four norms per layer (before and after attention and MLP), a learned `layer_scalar` multiplying its output;
- full layers with `attention_k_eq_v`: the values are the key projection's output (normed as values, not keys);
- KV sharing: the last `num_kv_shared_layers` layers project no keys or values and attend to those of the last
  earlier layer of their type (`GemmaLayout.kv_source`), read from that layer's cache after this forward wrote
  it; only the other layers have a cache entry (`GemmaLayout.cache_layers`);
- per-layer inputs (PLE): a second embedding table of L·P columns and a projection of the token embedding, normed
  and summed, give each layer a P-wide input that gates a residual branch after its MLP;
- the embedding scaled by sqrt(H) (rounded to the weights' dtype first, as transformers does), the GELU (tanh) MLP,
  double-width MLPs on shared layers (`use_double_wide_mlp`), and tanh soft-capping of the logits;
- the mixture-of-experts block (26B-A4B, `GemmaDecoderLayer.experts_block`): beside each layer's dense MLP, experts
  chosen by a router that reads the residual stream, their normed sum added to the normed MLP output.
Not supported (one-line errors in config.py): bidirectional attention.

Gemma 3 and 2 are the same decoder with less (`GemmaLayout`'s flags): one head size and RoPE scheme per layer type
(Gemma 3's full layers: linear scaling), norms applied as 1 + w, scores scaled by query_pre_attn_scalar^-½, no value
norm, layer scalar, KV sharing or per-layer inputs; Gemma 2 also has no q/k norms and caps the attention scores at
c·tanh(s/c), a static argument of the invariant attention like the window.

Invariant numerics: every matmul runs on the target's row tiles (`Linear` with numerics), every sum over features is
a halving sum, and every product that meets an add is rounded first (`exact_mul`), as in llama.py.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxspec.config import TargetConfig, gemma_inv_freq
from jaxspec.errors import JaxspecError
from jaxspec.models import kv_cache as kvc
from jaxspec.models import moe as moe_ops
from jaxspec.models.attention import masked_attention
from jaxspec.models.layers import apply_rope, rope_cos_sin
from jaxspec.models.llama import (
    Experts,
    Linear,
    TargetOutput,
    head_logits,
    hold_step_weights,
    without_held_weights,
)
from jaxspec.models.numerics import (
    Numerics,
    attend,
    default_numerics,
    exact_mul,
    held_dtype,
    invariant_mean_square,
    normal_weight,
)
from jaxspec.sharding import cache_kv_heads


def gemma_rms_norm(x: jax.Array, weight: jax.Array | None, eps: float, invariant: bool = False,
                   offset: bool = False) -> jax.Array:
    """Gemma4RMSNorm: x · (mean(x²) + eps)^-½ in float32, times the weight in float32 (None: no weight, the value
    norm; offset: 1 + weight, Gemma 2/3's RMSNorm), then rounded to x's dtype. invariant: the mean by halving sum,
    products rounded before any add."""
    xf = x.astype(jnp.float32)
    ms = invariant_mean_square(xf) if invariant else jnp.mean(xf * xf, axis=-1, keepdims=True)
    y = xf * jax.lax.rsqrt(ms + eps)
    if weight is not None:
        w = 1.0 + weight.astype(jnp.float32) if offset else weight.astype(jnp.float32)
        y = exact_mul(y, w) if invariant else y * w
    elif invariant:
        y = exact_mul(y, 1.0)  # rounded here: whatever adds to it next sees these bits in every program
    return y.astype(x.dtype)


def gelu_tanh(x: jax.Array, invariant: bool = False) -> jax.Array:
    """GELU with the tanh approximation (transformers' gelu_pytorch_tanh, jax.nn.gelu(approximate=True)); invariant:
    computed in float32 with each product rounded before it meets an add."""
    xf = x.astype(jnp.float32)  # in float32 whatever the dtype, as torch computes a 16-bit GELU
    if not invariant:
        return jax.nn.gelu(xf, approximate=True).astype(x.dtype)
    inner = exact_mul(xf + exact_mul(exact_mul(exact_mul(xf, xf), xf), 0.044715), math.sqrt(2.0 / math.pi))
    cdf = 1.0 + exact_mul(jnp.tanh(inner), 1.0)  # tanh rounded before the add
    return exact_mul(exact_mul(xf, 0.5), cdf).astype(x.dtype)


def _mul(a: jax.Array, b, invariant: bool) -> jax.Array:
    return exact_mul(a, b) if invariant else a * b


def _norm(norm: Norm | None, x: jax.Array, invariant: bool) -> jax.Array:
    """A norm the layer may not have (Gemma 2's q/k, Gemma 2/3's v): absent, x unchanged."""
    return x if norm is None else norm(x, invariant)


class Norm(nnx.Module):
    """A Gemma RMSNorm; offset (Gemma 2/3): the stored weight w is applied as 1 + w, so it starts at zero."""

    def __init__(self, dim: int, eps: float, *, dtype, scaled: bool = True, offset: bool = False):
        init = jnp.zeros if offset else jnp.ones
        self.weight = nnx.data(nnx.Param(init((dim,), held_dtype(dtype))) if scaled else None)
        self.eps = eps
        self.offset = offset

    def __call__(self, x: jax.Array, invariant: bool = False) -> jax.Array:
        return gemma_rms_norm(x, None if self.weight is None else self.weight[...], self.eps, invariant, self.offset)


class GemmaAttention(nnx.Module):
    """One layer's attention. A KV-shared layer holds only q_proj, q_norm and o_proj; a full layer with
    attention_k_eq_v has no v_proj; Gemma 2 has no q/k norms and Gemma 2/3 no value norm."""

    def __init__(self, cfg: TargetConfig, layer: int, *, dtype, rngs: nnx.Rngs | None):
        g = cfg.gemma
        h = cfg.hidden_size
        self.sliding = g.sliding(layer)
        self.head_dim = cfg.head_dim if self.sliding else g.full_head_dim
        self.kv_heads = cfg.num_kv_heads if self.sliding else g.full_kv_heads
        self.num_heads = cfg.num_heads
        self.window = g.sliding_window if self.sliding else None
        self.shared = g.kv_source[layer] != layer
        self.scale, self.softcap = g.query_scale, g.attn_softcapping
        d, eps, off = self.head_dim, cfg.rms_norm_eps, g.norm_offset
        self.q_proj = Linear(h, cfg.num_heads * d, bias=False, dtype=dtype, rngs=rngs)
        self.q_norm = nnx.data(Norm(d, eps, dtype=dtype, offset=off) if g.qk_norm else None)
        self.o_proj = Linear(cfg.num_heads * d, h, bias=False, dtype=dtype, rngs=rngs)
        own_kv = not self.shared
        self.k_proj = nnx.data(Linear(h, self.kv_heads * d, bias=False, dtype=dtype, rngs=rngs) if own_kv else None)
        has_v = own_kv and not (g.k_eq_v and not self.sliding)
        self.v_proj = nnx.data(Linear(h, self.kv_heads * d, bias=False, dtype=dtype, rngs=rngs) if has_v else None)
        self.k_norm = nnx.data(Norm(d, eps, dtype=dtype, offset=off) if own_kv and g.qk_norm else None)
        self.v_norm = nnx.data(Norm(d, eps, dtype=dtype, scaled=False) if own_kv and g.v_norm else None)

    def __call__(self, x, cos, sin, k_cache, v_cache, lengths, mask, *, empty_cache, numerics, positions, ancestors):
        """x [B, T, H]; cos/sin [B, T, D] of this layer type; k/v_cache [B, Hkv·r, S, D]: this layer's own, or the
        producer's already holding this forward's keys (a shared layer). → (o_proj output, k_cache, v_cache)."""
        b, t, _ = x.shape
        inv = numerics is not None
        d = self.head_dim
        q = self.q_proj(x, numerics).reshape(b, t, self.num_heads, d)
        q = apply_rope(_norm(self.q_norm, q, inv), cos, sin, inv)  # [B, T, Hq, D]
        if not self.shared:
            k = self.k_proj(x, numerics).reshape(b, t, self.kv_heads, d)
            v = k if self.v_proj is None else self.v_proj(x, numerics).reshape(b, t, self.kv_heads, d)
            k = apply_rope(_norm(self.k_norm, k, inv), cos, sin, inv)
            v = _norm(self.v_norm, v, inv)
            k, v = kvc.repeat_heads(k, k_cache.shape[1]), kvc.repeat_heads(v, v_cache.shape[1])
            k_cache = kvc.write_block(k_cache, k, lengths)
            v_cache = kvc.write_block(v_cache, v, lengths)
        if inv:
            bk = numerics.key_block
            out = attend(
                numerics, q, k_cache, v_cache, lengths, positions, ancestors,
                num_blocks=-(-t // bk) if empty_cache else None, scale=self.scale, window=self.window,
                softcap=self.softcap,
            )
        else:
            k_win, v_win = kvc.read_window(k_cache, lengths, t), kvc.read_window(v_cache, lengths, t)
            k_pre, v_pre = (k_cache[:, :, :0], v_cache[:, :, :0]) if empty_cache else (k_cache, v_cache)
            out = masked_attention(q, k_pre, v_pre, lengths, k_win, v_win, mask, scale=self.scale,
                                   window=self.window, positions=positions, softcap=self.softcap)
        return self.o_proj(out.reshape(b, t, self.num_heads * d), numerics), k_cache, v_cache


class GemmaMLP(nnx.Module):
    def __init__(self, h: int, width: int, *, dtype, rngs: nnx.Rngs | None):
        self.gate_proj = Linear(h, width, bias=False, dtype=dtype, rngs=rngs)
        self.up_proj = Linear(h, width, bias=False, dtype=dtype, rngs=rngs)
        self.down_proj = Linear(width, h, bias=False, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array, numerics: Numerics | None = None) -> jax.Array:
        inv = numerics is not None
        gated = _mul(gelu_tanh(self.gate_proj(x, numerics), inv), self.up_proj(x, numerics), inv)
        return self.down_proj(gated, numerics)


class GemmaRouter(nnx.Module):
    """Gemma 4's router: the residual stream normed without a weight, times a learned `scale` and H^-½, projected to
    one logit per expert; each chosen expert's weight is then scaled by its `per_expert_scale`."""

    def __init__(self, h: int, num_experts: int, eps: float, *, dtype, rngs: nnx.Rngs | None):
        self.norm = Norm(h, eps, dtype=dtype, scaled=False)
        self.proj = Linear(h, num_experts, bias=False, dtype=dtype, rngs=rngs)
        self.scale = nnx.Param(jnp.ones((h,), held_dtype(dtype)))
        self.per_expert_scale = nnx.Param(jnp.ones((num_experts,), held_dtype(dtype)))

    def __call__(self, x: jax.Array, moe, numerics: Numerics | None) -> tuple[jax.Array, jax.Array]:
        """x [N, H] → (experts [N, k] int32 ascending, weights [N, k] float32), as transformers' Gemma4TextRouter:
        the scaled input rounded to the dtype after each factor (the scalar in float32, as torch multiplies a
        16-bit tensor by a float), a float32 softmax over all experts, the top k renormalized, times their scales."""
        inv = numerics is not None
        y = _mul(self.norm(x, inv), self.scale[...].astype(x.dtype), inv)
        y = _mul(y.astype(jnp.float32), x.shape[-1] ** -0.5, inv).astype(x.dtype)
        experts, weights = moe_ops.route(self.proj(y, numerics), moe, x.dtype, inv)
        return experts, _mul(weights, self.per_expert_scale[...].astype(jnp.float32)[experts], inv)


class GemmaDecoderLayer(nnx.Module):
    def __init__(self, cfg: TargetConfig, layer: int, *, dtype, rngs: nnx.Rngs | None):
        g, h, eps = cfg.gemma, cfg.hidden_size, cfg.rms_norm_eps
        self.self_attn = GemmaAttention(cfg, layer, dtype=dtype, rngs=rngs)
        self.mlp = GemmaMLP(h, g.mlp_widths[layer], dtype=dtype, rngs=rngs)
        for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):
            setattr(self, name, Norm(h, eps, dtype=dtype, offset=g.norm_offset))
        self.layer_scalar = nnx.data(nnx.Param(jnp.ones((1,), held_dtype(dtype))) if g.layer_scalar else None)
        # 26B-A4B's mixture-of-experts block beside the dense MLP (`experts_block`), named as transformers names it
        self.moe = cfg.moe if cfg.moe is not None and layer in cfg.moe.layers else None
        moe = self.moe
        self.router = nnx.data(GemmaRouter(h, moe.num_experts, eps, dtype=dtype, rngs=rngs) if moe else None)
        self.experts = nnx.data(Experts(moe.num_experts, h, moe.intermediate_size, dtype=dtype, rngs=rngs)
                                if moe else None)
        for name in ("post_feedforward_layernorm_1", "pre_feedforward_layernorm_2", "post_feedforward_layernorm_2"):
            setattr(self, name, nnx.data(Norm(h, eps, dtype=dtype) if moe else None))
        p = g.per_layer_dim
        self.per_layer_input_gate = nnx.data(Linear(h, p, bias=False, dtype=dtype, rngs=rngs) if p else None)
        self.per_layer_projection = nnx.data(Linear(p, h, bias=False, dtype=dtype, rngs=rngs) if p else None)
        self.post_per_layer_input_norm = nnx.data(Norm(h, eps, dtype=dtype) if p else None)

    def experts_block(self, x: jax.Array, numerics: Numerics | None) -> jax.Array:
        """Gemma 4 26B-A4B's mixture-of-experts block on x [B, T, H] (the residual stream after attention): the
        router reads x, the experts (tanh-GELU gated MLPs, stacked as llama.Experts holds them) their own norm of
        it, and the weighted sum is normed again (models/moe.py: the tiles, the order of the sum, expert
        parallelism). transformers stores a layer's experts fused, gate_up_proj [E, 2I, H] and down_proj
        [E, H, I]; checkpoints/hf.py splits and transposes them as it reads."""
        inv = numerics is not None
        lead, h = x.shape[:-1], x.shape[-1]
        flat = x.reshape(-1, h)
        experts, weights = self.router(flat, self.moe, numerics)
        e = self.experts
        outputs = moe_ops.expert_outputs(
            self.pre_feedforward_layernorm_2(flat, inv), experts, e.gate_proj[...], e.up_proj[...], e.down_proj[...],
            None if numerics is None else numerics.row_tile, act=functools.partial(gelu_tanh, invariant=inv))
        return self.post_feedforward_layernorm_2(moe_ops.combine(outputs, weights), inv).reshape(*lead, h)

    def __call__(self, x, per_layer_input, cos, sin, k_cache, v_cache, lengths, mask, *, empty_cache, numerics,
                 positions, ancestors):
        inv = numerics is not None
        attn, k_cache, v_cache = self.self_attn(
            self.input_layernorm(x, inv), cos, sin, k_cache, v_cache, lengths, mask, empty_cache=empty_cache,
            numerics=numerics, positions=positions, ancestors=ancestors)
        x = x + self.post_attention_layernorm(attn, inv)
        ff = self.mlp(self.pre_feedforward_layernorm(x, inv), numerics)
        if self.moe is not None:  # 26B-A4B: the normed dense MLP plus the normed experts, both from x
            ff = self.post_feedforward_layernorm_1(ff, inv) + self.experts_block(x, numerics)
        x = x + self.post_feedforward_layernorm(ff, inv)
        if self.per_layer_input_gate is not None:
            gate = gelu_tanh(self.per_layer_input_gate(x, numerics), inv)
            branch = self.per_layer_projection(_mul(gate, per_layer_input, inv), numerics)
            x = x + self.post_per_layer_input_norm(branch, inv)
        if self.layer_scalar is not None:
            x = _mul(x, self.layer_scalar[...].astype(x.dtype), inv)
        return x, k_cache, v_cache


class GemmaModel(nnx.Module):
    """Token ids → logits and EAGLE-3 features through an explicit KV cache, with LlamaModel's interface (engine,
    proposers, CLIs). Attribute names follow transformers' module tree (`model.layers.{i}.self_attn.q_proj`, ...)
    so that checkpoints load by name (checkpoints/hf.py).

    The cache holds one entry per layer that computes keys and values (`GemmaLayout.cache_layers`), each of its
    layer type's shape: sliding layers [B, Hkv, S, D], full layers [B, Hkv_full, S, D_full], at the full capacity
    (a sliding layer's keys are masked by position, not evicted)."""

    def __init__(self, cfg: TargetConfig, *, dtype=jnp.float32, rngs: nnx.Rngs | None,
                 numerics: Numerics | None | str = "default"):
        if cfg.gemma is None:
            raise ValueError("GemmaModel needs a Gemma config (TargetConfig.gemma)")
        g = cfg.gemma
        self.config = cfg
        self.dtype = jnp.dtype(dtype)
        self.numerics = self.invariant_numerics() if numerics == "default" else numerics
        self.quantization: str | None = None
        self.accumulate = None  # the tied LM head's dot in a mixed-precision training step (`head_logits`)
        self.embed_tokens = nnx.Param(normal_weight(rngs, (cfg.vocab_size, cfg.hidden_size), dtype))  # [V, H]
        self.layers = nnx.List([GemmaDecoderLayer(cfg, i, dtype=dtype, rngs=rngs) for i in range(cfg.num_layers)])
        self.norm = Norm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype, offset=g.norm_offset)
        self.lm_head = nnx.data(None if cfg.tie_word_embeddings else
                                Linear(cfg.hidden_size, cfg.vocab_size, bias=False, dtype=dtype, rngs=rngs))
        self.head_panels = nnx.data(None)  # the tied table as the CPU row kernel's panels (`hold_step_weights`)
        p = g.per_layer_dim
        if p:
            self.embed_tokens_per_layer = nnx.Param(normal_weight(rngs, (g.per_layer_vocab, cfg.num_layers * p), dtype))
            self.per_layer_model_projection = Linear(cfg.hidden_size, cfg.num_layers * p, bias=False, dtype=dtype,
                                                     rngs=rngs)
            self.per_layer_projection_norm = Norm(p, cfg.rms_norm_eps, dtype=dtype)

    def invariant_numerics(self, kernels: str | None = None) -> Numerics:
        return default_numerics(kernels=kernels)

    def hold_step_weights(self) -> GemmaModel:
        """llama.hold_step_weights: the CPU row kernel's panels of every matmul (Gemma projects q, k and v by
        separate dots: shared layers have no k or v, so no side-by-side kernel); returns self."""
        hold_step_weights(self)
        return self

    def without_held_weights(self) -> GemmaModel:
        return without_held_weights(self)

    def init_cache(self, batch: int, capacity: int) -> kvc.KVCache:
        """An empty cache: one entry per layer that computes keys and values, of its layer type's shape."""
        cfg, g = self.config, self.config.gemma
        ks, vs = [], []
        for i in g.cache_layers:
            attn = self.layers[i].self_attn
            shape = (batch, cache_kv_heads(cfg.num_heads, attn.kv_heads), capacity, attn.head_dim)
            ks.append(jnp.zeros(shape, self.dtype))
            vs.append(jnp.zeros(shape, self.dtype))
        return kvc.KVCache(tuple(ks), tuple(vs), jnp.zeros((batch,), jnp.int32))

    def embed(self, tokens: jax.Array) -> jax.Array:
        """The scaled embedding: table rows times sqrt(H) rounded to the model dtype (transformers rounds the scale
        to the weights' dtype), rounded before anything adds to it."""
        rows = jnp.take(self.embed_tokens[...], tokens, axis=0).astype(self.dtype)
        return exact_mul(rows, jnp.asarray(self.config.hidden_size**0.5, self.dtype))

    def per_layer_inputs(self, tokens: jax.Array, x: jax.Array, numerics: Numerics | None) -> jax.Array:
        """PLE: (norm(proj(embedding) · H^-½) + table[tokens] · sqrt(P)) · 2^-½ → [B, T, L, P]."""
        cfg, p = self.config, self.config.gemma.per_layer_dim
        inv = numerics is not None
        lead = tokens.shape
        rows = jnp.take(self.embed_tokens_per_layer[...], tokens, axis=0).astype(self.dtype)  # covers the vocabulary
        token_part = exact_mul(rows, jnp.asarray(p**0.5, self.dtype)).reshape(*lead, cfg.num_layers, p)
        # scalar factors in float32, rounded once to the dtype (as torch multiplies a 16-bit tensor by a float)
        proj = self.per_layer_model_projection(x, numerics).astype(jnp.float32)
        proj = _mul(proj, cfg.hidden_size**-0.5, inv).astype(self.dtype)
        proj = self.per_layer_projection_norm(proj.reshape(*lead, cfg.num_layers, p), inv)
        return _mul((proj + token_part).astype(jnp.float32), 2.0**-0.5, inv).astype(self.dtype)

    def logits(self, hidden: jax.Array) -> jax.Array:
        """Final norm, LM head and soft-capping on pre-norm hidden states [..., H] → float32 logits [..., V]."""
        nm = None if self.numerics is None else self.numerics.narrow()
        return self.vocab_logits(self.norm(hidden, nm is not None), nm)

    def vocab_logits(self, normed: jax.Array, numerics: Numerics | None = None, drafting: bool = False) -> jax.Array:
        """The LM head (the tied embedding table when there is none) and tanh soft-capping on normed states;
        drafting as LlamaModel.vocab_logits."""
        logits = head_logits(self.embed_tokens[...], self.lm_head, normed, numerics, self.accumulate,
                             self.head_panels, drafting)  # [..., V]
        cap = self.config.gemma.final_logit_softcapping
        if cap is not None:  # in the model dtype, as transformers caps them
            logits = jnp.tanh(logits / cap) * jnp.asarray(cap, logits.dtype)
        return logits.astype(jnp.float32)

    def __call__(
        self,
        tokens: jax.Array,  # [B, T] int32
        positions: jax.Array,  # [B, T] int32
        cache: kvc.KVCache,
        *,
        block_mask: jax.Array | None = None,  # [B, T, T] among the new tokens (a tree's ancestors); None = causal
        ancestors: jax.Array | None = None,  # [B, T, L] a tree's ancestors by depth (invariant numerics)
        logit_indices: jax.Array | None = None,  # [B, n] which positions get logits; None = all
        return_aux: bool = False,
        return_hidden: bool = False,
        empty_cache: bool = False,
        prompt_chunk: bool = False,  # a prompt's later chunk (chunked prefill): the prefill's tiles, the cache read
        write_offset: int | jax.Array = 0,
    ) -> TargetOutput:
        cfg, g = self.config, self.config.gemma
        b, t = tokens.shape
        if not (isinstance(write_offset, int) and write_offset == 0):
            raise JaxspecError("a Gemma model writes its keys at the committed length only (no write_offset: it is "
                               "not a draft model yet)")
        if self.numerics is not None and ancestors is None and block_mask is not None:
            ancestors = kvc.ancestors_from_mask(block_mask, min(t, self.numerics.key_block))
        if block_mask is None:
            block_mask = kvc.causal_block_mask(b, t)
        inv = self.numerics is not None
        numerics = self.numerics.for_prefill() if inv and (empty_cache or prompt_chunk) else self.numerics
        rope = {  # cos/sin [B, T, D] per layer type, each of its own head size and frequencies
            kind: rope_cos_sin(positions, jnp.asarray(gemma_inv_freq(d, freqs)), inv)
            for kind, d, freqs in (("sliding_attention", cfg.head_dim, g.sliding_rope),
                                   ("full_attention", g.full_head_dim, g.full_rope))
        }
        x = self.embed(tokens)  # [B, T, H]
        ple = self.per_layer_inputs(tokens, x, numerics) if g.per_layer_dim else None  # [B, T, L, P]
        slot = {layer: n for n, layer in enumerate(g.cache_layers)}
        ks, vs = list(cache.k), list(cache.v)
        aux = {}
        for i, layer in enumerate(self.layers):
            if return_aux and i in cfg.aux_layer_ids:
                aux[i] = x  # hidden_states[i]: the input of layer i
            n = slot[g.kv_source[i]]
            cos, sin = rope[g.layer_types[i]]
            x, ks[n], vs[n] = layer(
                x, None if ple is None else ple[:, :, i], cos, sin, ks[n], vs[n], cache.lengths, block_mask,
                empty_cache=empty_cache, numerics=numerics, positions=positions, ancestors=ancestors)
        if logit_indices is not None:
            x = jnp.take_along_axis(x, logit_indices[:, :, None], axis=1)  # [B, n, H]
        features = jnp.concatenate([aux[i] for i in cfg.aux_layer_ids], axis=-1) if return_aux else None
        return TargetOutput(self.logits(x), features, cache._replace(k=tuple(ks), v=tuple(vs)),
                            x if return_hidden else None)
