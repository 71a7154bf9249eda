"""Automatic speculation among several drafters of one target (`jaxspec.engine.auto.among`, `generate
--also-draft`): each drafter's own choice, the batch running the best; the target's text whatever runs."""

import json

import jax.numpy as jnp
import numpy as np
import pytest
from hf_tiny import make_tiny, write_char_tokenizer
from spec_fixtures import PROMPTS, fitted_drafter, fitted_head, tiny_target

from jaxspec.engine.auto.among import AutoAmongDrafters, describe_among
from jaxspec.engine.auto.config import AcceptanceProfile, StepCosts
from jaxspec.engine.auto.generator import AutoSpeculativeGenerator
from jaxspec.engine.generation import Generator
from jaxspec.models.target import with_aux_layers

PRIOR = AcceptanceProfile((0.9, 0.8, 0.7), 100)
# a DFlash chain of 3 costs one drafter forward and a verify of 4: 0.023 s for 3.12 tokens (135 tokens/s); a head's
# costs three head steps of `draft` each; target-only 0.01 s a token (100 tokens/s)
BLOCK_COSTS = StepCosts(decode=0.01, verify=(0.0, 0.011, 0.012, 0.013), draft=0.01, block_draft=True)


@pytest.fixture(scope="module")
def reference():
    return [c.token_ids for c in Generator(tiny_target(), batch_size=1).generate(PROMPTS, max_new_tokens=30)]


def _among(head_draft_seconds: float, head_prior=PRIOR) -> AutoAmongDrafters:
    head = AutoSpeculativeGenerator(tiny_target(), fitted_head(), prior=head_prior, batch_size=4)
    block = AutoSpeculativeGenerator(tiny_target(), fitted_drafter(), prior=PRIOR, batch_size=4, max_draft=3)
    among = AutoAmongDrafters([head, block], ["head", "dflash"])
    head_costs = StepCosts(decode=0.01, verify=(0.0, 0.011, 0.012, 0.013, 0.014, 0.015), draft=head_draft_seconds)
    for start in range(0, len(PROMPTS), 4):  # the timings fixed, so that the choice is the test's
        capacity = max(d.cost_capacity(PROMPTS[start : start + 4], 30) for d in among.drafters)
        head.step_costs[capacity], block.step_costs[capacity] = head_costs, BLOCK_COSTS
    return among


@pytest.mark.parametrize("head_draft_seconds,winner", [(0.01, "dflash"), (0.0005, "head")])
def test_each_batch_runs_the_drafter_whose_choice_is_fastest(head_draft_seconds, winner, reference):
    among = _among(head_draft_seconds)
    got = among.generate(PROMPTS, max_new_tokens=30)
    assert [c.token_ids for c in got] == reference
    records = [c.stats["auto"] for c in got]
    assert {r["drafter"] for r in records} == {winner}
    assert all(r["num_speculative_tokens"] == 3 for r in records)
    expected = records[0]["drafters"]
    assert set(expected) == {"head", "dflash"} and max(expected, key=expected.get) == winner
    assert {c.stats["proposer"] for c in got} == {"dflash" if winner == "dflash" else "eagle3"}
    batches = len(PROMPTS) // 4
    assert describe_among(got, 4) == f"{winner}: K=3 for {batches} batch{'es' if batches > 1 else ''}"
    # only the drafter that ran took in counts
    ran, idle = (among.drafters[1], among.drafters[0]) if winner == "dflash" else among.drafters
    assert ran.running.profile().verify_steps > 0 and idle.running.profile().verify_steps == 0


def test_a_drafter_without_a_record_measures_first(reference):
    """The head has no acceptance profile: its first batch drafts its default chain to measure one, whatever the
    other drafter expects; then the costs decide."""
    among = _among(0.01, head_prior=None)
    got = among.generate(PROMPTS, max_new_tokens=30)
    assert [c.token_ids for c in got] == reference
    first = got[0].stats["auto"]
    assert first["drafter"] == "head" and first["basis"] == "first batch"
    assert among.drafters[0].running.profile().verify_steps > 0


def test_a_view_returns_other_layers_features_over_the_same_weights():
    model = tiny_target()
    ids = model.config.aux_layer_ids
    view = with_aux_layers(model, ids[:1])
    assert view.config.aux_layer_ids == ids[:1] and model.config.aux_layer_ids == ids
    assert view.embed_tokens[...] is model.embed_tokens[...]
    tokens = jnp.asarray([[3, 7, 1, 12, 5]], jnp.int32)
    positions = jnp.arange(5)[None]
    whole = model(tokens, positions, model.init_cache(1, 8), return_aux=True)
    part = view(tokens, positions, view.init_cache(1, 8), return_aux=True)
    h = model.config.hidden_size
    assert part.aux.shape[-1] == h and whole.aux.shape[-1] == len(ids) * h
    np.testing.assert_array_equal(np.asarray(part.aux), np.asarray(whole.aux[..., :h]))
    np.testing.assert_array_equal(np.asarray(part.logits), np.asarray(whole.logits))


def test_generate_also_draft_chooses_among_a_head_and_a_dflash_drafter(tmp_path, capsys):
    """`generate --draft HEAD --also-draft DFLASH`: both random (no record), so each measures on a batch of its
    own, and the text is target-only's; the flags that would fix the method are refused."""
    from jaxspec import convert, generate

    make_tiny("smollm2_tied", tmp_path / "target", seed=5)
    write_char_tokenizer(tmp_path / "target")
    target = str(tmp_path / "target")
    assert convert.main(["random-head", "--target", target, "--out", str(tmp_path / "head")]) == 0
    assert convert.main(["random-dflash", "--target", target, "--out", str(tmp_path / "dflash"), "--block-size",
                         "4", "--num-layers", "1"]) == 0
    capsys.readouterr()
    common = ["--target", target, "--raw", "--json", "--prompts-file", str(tmp_path / "p.jsonl"),
              "--max-new-tokens", "10"]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"id": str(i), "prompt": p}) + "\n"
                                              for i, p in enumerate(["hello there", "abcabc", "the fox"])))
    assert generate.main([*common, "--no-draft"]) == 0
    want = [json.loads(line)["token_ids"] for line in capsys.readouterr().out.strip().splitlines()]
    assert generate.main([*common, "--draft", str(tmp_path / "head"), "--also-draft", str(tmp_path / "dflash")]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]
    assert [r["token_ids"] for r in records] == want
    assert [r["stats"]["auto"]["drafter"] for r in records[:2]] == ["head", "dflash"]  # each measures first
    assert all(r["stats"]["auto"]["basis"] == "first batch" for r in records[:2])
    for extra, message in ((["--tree", "6,3,2"], "drop --tree"), (["--num-speculative-tokens", "2"],
                                                                  "drop --num-speculative-tokens")):
        with pytest.raises(SystemExit) as exc:
            generate.main([*common, "--draft", str(tmp_path / "head"), "--also-draft", str(tmp_path / "dflash"),
                           *extra])
        assert exc.value.code == 2 and message in capsys.readouterr().err
    with pytest.raises(SystemExit):
        generate.main([*common, "--no-draft", "--also-draft", str(tmp_path / "dflash")])
    assert "drop --no-draft" in capsys.readouterr().err
