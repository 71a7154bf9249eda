"""The Llama-family target model in Flax NNX (Llama 2/3.x, SmolLM2, Qwen2/2.5, Qwen3, Mistral).

A forward takes an explicit KV cache and returns a new one; besides logits it returns the EAGLE-3 auxiliary
features: Hugging Face `hidden_states[l]` (the residual stream entering layer l) at `config.aux_layer_ids`,
concatenated to [B, T, n_aux * H].

Layers are separate modules applied in a Python loop (unrolled under jit), each with its own weight and cache
arrays. A `lax.scan` over stacked layers compiles faster, but XLA then copies each layer's weight slice before its
matmul: measured on a 2-core CPU with SmolLM2-135M, one-token decode took 35 ms scanned vs 20.5 ms unrolled.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jaxspec.config import TargetConfig, rope_inv_freq
from jaxspec.models import kv_cache as kvc
from jaxspec.models import moe as moe_ops
from jaxspec.models.attention import masked_attention
from jaxspec.models.layers import accumulating_matmul, apply_rope, rms_norm, rope_cos_sin
from jaxspec.models.numerics import (
    Numerics,
    attend,
    contract,
    default_numerics,
    draft_attend,
    exact_mul,
    held_dtype,
    invariant_rms_norm,
    model_sharded,
    normal_weight,
    panel_matmul,
    tiled_matmul,
)
from jaxspec.models.numerics import drop_held_weights
from jaxspec.models.quantize import held_dtype_for, quantize_weight
from jaxspec.sharding import cache_kv_heads
from pallas_kernels.row_attention import supports as row_attention_supports
from pallas_kernels.row_matmul import exact_panel_dtype, pack_panels


class Linear(nnx.Module):
    """y = x @ kernel + bias, kernel [in, out] (the transpose of a PyTorch checkpoint's weight), computed in `dtype`
    with the weights held in `held_dtype(dtype)`."""

    def __init__(self, d_in: int, d_out: int, *, bias: bool, dtype, rngs: nnx.Rngs | None):
        self.kernel = nnx.Param(normal_weight(rngs, (d_in, d_out), dtype))  # 8-bit values once quantized (`quantize`)
        self.bias = nnx.data(nnx.Param(jnp.zeros((d_out,), held_dtype(dtype))) if bias else None)
        self.scale = nnx.data(None)  # float32 [out], the per-channel scale of an 8-bit kernel (models/quantize.py)
        self.panels = nnx.data(None)  # the kernel as the CPU row kernel's panels, held once (`hold_step_weights`)
        self.draft_panels = nnx.data(None)  # the same, for a drafter's plain calls (`hold_draft_weights`) ...
        self.draft_scale = nnx.data(None)  # ... as int8 values with this float32 [out] scale, from a float kernel
        # None: the dot's own result dtype; float32: 16-bit products accumulated into float32 in every dot of the
        # forward and the backward (mixed-precision training, train/precision.py), then rounded to x's dtype
        self.accumulate = None

    def quantize(self, mode: str) -> None:
        """Replace the kernel by 8-bit values (`mode`: int8 or fp8) and a per-output-channel scale
        (models/quantize.py); in place."""
        kernel, held = self.kernel.get_value(), held_dtype_for(mode)
        quantize = functools.partial(quantize_weight, mode=mode, held=held)
        if isinstance(kernel, jax.ShapeDtypeStruct):  # a model built for shapes only (loaders fill it)
            q, scale = jax.eval_shape(quantize, kernel)
            q, scale = (jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=kernel.sharding) for a in (q, scale))
        else:
            q, scale = quantize(kernel)
        self.kernel = nnx.Param(q)
        self.scale = nnx.data(nnx.Param(scale))
        self.panels = self.draft_panels = self.draft_scale = None  # made from the float kernel

    def __call__(self, x: jax.Array, numerics: Numerics | None = None) -> jax.Array:
        """numerics: run the matmul on fixed row tiles (batch-invariant numerics); None: one plain dot."""
        bias = None if self.bias is None else self.bias[...]
        scale = None if self.scale is None else self.scale[...]
        if numerics is not None:
            kernel = self.kernel[...]
            if numerics.row_kernel and not model_sharded():
                panels = self.panels if self.panels is not None else pack_panels(kernel)
                return panel_matmul(x, panels, kernel.shape[1], bias, scale)
            return tiled_matmul(x, kernel, numerics.row_tile, bias, wide_row_tile=numerics.wide_tile(x, kernel),
                                scale=scale)
        if self.draft_panels is not None and not model_sharded():
            # a drafter's matmul held on the row kernel (`hold_draft_weights`): drafts only change speed
            draft_scale = scale if self.draft_scale is None else self.draft_scale[...]
            return panel_matmul(x, self.draft_panels, self.kernel.shape[1], bias, draft_scale)
        if self.accumulate is not None and scale is not None:
            # a quantized target in a 16-bit training step (frozen: nothing differentiates its weights): the narrow
            # dot's float32 sums meet the scale before they are rounded, as in inference (`contract`)
            y = jax.lax.dot_general(x, self.kernel[...].astype(x.dtype), (((x.ndim - 1,), (0,)), ((), ())),
                                    preferred_element_type=self.accumulate)
            y = exact_mul(y, scale.astype(jnp.float32)).astype(x.dtype)
        elif self.accumulate is not None:
            y = accumulating_matmul(x, self.kernel[...].astype(x.dtype), self.accumulate)
        else:
            y = contract(x, self.kernel[...], ((x.ndim - 1,), (0,)), scale)
        return y if bias is None else y + bias.astype(x.dtype)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, *, dtype):
        self.weight = nnx.Param(jnp.ones((dim,), held_dtype(dtype)))
        self.eps = eps

    def __call__(self, x: jax.Array, invariant: bool = False) -> jax.Array:
        return (invariant_rms_norm if invariant else rms_norm)(x, self.weight[...], self.eps)


class Attention(nnx.Module):
    """GQA self-attention through a KV cache. `cfg` is a TargetConfig or a HeadConfig (whose q/k/v read 2H)."""

    def __init__(self, cfg, *, dtype, rngs: nnx.Rngs | None, d_in: int | None = None):
        h, d = cfg.hidden_size, cfg.head_dim
        d_in = d_in or h
        self.cfg = cfg
        self.q_proj = Linear(d_in, cfg.num_heads * d, bias=cfg.attention_bias, dtype=dtype, rngs=rngs)
        self.k_proj = Linear(d_in, cfg.num_kv_heads * d, bias=cfg.attention_bias, dtype=dtype, rngs=rngs)
        self.v_proj = Linear(d_in, cfg.num_kv_heads * d, bias=cfg.attention_bias, dtype=dtype, rngs=rngs)
        self.o_proj = Linear(cfg.num_heads * d, h, bias=cfg.o_proj_bias, dtype=dtype, rngs=rngs)
        self.q_norm = nnx.data(RMSNorm(d, cfg.rms_norm_eps, dtype=dtype) if cfg.qk_norm else None)
        self.k_norm = nnx.data(RMSNorm(d, cfg.rms_norm_eps, dtype=dtype) if cfg.qk_norm else None)
        self.qkv_fused = nnx.data(None)  # (kernel, bias, scale) of `fused_qkv_weights`, held once (`hold_step_weights`)
        self.qkv_panels = nnx.data(None)  # that kernel as the CPU row kernel's panels, held likewise
        self.draft_row_attention = False  # a drafter's causal calls on the CPU row attention (`hold_draft_weights`)

    def __call__(
        self,
        x: jax.Array,  # [B, T, H]
        cos: jax.Array,  # [B, T, D]
        sin: jax.Array,  # [B, T, D]
        k_cache: jax.Array,  # [B, Hkv·r, S, D] r = the cache's repetition of each KV head (init_cache)
        v_cache: jax.Array,  # [B, Hkv·r, S, D]
        lengths: jax.Array,  # [B] committed tokens, seen by every new token
        mask: jax.Array,  # [B, T, W] which of the W uncommitted slots [lengths, lengths + W) each new token sees
        write_offset: int | jax.Array = 0,  # the new tokens go to slots lengths + write_offset + t
        empty_cache: bool = False,  # nothing is committed (a prefill): attend to the new tokens only
        numerics: Numerics | None = None,  # batch-invariant numerics (the target); None: fastest (the head)
        positions: jax.Array | None = None,  # [B, T] the new tokens' positions (invariant numerics; a drafter's
        # causal call with `draft_row_attention`: their slots)
        ancestors: jax.Array | None = None,  # [B, T, L] a tree's ancestors by depth (invariant numerics)
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        cfg = self.cfg
        b, t, _ = x.shape
        q, k, v = self.project(x, cos, sin, numerics)
        k, v = kvc.repeat_heads(k, k_cache.shape[1]), kvc.repeat_heads(v, v_cache.shape[1])  # [B, T, Hkv·r, D]
        k_cache = kvc.write_block(k_cache, k, lengths + write_offset)
        v_cache = kvc.write_block(v_cache, v, lengths + write_offset)
        if numerics is not None:  # keys read back from the cache in position order (write before read)
            bk = numerics.key_block
            out = attend(
                numerics, q, k_cache, v_cache, lengths, positions, ancestors,
                num_blocks=-(-t // bk) if empty_cache else None,
            ).reshape(b, t, cfg.num_heads * cfg.head_dim)
            return self.o_proj(out, numerics), k_cache, v_cache
        if self.draft_row_attention and positions is not None and not model_sharded():
            out = draft_attend(q, k_cache, v_cache, lengths, positions)  # causal, at the slots just written
            return self.o_proj(out.reshape(b, t, cfg.num_heads * cfg.head_dim)), k_cache, v_cache
        if isinstance(write_offset, int) and write_offset == 0 and mask.shape[-1] == t:  # the window is the new tokens
            k_win, v_win = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
        else:  # a window of earlier uncommitted entries too (the head's tree levels)
            k_win = kvc.read_window(k_cache, lengths, mask.shape[-1])
            v_win = kvc.read_window(v_cache, lengths, mask.shape[-1])
        k_pre, v_pre = (k_cache[:, :, :0], v_cache[:, :, :0]) if empty_cache else (k_cache, v_cache)
        out = masked_attention(q, k_pre, v_pre, lengths, k_win, v_win, mask).reshape(b, t, cfg.num_heads * cfg.head_dim)
        return self.o_proj(out), k_cache, v_cache


    def project(
        self, x: jax.Array, cos: jax.Array, sin: jax.Array, numerics: Numerics | None = None
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """q [B, T, Hq, D], k and v [B, T, Hkv, D] of x [B, T, d_in]: the projections, q/k norms and RoPE — shared by
        the cached forward above and the head's training-time test (`train.ttt`), which attends without a cache."""
        cfg = self.cfg
        b, t, _ = x.shape
        inv = numerics is not None
        if inv and numerics.fused_qkv and not model_sharded():  # one dot (Numerics.fused_qkv)
            nq, nkv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
            if numerics.row_kernel:
                if self.qkv_panels is not None:
                    panels, bias, scale = self.qkv_panels
                else:
                    kernel, bias, scale = self.fused_qkv_weights()
                    panels = pack_panels(kernel)
                qkv = panel_matmul(x, panels, nq + 2 * nkv, bias, scale)
            else:
                kernel, bias, scale = self.qkv_fused if self.qkv_fused is not None else self.fused_qkv_weights()
                qkv = tiled_matmul(x, kernel, numerics.row_tile, bias, wide_row_tile=numerics.wide_tile(x, kernel),
                                   scale=scale)
            q, k, v = jnp.split(qkv, (nq, nq + nkv), axis=-1)  # [B, T, Nq], [B, T, Nkv] x 2
        else:
            q, k, v = (proj(x, numerics) for proj in (self.q_proj, self.k_proj, self.v_proj))
        q = q.reshape(b, t, cfg.num_heads, cfg.head_dim)
        k = k.reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
        v = v.reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q, inv), self.k_norm(k, inv)
        return apply_rope(q, cos, sin, inv), apply_rope(k, cos, sin, inv), v

    def fused_qkv_weights(self) -> tuple[jax.Array, jax.Array | None, jax.Array | None]:
        """The q, k and v kernels side by side, [d_in, Nq + 2·Nkv], and their biases and 8-bit kernels' scales
        likewise (None without)."""
        projs = (self.q_proj, self.k_proj, self.v_proj)
        kernel = jnp.concatenate([p.kernel[...] for p in projs], axis=1)
        bias = None if self.q_proj.bias is None else jnp.concatenate([p.bias[...] for p in projs])
        scale = None if self.q_proj.scale is None else jnp.concatenate([p.scale[...] for p in projs])
        return kernel, bias, scale


