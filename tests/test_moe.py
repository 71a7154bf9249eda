"""Mixture-of-experts targets (Mixtral, Qwen2-MoE, Qwen3-MoE; jaxspec/models/moe.py): greedy generation equals
transformers', the sparse block gives a token the same bits whatever tokens share its experts, and greedy
speculation (chain, tree, n-gram; batch 1 and 4; one device and experts split over the 8-device CPU mesh) equals
target-only in bfloat16. Logit and feature parity per family is in tests/test_llama_parity.py (hf_tiny.FAMILIES)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from hf_tiny import make_tiny
from spec_fixtures import PROMPTS, in_dtype

from jaxspec import sharding
from jaxspec.checkpoints.hf import load_target
from jaxspec.config import MoeConfig, TargetConfig
from jaxspec.engine.generation import Generator
from jaxspec.engine.generator import SpeculativeGenerator
from jaxspec.engine.tree import TreeConfig
from jaxspec.errors import JaxspecError
from jaxspec.models.llama import LlamaModel, SparseMoe
from jaxspec.models.numerics import Numerics, default_numerics


@pytest.mark.parametrize("family,overrides", [
    pytest.param("mixtral", dict(num_experts_per_tok=1), id="mixtral-top1", marks=pytest.mark.slow),
    pytest.param("qwen3_moe", dict(num_experts_per_tok=8, norm_topk_prob=False), id="qwen3-top8-unnormalized"),
    pytest.param("qwen2_moe_shared", {}, id="qwen2-shared-top2", marks=pytest.mark.slow),
])
def test_greedy_generation_equals_transformers(family, overrides, tmp_path):
    hf = make_tiny(family, tmp_path, seed=3, **overrides)
    with torch.no_grad():  # routers sharper than their init, so that the choice of experts matters
        for layer in hf.model.layers:
            if hasattr(layer.mlp, "gate") and hasattr(layer.mlp.gate, "weight") and layer.mlp.gate.weight.ndim == 2:
                layer.mlp.gate.weight.mul_(20.0)
    hf.save_pretrained(tmp_path)
    hf.generation_config.eos_token_id = None  # 32 tokens whatever they are, as jaxspec without stop ids
    model = load_target(tmp_path)
    assert model.config.moe.top_k == (overrides.get("num_experts_per_tok") or 2)
    prompts = [[5, 17, 3, 9, 60], [44, 2, 61, 8, 19, 23, 7]]
    got = Generator(model, batch_size=2).generate(prompts, max_new_tokens=32)
    for prompt, completion in zip(prompts, got):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False, pad_token_id=0)
        assert completion.token_ids == ref[0, len(prompt):].tolist()


def _sparse_block(dtype, hidden: int = 64, width: int = 48) -> SparseMoe:
    cfg = dataclasses.replace(moe_config(num_experts=8, top_k=2), hidden_size=hidden)
    cfg = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, intermediate_size=width))
    block = SparseMoe(cfg, dtype=dtype, rngs=nnx.Rngs(0))
    block.gate.kernel.set_value(block.gate.kernel[...] * 30)  # decisive routing: tokens spread over the experts
    return block


@pytest.mark.parametrize("numerics", [
    default_numerics("cpu", "reference"),  # one-row tiles (decode, verify)
    # a CPU prefill: its experts on 64-row tiles
    pytest.param(default_numerics("cpu", "reference").for_prefill(), marks=pytest.mark.slow),
    Numerics(row_tile=8),  # 8-row tiles: every tile shared by tokens of one expert
], ids=["cpu-decode", "cpu-prefill", "tile8"])
def test_a_tokens_expert_output_does_not_depend_on_the_others(numerics):
    """The router and the experts in bfloat16: each token's output is the same bits computed alone, with 5 or 37
    other tokens, or in another order (so its experts' tiles hold other tokens, or fewer). At SmolLM2's widths
    (hidden 576, experts 1536 wide), where the plain path (ragged_dot) gave some tokens other bits in other company
    on this project's CPU (measured; at the tiny model's widths it did not)."""
    block = _sparse_block(jnp.bfloat16, hidden=576, width=1536)
    x = (jax.random.normal(jax.random.key(1), (40, 576)) * 2).astype(jnp.bfloat16)
    graphdef, state = nnx.split(block)  # weights as arguments, not constants folded into each program
    forward = jax.jit(lambda state, x: nnx.merge(graphdef, state)(x, numerics))
    run = functools.partial(forward, state)
    whole = np.asarray(run(x).astype(jnp.float32))
    chosen = np.asarray(jax.lax.top_k(x.astype(jnp.float32) @ block.gate.kernel[...], 2)[1])
    assert len(np.unique(chosen)) == 8  # all experts in use, several tokens each
    for rows in ([3], [0, 7, 11, 12, 30, 39], list(range(39, -1, -1))):
        part = np.asarray(run(x[np.asarray(rows)]).astype(jnp.float32))
        np.testing.assert_array_equal(part, whole[rows])


def test_plain_and_invariant_numerics_agree_closely():
    """The ragged_dot path (plain numerics: training features) computes the same function as the tiles."""
    block = _sparse_block(jnp.float32)
    x = jax.random.normal(jax.random.key(2), (2, 9, 64))
    tiled = block(x, default_numerics("cpu", "reference"))
    plain = block(x, None)
    np.testing.assert_allclose(np.asarray(plain), np.asarray(tiled), rtol=2e-5, atol=2e-6)


def moe_config(num_experts: int = 8, top_k: int = 2, vocab: int = 101, **moe) -> TargetConfig:
    """spec_fixtures.tiny_target's shape with sparse MLPs in layers 0, 2 and 3 (layer 1 dense)."""
    return TargetConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_layers=4, num_heads=4, num_kv_heads=2,
        head_dim=16, max_position_embeddings=2048,
        moe=MoeConfig(num_experts=num_experts, top_k=top_k, intermediate_size=48, layers=(0, 2, 3), **moe),
    )


