"""Weight-only 8-bit quantization of a target's decoder matmuls (`--quantize int8|fp8`, and compressed-tensors FP8
checkpoints, checkpoints/hf.py).

Why: a decode step reads every weight once, so its time is the weights' bytes over the memory bandwidth; int8
weights halve a bfloat16 target's bytes (a quarter of a float32 one's), and the systems users compare with verify
with quantized targets (vLLM, SGLang: W8A16, FP8). What: each q/k/v/o/gate/up/down kernel [K, N] of every decoder
layer becomes 8-bit values q and one float32 scale per output channel: int8, s[n] = max_k |W[k, n]| / 127 and
q = round(W / s); fp8 (e4m3), s[n] = max_k |W[k, n]| / 448 and q = W / s rounded to e4m3 (symmetric; a zero
column keeps s = 1). Activations stay in the compute dtype (weight-only: a compressed-tensors checkpoint's dynamic
activation quantization is not applied). The embedding table and the LM head stay in the compute
dtype (as AWQ/GPTQ W8A16 checkpoints and compressed-tensors' FP8 ones leave them): a step reads only B·T rows of
the table, and the LM head's logits are what every accepted token is chosen from.

How a quantized matmul computes (`Linear`, `numerics.tiled_matmul`): y = (x @ q) · s + bias, the dot over q's
values in x's dtype accumulated in float32 (int8 and e4m3 values are exact in bfloat16 and float32), the scale applied to
the float32 result before it is rounded to x's dtype, and the product rounded before the bias meets it
(`exact_mul`). Under invariant numerics this all happens inside each fixed row tile, so a row's bits do not depend
on its company and greedy speculation equals quantized target-only generation bit for bit, as in float.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxspec.errors import JaxspecError
from jaxspec.models.numerics import drop_held_weights

MODES = ("int8", "fp8")
QUANTIZED_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
INT8_MAX = 127
FP8 = jnp.float8_e4m3fn
FP8_MAX = float(jnp.finfo(FP8).max)  # 448


def quantize_weight(w: jax.Array, mode: str, held=None) -> tuple[jax.Array, jax.Array]:
    """w [K, N] → (q [K, N], s float32 [N]) with w ≈ q · s, per output channel (module docstring), q's values held
    in `held` (default: the mode's own dtype; `held_dtype_for`). int8: s = absmax / 127, q = round(w / s); fp8
    (e4m3): s = absmax / 448, q = w / s rounded to e4m3 (to nearest even), as compressed-tensors' FP8 checkpoints
    are made."""
    top = jnp.full((w.shape[-1],), INT8_MAX if mode == "int8" else FP8_MAX, jnp.float32)
    return _quantize(w, top, mode, held)


@functools.partial(jax.jit, static_argnames=("mode", "held"))
def _quantize(w, top, mode, held):
    # True IEEE quotients, as numpy and torch give them (compressed-tensors checkpoints store those): XLA rewrites
    # a division by a broadcast value into a multiply by its reciprocal (one ulp off in ~half the cases, measured
    # on XLA:CPU), so each divisor is a whole array, `top` made outside and the scale behind a barrier
    w = w.astype(jnp.float32)
    absmax = jnp.max(jnp.abs(w), axis=0)
    scale = jnp.where(absmax > 0, absmax / top, 1.0)  # [N]
    divisor = jax.lax.optimization_barrier(jnp.broadcast_to(scale, w.shape))  # [K, N]
    if mode == "int8":
        q = jnp.clip(jnp.round(w / divisor), -INT8_MAX, INT8_MAX).astype(jnp.int8)
    else:
        q = (w / divisor).astype(FP8)
    return q.astype(held or q.dtype), scale


def held_dtype_for(mode: str, backend: str | None = None):
    """How quantized weight values are held: in their own 8-bit dtype on accelerators (half a bfloat16 weight's
    bytes, read by the GEMM as they are); as float32 on CPU, where XLA:CPU widened an int8 weight into a fresh
    float32 copy at every dot (measured, SmolLM2 decode on 2 cores: 225 ms against 50 ms for float32 weights). The
    values are the same either way (int8 and e4m3 values are exact in float32 and bfloat16), so are the bits. On
    CPU the row kernel's panels of them are int8 (int8 values) or bfloat16 (e4m3 values), widened exactly in the
    kernel (`row_matmul.exact_panel_dtype`): a quarter or half of a float32 weight's bytes per step, while the
    float32 arrays themselves save no memory."""
    if (backend or jax.default_backend()) == "cpu":
        return jnp.float32
    return jnp.int8 if mode == "int8" else FP8


def quantized_linears(model):
    """The decoder layers' Linear modules that `quantize_target` quantizes, in order."""
    for layer in model.layers:
        for owner in (layer.self_attn, layer.mlp):
            for name in QUANTIZED_PROJECTIONS:
                if hasattr(owner, name):
                    yield getattr(owner, name)


def quantize_target(model, mode: str):
    """Quantize `model`'s decoder matmuls in place (`mode`: one of MODES) and return it. A model built for shapes
    only (`rngs=None`, as `--compiled-cost` builds one) gets int8 and scale shapes. What is held on the model for its
    steps (`llama.hold_step_weights`: side-by-side q/k/v kernels, row-kernel panels) is dropped, since it was made
    from the float kernels."""
    if mode not in MODES:
        raise ValueError(f"quantization must be one of {', '.join(MODES)}, got {mode!r}")
    if model.config.gemma is not None:
        raise JaxspecError(f"{mode} quantization of Gemma targets is not supported yet; run the target unquantized "
                           "(drop --quantize)")
    if model.config.moe is not None:
        raise JaxspecError(f"{mode} quantization of mixture-of-experts targets is not supported yet (their experts "
                           "would stay in the compute dtype); run the target unquantized (drop --quantize)")
    for linear in quantized_linears(model):
        linear.quantize(mode)
    drop_held_weights(model)
    model.quantization = mode
    return model
