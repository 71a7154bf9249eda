"""Gemma 4 targets (jaxspec/models/gemma.py): tiny random Gemma 4 text decoders built with transformers' own
config class and weight names load by name (and from the multimodal checkpoint's layout), give transformers' logits
and features and its greedy text (past the sliding window; 26B-A4B's mixture-of-experts block too), and greedy
speculation (EAGLE-3 chain and tree, n-gram; batch 1 and 4; one device and the CPU mesh, experts split over it)
equals target-only in bfloat16. The sliding window in the invariant
attention itself (kernel and reference) is tested in tests/test_invariant_attention.py."""

from __future__ import annotations

import copy
import functools
import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from hf_tiny import as_multimodal, assert_greedy_text_equals_transformers
from spec_fixtures import PROMPTS, in_dtype

from jaxspec import sharding
from jaxspec.checkpoints.hf import load_target
from jaxspec.config import target_config_from_hf
from jaxspec.engine.generation import Generator
from jaxspec.engine.generator import SpeculativeGenerator
from jaxspec.engine.tree import TreeConfig
from jaxspec.errors import JaxspecError
from jaxspec.models.gemma import GemmaModel

SLIDING, FULL = "sliding_attention", "full_attention"

# Every Gemma 4 feature on: two layer types with their own head sizes and RoPE, a window of 8 (generation runs far
# past it), keys and values shared by the last two layers, per-layer inputs, values from the key projection in full
# layers, double-wide MLPs in shared layers, soft-capped logits.
ALL_ON = dict(
    vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, global_head_dim=32, sliding_window=8,
    layer_types=[SLIDING, SLIDING, FULL, SLIDING, SLIDING, FULL], hidden_size_per_layer_input=8,
    vocab_size_per_layer_input=128, num_kv_shared_layers=2, attention_k_eq_v=True, num_global_key_value_heads=1,
    final_logit_softcapping=30.0, use_double_wide_mlp=True,
)
# ... with 26B-A4B's mixture-of-experts block beside every dense MLP (4 experts, 2 per token)
MOE = dict(ALL_ON, enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=24)
# ... and off: no sharing, no per-layer inputs, separate values, the default 5:1 layer pattern, no capping.
ALL_OFF = dict(ALL_ON, num_hidden_layers=7, layer_types=None, hidden_size_per_layer_input=0, num_kv_shared_layers=0,
               attention_k_eq_v=False, num_global_key_value_heads=None, final_logit_softcapping=None,
               use_double_wide_mlp=False, sliding_window=6)


def make_gemma4(out_dir, seed: int = 0, **config):
    """A random Gemma4ForCausalLM saved to out_dir: weights N(0, 0.15²), norm weights 1 + N(0, 0.2²) and layer
    scalars 0.8, so that every part changes the output. (At N(0, 0.3²) one position of ALL_ON's logits moved 2e-3
    between transformers and jaxspec, plain and invariant numerics alike: a value vector near zero, which the
    weightless value norm scales up, amplifies float32 rounding; 2e-5 elsewhere.)"""
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    torch.manual_seed(seed)
    hf = Gemma4ForCausalLM(Gemma4TextConfig(**config)).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.normal_(0.0, 0.2 if "norm" in name else 0.15)
            if "norm" in name:
                p.add_(1.0)
        for name, b in hf.named_buffers():
            if name.endswith("layer_scalar"):
                b.fill_(0.8)
    hf.save_pretrained(out_dir)
    hf.generation_config.eos_token_id = None  # 32 tokens whatever they are, as jaxspec without stop ids
    return hf


@pytest.mark.parametrize("config", [ALL_ON, MOE, pytest.param(ALL_OFF, marks=pytest.mark.slow)],
                         ids=["all-on", "moe", "all-off"])