@functools.cache
def moe_target(vocab: int = 101, logit_scale: float = 1.0) -> LlamaModel:
    """A random MoE target whose embeddings dominate its residual stream (as spec_fixtures.tiny_target), its
    routers sharpened so that tokens go to different experts."""
    model = LlamaModel(moe_config(vocab=vocab), rngs=nnx.Rngs(4))
    model.embed_tokens.set_value(model.embed_tokens[...] * 20.0)
    model.lm_head.kernel.set_value(model.lm_head.kernel[...] * logit_scale)
    for i in model.config.moe.layers:
        gate = model.layers[i].mlp.gate.kernel
        gate.set_value(gate[...] * 30.0)
    return model


@functools.cache
def moe_head():
    from fit_head import fit_head

    return fit_head(moe_target(), steps=200, n_seqs=32, seq_len=40)


@functools.cache
def bf16_moe() -> LlamaModel:
    return in_dtype(moe_target(), jnp.bfloat16)


@functools.cache
def bf16_reference() -> list[list[int]]:
    """Target-only, one row at a time: what every batch and every method must give."""
    return [c.token_ids for c in Generator(bf16_moe(), batch_size=1).generate(PROMPTS + [PROMPTS[1] * 3],
                                                                               max_new_tokens=32)]


@pytest.mark.parametrize("method,batch", [
    pytest.param("chain5", 4, id="chain5-b4", marks=pytest.mark.slow),  # CI: the mesh test below
    pytest.param("chain5", 1, id="chain5-b1", marks=pytest.mark.slow),
    pytest.param("tree", 4, id="tree-b4", marks=pytest.mark.slow),
    pytest.param("tree", 1, id="tree-b1", marks=pytest.mark.slow),
    pytest.param("ngram", 4, id="ngram-b4", marks=pytest.mark.slow),
    pytest.param("ngram", 1, id="ngram-b1", marks=pytest.mark.slow),
])
def test_bfloat16_greedy_speculation_equals_target_only(method, batch):
    """In bfloat16, where a token's bits changing with its company would part the texts within a few tokens."""
    target = bf16_moe()
    prompts = PROMPTS + [PROMPTS[1] * 3]  # the last one repeats itself: prompt lookup finds matches
    if method == "ngram":
        from jaxspec.engine.proposers.ngram import NgramProposer

        gen = Generator(target, proposer=NgramProposer(4, 2, 3), batch_size=batch)
    else:
        tree = TreeConfig(10, 4, 3) if method == "tree" else None
        gen = SpeculativeGenerator(target, moe_head(), num_draft=5, tree=tree, batch_size=batch)
    got = gen.generate(prompts, max_new_tokens=32)
    assert [c.token_ids for c in got] == bf16_reference()
    if method == "ngram":  # steps that verified a match and steps that ran the root alone
        outcomes = {k: sum(c.stats["rejections"][k] for c in got) for k in ("no_draft", "miss", "all_accepted")}
        assert outcomes["no_draft"] > 0 and outcomes["miss"] + outcomes["all_accepted"] > 0
    else:
        assert np.mean([c.stats["mean_accepted_length"] for c in got]) > 1.5  # drafts were really accepted


@pytest.mark.parametrize("proposer", ["ngram", pytest.param("chain4", marks=pytest.mark.slow),
                                      pytest.param("tree", marks=pytest.mark.slow)])
