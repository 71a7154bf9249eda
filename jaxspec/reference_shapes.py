"""The shapes of real targets, for random-weight models: a random Llama-3.1-8B gives the 8B speed and exercises the
8B numerics (contraction lengths, head counts, vocabulary) without a 16 GB download. Random weights give real speed
and real bit-level behaviour, not real text or acceptance."""

from __future__ import annotations

import dataclasses

from jaxspec.config import GemmaLayout, MoeConfig, RopeConfig, TargetConfig

SHAPES: dict[str, dict] = {
    "llama3.1-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
                        num_kv_heads=8, head_dim=128, rope=RopeConfig(theta=500000.0)),
    "llama3.2-1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16, num_heads=32,
                        num_kv_heads=8, head_dim=64, tie_word_embeddings=True, rope=RopeConfig(theta=500000.0)),
    "smollm2-135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                         num_kv_heads=3, head_dim=64, tie_word_embeddings=True),
    # Qwen3-30B-A3B: 128 experts of width 768 in all 48 layers, 8 per token (its config.json)
    "qwen3-30b-a3b": dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_layers=48, num_heads=32,
                          num_kv_heads=4, head_dim=128, rope=RopeConfig(theta=1000000.0), qk_norm=True,
                          model_type="qwen3_moe", rms_norm_eps=1e-6,
                          moe=MoeConfig(num_experts=128, top_k=8, intermediate_size=768, layers=tuple(range(48)))),
    # Gemma 4 31B as its public descriptions give it: 60 layers, 5 sliding (window 1024; 16 KV heads of 256) to 1
    # full (4 KV heads of 512, values from the key projection, proportional RoPE), tied 262k vocabulary, logits
    # soft-capped at 30; no per-layer inputs, no KV sharing. Not read from its config.json (no download here).
    "gemma4-31b": dict(vocab_size=262144, hidden_size=5376, intermediate_size=21504, num_layers=60, num_heads=32,
                       num_kv_heads=16, head_dim=256, tie_word_embeddings=True, qk_norm=True,
                       model_type="gemma4_text", rms_norm_eps=1e-6,
                       gemma=dict(sliding_window=1024, full_head_dim=512, full_kv_heads=4, k_eq_v=True,
                                   final_logit_softcapping=30.0)),
    # Gemma 3 27B (its config.json): 62 layers, 5 sliding (window 1024) to 1 full, 32 query / 16 KV heads of 128,
    # scores scaled by 168^-1/2, q/k norms, full layers' RoPE at 1e6 scaled linearly by 8, tied 262k vocabulary
    "gemma3-27b": dict(vocab_size=262208, hidden_size=5376, intermediate_size=21504, num_layers=62, num_heads=32,
                       num_kv_heads=16, head_dim=128, tie_word_embeddings=True, qk_norm=True,
                       model_type="gemma3_text", rms_norm_eps=1e-6,
                       gemma=dict(last_full=False, sliding_window=1024, full_head_dim=128, full_kv_heads=16,
                                  norm_offset=True, v_norm=False, layer_scalar=False, query_scale=168**-0.5,
                                  sliding_rope=(10_000.0, 1.0, 1.0), full_rope=(1_000_000.0, 1.0, 8.0))),
}


def gemma_layout(num_layers: int, intermediate_size: int, last_full: bool = True, **fields) -> GemmaLayout:
    """A Gemma layout for `num_layers` layers of the default pattern (every sixth layer full; Gemma 4's last layer
    full too: last_full), no KV sharing: what a shape with fewer layers compiles (compiled_cost measures whole periods
    of six)."""
    types = tuple("sliding_attention" if (i + 1) % 6 and (i < num_layers - 1 or not last_full) else "full_attention"
                  for i in range(num_layers))
    return GemmaLayout(layer_types=types, kv_source=tuple(range(num_layers)),
                        mlp_widths=(intermediate_size,) * num_layers, **fields)


def layer_period(cfg: TargetConfig) -> int:
    """Layers that repeat as one unit: Gemma's six (five sliding, one full), one layer otherwise."""
    return 6 if cfg.gemma is not None else 1


def reference_config(name: str, **overrides) -> TargetConfig:
    """The TargetConfig of shape `name` (a key of SHAPES), with `overrides` applied (e.g. max_position_embeddings;
    fewer `num_layers` keep the sparse layers among them)."""
    if name not in SHAPES:
        raise KeyError(f"unknown shape {name!r}; known: {', '.join(sorted(SHAPES))}")
    fields = {"max_position_embeddings": 4096, **SHAPES[name], **overrides}
    moe = fields.get("moe")
    if moe is not None and "moe" not in overrides:
        layers = tuple(i for i in moe.layers if i < fields["num_layers"])
        fields["moe"] = dataclasses.replace(moe, layers=layers)
    if isinstance(fields.get("gemma"), dict):
        fields["gemma"] = gemma_layout(fields["num_layers"], fields["intermediate_size"], **fields["gemma"])
    return TargetConfig(**fields)