def test_logits_features_and_greedy_text_equal_transformers(config, tmp_path):
    hf = make_gemma4(tmp_path, **config)
    model = load_target(tmp_path, aux_layer_ids=(1, 3, 5))
    assert isinstance(model, GemmaModel)
    forward = nnx.jit(lambda m, ids, positions: m(ids, positions, m.init_cache(2, 24), empty_cache=True,
                                                  return_aux=True))
    ids = np.random.RandomState(0).randint(0, 128, (2, 20))
    # The reference in float64 where transformers runs it (not its grouped MoE matmul): the exact values, so that the
    # tolerance measures jaxspec's float32 rounding alone. At ALL_ON's position [0, 12] (the amplified value norm of
    # make_gemma4's docstring) torch's own float32 logits are 1.0e-4 from the exact ones, a fifth of the tolerance,
    # and float32 summation orders land up to 3.6e-4 away (XLA's plain dots 1.0e-4, the CPU row attention 3.6e-4;
    # on the other positions and seeds the row attention is as close as the others or closer)
    exact = hf if config.get("enable_moe_block") else copy.deepcopy(hf).double()
    with torch.no_grad():  # hidden states asked for: transformers then runs every layer on every position
        ref = exact(torch.tensor(ids), output_hidden_states=True)
    positions = jnp.broadcast_to(jnp.arange(20), (2, 20))
    for numerics in ("invariant", "plain") if config is ALL_OFF else ("invariant",):  # plain: -m slow
        if numerics == "plain":
            model.numerics = None
        out = forward(model, jnp.asarray(ids), positions)
        scale = np.abs(ref.logits.numpy()).max()
        np.testing.assert_allclose(np.asarray(out.logits), ref.logits.numpy(), atol=1e-4 * scale, err_msg=numerics)
        features = np.concatenate([ref.hidden_states[i].numpy() for i in (1, 3, 5)], axis=-1)
        np.testing.assert_allclose(np.asarray(out.aux), features, atol=1e-4 * np.abs(features).max())
    if config is ALL_ON:  # the same decoder in the multimodal checkpoint's layout: the same logits
        # the decoder under model.language_model., a vision tower beside it (to be ignored), and a k/v weight a
        # KV-shared layer does not use (ignored, as transformers ignores them)
        multimodal = as_multimodal(tmp_path, tmp_path / "multimodal", "gemma4", "model.language_model.", {
            "model.vision_tower.encoder.weight": (4, 4),
            "model.language_model.layers.5.self_attn.k_proj.weight": (32, 64)})
        mm_out = forward(load_target(multimodal, aux_layer_ids=(1, 3, 5)), jnp.asarray(ids), positions)
        np.testing.assert_array_equal(np.asarray(mm_out.logits), np.asarray(out.logits))
    assert_greedy_text_equals_transformers(load_target(tmp_path), hf)  # invariant numerics, the default


@functools.cache
def gemma_checkpoint(tmp_root) -> str:
    path = tmp_root / "gemma4-all-on"
    make_gemma4(path, seed=1, **ALL_ON)
    return str(path)


@pytest.fixture(scope="module")
def bf16_gemma(tmp_path_factory):
    return in_dtype(load_target(gemma_checkpoint(tmp_path_factory.getbasetemp())), jnp.bfloat16)


@pytest.fixture(scope="module")
def gemma_head(bf16_gemma, tmp_path_factory):
    from fit_head import fit_head

    return fit_head(load_target(gemma_checkpoint(tmp_path_factory.getbasetemp())), steps=300)


PROMPT_SET = [PROMPTS[0], PROMPTS[1] * 3, PROMPTS[2], PROMPTS[3]]  # one repeats itself: prompt lookup finds matches


@pytest.fixture(scope="module")
def bf16_reference(bf16_gemma):
    """Target-only, one row at a time: what every batch, method and mesh must give."""
    return [c.token_ids for c in Generator(bf16_gemma, batch_size=1).generate(PROMPT_SET, max_new_tokens=32)]


