"""How far a quantized target's features and next-token distributions drift from its float original's
(`jaxspec.bench --quantize MODE --quantization-drift`).

Why: a head trained on the float target reads the quantized target's auxiliary hidden states and is verified
against its logits. Where the features drift, the head's drafts get worse (acceptance falls); where the logits
drift, the text itself changes. vLLM's plan for MXFP4 verifiers asks for exactly this telemetry before deciding on
mitigations (rescaling, distilling the head on quantized features).

What: both targets run every prompt once (one padded batch, causal, so padding after a prompt changes none of its
positions; plain numerics, whose last bits differ from the invariant ones' far less than quantization moves them); over the prompts' real positions, for each auxiliary layer the head reads, the mean cosine similarity
and mean relative L2 error of the quantized hidden state against the float one, and for the logits the mean
KL(float || quantized) of the next-token distributions and how often their argmax agrees.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


def quantization_drift(float_model, quantized_model, prompts: list[list[int]]) -> dict:
    """{"aux_layers": [{"layer", "cosine", "relative_error"}, ...], "next_token_kl", "argmax_agreement",
    "positions"} of `quantized_model` against `float_model` (same config) on `prompts` (token ids)."""
    cfg = float_model.config
    width = max(len(p) for p in prompts)
    tokens = np.zeros((len(prompts), width), np.int32)
    valid = np.zeros((len(prompts), width), bool)
    for row, ids in enumerate(prompts):
        tokens[row, : len(ids)] = ids
        valid[row, : len(ids)] = True
    positions = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), tokens.shape)

    def forward(model):
        model = nnx.merge(*nnx.split(model))  # the same weights, run with plain numerics: one dot per matmul
        model.numerics = None  # (the invariant tiles' decode path would take one weight pass per prompt row)
        out = model(jnp.asarray(tokens), positions, model.init_cache(len(prompts), width), return_aux=True)
        aux = out.aux.astype(jnp.float32).reshape(*tokens.shape, len(cfg.aux_layer_ids), cfg.hidden_size)
        return np.asarray(aux[valid]), np.asarray(jax.nn.log_softmax(out.logits.astype(jnp.float32))[valid])

    (f_aux, f_logp), (q_aux, q_logp) = forward(float_model), forward(quantized_model)  # [P, L, H], [P, V]
    dot = np.sum(f_aux * q_aux, axis=-1)
    norms = np.linalg.norm(f_aux, axis=-1), np.linalg.norm(q_aux, axis=-1)
    cosine = dot / np.maximum(norms[0] * norms[1], 1e-30)  # [P, L]
    relative = np.linalg.norm(q_aux - f_aux, axis=-1) / np.maximum(norms[0], 1e-30)
    kl = np.sum(np.exp(f_logp) * (f_logp - q_logp), axis=-1)  # [P]
    return {
        "aux_layers": [
            {"layer": layer, "cosine": float(cosine[:, i].mean()), "relative_error": float(relative[:, i].mean())}
            for i, layer in enumerate(cfg.aux_layer_ids)
        ],
        "next_token_kl": float(kl.mean()),
        "argmax_agreement": float(np.mean(f_logp.argmax(-1) == q_logp.argmax(-1))),
        "positions": int(valid.sum()),
    }
