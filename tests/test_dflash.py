"""DFlash block drafters: one drafter forward drafts a chain of up to B - 1 tokens; the output is the target's.

- A z-lab-format checkpoint (config.json + safetensors with exactly z-lab's keys, written here by hand) loads, and
  its first block's logits equal a direct numpy reimplementation of the published description, on target features
  from transformers (`hidden_states[i + 1]`: the output of layer i).
- Greedy output equals target-only with a random drafter (drafts rejected) and a fitted one (most accepted).
- Sampling is lossless: the joint distribution of the first two tokens is the target's (chi-square).
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from hf_tiny import make_tiny
from spec_fixtures import PROMPTS, fitted_drafter, in_dtype, random_drafter, tiny_target

from jaxspec.checkpoints.dflash import export_dflash, load_dflash
from jaxspec.checkpoints.hf import load_target
from jaxspec.engine.generation import Generator
from jaxspec.engine.proposers.base import PrefillView, StepView
from jaxspec.checkpoints.dflash import check_drafter_fits
from jaxspec.engine.proposers.dflash import DFlashProposer
from jaxspec.errors import JaxspecError
from jaxspec.sampling import SamplingConfig

TARGET_LAYER_IDS = [0, 2]  # z-lab ids: the outputs of layers 0 and 2 (hidden_states 1 and 3)
BLOCK, MASK = 4, 95


def zlab_config(**extra) -> dict:
    return {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "block_size": BLOCK, "num_target_layers": 4,
        "dflash_config": {"mask_token_id": MASK, "target_layer_ids": TARGET_LAYER_IDS},
        "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 8, "intermediate_size": 48, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "max_position_embeddings": 256, "vocab_size": 97, "tie_word_embeddings": False,
        "layer_types": ["full_attention", "full_attention"], **extra,
    }


def zlab_weights(rng, cfg: dict, target_hidden: int) -> dict[str, np.ndarray]:
    """Random weights under z-lab's names, torch layout [out, in]; norms away from 1 so a missed one shows."""
    h, d, hq, hkv, i = (cfg[k] for k in ("hidden_size", "head_dim", "num_attention_heads", "num_key_value_heads",
                                          "intermediate_size"))
    w = lambda *shape: (rng.standard_normal(shape) * 0.2).astype(np.float32)  # noqa: E731
    norm = lambda n: (1 + 0.2 * rng.standard_normal(n)).astype(np.float32)  # noqa: E731
    out = {"fc.weight": w(h, len(TARGET_LAYER_IDS) * target_hidden), "hidden_norm.weight": norm(h),
           "norm.weight": norm(h)}
    for layer in range(cfg["num_hidden_layers"]):
        p = f"layers.{layer}."
        out |= {
            p + "input_layernorm.weight": norm(h), p + "post_attention_layernorm.weight": norm(h),
            p + "self_attn.q_proj.weight": w(hq * d, h), p + "self_attn.k_proj.weight": w(hkv * d, h),
            p + "self_attn.v_proj.weight": w(hkv * d, h), p + "self_attn.o_proj.weight": w(h, hq * d),
            p + "self_attn.q_norm.weight": norm(d), p + "self_attn.k_norm.weight": norm(d),
            p + "mlp.gate_proj.weight": w(i, h), p + "mlp.up_proj.weight": w(i, h), p + "mlp.down_proj.weight": w(h, i),
        }
    return out


def write_zlab(path, cfg: dict, weights: dict) -> None:
    from safetensors.numpy import save_file

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    save_file(weights, str(path / "model.safetensors"))


