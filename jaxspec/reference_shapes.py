"""The shapes of real targets, for random-weight models: a random Llama-3.1-8B gives the 8B speed and exercises the
8B numerics (contraction lengths, head counts, vocabulary) without a 16 GB download. Random weights give real speed
and real bit-level behaviour, not real text or acceptance."""

from __future__ import annotations

import dataclasses

from jaxspec.config import RopeConfig, TargetConfig

SHAPES: dict[str, dict] = {
    "llama3.1-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
                        num_kv_heads=8, head_dim=128, rope=RopeConfig(theta=500000.0)),
    "llama3.2-1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16, num_heads=32,
                        num_kv_heads=8, head_dim=64, tie_word_embeddings=True, rope=RopeConfig(theta=500000.0)),
    "smollm2-135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                         num_kv_heads=3, head_dim=64, tie_word_embeddings=True),
}


def reference_config(name: str, **overrides) -> TargetConfig:
    """The TargetConfig of shape `name` (a key of SHAPES), with `overrides` applied (e.g. max_position_embeddings)."""
    if name not in SHAPES:
        raise KeyError(f"unknown shape {name!r}; known: {', '.join(sorted(SHAPES))}")
    cfg = TargetConfig(**{"max_position_embeddings": 4096, **SHAPES[name]})
    return dataclasses.replace(cfg, **overrides) if overrides else cfg