@pytest.mark.parametrize("method,batch", [  # CI: n-gram on the mesh below (a head takes ~60 s to fit)
    pytest.param("chain5", 4, marks=pytest.mark.slow),
    pytest.param("chain5", 1, marks=pytest.mark.slow),
    pytest.param("tree", 4, marks=pytest.mark.slow),
    pytest.param("tree", 1, marks=pytest.mark.slow),
    pytest.param("ngram", 1, marks=pytest.mark.slow),
])
def test_bfloat16_greedy_speculation_equals_target_only(method, batch, bf16_gemma, gemma_head, bf16_reference):
    """In bfloat16, where a token's bits changing with its company would part the texts within a few tokens; 32
    tokens after prompts of up to 33 run every sliding layer far past its window of 8."""
    if method == "ngram":
        from jaxspec.engine.proposers.ngram import NgramProposer

        gen = Generator(bf16_gemma, proposer=NgramProposer(4, 2, 3), batch_size=batch)
    else:
        tree = TreeConfig(10, 4, 3) if method == "tree" else None
        gen = SpeculativeGenerator(bf16_gemma, in_dtype(gemma_head, jnp.bfloat16), num_draft=5, tree=tree,
                                   batch_size=batch)
    got = gen.generate(PROMPT_SET, max_new_tokens=32)
    assert [c.token_ids for c in got] == bf16_reference
    assert sum(c.stats["accepted_per_position"][0] for c in got) > 0  # drafts were really accepted


@pytest.mark.slow  # ~70 s; CI: the assistant's bfloat16 batch below (one device) and the mesh tests of the other
def test_a_mesh_gives_one_devices_tokens(bf16_gemma, bf16_reference):  # families
    """data=2, model=2: heads split over the model axis (the full layers' one KV head repeated on both devices),
    prompt lookup in bfloat16, the one-device target-only tokens."""
    from jaxspec.engine.proposers.ngram import NgramProposer

    mesh = sharding.make_mesh(sharding.MeshConfig(data=2, model=2))
    gen = Generator(bf16_gemma, proposer=NgramProposer(4, 2, 3), batch_size=4, mesh=mesh)
    got = gen.generate(PROMPT_SET, max_new_tokens=32)
    assert [c.token_ids for c in got] == bf16_reference
    assert sum(c.stats["rejections"]["all_accepted"] + c.stats["rejections"]["miss"] for c in got) > 0


@pytest.mark.parametrize("mesh", [None, pytest.param((2, 2), marks=pytest.mark.slow)],  # the mesh: ~90-130 s
                         ids=["one-device", "mesh"])
def test_greedy_speculation_on_a_moe_target_equals_target_only(mesh, tmp_path):
    """26B-A4B's block in bfloat16: prompt lookup at batch 4 (steps that verify a match, steps that run the root
    alone) gives target-only's tokens one row at a time; on a data=2 x model=2 mesh too, each device holding 2 of
    every layer's 4 experts and running their tiles."""
    from jaxspec.engine.proposers.ngram import NgramProposer

    make_gemma4(tmp_path, seed=3, **MOE)
    target = in_dtype(load_target(tmp_path), jnp.bfloat16)
    prompts = [PROMPTS[0], [5, 6, 7, 8] * 3, PROMPTS[2], PROMPTS[3]]  # one prompt bucket: one prefill compile each
    want = [c.token_ids for c in Generator(target, batch_size=1).generate(prompts, max_new_tokens=24)]
    on = None if mesh is None else sharding.make_mesh(sharding.MeshConfig(data=mesh[0], model=mesh[1]))
    gen = Generator(target, proposer=NgramProposer(4, 2, 3), batch_size=4, mesh=on)
    got = gen.generate(prompts, max_new_tokens=24)
    assert [c.token_ids for c in got] == want
    assert sum(c.stats["rejections"]["all_accepted"] + c.stats["rejections"]["miss"] for c in got) > 0
    if on is not None:
        experts = gen.params["layers"][0]["experts"]
        assert {s.data.shape for s in experts["gate_proj"][...].addressable_shards} == {(2, 64, 24)}