class MLP(nnx.Module):
    def __init__(self, cfg, *, dtype, rngs: nnx.Rngs | None, width: int | None = None):
        h, i = cfg.hidden_size, width or cfg.intermediate_size
        self.gate_proj = Linear(h, i, bias=cfg.mlp_bias, dtype=dtype, rngs=rngs)
        self.up_proj = Linear(h, i, bias=cfg.mlp_bias, dtype=dtype, rngs=rngs)
        self.down_proj = Linear(i, h, bias=cfg.mlp_bias, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array, numerics: Numerics | None = None) -> jax.Array:
        return self.down_proj(jax.nn.silu(self.gate_proj(x, numerics)) * self.up_proj(x, numerics), numerics)


class Experts(nnx.Module):
    """A sparse layer's SwiGLU experts, stacked: gate and up [E, H, I], down [E, I, H] (each expert's kernels [in,
    out], as `Linear` holds one). Stacked so that a tile of tokens indexes its expert's weights (models/moe.py) and
    a mesh splits the experts over its model axis (sharding.py); checkpoints store them one expert at a time
    (checkpoints/hf.py stacks them)."""

    def __init__(self, num_experts: int, hidden: int, width: int, *, dtype, rngs: nnx.Rngs | None):
        self.gate_proj = nnx.Param(normal_weight(rngs, (num_experts, hidden, width), dtype))
        self.up_proj = nnx.Param(normal_weight(rngs, (num_experts, hidden, width), dtype))
        self.down_proj = nnx.Param(normal_weight(rngs, (num_experts, width, hidden), dtype))


