"""`--proposer draft-model`: an independent small model drafts K tokens per step with its own KV cache (the original
speculative sampling; transformers' assistant_model). Greedy output equals target-only with drafts rejected (a
random draft) and accepted (the target as its own draft), ragged batches, bfloat16 and a mesh; sampling with the
draft's real distribution as q is lossless; the CLI's flags."""

import json

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hf_tiny import make_tiny, write_char_tokenizer
from spec_fixtures import PROMPTS, tiny_target
from test_spec_sampling import SHAPE, chi_square_p, first_two, plain_target
from test_ngram_proposer import target_joint

from jaxspec.config import TargetConfig, TreeConfig
from jaxspec.engine.generation import Generator
from jaxspec.engine.proposers.draft_model import DraftModelProposer
from jaxspec.errors import JaxspecError
from jaxspec.models.llama import LlamaModel
from jaxspec.sampling import SamplingConfig


def small_draft(vocab: int = 101, seed: int = 3) -> LlamaModel:
    """A 2-layer draft narrower than the tiny target, its vocabulary padded by 3 rows (as released models pad
    theirs): its drafts are mostly rejected."""
    cfg = TargetConfig(vocab_size=vocab + 3, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2,
                       num_kv_heads=2, head_dim=16, max_position_embeddings=2048)
    return LlamaModel(cfg, rngs=nnx.Rngs(seed))


@pytest.fixture(scope="module")
def reference():
    return [c.token_ids for c in Generator(tiny_target(), batch_size=1).generate(PROMPTS, max_new_tokens=24)]


# CI: whole chains accepted (the target as its own draft); rejections run in CI in the CLI test (another random
# model); a smaller draft with a padded vocabulary under -m slow
# CI: test_cli_generate_with_a_draft_model_equals_no_draft (the same engine, through the CLI)
@pytest.mark.parametrize("draft,k,batch", [pytest.param("self", 4, 4, marks=pytest.mark.slow),
                                           pytest.param("small", 3, 4, marks=pytest.mark.slow),
                                           pytest.param("small", 1, 1, marks=pytest.mark.slow)])
def test_greedy_equals_target_only(draft, k, batch, reference):
    model = tiny_target() if draft == "self" else small_draft()
    proposer, params = DraftModelProposer.of(model, k)
    got = Generator(tiny_target(), proposer=proposer, proposer_params=params, batch_size=batch).generate(
        PROMPTS, max_new_tokens=24)
    assert [c.token_ids for c in got] == reference
    mean = np.mean([c.stats["mean_accepted_length"] for c in got])
    if draft == "self":
        assert mean > k  # its own drafts (plain numerics) are nearly always the target's tokens: whole chains accepted
    for c in got:
        assert c.stats["proposer"] == "draft-model" and len(c.stats["acceptance_per_position"]) == k
        # per step the catch-up plus K - 1 one-token forwards; and the prompt's forward
        assert c.stats["draft_calls"] == k * c.stats["verify_calls"] + 1


# CI: the CLI test below grows trees with the target as its own draft model (whole branches accepted, batch 1)
@pytest.mark.parametrize("draft,batch", [pytest.param("self", 4, marks=pytest.mark.slow),
                                         pytest.param("small", 3, marks=pytest.mark.slow)])
def test_trees_equal_target_only(draft, batch, reference):
    """A tree from the draft model's top-k (EAGLE-2's dynamic tree, grown a level per draft forward) verifies to
    the target's own greedy tokens."""
    tree = TreeConfig.parse("8,3,2")
    model = tiny_target() if draft == "self" else small_draft()
    proposer, params = DraftModelProposer.of(model, 1, tree)
    assert proposer.depth == 3 and proposer.verify_width == 8 and proposer.extra_capacity() == tree.cache_slots
    got = Generator(tiny_target(), proposer=proposer, proposer_params=params, batch_size=batch).generate(
        PROMPTS, max_new_tokens=24)
    assert [c.token_ids for c in got] == reference
    mean = np.mean([c.stats["mean_accepted_length"] for c in got])
    if draft == "self":
        assert mean > 3  # its own top-1 branch is nearly always the target's path: whole branches accepted
    for c in got:
        assert len(c.stats["acceptance_per_position"]) == 3
        assert c.stats["draft_calls"] == 3 * c.stats["verify_calls"] + 1  # the catch-up and two more levels