def reference_block_logits(weights, cfg, ctx_feats, root, lm_head) -> np.ndarray:
    """The published description in numpy (float64): ctx = hidden_norm(fc(features)); the block [root, MASK...]
    at positions n .. n + B - 1 attends without a mask to the context's keys (positions 0 .. n - 1) and its own;
    logits = lm_head(norm(x)) at slots 1 .. B - 1."""
    eps, d, hq, hkv = cfg["rms_norm_eps"], cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    W = {k: v.astype(np.float64) for k, v in weights.items()}

    def rms(x, wt):
        return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * wt

    def rope(x, pos):  # x [T, heads, d]
        inv = 1.0 / (cfg["rope_theta"] ** (np.arange(0, d, 2) / d))
        ang = np.concatenate([pos[:, None] * inv, pos[:, None] * inv], -1)[:, None, :]
        rot = np.concatenate([-x[..., d // 2:], x[..., : d // 2]], -1)
        return x * np.cos(ang) + rot * np.sin(ang)

    n = ctx_feats.shape[0]
    ctx = rms(ctx_feats @ W["fc.weight"].T, W["hidden_norm.weight"])  # [n, H]
    x = lm_head[[root] + [MASK] * (BLOCK - 1)].astype(np.float64)  # the tied test target: embedding = LM head
    pos_ctx, pos_blk = np.arange(n, dtype=np.float64), np.arange(n, n + BLOCK, dtype=np.float64)
    for layer in range(cfg["num_hidden_layers"]):
        p = f"layers.{layer}."
        xn = rms(x, W[p + "input_layernorm.weight"])
        q = (xn @ W[p + "self_attn.q_proj.weight"].T).reshape(BLOCK, hq, d)
        q = rope(rms(q, W[p + "self_attn.q_norm.weight"]), pos_blk)

        def kv(src, pos):
            k = (src @ W[p + "self_attn.k_proj.weight"].T).reshape(len(src), hkv, d)
            v = (src @ W[p + "self_attn.v_proj.weight"].T).reshape(len(src), hkv, d)
            return rope(rms(k, W[p + "self_attn.k_norm.weight"]), pos), v

        (kc, vc), (kb, vb) = kv(ctx, pos_ctx), kv(xn, pos_blk)
        k, v = np.concatenate([kc, kb]), np.concatenate([vc, vb])  # [n + B, hkv, d]
        g = hq // hkv
        scores = np.einsum("thd,shd->hts", q, np.repeat(k, g, axis=1)) / np.sqrt(d)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        att = np.einsum("hts,shd->thd", probs, np.repeat(v, g, axis=1)).reshape(BLOCK, hq * d)
        x = x + att @ W[p + "self_attn.o_proj.weight"].T
        xn = rms(x, W[p + "post_attention_layernorm.weight"])
        gate, up = xn @ W[p + "mlp.gate_proj.weight"].T, xn @ W[p + "mlp.up_proj.weight"].T
        x = x + (gate / (1 + np.exp(-gate)) * up) @ W[p + "mlp.down_proj.weight"].T
    return rms(x, W["norm.weight"])[1:] @ lm_head.T.astype(np.float64)  # [B - 1, V]


def test_a_zlab_checkpoint_drafts_as_the_published_description(tmp_path):
    torch_target = make_tiny("smollm2_tied", tmp_path / "target", seed=3)
    cfg = zlab_config()
    weights = zlab_weights(np.random.default_rng(0), cfg, target_hidden=64)
    write_zlab(tmp_path / "drafter", cfg, weights)
    prompt = [5, 17, 3, 9, 44, 2, 61]
    with torch.no_grad():
        hs = torch_target(torch.tensor([prompt]), output_hidden_states=True).hidden_states
    feats = np.concatenate([hs[i + 1][0].double().numpy() for i in TARGET_LAYER_IDS], -1)  # outputs of layers i
    lm_head = torch_target.lm_head.weight.detach().double().numpy()  # tied: the embedding table too

    target = load_target(tmp_path / "target", aux_layer_ids=tuple(i + 1 for i in TARGET_LAYER_IDS))
    drafter = load_dflash(tmp_path / "drafter", target.config)
    check_drafter_fits(drafter.config, target.config)
    proposer, params = DFlashProposer.of(drafter)
    t = len(prompt)
    tokens = jnp.asarray([prompt], jnp.int32)
    out = target(tokens, jnp.arange(t, dtype=jnp.int32)[None], target.init_cache(1, 32), return_aux=True)
    np.testing.assert_allclose(np.asarray(out.aux[0]), feats, rtol=1e-4, atol=1e-4)  # the taps: hidden_states[i + 1]
    root = 23
    view = PrefillView(tokens, jnp.asarray([t]), jnp.asarray([root]), out.aux, None)
    state = proposer.init(params, target, view, 32)
    step = StepView(jnp.asarray([root]), jnp.asarray([t]), jnp.asarray([1]), None)
    proposal, _ = proposer.propose(params, target, state, step, jax.random.split(jax.random.key(0), 1))
    want = reference_block_logits(weights, cfg, feats, root, lm_head)
    np.testing.assert_array_equal(np.asarray(proposal.tokens[0, 1:]), want.argmax(-1))
    drafter_states = nnx.merge(proposer.drafter_graphdef, params)(
        target.embed(jnp.asarray([[root] + [MASK] * (BLOCK - 1)])), jnp.arange(t, t + BLOCK)[None],
        state.cache,
    )
    np.testing.assert_allclose(np.asarray(target.vocab_logits(drafter_states)[0, 1:]), want, rtol=2e-4, atol=2e-4)

    again = load_dflash(export_dflash(drafter, tmp_path / "exported", target=target.config, dtype="float32"),
                        target.config)
    for a, b in zip(jax.tree.leaves(nnx.state(drafter)), jax.tree.leaves(nnx.state(again))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("change,message", [
    (lambda c: c.pop("block_size"), "names no block_size"),
    (lambda c: c["dflash_config"].pop("mask_token_id"), "names no mask token"),
    (lambda c: c["dflash_config"].update(mask_token_id=97), "mask_token_id 97 is outside the vocabulary"),
    (lambda c: c.update(num_target_layers=36), "trained on a target of 36 layers"),
    (lambda c: c.update(layer_types=["sliding_attention", "full_attention"]), "sliding-window drafter layers"),
    (lambda c: c["dflash_config"].update(target_layer_ids=[0, 3]), "reads the output of target layer 3"),
])
def test_drafters_that_do_not_fit_are_one_line_errors(tmp_path, change, message):
    make_tiny("smollm2_tied", tmp_path / "target", seed=3)
    cfg = zlab_config()
    weights = zlab_weights(np.random.default_rng(0), cfg, target_hidden=64)
    change(cfg)
    write_zlab(tmp_path / "drafter", cfg, weights)
    target = load_target(tmp_path / "target")
    with pytest.raises(JaxspecError, match=message):
        load_dflash(tmp_path / "drafter", target.config)


def test_extra_tensors_are_refused(tmp_path):
    make_tiny("smollm2_tied", tmp_path / "target", seed=3)
    cfg = zlab_config()
    weights = zlab_weights(np.random.default_rng(0), cfg, target_hidden=64)
    weights["layers.0.attention_conv.weight"] = np.zeros((4, 4), np.float32)  # a DFlash2 drafter's
    write_zlab(tmp_path / "drafter", cfg, weights)
    with pytest.raises(JaxspecError, match="tensors a DFlash-1 drafter does not: layers.0.attention_conv.weight"):
        load_dflash(tmp_path / "drafter", load_target(tmp_path / "target").config)


@pytest.fixture(scope="module")
def reference():
    return [c.token_ids for c in Generator(tiny_target(), batch_size=1).generate(PROMPTS, max_new_tokens=30)]


# All under -m slow: in CI the fitted drafter's whole blocks in a batch of 4 rows give the target's text on a mesh
# (test_on_a_mesh_equals_one_device below; rejected drafts happen there too, its acceptance is below 4).
GREEDY_CI: set = set()


@pytest.mark.parametrize("kind,k,batch", [
    pytest.param(kind, k, b, marks=() if (kind, k, b) in GREEDY_CI else pytest.mark.slow)
    for b in (1, 4) for k in (1, 3) for kind in ("random", "fitted")
])
def test_greedy_equals_target_only(kind, k, batch, reference):
    drafter = random_drafter() if kind == "random" else fitted_drafter()
    proposer, params = DFlashProposer.of(drafter, k)
    gen = Generator(tiny_target(), proposer=proposer, proposer_params=params, batch_size=batch)
    got = gen.generate(PROMPTS, max_new_tokens=30)
    assert [c.token_ids for c in got] == reference
    mean = np.mean([c.stats["mean_accepted_length"] for c in got])
    if kind == "random":
        assert mean < 1.2
    elif k == 3:
        assert mean > 2.5  # blocks really are accepted several tokens at a time
    for c in got:
        assert len(c.stats["acceptance_per_position"]) == k and c.stats["proposer"] == "dflash"
        assert c.stats["draft_calls"] == c.stats["verify_calls"] + 1  # one drafter forward per step


@pytest.mark.parametrize("kind,batch", [("fitted", 4), pytest.param("random", 1, marks=pytest.mark.slow)])
def test_trees_from_the_blocks_slots_equal_target_only(kind, batch, reference):
    """A tree grown from one forward's slot distributions (every depth-d node's children: slot d + 1's top-k) gives
    the target's text; where the chain's drafts miss, a sibling may be accepted, so the fitted drafter's tree
    accepts at least as many tokens per verify as its chain of the same depth."""
    from jaxspec.engine.tree import TreeConfig

    tree = TreeConfig(8, BLOCK - 1, 2)
    drafter = random_drafter() if kind == "random" else fitted_drafter()
    proposer, params = DFlashProposer.of(drafter, tree=tree)
    assert proposer.depth == BLOCK - 1 and proposer.verify_width == 8 and proposer.forwards_per_step == 1
    gen = Generator(tiny_target(), proposer=proposer, proposer_params=params, batch_size=batch)
    got = gen.generate(PROMPTS, max_new_tokens=30)
    assert [c.token_ids for c in got] == reference
    if kind == "fitted":
        proposer, params = DFlashProposer.of(drafter, BLOCK - 1)
        chain = Generator(tiny_target(), proposer=proposer, proposer_params=params, batch_size=batch)
        chained = chain.generate(PROMPTS, max_new_tokens=30)

        def per_verify(out):
            return sum(c.num_generated - 1 for c in out) / sum(c.stats["verify_calls"] for c in out)

        assert per_verify(got) >= per_verify(chained) > 2.5
        assert sum(c.stats["accepted_via_sibling"] for c in got) > 0  # a sibling, not the chain's draft, accepted
    with pytest.raises(JaxspecError, match=f"drafts 1..{BLOCK - 1} tokens per step"):
        DFlashProposer.of(drafter, tree=TreeConfig(8, BLOCK, 2))


def test_a_random_drafter_from_convert_drafts_at_a_forced_acceptance(tmp_path):
    """`convert random-dflash` writes an untrained drafter shaped for a target (z-lab's layout), and `--accept-prob`
    forces its chains' acceptance as an EAGLE-3 head's: a block drafter's speed measured at a chosen acceptance
    with random weights at real shapes (the GPU sitting's DFlash bench)."""
    from hf_tiny import write_char_tokenizer

    from jaxspec import convert
    from jaxspec.cli.args import AUTO
    from jaxspec.cli.loading import draft_generator
    from jaxspec.engine.tree import TreeConfig

    make_tiny("smollm2_tied", tmp_path / "target", seed=5)
    write_char_tokenizer(tmp_path / "target")
    out = tmp_path / "drafter"
    assert convert.main(["random-dflash", "--target", str(tmp_path / "target"), "--out", str(out), "--block-size",
                         "4", "--num-layers", "1"]) == 0
    cfg = load_target(tmp_path / "target").config
    drafter = load_dflash(out, cfg)
    assert (drafter.config.block_size, drafter.config.num_layers) == (4, 1)
    target = load_target(tmp_path / "target", aux_layer_ids=drafter.config.aux_layer_ids)
    gen = draft_generator(target, drafter, str(out), 3, None, batch_size=4, forced_accept_prob=0.75)
    got = gen.generate(PROMPTS, max_new_tokens=40)  # no stop tokens: forced drafts are not the target's text
    calls = sum(c.stats["verify_calls"] for c in got)
    mean = sum(c.num_generated - 1 for c in got) / calls
    assert 2.2 < mean < 3.3, mean  # 1 + 0.75 + 0.75^2 + 0.75^3 = 2.73
    for num_draft, tree in ((AUTO, None), (3, TreeConfig(6, 3, 2))):
        with pytest.raises(JaxspecError, match="drop it for a DFlash drafter with --tree or auto"):
            draft_generator(target, drafter, str(out), num_draft, tree, batch_size=1, forced_accept_prob=0.75)


@pytest.mark.slow  # CI: bfloat16 speculation in test_invariance; DFlash greedy in float32 here
def test_bfloat16_greedy_equals_target_only():
    """bfloat16 target and drafter, a batch of 4 with ragged acceptance: every verify of a drafted block gives the
    bits the target's own decode steps give (batch-invariant numerics), so the text is the target's."""
    target = in_dtype(tiny_target(), jnp.bfloat16)
    want = [c.token_ids for c in Generator(target, batch_size=1).generate(PROMPTS, max_new_tokens=30)]
    proposer, params = DFlashProposer.of(in_dtype(fitted_drafter(), jnp.bfloat16), 3)
    got = Generator(target, proposer=proposer, proposer_params=params, batch_size=4).generate(PROMPTS,
                                                                                              max_new_tokens=30)
    assert [c.token_ids for c in got] == want
    assert np.mean([c.stats["mean_accepted_length"] for c in got]) > 2.0  # blocks are accepted in bfloat16 too


@pytest.mark.slow  # ~52 s (CI time); CI: auto's pricing for heads and draft models (test_auto_generator, the
# draft-model CLI test's first batch); a DFlash drafter's price is one timed propose call, as P-EAGLE's (slow too)
def test_auto_prices_one_drafter_forward_per_step_and_keeps_the_targets_text(reference):
    """`--num-speculative-tokens auto` with a DFlash drafter: a chain of K costs one drafter forward and a verify of
    K + 1 tokens (not K head steps), which changes the choice; whatever it chooses, the text is the target's."""
    import dataclasses

    from jaxspec.engine.auto.config import AcceptanceProfile, StepCosts, choose, step_seconds
    from jaxspec.engine.auto.generator import AutoSpeculativeGenerator

    block = StepCosts(decode=0.01, verify=(0.0, 0.011, 0.012, 0.013), draft=0.01, block_draft=True)
    per_draft = dataclasses.replace(block, block_draft=False)  # the same numbers priced as an EAGLE-3 head's
    assert step_seconds(block, 3) == pytest.approx(0.013 + 0.01) and step_seconds(per_draft, 3) == pytest.approx(0.043)
    prior = AcceptanceProfile((0.9, 0.8, 0.7), 100)
    assert choose(block, prior).method == 3 and choose(per_draft, prior).method == 0

    gen = AutoSpeculativeGenerator(tiny_target(), fitted_drafter(), prior=prior, batch_size=4)
    assert gen.depth == BLOCK - 1  # chains up to the block, from one forward
    for start in range(0, len(PROMPTS), 4):  # the timing's result, fixed so that the choice is the test's
        gen.step_costs[gen.cost_capacity(PROMPTS[start : start + 4], 30)] = block
    got = gen.generate(PROMPTS, max_new_tokens=30)
    assert [c.token_ids for c in got] == reference
    assert all(c.stats["auto"]["num_speculative_tokens"] == 3 and c.stats["proposer"] == "dflash" for c in got)
    # timed as the engine runs it: the proposer's whole draft (context written, one forward, the longest chain)
    from jaxspec.engine.auto.step_costs import measure_step_costs

    timed = measure_step_costs(tiny_target(), fitted_drafter(), 4, 64, BLOCK - 1, repeats=1)
    assert timed.block_draft and timed.draft > 0 and timed.max_draft == BLOCK - 1
    with pytest.raises(JaxspecError, match="automatic speculation prices a DFlash drafter's chains only"):
        from jaxspec.engine.tree import TreeConfig

        AutoSpeculativeGenerator(tiny_target(), fitted_drafter(), prior=prior, trees={TreeConfig(6, 3, 2): 2.0})


def test_the_drafter_context_follows_the_target_after_every_step():
    """Crop semantics (BLOCK_DRAFTERS.md §6.3): after each step the drafter's committed context plus its pending
    features is the target's committed length, whatever was accepted; the engine's prefill and one step at a time."""
    from jaxspec.engine import core

    target, drafter = tiny_target(), fitted_drafter()
    proposer, params = DFlashProposer.of(drafter)
    graphdef, target_params = nnx.split(target)
    b, t = len(PROMPTS), max(map(len, PROMPTS))
    prompt = np.zeros((b, t), np.int32)
    for i, p in enumerate(PROMPTS):
        prompt[i, : len(p)] = p
    lens = jnp.asarray([len(p) for p in PROMPTS], jnp.int32)
    eos = jnp.asarray([-1], jnp.int32)
    prefill = jax.jit(core.prefill, static_argnames=("target_graphdef", "proposer", "capacity"))
    one_step = jax.jit(core.steps, static_argnames=("target_graphdef", "proposer", "num_steps"))
    st = prefill(graphdef, target_params, proposer, params, jnp.asarray(prompt), lens, jnp.full((b,), 24), eos,
                 jax.random.split(jax.random.key(0), b), None, None, capacity=64)  # greedy: no row sampling
    accepted = set()
    while not np.all(np.asarray(st.done)):
        before = np.asarray(st.cache.lengths)
        st = one_step(graphdef, target_params, proposer, params, st, eos, num_steps=1)
        live = ~np.asarray(st.done)
        context = np.asarray(st.proposer.cache.lengths) + np.asarray(st.proposer.num_pending)
        np.testing.assert_array_equal(context[live], np.asarray(st.cache.lengths)[live])
        accepted |= set((np.asarray(st.cache.lengths) - before)[live].tolist())
    assert len(accepted) >= 2  # steps that accepted different numbers of drafts


SAMPLING_VOCAB, SAMPLING_N = 16, 20000
SAMPLING_SHAPE = dict(vocab=SAMPLING_VOCAB, embed_scale=20.0, logit_scale=15.0)


@pytest.mark.slow  # CI's lossless-sampling representative: tests/test_spec_sampling.py (the same rejection walk)
@pytest.mark.parametrize("tree", [None, "6,3,2"])
def test_sampling_is_lossless(tree):
    from scipy import stats

    target = nnx.clone(tiny_target(**SAMPLING_SHAPE))
    target.numerics = None  # the algorithm, not bits: plain numerics keep 20 000 draws fast
    prompt = [3, 7, 1, 12]
    sampling = SamplingConfig(1.0)
    n = len(prompt)
    seqs = jnp.asarray([prompt + [x1] for x1 in range(SAMPLING_VOCAB)], jnp.int32)
    out = target(seqs, jnp.broadcast_to(jnp.arange(n + 1), seqs.shape), target.init_cache(SAMPLING_VOCAB, n + 1))
    probs = np.asarray(jax.nn.softmax(out.logits, axis=-1), np.float64)
    joint = probs[0, n - 1][:, None] * probs[:, n]  # P(x1, x2)

    from jaxspec.engine.tree import TreeConfig

    # accepted as often as the target picks it; a tree's siblings walked without q (deterministic drafts)
    proposer, params = DFlashProposer.of(random_drafter(SAMPLING_VOCAB), tree=tree and TreeConfig.parse(tree))
    gen = Generator(target, proposer=proposer, proposer_params=params, batch_size=SAMPLING_N)
    got = gen.generate([prompt] * SAMPLING_N, max_new_tokens=2, sampling=sampling, seed=5)
    counts = np.zeros((SAMPLING_VOCAB, SAMPLING_VOCAB))
    for c in got:
        counts[c.token_ids[0], c.token_ids[1]] += 1
    expected = joint.ravel() / joint.sum() * SAMPLING_N
    big = expected >= 5
    observed = counts.ravel()
    assert observed[expected == 0].sum() == 0
    p = stats.chisquare(np.append(observed[big], observed[~big].sum()),
                        np.append(expected[big], expected[~big].sum())).pvalue
    assert p > 0.01
    accepted = np.mean([c.stats["acceptance_per_position"][0] for c in got])
    assert 0.05 < accepted < 0.98  # both branches of the verifier ran


@pytest.mark.slow  # CI: test_dflash_train's exported drafter through jaxspec.generate (auto with its record)
def test_generate_with_a_dflash_drafter_equals_no_draft(tmp_path, capsys):
    """`jaxspec.generate --draft DIR` recognizes a z-lab drafter: its chains, one drafter forward per step, give
    the target's own text; --tree is a one-line error."""
    from hf_tiny import write_char_tokenizer

    from jaxspec import generate

    make_tiny("smollm2_tied", tmp_path / "target", seed=3)
    write_char_tokenizer(tmp_path / "target")
    cfg = zlab_config()
    write_zlab(tmp_path / "drafter", cfg, zlab_weights(np.random.default_rng(0), cfg, target_hidden=64))
    common = ["--target", str(tmp_path / "target"), "--raw", "--json", "--prompt", "hello there",
              "--max-new-tokens", "12"]
    runs = {}
    for name, extra in (("none", ["--no-draft"]), ("dflash", ["--draft", str(tmp_path / "drafter")])):
        assert generate.main([*common, *extra]) == 0
        runs[name] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert runs["dflash"]["token_ids"] == runs["none"]["token_ids"]
    stats = runs["dflash"]["stats"]
    assert stats["proposer"] == "dflash" and len(stats["acceptance_per_position"]) == BLOCK - 1
    assert stats["auto"]["basis"] == "first batch"  # auto, the default: no record, so the whole block is measured
    assert generate.main([*common, "--draft", str(tmp_path / "drafter"), "--tree", "6,3,2"]) == 0  # from its slots
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["token_ids"] == runs["none"]["token_ids"]

    # the benchmark takes a drafter too: target-only and its chains, interleaved, the same text
    from jaxspec.bench import cli as bench

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"id": "a", "prompt": "hello there"}\n{"id": "b", "prompt": "abcabc"}\n')
    assert bench.main(["--target", str(tmp_path / "target"), "--draft", str(tmp_path / "drafter"), "--raw",
                       "--prompts-file", str(prompts), "--max-new-tokens", "8", "--num-speculative-tokens", "3",
                       "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)["speculative"]
    assert row["identical_outputs"] == "2/2" and row["method"] == "chain K=3"


def test_on_a_mesh_equals_one_device(reference):
    """data=2 x model=2: the drafter's parameters and context cache split as the target's are; the text is the
    target's (tiny_target: 4 query and 2 KV heads)."""
    from jaxspec import sharding

    proposer, params = DFlashProposer.of(fitted_drafter())
    mesh = sharding.make_mesh(sharding.MeshConfig(data=2, model=2))
    gen = Generator(tiny_target(), proposer=proposer, proposer_params=params, batch_size=4, mesh=mesh)
    got = gen.generate(PROMPTS, max_new_tokens=30)
    assert [c.token_ids for c in got] == reference
    assert np.mean([c.stats["mean_accepted_length"] for c in got]) > 2.5