def test_config_layout_and_refusals():
    raw = dict(ALL_ON, model_type="gemma4_text")  # global_head_dim / num_global_key_value_heads (earlier releases)
    cfg = target_config_from_hf(raw)
    g = cfg.gemma
    assert g.kv_source == (0, 1, 2, 3, 3, 2) and g.cache_layers == (0, 1, 2, 3)
    assert (g.full_head_dim, g.full_kv_heads, cfg.head_dim, cfg.num_kv_heads) == (32, 1, 16, 2)
    assert g.mlp_widths == (96,) * 4 + (192,) * 2
    assert g.full_rope == (1e6, 0.25, 1.0) and g.sliding_rope == (1e4, 1.0, 1.0)
    from transformers import Gemma4TextConfig

    # as transformers >= 5.2x writes it: per_layer_config holds only the overrides that differ (none here)
    written = Gemma4TextConfig(**dict(ALL_ON, global_head_dim=16, num_global_key_value_heads=2)).to_dict()
    assert written["per_layer_config"] == {} and "global_head_dim" not in written
    layout = target_config_from_hf(written).gemma
    assert (layout.full_head_dim, layout.full_kv_heads) == (16, 2)
    written = Gemma4TextConfig(**ALL_ON).to_dict()
    assert (target_config_from_hf(written).gemma.full_head_dim, target_config_from_hf(written).gemma.full_kv_heads) \
        == (32, 1)
    from jaxspec.models.quantize import quantize_target

    with pytest.raises(JaxspecError, match="quantization of Gemma targets"):
        quantize_target(GemmaModel(cfg, rngs=None), "int8")
    moe = target_config_from_hf(dict(MOE, model_type="gemma4_text")).moe
    assert (moe.num_experts, moe.top_k, moe.intermediate_size, moe.layers) == (4, 2, 24, tuple(range(6)))
    assert moe.norm_topk_prob and not moe.round_weights
    for bad, message in ((dict(MOE, num_experts=None), "lacks the field 'num_experts'"),
                         (dict(MOE, top_k_experts=5), "exceeds the 4 experts"),
                         (dict(use_bidirectional_attention="all"), "bidirectional"),
                         (dict(hidden_activation="relu"), "hidden_activation"),
                         (dict(num_kv_shared_layers=6), "num_kv_shared_layers"),
                         (dict(per_layer_config={"9": {"head_dim": 8}}), "per_layer_config must map"),
                         (dict(num_global_key_value_heads=3), "not a multiple of the full layers' 3 KV heads"),
                         (dict(sliding_window=0), "sliding_window must be at least 1"),
                         (dict(vocab_size_per_layer_input=64), "vocab_size_per_layer_input=64 is smaller"),
                         (dict(rope_parameters={"sliding_attention": {}}), "no 'full_attention'")):
        with pytest.raises(JaxspecError, match=message):
            target_config_from_hf({**raw, **bad})


@pytest.mark.slow  # ~90 s: greedy data from the target, 60 training steps, two generate runs
def test_an_eagle3_head_trained_on_gemma4_loads_back_and_accepts_more_than_a_random_one(tmp_path, capsys):
    """train.launch against a Gemma 4 target (online features from its layers), the export names the verifier
    Gemma4ForCausalLM, and jaxspec.generate with it gives the target's text with more tokens per verify than an
    untrained head of the same shape."""
    from hf_tiny import train_head_on_own_text, write_char_tokenizer

    from jaxspec import convert, generate

    target = tmp_path / "target"
    make_gemma4(target, seed=2, **dict(ALL_ON, vocab_size=97, vocab_size_per_layer_input=97))
    write_char_tokenizer(target)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 95, 5).tolist() for _ in range(24)]  # printable characters (write_char_tokenizer)
    run_dir, _ = train_head_on_own_text(target, tmp_path, prompts)
    head = run_dir / "head-speculators"
    record = json.loads((head / "config.json").read_text())
    assert record["speculators_config"]["verifier"]["architectures"] == ["Gemma4ForCausalLM"]
    assert convert.main(["random-head", "--target", str(target), "--out", str(tmp_path / "random")]) == 0
    text = "".join(chr(32 + i) for i in prompts[0])  # a training prompt: the head has seen its continuation
    common = ["--target", str(target), "--raw", "--json", "--prompt", text, "--max-new-tokens", "24"]
    runs = {}
    for name, extra in (("none", ["--no-draft"]), ("trained", ["--draft", str(head)]),
                        ("random", ["--draft", str(tmp_path / "random")])):
        capsys.readouterr()
        assert generate.main([*common, *extra, *(["--num-speculative-tokens", "3"] if name != "none" else [])]) == 0
        runs[name] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert runs["trained"]["token_ids"] == runs["random"]["token_ids"] == runs["none"]["token_ids"]
    accepted = {n: runs[n]["stats"]["mean_accepted_length"] for n in ("trained", "random")}
    assert accepted["trained"] > accepted["random"] + 0.5, accepted


