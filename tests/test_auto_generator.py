"""Automatic speculation per batch (`--num-speculative-tokens auto`): whatever it chooses, the output is the
target's; the choice follows the costs and the acceptance; the running counts are the engine's."""

import jax
import numpy as np
import pytest
from flax import nnx
from spec_fixtures import PROMPTS, fitted_head, tiny_target

from jaxspec.engine.generation import Generator
from jaxspec.engine.auto.config import AcceptanceProfile, RunningAcceptance, StepCosts
from jaxspec.engine.auto.generator import FIRST_CHAIN, AutoSpeculativeGenerator, chosen, describe_choices
from jaxspec.engine.generator import SpeculativeGenerator
from jaxspec.engine.tree import TreeConfig

MAX_NEW = 12
CHEAP_VERIFY = StepCosts(decode=0.01, verify=(0.0,) + (0.0101,) * 4, draft=0.0001)  # any acceptance pays
DEAR_VERIFY = StepCosts(decode=0.01, verify=(0.0,) + tuple(0.01 * (1 + k) for k in range(1, 5)), draft=0.001)
# one draft pays above a first-draft rate of 0.6: (1 + r) / (15 ms + 1 ms) > 1 / 10 ms
MID_VERIFY = StepCosts(decode=0.01, verify=(0.0,) + tuple(0.01 + 0.005 * k for k in range(1, 5)), draft=0.001)


TREE = TreeConfig(6, 3, 2)
# a verify of 6 tokens costs a decode step and the expansion little: the tree (its record: 3.5 tokens) beats K=4
WITH_TREE = StepCosts(decode=0.01, verify=(0.0,) + (0.0101,) * 5, draft=0.0001, tree_drafts=((TREE, 0.0002),))


def _auto(prior, costs: StepCosts | None, batch_size: int = 1, trees=None) -> AutoSpeculativeGenerator:
    gen = AutoSpeculativeGenerator(tiny_target(), fitted_head(), prior=prior, batch_size=batch_size, trees=trees)
    if costs is not None:  # the timing's result, fixed so that the choice is the test's
        for prompts in (PROMPTS[i : i + batch_size] for i in range(0, len(PROMPTS), batch_size)):
            gen.step_costs[gen.cost_capacity(prompts, MAX_NEW)] = costs
    return gen


@pytest.fixture(scope="module")
def target_only():
    out = Generator(tiny_target(), batch_size=1).generate(PROMPTS, max_new_tokens=MAX_NEW)
    return [c.token_ids for c in out]


@pytest.mark.parametrize(
    "prior, costs, expected",
    [
        pytest.param(  # ~80 s; in CI the README's command (test_smollm2) chooses from a prior and timed costs
            AcceptanceProfile((0.9, 0.8, 0.7, 0.6), 100), CHEAP_VERIFY, 4, marks=pytest.mark.slow
        ),  # high acceptance, cheap verify: longest
        pytest.param(  # target-only chosen is in the probe tests below
            AcceptanceProfile((0.2, 0.05, 0.01, 0.0), 100), DEAR_VERIFY, 0, marks=pytest.mark.slow
        ),  # low acceptance, dear verify: target-only
    ],
)
def test_the_choice_follows_costs_and_acceptance_and_the_output_is_the_targets(prior, costs, expected, target_only):
    gen = _auto(prior, costs)
    out = gen.generate(PROMPTS, max_new_tokens=MAX_NEW)
    assert [c.token_ids for c in out] == target_only
    first = out[0].stats["auto"]
    assert first["num_speculative_tokens"] == expected and first["basis"] == "prior"
    assert first["acceptance_per_position"] == list(prior.rates)
    assert first["step_costs_ms"]["decode"] == 10.0
    if expected == 0:  # target-only never speculates, so nothing is observed and the choice stays
        assert chosen(out, 1) == {0: len(PROMPTS)} and gen.running.profile().verify_steps == 0
        assert all("verify_calls" not in c.stats for c in out)
    else:
        assert all(c.stats["auto"]["num_speculative_tokens"] >= 1 for c in out)
        assert out[-1].stats["auto"]["basis"] == "prior+observed"