@pytest.mark.slow  # ~30 s each; CI: bfloat16 and meshes with the other drafters (test_invariance, test_dflash)
@pytest.mark.parametrize("tree", [None, "8,3,2"])
def test_bfloat16_and_a_mesh_equal_target_only(tree):
    from jaxspec import sharding
    from test_invariance import _as_dtype

    target = _as_dtype(tiny_target(), jnp.bfloat16)
    want = [c.token_ids for c in Generator(target, batch_size=1).generate(PROMPTS, max_new_tokens=24)]
    proposer, params = DraftModelProposer.of(_as_dtype(tiny_target(), jnp.bfloat16), 3,
                                             None if tree is None else TreeConfig.parse(tree))
    mesh = sharding.make_mesh(sharding.MeshConfig(data=2, model=2))
    got = Generator(target, proposer=proposer, proposer_params=params, batch_size=4, mesh=mesh).generate(
        PROMPTS, max_new_tokens=24)
    assert [c.token_ids for c in got] == want
    assert np.mean([c.stats["mean_accepted_length"] for c in got]) > 2.0


@pytest.mark.slow  # ~30 s each; CI: rejection sampling with a draft's q (test_spec_sampling, EAGLE-3's chains)
@pytest.mark.parametrize("tree", [None, "4,2,2"])
def test_sampling_with_the_drafts_distribution_is_lossless(tree):
    """Drafts sampled from another model's distribution (q, not one-hot), or a tree from its top-k (the walk that
    needs no q): the first two tokens follow the target."""
    n, prompt, sampling = 20000, [3, 7, 1, 12], SamplingConfig(1.0)
    joint = target_joint(prompt, sampling)
    draft = nnx.clone(tiny_target(**{**SHAPE, "seed": 1}))  # same shape, other weights: often, not always, agrees
    proposer, params = DraftModelProposer.of(draft, 2, None if tree is None else TreeConfig.parse(tree))
    gen = Generator(plain_target(), proposer=proposer, proposer_params=params, batch_size=n)
    out = gen.generate([prompt] * n, max_new_tokens=2, sampling=sampling, seed=5)
    assert chi_square_p(first_two(out), joint) > 0.01
    accepted = np.mean([c.stats["accepted_per_position"][0] for c in out])
    assert 0.05 < accepted < 0.95  # both branches of the rejection rule ran


def test_cli_generate_with_a_draft_model_equals_no_draft(tmp_path, capsys):
    from jaxspec import generate

    for name, seed in (("target", 5), ("draft", 6)):
        make_tiny("smollm2_tied", tmp_path / name, seed=seed)
        write_char_tokenizer(tmp_path / name)
    common = ["--target", str(tmp_path / "target"), "--prompt", "hello there", "--raw", "--json",
              "--max-new-tokens", "12"]
    runs = {}
    draft = ["--proposer", "draft-model", "--draft-model", str(tmp_path / "draft")]
    tree = ["--proposer", "draft-model", "--draft-model", str(tmp_path / "target"), "--tree", "6,3,2"]  # itself
    for name, extra in (("none", ["--no-draft"]), ("auto", draft), ("tree", tree)):  # auto: no acceptance record
        assert generate.main([*common, *extra]) == 0
        runs[name] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert runs["auto"]["token_ids"] == runs["none"]["token_ids"] == runs["tree"]["token_ids"]
    tree_stats = runs["tree"]["stats"]
    assert tree_stats["proposer"] == "draft-model" and len(tree_stats["acceptance_per_position"]) == 3  # the depth
    assert tree_stats["mean_accepted_length"] > 2  # the target drafting for itself: whole branches accepted
    assert tree_stats["draft_calls"] == 3 * tree_stats["verify_calls"] + 1  # the catch-up and two more levels a step
    stats = runs["auto"]["stats"]
    assert stats["proposer"] == "draft-model+lookup" and stats["mean_accepted_length"] < 6  # another model: rejections
    auto = stats["auto"]
    assert auto["basis"] == "first batch" and auto["num_speculative_tokens"] == 5  # its first batch measures it