ASSISTANT = dict(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, global_head_dim=32, num_global_key_value_heads=1,
                 attention_k_eq_v=True, sliding_window=8, layer_types=[SLIDING, FULL],
                 hidden_size_per_layer_input=0, vocab_size_per_layer_input=0)


def make_assistant(out_dir, ordered: bool, seed: int = 3):
    """A random Gemma4AssistantForCausalLM for ALL_ON's target (its KV heads, head sizes and window), saved; with
    `ordered`, the centroid-clustered head over a shuffled token ordering."""
    from transformers import Gemma4AssistantConfig, Gemma4AssistantForCausalLM, Gemma4TextConfig

    torch.manual_seed(seed)
    cfg = Gemma4AssistantConfig(text_config=Gemma4TextConfig(**ASSISTANT), backbone_hidden_size=64,
                                use_ordered_embeddings=ordered, num_centroids=16, centroid_intermediate_top_k=4)
    hf = Gemma4AssistantForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.normal_(0.0, 0.2 if "norm" in name else 0.15)
            if "norm" in name:
                p.add_(1.0)
        if ordered:
            hf.masked_embedding.token_ordering.copy_(torch.randperm(128))
    hf.save_pretrained(out_dir)
    return hf


@pytest.mark.parametrize("ordered", [True, pytest.param(False, marks=pytest.mark.slow)], ids=["centroids", "tied"])
def test_the_assistant_drafts_what_transformers_drafts(ordered, tmp_path):
    """The assistant's K draft steps from a prompt's target pass equal transformers' candidate generator loop on the
    same inputs: the target's keys and values (shared_kv_states), its last hidden state, the root at position n."""
    from jaxspec.checkpoints.gemma4_assistant import load_assistant
    from jaxspec.engine.proposers.base import PrefillView, StepView
    from jaxspec.engine.proposers.gemma4_assistant import AssistantProposer
    from jaxspec.models import kv_cache as kvc

    hf_target = make_gemma4(tmp_path / "target", **ALL_ON)
    hf_assistant = make_assistant(tmp_path / "assistant", ordered)
    ids = torch.tensor([[5, 17, 3, 9, 60, 44, 2, 61, 8, 19, 23, 7, 1]])  # 13 tokens: past the window of 8
    n, k = ids.shape[1], 4
    with torch.no_grad():
        out = hf_target(ids, output_hidden_states=True, return_shared_kv_states=True)
        root = out.logits[:, -1].argmax(-1, keepdim=True)
        hidden, want, want_logits = out.hidden_states[-1][:, -1:], [], []
        token = root
        for _ in range(k):
            inputs = torch.cat([hf_target.model.embed_tokens(token), hidden], dim=-1)
            step = hf_assistant(inputs_embeds=inputs, position_ids=torch.tensor([[n]]),
                                shared_kv_states=out.shared_kv_states, use_cache=False)
            token, hidden = step.logits.argmax(-1), step.last_hidden_state
            want.append(int(token[0, 0]))
            want_logits.append(step.logits[0, 0].numpy())
    target = load_target(tmp_path / "target")
    target.numerics = None  # the drafts' inputs need the target's values, not its invariant bits
    assistant = load_assistant(tmp_path / "assistant", target.config)
    proposer, params = AssistantProposer.of(assistant, target.config, k)
    prefill = target(jnp.asarray(ids.numpy()), jnp.arange(n)[None], target.init_cache(1, 32), empty_cache=True,
                     return_hidden=True)
    cache = kvc.advance(prefill.cache, jnp.asarray([n]))
    assert int(root[0, 0]) == int(jnp.argmax(prefill.logits[0, -1]))
    state = proposer.init(params, target, PrefillView(None, None, None, None, prefill.hidden[:, -1:]), 32)
    view = StepView(jnp.asarray([int(root[0, 0])]), cache.lengths, jnp.ones((1,), jnp.int32), None, None, cache)
    proposal, _ = proposer.propose(params, target, state, view, None)
    assert proposal.tokens[0, 1:].tolist() == want
    # the first step's logits (the only step whose input does not depend on earlier argmaxes)
    first, _ = assistant(jnp.concatenate([target.embed(jnp.asarray([[int(root[0, 0])]])),
                                          target.norm(prefill.hidden[:, -1:])], axis=-1),
                         jnp.asarray([[n]]), *(
                             {kind: getattr(cache, kv)[i] for kind, i in proposer.cache_index} for kv in ("k", "v")),
                         cache.lengths)
    np.testing.assert_allclose(np.asarray(first[0, 0]), want_logits[0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype,batch", [("bfloat16", 4), pytest.param("float32", 1, marks=pytest.mark.slow)])
def test_greedy_speculation_with_the_assistant_equals_target_only(dtype, batch, tmp_path):
    """The engine hands the assistant its view of the target cache inside the jitted step; whatever it drafts, the
    text is target-only's (bfloat16: a token's bits changing with its company would part the texts)."""
    from jaxspec.checkpoints.gemma4_assistant import load_assistant
    from jaxspec.engine.proposers.gemma4_assistant import AssistantProposer

    make_gemma4(tmp_path / "target", **ALL_ON)
    make_assistant(tmp_path / "assistant", ordered=True)
    target = load_target(tmp_path / "target")
    if dtype == "bfloat16":
        target = in_dtype(target, jnp.bfloat16)
    assistant = load_assistant(tmp_path / "assistant", target.config, dtype=getattr(jnp, dtype))
    proposer, params = AssistantProposer.of(assistant, target.config, 3)
    want = [c.token_ids for c in Generator(target, batch_size=1).generate(PROMPT_SET, max_new_tokens=12)]
    got = Generator(target, proposer=proposer, proposer_params=params, batch_size=batch).generate(
        PROMPT_SET, max_new_tokens=12)  # prompts of 4 to 33 tokens: sliding layers (window 8) run past it
    assert [c.token_ids for c in got] == want
    assert all(c.stats["proposer"] == "gemma4-assistant" for c in got)


@pytest.mark.slow  # ~60 s; CI: the engine test above (the CLI only loads and wires it)
def test_generate_with_an_assistant_draft_equals_no_draft(tmp_path, capsys):
    """jaxspec.generate --draft DIR recognizes a Gemma 4 assistant by its config.json, checks it against the target
    before loading, and gives the target's own text; a Llama target is refused in one line."""
    from hf_tiny import write_char_tokenizer

    from jaxspec import generate

    make_gemma4(tmp_path / "target", **dict(ALL_ON, vocab_size=97, vocab_size_per_layer_input=97))
    write_char_tokenizer(tmp_path / "target")
    with torch.no_grad():
        import transformers

        cfg = transformers.Gemma4AssistantConfig(
            text_config=transformers.Gemma4TextConfig(**dict(ASSISTANT, vocab_size=97)), backbone_hidden_size=64)
        transformers.Gemma4AssistantForCausalLM(cfg).save_pretrained(tmp_path / "assistant")
    common = ["--target", str(tmp_path / "target"), "--raw", "--json", "--prompt", "hello hello", "--max-new-tokens",
              "16"]
    runs = {}
    for name, extra in (("none", ["--no-draft"]), ("assistant", ["--draft", str(tmp_path / "assistant")])):
        capsys.readouterr()
        assert generate.main([*common, *extra]) == 0
        runs[name] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert runs["assistant"]["token_ids"] == runs["none"]["token_ids"]
    assert runs["assistant"]["stats"]["proposer"] == "gemma4-assistant+lookup"  # prompt lookup beside it
    from hf_tiny import make_tiny

    make_tiny("smollm2_tied", tmp_path / "llama")
    write_char_tokenizer(tmp_path / "llama")
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        generate.main(["--target", str(tmp_path / "llama"), "--raw", "--prompt", "hi", "--draft",
                       str(tmp_path / "assistant")])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: a Gemma 4 assistant drafts for Gemma 4 targets only (it reads the target's keys and values); the "
        "target is llama"]


def tiny_assistant_pair(tmp_path, vocab: int, logit_scale: float = 1.0):
    """(target, assistant) loaded in float32: ALL_ON's target and a tied-head assistant at `vocab` tokens, the
    target's LM head scaled by logit_scale (sharper distributions for sampling tests)."""
    from jaxspec.checkpoints.gemma4_assistant import load_assistant

    hf = make_gemma4(tmp_path / "target", **dict(ALL_ON, vocab_size=vocab, vocab_size_per_layer_input=vocab,
                                                   final_logit_softcapping=None))
    with torch.no_grad():
        hf.model.embed_tokens.weight.mul_(logit_scale)  # tied: the LM head too
    hf.save_pretrained(tmp_path / "target")
    import transformers

    torch.manual_seed(5)
    cfg = transformers.Gemma4AssistantConfig(
        text_config=transformers.Gemma4TextConfig(**dict(ASSISTANT, vocab_size=vocab)), backbone_hidden_size=64)
    transformers.Gemma4AssistantForCausalLM(cfg).save_pretrained(tmp_path / "assistant")
    target = load_target(tmp_path / "target")
    return target, load_assistant(tmp_path / "assistant", target.config)


@pytest.mark.slow  # ~2 min: 20 000 two-token draws
def test_sampling_with_the_assistant_is_lossless(tmp_path):
    """The assistant's argmax drafts verified by the walk that needs no draft probabilities: the first two tokens
    follow the target's own joint distribution (chi-square), computed directly from the target."""
    import jax

    from jaxspec.engine.proposers.gemma4_assistant import AssistantProposer
    from jaxspec.sampling import SamplingConfig, filtered_logits
    from test_spec_sampling import chi_square_p

    vocab, n_draws, prompt = 16, 20000, [3, 7, 1, 12]
    target, assistant = tiny_assistant_pair(tmp_path, vocab, logit_scale=1.5)
    target.numerics = None  # the sampling algorithm, not bits: plain numerics keep 20 000 draws fast
    sampling = SamplingConfig(1.0)
    seqs = jnp.asarray([prompt + [x1] for x1 in range(vocab)], jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(5), seqs.shape)
    probs = jax.nn.softmax(filtered_logits(target(seqs, positions, target.init_cache(vocab, 5)).logits, sampling))
    p1, p2 = np.asarray(probs[0, 3], np.float64), np.asarray(probs[:, 4], np.float64)
    proposer, params = AssistantProposer.of(assistant, target.config, 2)
    got = Generator(target, proposer=proposer, proposer_params=params, batch_size=n_draws // 4).generate(
        [prompt] * n_draws, max_new_tokens=2, sampling=sampling, seed=11)
    counts = np.zeros((vocab, vocab))
    for c in got:
        counts[c.token_ids[0], c.token_ids[1]] += 1
    assert chi_square_p(counts, p1[:, None] * p2) > 0.01
    first = np.mean([c.stats["acceptance_per_position"][0] for c in got])
    assert 0.0 < first < 1.0  # both branches (a draft accepted, the residual draw) ran


@pytest.mark.slow  # ~60 s
def test_the_assistant_on_a_mesh_gives_one_devices_tokens(tmp_path):
    """data=2, model=4 (the 8 CPU devices): the target cache's heads split over the model axis (its 2 and 1 KV heads
    repeated to 4), the assistant reading it there; bfloat16 greedy text equals the one-device target-only text."""
    from jaxspec.engine.proposers.gemma4_assistant import AssistantProposer

    target, assistant = tiny_assistant_pair(tmp_path, 128)
    target, assistant = in_dtype(target, jnp.bfloat16), in_dtype(assistant, jnp.bfloat16)
    want = [c.token_ids for c in Generator(target, batch_size=1).generate(PROMPT_SET, max_new_tokens=20)]
    proposer, params = AssistantProposer.of(assistant, target.config, 3)
    mesh = sharding.make_mesh(sharding.MeshConfig(data=2, model=4))
    got = Generator(target, proposer=proposer, proposer_params=params, batch_size=4, mesh=mesh).generate(
        PROMPT_SET, max_new_tokens=20)
    assert [c.token_ids for c in got] == want