@pytest.mark.slow  # ~44 s; CI: the draft-model CLI test runs auto's first batch (tests/test_draft_model.py)
def test_without_a_prior_the_first_batch_measures_and_the_counts_decide(target_only):
    gen = _auto(None, DEAR_VERIFY)
    out = gen.generate(PROMPTS, max_new_tokens=MAX_NEW)
    assert [c.token_ids for c in out] == target_only
    first, second = out[0].stats, out[1].stats
    assert first["auto"]["basis"] == "first batch" and first["auto"]["num_speculative_tokens"] == FIRST_CHAIN
    assert len(first["accepted_per_position"]) == FIRST_CHAIN
    assert second["auto"]["basis"] == "observed"
    # the running acceptance after the first batch is that batch's own counts
    rates = [n / first["verify_calls"] for n in first["accepted_per_position"]]
    expected = np.minimum.accumulate(rates)
    np.testing.assert_allclose(first["auto"]["running_acceptance_per_position"], np.round(expected, 4))
    assert second["auto"]["acceptance_per_position"] == first["auto"]["running_acceptance_per_position"]
    assert f"K={FIRST_CHAIN} for 1 batch" in describe_choices(out, 1)


@pytest.mark.slow
def test_batches_of_several_rows_and_the_extra_cache_fit_every_choice(target_only):
    gen = _auto(AcceptanceProfile((0.9, 0.8, 0.7, 0.6), 100), CHEAP_VERIFY, batch_size=2)
    chain = SpeculativeGenerator(tiny_target(), fitted_head(), num_draft=4, batch_size=2)
    assert gen.cost_capacity(PROMPTS[:2], MAX_NEW) == chain.batch_capacity(PROMPTS[:2], MAX_NEW)  # priced as run
    out = gen.generate(PROMPTS, max_new_tokens=MAX_NEW)
    assert [c.token_ids for c in out] == target_only
    assert chosen(out, 2) == {4: 2}
    steps = sum(c.stats["verify_calls"] for c in out)
    assert out[-1].stats["auto"]["running_verify_steps"] == steps


@pytest.mark.slow
def test_timed_costs_are_measured_once_per_cache_bucket():
    gen = _auto(AcceptanceProfile((0.9, 0.8, 0.7, 0.6), 100), None)
    gen.generate(PROMPTS[:2], max_new_tokens=MAX_NEW)
    assert len(gen.step_costs) == 1 and gen.timing_seconds > 0
    (costs,) = gen.step_costs.values()
    assert costs.max_draft == 4 and costs.decode > 0


@pytest.mark.slow  # ~48 s; CI: every auto run calibrates its batches (the README command in tests/test_smollm2.py)
def test_each_batch_calibrates_the_timed_costs_with_its_own_step_time():
    gen = _auto(AcceptanceProfile((0.2, 0.05, 0.01, 0.0), 100), DEAR_VERIFY)  # target-only
    out = gen.generate(PROMPTS[:2], max_new_tokens=MAX_NEW)
    assert chosen(out, 1) == {0: 2}
    seconds = sum(c.seconds - c.prefill_seconds for c in out)
    steps = sum(c.num_generated - 1 for c in out)
    (ratio,) = out[-1].stats["auto"]["step_calibration"].values()
    assert list(out[-1].stats["auto"]["step_calibration"]) == ["0"]
    assert ratio == pytest.approx(seconds / (steps * DEAR_VERIFY.decode), abs=1e-4)
    assert gen.calibration.seconds(DEAR_VERIFY, 0) == pytest.approx(seconds / steps)  # what the next uses


