"""`--memory-report`: the bytes reported for parameters and KV caches are what the shapes say, on one device and per
device on a mesh; the compiled step's peak covers its parameters and caches."""

from __future__ import annotations

import functools
import math

import jax
import pytest
from fit_head import head_config_for
from flax import nnx

from jaxspec import sharding
from jaxspec.config import TargetConfig
from jaxspec.engine.generation import Generator
from jaxspec.models.eagle3 import Eagle3Head
from jaxspec.models.llama import LlamaModel
from jaxspec.engine.generator import SpeculativeGenerator

CFG = TargetConfig(vocab_size=104, hidden_size=64, intermediate_size=128, num_layers=3, num_heads=8, num_kv_heads=4,
                   head_dim=16, tie_word_embeddings=False)
PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8], [9], [10, 11]]
F32 = 4


@functools.cache
def models():
    target = LlamaModel(CFG, rngs=nnx.Rngs(0))
    return target, Eagle3Head(head_config_for(target), rngs=nnx.Rngs(1))


def target_parameter_bytes(c: TargetConfig) -> int:
    """From the config: embeddings, per layer q/k/v/o + gate/up/down + two norms, the final norm, the lm head."""
    h, q, kv = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    layer = h * q + 2 * h * kv + q * h + 3 * h * c.intermediate_size + 2 * h
    return F32 * (c.vocab_size * h + c.num_layers * layer + h + (0 if c.tie_word_embeddings else h * c.vocab_size))


def held_step_bytes(c: TargetConfig, numerics) -> int:
    """What `llama.hold_step_weights` holds for these numerics: with the CPU row kernel every matmul's weight as
    16-column panels (q/k/v side by side, the tied table as the LM head), else the side-by-side q/k/v kernel."""
    h, q, kv, i = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.intermediate_size

    def panels(k: int, n: int) -> int:
        return F32 * k * -(-n // 16) * 16

    if numerics.row_kernel:
        layer = panels(h, q + 2 * kv) + panels(q, h) + 2 * panels(h, i) + panels(i, h)
        return c.num_layers * layer + panels(h, c.vocab_size)
    return F32 * c.num_layers * h * (q + 2 * kv) if numerics.fused_qkv else 0


def kv_cache_bytes(layers: int, batch: int, kv_heads: int, capacity: int, head_dim: int) -> int:
    """K and V of every layer, [B, Hkv, S, D] each, plus the per-row committed lengths (int32)."""
    return 2 * layers * batch * kv_heads * capacity * head_dim * F32 + batch * 4


def test_target_only_report_matches_the_shapes():
    target, _ = models()
    gen = Generator(target, batch_size=2)
    gen.generate(PROMPTS[:2], max_new_tokens=6)
    m = gen.memory
    assert (m.devices, m.batch_size, m.head_parameters, m.head_kv_cache) == (1, 2, 0, 0)
    held = held_step_bytes(CFG, target.numerics)  # what a CPU generator derives and holds (hold_step_weights)
    assert m.target_parameters == target_parameter_bytes(CFG) + held
    assert m.target_kv_cache == kv_cache_bytes(CFG.num_layers, 2, CFG.num_kv_heads, m.cache_capacity, CFG.head_dim)
    # the step reads its weights (the held q/k/v in place of the separate ones, which only a prefill reads) and cache
    assert m.step_peak >= m.target_parameters - held + m.target_kv_cache
    assert any("target KV cache (batch 2" in line for line in m.lines())


def test_speculative_report_adds_the_head():
    target, head = models()
    gen = SpeculativeGenerator(target, head, num_draft=3, batch_size=2)
    gen.generate(PROMPTS[:2], max_new_tokens=6)
    m, hc = gen.memory, head.config
    head_params = sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(nnx.state(head)))
    assert m.head_parameters == head_params > 0
    head_capacity = m.head_kv_cache // (2 * 2 * hc.num_kv_heads * hc.head_dim * F32)  # one layer, batch 2
    assert m.head_kv_cache == kv_cache_bytes(1, 2, hc.num_kv_heads, head_capacity, hc.head_dim)
    assert head_capacity >= m.cache_capacity - gen.extra_capacity
    assert m.target_kv_cache == kv_cache_bytes(CFG.num_layers, 2, CFG.num_kv_heads, m.cache_capacity, CFG.head_dim)


@pytest.mark.slow  # ~17 s; CI: test_mesh checks the per-device head cache a mesh generator reports
@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices (XLA_FLAGS host device count)")
def test_a_mesh_reports_per_device_bytes():
    """data=2 × model=4: each device holds a quarter of the KV heads of half the rows."""
    target, _ = models()
    mesh = sharding.make_mesh(sharding.MeshConfig(data=2, model=4))
    gen = Generator(target, batch_size=4, mesh=mesh)
    gen.generate(PROMPTS, max_new_tokens=6)
    m = gen.memory
    assert m.devices == 8
    kv_only = kv_cache_bytes(CFG.num_layers, 4, CFG.num_kv_heads, m.cache_capacity, CFG.head_dim) - 4 * 4
    assert m.target_kv_cache == kv_only // 8 + 2 * 4  # lengths split over data
    assert m.target_parameters < target_parameter_bytes(CFG) // 2  # split over model, not replicated
    assert any("per device (8 devices)" in line for line in m.lines())