class SparseMoe(nnx.Module):
    """A mixture-of-experts MLP (Mixtral's `block_sparse_moe`, Qwen's sparse `mlp`): the router `gate` [H, E], the
    experts, and Qwen2-MoE's shared expert with its sigmoid gate. The math, and why it is batch-invariant, is in
    models/moe.py."""

    def __init__(self, cfg: TargetConfig, *, dtype, rngs: nnx.Rngs | None):
        moe = cfg.moe
        self.moe = moe
        self.gate = Linear(cfg.hidden_size, moe.num_experts, bias=False, dtype=dtype, rngs=rngs)
        self.experts = Experts(moe.num_experts, cfg.hidden_size, moe.intermediate_size, dtype=dtype, rngs=rngs)
        shared = moe.shared_intermediate_size
        self.shared_expert = nnx.data(MLP(cfg, dtype=dtype, rngs=rngs, width=shared) if shared else None)
        self.shared_expert_gate = nnx.data(
            Linear(cfg.hidden_size, 1, bias=False, dtype=dtype, rngs=rngs) if shared else None)

    def __call__(self, x: jax.Array, numerics: Numerics | None = None) -> jax.Array:
        lead, h = x.shape[:-1], x.shape[-1]
        flat = x.reshape(-1, h)  # [N, H]
        experts, weights = moe_ops.route(self.gate(flat, numerics), self.moe, x.dtype, numerics is not None)
        row_tile = None if numerics is None else numerics.row_tile
        e = self.experts
        outputs = moe_ops.expert_outputs(flat, experts, e.gate_proj[...], e.up_proj[...], e.down_proj[...], row_tile)
        y = moe_ops.combine(outputs, weights)  # [N, H]
        if self.shared_expert is not None:  # Qwen2-MoE: sigmoid(x · w) times the shared expert, added
            gate = jax.nn.sigmoid(self.shared_expert_gate(flat, numerics))  # [N, 1]
            y = y + exact_mul(gate, self.shared_expert(flat, numerics))
        return y.reshape(*lead, h)


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: TargetConfig, *, dtype, rngs: nnx.Rngs | None, sparse: bool = False):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.self_attn = Attention(cfg, dtype=dtype, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.mlp = SparseMoe(cfg, dtype=dtype, rngs=rngs) if sparse else MLP(cfg, dtype=dtype, rngs=rngs)

    def __call__(self, x, cos, sin, k_cache, v_cache, lengths, mask, empty_cache=False, numerics=None,
                 positions=None, ancestors=None, write_offset=0):
        inv = numerics is not None
        attn, k_cache, v_cache = self.self_attn(
            self.input_layernorm(x, inv), cos, sin, k_cache, v_cache, lengths, mask, write_offset,
            empty_cache=empty_cache, numerics=numerics, positions=positions, ancestors=ancestors,
        )
        return self.finish(x, attn, numerics), k_cache, v_cache

    def finish(self, residual: jax.Array, attn: jax.Array, numerics: Numerics | None = None) -> jax.Array:
        """The layer's output [B, T, H] from its input (the residual) and attention's o_proj output: what a
        multi-layer EAGLE-3 head's training-time test (`train.ttt`) runs after its own attention."""
        x = residual + attn
        return x + self.mlp(self.post_attention_layernorm(x, numerics is not None), numerics)


def head_logits(table: jax.Array, lm_head: Linear | None, normed: jax.Array,
                numerics: Numerics | None = None, accumulate=None, table_panels: jax.Array | None = None,
                drafting: bool = False) -> jax.Array:
    """normed [..., H] through the LM head, or the tied embedding table [V, H] without one → logits [..., V] in
    normed's dtype. numerics: the target's row tiles, the table contracted in its stored layout (`tiled_matmul`'s
    w_out_in); None: one plain dot. accumulate: the tied table's dot as an untied head's Linear computes it in a
    mixed-precision training step (16-bit products, float32 sums: train/precision.py), None its own result dtype.
    table_panels: the tied table as the CPU row kernel's panels (`hold_step_weights`), which numerics with
    `row_kernel` read (packing the table in the program where none are held); drafting: a drafter's plain read
    of the head (DFlash's slots), on those held panels when there are any."""
    on_panels = drafting and numerics is None and not model_sharded()
    if lm_head is not None:
        if on_panels and lm_head.panels is not None:
            return panel_matmul(normed, lm_head.panels, lm_head.kernel.shape[1])
        return lm_head(normed, numerics)
    if numerics is not None and numerics.row_kernel and not model_sharded():
        panels = table_panels if table_panels is not None else pack_panels(table, out_in=True)
        return panel_matmul(normed, panels, table.shape[0])
    if on_panels and table_panels is not None:
        return panel_matmul(normed, table_panels, table.shape[0])
    if numerics is not None:
        return tiled_matmul(normed, table, numerics.row_tile, w_out_in=True)
    if accumulate is not None:
        return accumulating_matmul(normed, table.T.astype(normed.dtype), accumulate)
    return contract(normed, table, ((normed.ndim - 1,), (1,)))


def hold_step_weights(model) -> None:
    """Compute once, for every call that follows, what a target's decode and verify steps derive from its weights
    under its numerics, unless held already: each attention's side-by-side q/k/v kernel (`Numerics.fused_qkv`), and
    with `Numerics.row_kernel` every matmul's weight as the CPU row kernel's panels (pallas_kernels/row_matmul.py;
    the fused q/k/v kernel's instead of q's, k's and v's, and the tied embedding table's as the LM head). Without
    them each step program derives them again in its body (same values, so the same bits), and copying weights is
    slow on XLA:CPU (~20% of a 4-step speculative chain for the q/k/v concatenation alone).

    A `Generator` holds them on the model it is given, so that its programs (and those of every other generator of
    that model) read them. A snapshot: the weights must be final (the target's are never trained). Under a
    model-sharded mesh the projections stay split dots, and nothing is held. Not `nnx.Param`s: checkpoints
    (`nnx.state(model, nnx.Param)`) leave them out. What they cost in memory: the q/k/v kernels once more, or with
    the row kernel every matmul's weight once more (float32, or int8 / bfloat16 where its values are:
    `held_panels`), which `--memory-report` counts as the target's."""
    numerics = model.numerics
    if numerics is None or model_sharded():
        return
    nodes = [node for _, node in nnx.iter_graph(model)]
    fused = set()
    for attn in (n for n in nodes if isinstance(n, Attention)):
        if not numerics.fused_qkv:
            break
        fused.update(id(p) for p in (attn.q_proj, attn.k_proj, attn.v_proj))
        if numerics.row_kernel and attn.qkv_panels is None:
            kernel, bias, scale = attn.fused_qkv_weights()
            attn.qkv_panels = nnx.data((held_panels(kernel), bias, scale))
        elif not numerics.row_kernel and attn.qkv_fused is None:
            attn.qkv_fused = nnx.data(attn.fused_qkv_weights())
    if not numerics.row_kernel:
        return
    for linear in (n for n in nodes if isinstance(n, Linear) and id(n) not in fused):
        if linear.panels is None:
            linear.panels = nnx.data(held_panels(linear.kernel[...]))
    if model.lm_head is None and model.head_panels is None:
        model.head_panels = nnx.data(held_panels(model.embed_tokens[...], out_in=True))


def hold_draft_weights(drafter, target) -> None:
    """Hold every matmul weight of a drafter (an EAGLE-3 head, a DFlash drafter) as the CPU row kernel's panels, in
    place, where the target's numerics run on that kernel: the drafter's plain matmuls then run there too (`Linear`
    with panels and no numerics), at one weight pass for all the rows a step drafts (a tree level's nodes, a
    block's slots) where XLA:CPU's multi-row dots cost ~1.7 passes. Drafts only change speed, so any numerics serve.
    Not for a drafter being trained (the kernel has no gradient): the CLIs hold it on the drafters they load, apart
    from the panels a target holds for its own numerics (`hold_step_weights`), which its plain calls never read.

    A float weight is held as int8 values with one scale per output column (`quantize_weight`, as `--quantize int8`
    makes a target's): a quarter of float32's bytes, half of bfloat16's, where the head's steps come right after the
    target's forward has evicted them from the caches. Measured with the shipped head on 80 GSM8K and 80 MT-Bench
    prompts, chains of 2: acceptance within 0.1% and the same texts, its step 22-28% cheaper (BENCHMARKS.md,
    "The head's weights as int8 panels"). What holding cost and bought is in BENCHMARKS.md ("The CPU row kernel")."""
    numerics = getattr(target, "numerics", None)
    if numerics is None or not numerics.row_kernel:
        return
    for linear in [n for _, n in nnx.iter_graph(drafter) if isinstance(n, Linear)]:
        if linear.draft_panels is not None:
            continue
        if linear.scale is None:  # float values: int8 ones and a scale per output column
            values, scale = quantize_weight(linear.kernel[...], "int8", jnp.float32)
            linear.draft_panels = nnx.data(pack_panels(values, dtype=jnp.int8))
            linear.draft_scale = nnx.data(scale)
        else:  # 8-bit values already, beside their own scale
            linear.draft_panels = nnx.data(held_panels(linear.kernel[...]))
    if numerics.row_attention:  # and its causal attention (the calls that pass positions: an EAGLE-3 head's chain)
        for attention in [n for _, n in nnx.iter_graph(drafter) if isinstance(n, Attention)]:
            attention.draft_row_attention = row_attention_supports(drafter.dtype, None)


def draft_holding(drafter) -> str | None:
    """How `hold_draft_weights` held a drafter's matmuls ("int8 panels, a scale per column", ...), None where it held
    none: part of what its step costs (automatic speculation's stored step costs are keyed by it)."""
    kinds = set()
    for linear in [n for _, n in nnx.iter_graph(drafter) if isinstance(n, Linear)]:
        if linear.draft_panels is not None:
            scale = ", a scale per column" if linear.draft_scale is not None else ""
            kinds.add(f"{jnp.dtype(linear.draft_panels.dtype).name} panels{scale}")
    return "; ".join(sorted(kinds)) or None


def held_panels(w: jax.Array, out_in: bool = False) -> jax.Array:
    """A weight held as the row kernel's panels: in int8 / bfloat16 when its values all are int8 / bfloat16 values
    (the same sums from a quarter / half the bytes, `exact_panel_dtype`), else float32."""
    return pack_panels(w, out_in=out_in, dtype=exact_panel_dtype(w))


def without_held_weights(model):
    """A copy of `model` sharing its weights, without what `hold_step_weights` held on it."""
    copy = nnx.merge(*nnx.split(model))
    drop_held_weights(copy)
    return copy


class TargetOutput(NamedTuple):
    logits: jax.Array  # [B, T or n, vocab] float32
    aux: jax.Array | None  # [B, T, n_aux * hidden] in the model dtype, or None
    cache: kvc.KVCache
    hidden: jax.Array | None = None  # [B, T or n, hidden] before the final norm, when asked for


class LlamaModel(nnx.Module):
    """Token ids → logits and EAGLE-3 features, through an explicit KV cache.

    Attribute names follow the Hugging Face module tree (`model.layers.{i}.self_attn.q_proj` ...), so that a
    checkpoint key maps to a parameter path by name.

    `numerics` (static): batch-invariant numerics by default, so that target-only, chain and tree generation give
    the same bits (numerics.py); None computes with plain XLA ops, faster, for work that only needs the values
    (training features, measuring what invariance costs).
    """

    def __init__(
        self,
        cfg: TargetConfig,
        *,
        dtype=jnp.float32,
        rngs: nnx.Rngs | None,
        numerics: Numerics | None | str = "default",  # "default": default_numerics() of this backend
    ):
        self.config = cfg
        self.dtype = jnp.dtype(dtype)
        self.numerics = self.invariant_numerics() if numerics == "default" else numerics
        self.quantization: str | None = None  # "int8" or "fp8" once `models.quantize.quantize_target` ran
        self.accumulate = None  # the tied LM head's dot in a mixed-precision training step (`head_logits`)
        self.embed_tokens = nnx.Param(normal_weight(rngs, (cfg.vocab_size, cfg.hidden_size), dtype))  # [V, H]
        sparse = cfg.moe.layers if cfg.moe is not None else ()
        self.layers = nnx.List([DecoderLayer(cfg, dtype=dtype, rngs=rngs, sparse=i in sparse)
                                for i in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.lm_head = nnx.data(
            None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size, bias=False, dtype=dtype, rngs=rngs)
        )
        self.head_panels = nnx.data(None)  # the tied table as the CPU row kernel's panels (`hold_step_weights`)

    def invariant_numerics(self, kernels: str | None = None) -> Numerics:
        """`default_numerics` of this backend (kernels: the user's choice)."""
        return default_numerics(kernels=kernels)

    def hold_step_weights(self) -> LlamaModel:
        """Hold what decode and verify steps derive from the weights (`hold_step_weights` below); returns self."""
        hold_step_weights(self)
        return self

    def without_held_weights(self) -> LlamaModel:
        """A copy sharing this model's weights, without what `hold_step_weights` held on it."""
        return without_held_weights(self)

    def init_cache(self, batch: int, capacity: int) -> kvc.KVCache:
        """An empty cache; under a mesh whose model axis is wider than the KV heads, each KV head repeated so that
        every device holds the one its query heads read (sharding.cache_kv_heads)."""
        cfg = self.config
        kv_heads = cache_kv_heads(cfg.num_heads, cfg.num_kv_heads)
        return kvc.init_cache(cfg.num_layers, batch, capacity, kv_heads, cfg.head_dim, self.dtype)

    def embed(self, tokens: jax.Array) -> jax.Array:
        return jnp.take(self.embed_tokens[...], tokens, axis=0).astype(self.dtype)  # gathered, then cast (held_dtype)

    def logits(self, hidden: jax.Array) -> jax.Array:
        """Final norm and LM head on pre-norm hidden states [..., H] → float32 logits [..., V]."""
        nm = None if self.numerics is None else self.numerics.narrow()  # wide tiles measure [K, N] weights only
        return self.vocab_logits(self.norm(hidden, nm is not None), nm)

    def vocab_logits(self, normed: jax.Array, numerics: Numerics | None = None, drafting: bool = False) -> jax.Array:
        """The LM head alone (the tied embedding table when there is none) on states already normed [..., H] →
        float32 logits [..., V]: what a drafter that shares the target's head (DFlash) reads after its own norm.
        numerics: the target's tiles (its own logits); None, plain XLA (a drafter's, which only changes speed);
        drafting: a drafter's proposal, not training: on the row kernel's panels where the target holds them."""
        logits = head_logits(self.embed_tokens[...], self.lm_head, normed, numerics, self.accumulate,
                             self.head_panels, drafting)
        return logits.astype(jnp.float32)

    def __call__(
        self,
        tokens: jax.Array,  # [B, T] int32
        positions: jax.Array,  # [B, T] int32
        cache: kvc.KVCache,
        *,
        block_mask: jax.Array | None = None,  # [B, T, T] bool among the new tokens (a tree's ancestors); None = causal
        ancestors: jax.Array | None = None,  # [B, T, L] a tree's ancestor by depth (kv_cache.ancestors_from_mask);
        # derived from block_mask when not given; with invariant numerics attention reads these, not the mask
        logit_indices: jax.Array | None = None,  # [B, n] which of the T positions get logits; None = all
        return_aux: bool = False,
        return_hidden: bool = False,  # also return the final hidden state (offline training features)
        empty_cache: bool = False,  # promise that nothing is committed yet (prefill): skips attending to the cache
        prompt_chunk: bool = False,  # a prompt's later chunk (chunked prefill): the prefill's tiles, the cache read
        write_offset: int | jax.Array = 0,  # plain numerics: new entries at slots lengths + write_offset + t, and
        # block_mask [B, T, W] over the W uncommitted slots from lengths on (a draft model's tree levels)
    ) -> TargetOutput:
        cfg = self.config
        b, t = tokens.shape
        if self.numerics is not None and not (isinstance(write_offset, int) and write_offset == 0):
            raise ValueError("write_offset (tree levels above the committed length) runs under plain numerics only")
        if self.numerics is not None and ancestors is None and block_mask is not None:  # a tree given by its mask
            ancestors = kvc.ancestors_from_mask(block_mask, min(t, self.numerics.key_block))
        if block_mask is None:
            block_mask = kvc.causal_block_mask(b, t)
        cos, sin = rope_cos_sin(positions, jnp.asarray(rope_inv_freq(cfg)), self.numerics is not None)
        # a prefill's rows meet only prefill rows: its own tiles (numerics.py); the logits below keep the decode's
        prefill = empty_cache or prompt_chunk
        numerics = self.numerics.for_prefill() if self.numerics is not None and prefill else self.numerics
        x = self.embed(tokens)  # [B, T, H]
        aux, ks, vs = {}, [], []
        for i, layer in enumerate(self.layers):
            if return_aux and i in cfg.aux_layer_ids:
                aux[i] = x  # hidden_states[i]: the input of layer i
            x, k, v = layer(
                x, cos, sin, cache.k[i], cache.v[i], cache.lengths, block_mask, empty_cache, numerics, positions,
                ancestors, write_offset,
            )
            ks.append(k)
            vs.append(v)
        if logit_indices is not None:
            x = jnp.take_along_axis(x, logit_indices[:, :, None], axis=1)  # [B, n, H]
        features = jnp.concatenate([aux[i] for i in cfg.aux_layer_ids], axis=-1) if return_aux else None
        hidden = x if return_hidden else None
        return TargetOutput(self.logits(x), features, cache._replace(k=tuple(ks), v=tuple(vs)), hidden)