def test_running_acceptance_pools_chains_of_different_lengths():
    run = RunningAcceptance()
    run.add([6, 3], 10)  # a K=2 batch: 10 verify steps
    run.add([4, 2, 1, 0], 10)  # a K=4 batch
    profile = run.profile()
    assert profile.verify_steps == 20
    assert profile.rates == pytest.approx((0.5, 0.25, 0.1, 0.0))  # positions 3-4 over the K=4 batch only
    assert RunningAcceptance().profile().rates == ()


def test_while_target_only_is_chosen_a_probe_batch_keeps_measuring(target_only):
    from jaxspec.engine.auto.generator import PROBE_EVERY

    gen = _auto(AcceptanceProfile((0.2, 0.05, 0.01, 0.0), 100), MID_VERIFY)
    prompts = (PROMPTS * PROBE_EVERY)[:PROBE_EVERY]
    out = gen.generate(prompts, max_new_tokens=MAX_NEW)
    assert [c.token_ids for c in out] == (target_only * PROBE_EVERY)[:PROBE_EVERY]
    assert chosen(out, 1) == {0: PROBE_EVERY - 1, 1: 1}
    probe = out[-1].stats
    assert probe["auto"]["basis"] == "probe" and probe["auto"]["num_speculative_tokens"] == 1
    assert probe["auto"]["running_verify_steps"] == probe["verify_calls"] > 0


@pytest.mark.parametrize(
    "costs, observed, probes",
    [
        (MID_VERIFY, None, 1),  # nothing observed yet: the head may draft well on these prompts
        (MID_VERIFY, (55, 100), 1),  # 0.55 of first drafts over 100 steps: 0.6 is within reach
        (MID_VERIFY, (10, 100), 0),  # 0.1 over 100 steps: one draft cannot pay, the probe would only cost
        (DEAR_VERIFY, None, 0),  # a verify of 2 tokens costs two decodes: no acceptance pays
    ],
)
def test_a_probe_runs_only_where_it_could_change_the_choice(costs, observed, probes, target_only):
    from jaxspec.engine.auto.generator import PROBE_EVERY

    gen = _auto(AcceptanceProfile((0.2, 0.05, 0.01, 0.0), 100), costs)
    if observed is not None:  # what earlier probes counted (first-draft acceptances, verify steps)
        gen.running.add([observed[0]], observed[1])
    prompts = (PROMPTS * PROBE_EVERY)[:PROBE_EVERY]
    out = gen.generate(prompts, max_new_tokens=MAX_NEW)
    assert [c.token_ids for c in out] == (target_only * PROBE_EVERY)[:PROBE_EVERY]
    assert chosen(out, 1) == ({0: PROBE_EVERY - 1, 1: 1} if probes else {0: PROBE_EVERY})


def test_a_stored_ratio_for_one_draft_does_not_keep_the_probes_off(target_only):
    """One draft's ratio stored by an earlier process (its steps ran 1.7x the timed cost, under load, say) would
    rule one draft out at any acceptance; until this process has run a draft it is costed as the others are."""
    from jaxspec.engine.auto.config import StepCalibration
    from jaxspec.engine.auto.generator import PROBE_EVERY

    gen = _auto(AcceptanceProfile((0.2, 0.05, 0.01, 0.0), 100), MID_VERIFY)
    gen.calibration = StepCalibration({0: 10.0, 1: 17.0}, {0: 10.0, 1: 10.0})
    prompts = (PROMPTS * PROBE_EVERY)[:PROBE_EVERY]
    out = gen.generate(prompts, max_new_tokens=MAX_NEW)
    assert [c.token_ids for c in out] == (target_only * PROBE_EVERY)[:PROBE_EVERY]
    assert chosen(out, 1) == {0: PROBE_EVERY - 1, 1: 1}
    assert list(gen.own_calibration.measured) == [0, 1]  # the gate now costs one draft at the probe's own ratio