def test_experts_split_over_the_mesh_give_one_devices_tokens(proposer):
    """data=2, model=4: each device holds 2 of the 8 experts of every sparse layer and runs their tiles; prompt
    lookup (CI: no head to fit), a chain of 4 and a tree with a fitted head, in bfloat16, give the one-device
    target-only tokens. Batch 8 holds all five prompts and three empty rows: one prefill and one step compile."""
    from jaxspec.engine.proposers.ngram import NgramProposer

    mesh = sharding.make_mesh(sharding.MeshConfig(data=2, model=4))
    if proposer == "ngram":
        gen = Generator(bf16_moe(), proposer=NgramProposer(4, 2, 3), batch_size=8, mesh=mesh)
    else:
        tree = TreeConfig(10, 4, 3) if proposer == "tree" else None
        gen = SpeculativeGenerator(bf16_moe(), moe_head(), num_draft=4, tree=tree, batch_size=8, mesh=mesh)
    got = gen.generate(PROMPTS + [PROMPTS[1] * 3], max_new_tokens=32)
    assert [c.token_ids for c in got] == bf16_reference()
    assert sum(c.stats["accepted_per_position"][0] for c in got) > 0  # drafts were accepted
    if proposer == "ngram":  # and steps without a match ran the root alone
        assert sum(c.stats["rejections"]["no_draft"] for c in got) > 0
    experts = gen.params["layers"][0]["mlp"]["experts"]
    for name, shape in (("gate_proj", (2, 64, 48)), ("down_proj", (2, 48, 64))):
        array = experts[name][...]
        assert {s.data.shape for s in array.addressable_shards} == {shape}, name
    # the memory report counts what one device holds: a quarter of the experts
    held = 4 * sum(x.size for x in jax.tree.leaves(nnx.state(bf16_moe(), nnx.Param)))  # float32-held on CPU
    experts_bytes = 4 * 3 * 8 * 64 * 48 * 3  # 3 sparse layers x gate/up/down
    assert gen.memory.target_parameters <= held - experts_bytes * 3 // 4


def test_sparse_layers_follow_the_config():
    cfg = moe_config()
    model = LlamaModel(cfg, rngs=None)
    kinds = [type(layer.mlp).__name__ for layer in model.layers]
    assert kinds == ["SparseMoe", "MLP", "SparseMoe", "SparseMoe"]
    with pytest.raises(JaxspecError, match="exceeds the 8 experts"):
        MoeConfig(num_experts=8, top_k=9, intermediate_size=4, layers=())
    from jaxspec.models.quantize import quantize_target

    with pytest.raises(JaxspecError, match="mixture-of-experts"):
        quantize_target(model, "int8")


@pytest.mark.slow  # ~1 min: 20 000 two-token draws
def test_speculative_sampling_from_a_moe_target_is_lossless(monkeypatch):
    """tests/test_spec_sampling.py's chain case on a sparse target (plain numerics, as there): the first two
    tokens follow the target's own joint distribution."""
    import test_spec_sampling as tss

    from fit_head import fit_head
    from jaxspec.sampling import SamplingConfig

    target = nnx.clone(moe_target(vocab=tss.VOCAB, logit_scale=15.0))
    target.numerics = None
    head = fit_head(target, steps=300)
    monkeypatch.setattr(tss, "plain_target", lambda: target)
    monkeypatch.setattr(tss, "fitted_head", lambda **_: head)
    tss.test_joint_distribution_and_acceptance_rate(SamplingConfig(2.0, top_p=0.9))


def test_a_moe_model_type_with_bad_expert_counts_is_one_line():
    from jaxspec.config import target_config_from_hf

    raw = dict(model_type="qwen3_moe", vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=2,
               num_attention_heads=2, num_key_value_heads=1, moe_intermediate_size=4, num_experts_per_tok=2)
    with pytest.raises(JaxspecError, match="num_experts"):
        target_config_from_hf(raw)
    cfg = target_config_from_hf({**raw, "num_experts": 4, "mlp_only_layers": [0]})
    assert cfg.moe.layers == (1,) and cfg.moe.num_experts == 4 and not cfg.moe.norm_topk_prob
    with pytest.raises(JaxspecError, match="exceeds"):
        target_config_from_hf({**raw, "num_experts": 1})


@pytest.mark.slow  # ~2 min: data generated by the target, 60 training steps, two evaluations
def test_a_head_trained_on_a_moe_target_loads_back_and_accepts_more_than_a_random_one(tmp_path):
    """train.launch on a tiny Qwen3-MoE checkpoint and its own greedy continuations: the exported head loads
    against the target and accepts more drafts per verify than an untrained head of the same shape."""
    from hf_tiny import train_head_on_own_text

    from jaxspec.checkpoints.heads import load_head
    from jaxspec.models.eagle3 import Eagle3Head

    hf = make_tiny("qwen3_moe", tmp_path / "target", seed=1)
    with torch.no_grad():  # embeddings dominate the residual stream (as spec_fixtures.tiny_target), sharp routers
        hf.model.embed_tokens.weight.mul_(20.0)
        for i in (0, 2, 3):
            hf.model.layers[i].mlp.gate.weight.mul_(20.0)
    hf.save_pretrained(tmp_path / "target")
    target = load_target(tmp_path / "target")
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 97, 5).tolist() for _ in range(48)]
    run_dir, seqs = train_head_on_own_text(tmp_path / "target", tmp_path, prompts, batch_size=16, seq_len=24,
                                           draft_vocab_size=64)
    trained = load_head(run_dir / "head-speculators", target.config, dtype="float32")
    untrained = Eagle3Head(trained.config, rngs=nnx.Rngs(0))
    held_out = [s[:6] for s in seqs[:8]]

    def accepted(head) -> float:
        out = SpeculativeGenerator(target, head, num_draft=3, batch_size=4).generate(held_out, max_new_tokens=24)
        return float(np.mean([c.stats["mean_accepted_length"] for c in out]))

    assert accepted(trained) > 1.5 > accepted(untrained)