@pytest.mark.slow  # CI: the CLI test above runs auto's first batch with a draft model; test_dflash prices another drafter
def test_auto_prices_a_draft_model_and_keeps_the_output(reference):
    """`--num-speculative-tokens auto` with a draft model: the first batch drafts the default chain to measure its
    acceptance, later batches choose from this machine's timed costs (a draft-model step, verifies, a decode) and
    the counts; every choice gives the target's text. The target as its own draft accepts whole chains and its
    step costs the target's decode, so drafting is not free: the choice is priced, not assumed."""
    from jaxspec.engine.auto.generator import AutoSpeculativeGenerator

    gen = AutoSpeculativeGenerator(tiny_target(), tiny_target(), prior=None, batch_size=1, max_draft=2)
    got = gen.generate(PROMPTS[:2], max_new_tokens=24)
    assert [c.token_ids for c in got] == reference[:2]
    records = [c.stats["auto"] for c in got]
    assert records[0]["basis"] == "first batch" and records[1]["basis"] == "observed"
    costs = records[1]["step_costs_ms"]
    assert costs["draft"] > 0 and len(costs["verify"]) == gen.depth  # a draft-model step and every verify timed
    assert records[1]["running_acceptance_per_position"][0] > 0.9  # its own drafts: nearly always accepted
    with pytest.raises(JaxspecError, match="automatic speculation prices a draft model's chains only"):
        from jaxspec.engine.tree import TreeConfig

        AutoSpeculativeGenerator(tiny_target(), tiny_target(), prior=None, trees={TreeConfig(6, 3, 2): 2.0})


@pytest.mark.parametrize("extra,message", [
    (["--proposer", "draft-model"], "--proposer draft-model needs --draft-model DIR"),
    (["--draft-model", "x"], "--draft-model drafts with --proposer draft-model; add it"),
    (["--proposer", "draft-model", "--draft-model", "x", "--tree", "6,3,2", "--num-speculative-tokens", "4"],
     "drop --num-speculative-tokens"),
    (["--proposer", "draft-model", "--draft-model", "NOWHERE"], "has no config.json"),
])
def test_bad_flags_are_one_line_errors(extra, message, tmp_path, capsys):
    from jaxspec import generate

    make_tiny("smollm2_tied", tmp_path / "target", seed=5)
    write_char_tokenizer(tmp_path / "target")
    extra = [str(tmp_path / "nowhere") if e == "NOWHERE" else e for e in extra]
    with pytest.raises(SystemExit) as exc:
        generate.main(["--target", str(tmp_path / "target"), "--prompt", "hi", "--raw", "--max-new-tokens", "4", *extra])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert exc.value.code == 2 and len(lines) == 1 and message in lines[0] and "Traceback" not in err