@pytest.mark.slow
def test_on_a_mesh_the_head_is_placed_once_and_the_output_is_one_devices(target_only):
    """Timing and every chain run on the mesh (data=2 × model=2), sharing one placed copy of the head."""
    from jaxspec import sharding

    mesh = sharding.make_mesh(sharding.MeshConfig(data=2, model=2))
    gen = AutoSpeculativeGenerator(tiny_target(), fitted_head(), prior=AcceptanceProfile((0.9, 0.8), 100),
                                   batch_size=2, mesh=mesh)
    out = gen.generate(PROMPTS, max_new_tokens=MAX_NEW)
    assert [c.token_ids for c in out] == target_only
    assert len(gen.step_costs) >= 1 and sum(chosen(out, 2).values()) == 2
    leaves = jax.tree.leaves(nnx.state(gen.head))
    assert all(isinstance(x.sharding, jax.sharding.NamedSharding) and x.sharding.mesh == mesh for x in leaves)


@pytest.mark.slow
def test_a_recorded_tree_is_chosen_where_it_pays_and_its_counts_are_its_own(target_only):
    prior = AcceptanceProfile((0.9, 0.8, 0.7, 0.6), 100)  # a chain of 4 expects 4.0 tokens per verify
    gen = _auto(prior, WITH_TREE, trees={TREE: 4.5})
    assert gen.num_draft == 4 and gen.methods == [0, 1, 2, 3, 4, TREE]
    out = gen.generate(PROMPTS, max_new_tokens=MAX_NEW)
    assert [c.token_ids for c in out] == target_only
    first = out[0].stats["auto"]
    assert first["method"] == "tree 6,3,2" and first["tree"] == "6,3,2" and first["num_speculative_tokens"] == 3
    assert first["tree_tokens_per_step"] == {"tree 6,3,2": 4.5} and first["basis"] == "prior"
    assert chosen(out, 1) == {TREE: len(PROMPTS)}
    assert describe_choices(out, 1) == f"tree 6,3,2 for {len(PROMPTS)} batches"
    # the tree's counts are kept apart from the chain's: its tokens per verify (the accepted drafts and the bonus of
    # every step, a last step cut at max-new-tokens included), pooled with its record
    tokens = sum(c.stats["verify_calls"] + sum(c.stats["accepted_per_position"]) for c in out)
    assert tokens >= sum(c.num_generated - 1 for c in out)
    steps = sum(c.stats["verify_calls"] for c in out)
    assert out[-1].stats["auto"]["running_trees"] == {
        "tree 6,3,2": {"tokens_per_verify": round(tokens / steps, 4), "verify_steps": steps}}
    assert gen.running.profile().verify_steps == 0
    assert gen.tree_tokens()[TREE] == pytest.approx((100 * 4.5 + tokens) / (100 + steps))
    assert list(out[-1].stats["auto"]["step_calibration"]) == ["tree 6,3,2"]
    # a tree the record does not name is never run, however cheap: its acceptance is unknown
    plain = _auto(prior, WITH_TREE)
    assert chosen(plain.generate(PROMPTS[:1], max_new_tokens=MAX_NEW), 1) == {4: 1}


@pytest.mark.parametrize("worth", [pytest.param(True, marks=pytest.mark.slow), False])  # True: ~40 s of timing
def test_trees_are_timed_only_where_the_chain_costs_say_they_could_win(worth, monkeypatch):
    from jaxspec.engine.auto import generator as auto_generator

    monkeypatch.setattr(auto_generator, "tree_worth_timing", lambda *a: worth)
    gen = _auto(AcceptanceProfile((0.9, 0.8), 100), None, trees={TREE: 2.5})
    gen.generate(PROMPTS[:1], max_new_tokens=MAX_NEW)
    (costs,) = gen.step_costs.values()
    assert costs.trees == ((TREE,) if worth else ())
    if worth:
        assert costs.tree_draft(TREE) > 0 and costs.max_draft >= TREE.total_tokens - 1