@pytest.mark.slow  # ~20 s; CI: the bench's machinery (test_cli), loading a draft model (the CLI test here)
def test_the_bench_times_a_draft_model_beside_target_only_and_transformers_assisted(tmp_path, capsys):
    """`jaxspec.bench --proposer draft-model`: the draft model's chains interleaved with target-only, the same
    text; with --compare-hf, transformers' generate alone and with `assistant_model=` the same draft, which gives
    the same greedy text too."""
    from jaxspec.bench import cli as bench

    for name, seed in (("target", 5), ("draft", 6)):
        make_tiny("smollm2_tied", tmp_path / name, seed=seed)
        write_char_tokenizer(tmp_path / name)
    (tmp_path / "p.jsonl").write_text('{"id": "a", "prompt": "hello there"}\n{"id": "b", "prompt": "abcabc"}\n')
    assert bench.main(["--target", str(tmp_path / "target"), "--prompts-file", str(tmp_path / "p.jsonl"), "--raw",
                       "--max-new-tokens", "12", "--proposer", "draft-model", "--draft-model", str(tmp_path / "draft"),
                       "--num-speculative-tokens", "3", "--compare-hf", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    (row,) = result["speculative"]
    assert row["method"] == "draft model chain K=3" and row["draft"].endswith("draft")
    assert row["identical_outputs"] == "2/2"
    assert len(row["acceptance_per_position"]) == 3
    assert result["transformers"]["identical_outputs"] == "2/2"
    assert result["transformers_assisted"]["identical_outputs"] == "2/2"
    assert result["transformers_assisted"]["tokens"] == result["jaxspec"]["tokens"]
    # a suite: its chains and auto (no trees: a draft model drafts chains), the same text as target-only
    assert bench.main(["--target", str(tmp_path / "target"), "--suite", str(tmp_path / "p.jsonl"), "--raw",
                       "--max-new-tokens", "8", "--batch-sizes", "1", "--chain-lengths", "2", "--proposer",
                       "draft-model", "--draft-model", str(tmp_path / "draft"), "--out", str(tmp_path / "suite"),
                       "--json"]) == 0
    runs = json.loads((tmp_path / "suite" / "results.json").read_text())["runs"]
    assert [r["method"] for r in runs] == ["target-only", "draft model chain K=2", "draft model auto"]
    assert all(r["identical_outputs"] == "2/2" for r in runs[1:])


def test_accepted_counts_equal_transformers_assisted_generation_step_for_step(tmp_path, capsys):
    """`bench --compare-hf` with a draft model replays transformers' assisted generation (`assistant_model=`, K drafts
    a step) from jaxspec's first verify step: every step accepts as many drafts in both (a draft that is the
    target's first 3 of 4 layers, so steps accept 0..3 of them). Prompt lookup off: its chains are not the draft
    model's (with it on, the bench skips the step-for-step comparison)."""
    from jaxspec.bench import cli as bench

    target = make_tiny("smollm2_tied", tmp_path / "target", seed=5, initializer_range=0.3)  # outputs that vary
    write_char_tokenizer(tmp_path / "target")
    target.model.layers = target.model.layers[:3]
    target.config.num_hidden_layers = 3
    target.save_pretrained(tmp_path / "draft")
    write_char_tokenizer(tmp_path / "draft")
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"id": str(i), "prompt": p}) + "\n" for i, p in
                                              enumerate(["hello there", "abcabc", "the quick brown fox"])))
    assert bench.main(["--target", str(tmp_path / "target"), "--prompts-file", str(tmp_path / "p.jsonl"), "--raw",
                       "--max-new-tokens", "20", "--proposer", "draft-model", "--draft-model", str(tmp_path / "draft"),
                       "--num-speculative-tokens", "3", "--prompt-lookup", "off", "--compare-hf", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    (chain,) = result["speculative"]
    hf = result["transformers_assisted"]
    assert chain["identical_outputs"] == hf["identical_outputs"] == "3/3"
    assert hf["same_steps_as_jaxspec"] == "3/3" and hf["num_assistant_tokens"] == 3
    assert hf["accepted_drafts_histogram"] == chain["accepted_drafts_histogram"]
    assert hf["verify_steps"] == chain["verify_steps"]
    assert hf["mean_accepted_length"] == chain["mean_accepted_length"]
    assert sum(n > 0 for n in hf["accepted_drafts_histogram"]) >= 3, hf  # misses, partial and whole acceptances


def test_a_draft_model_with_another_tokenizer_is_refused(tmp_path, capsys):
    from jaxspec import generate

    for name in ("target", "draft"):
        make_tiny("smollm2_tied", tmp_path / name, seed=5)
        write_char_tokenizer(tmp_path / name)
    vocab_file = tmp_path / "draft" / "tokenizer.json"
    tok = json.loads(vocab_file.read_text())
    vocab = tok["model"]["vocab"]
    first, second = list(vocab)[:2]
    vocab[first], vocab[second] = vocab[second], vocab[first]  # two ids swapped: another tokenizer
    vocab_file.write_text(json.dumps(tok))
    with pytest.raises(SystemExit) as exc:
        generate.main(["--target", str(tmp_path / "target"), "--prompt", "hi", "--raw", "--max-new-tokens", "4",
                       "--proposer", "draft-model", "--draft-model", str(tmp_path / "draft")])
    assert exc.value.code == 2 and "has another tokenizer than the target" in capsys.readouterr().err
    with pytest.raises(JaxspecError, match="drafts at least 1 token"):
        DraftModelProposer.of(small_draft(), 0)
