"""The automatic speculative configuration's arithmetic: expected tokens, the choice among target-only, chains and
trees, and the acceptance profile pooled with running counts."""

import numpy as np
import pytest

from jaxspec.errors import JaxspecError
from jaxspec.engine.auto.config import (
    AcceptanceProfile,
    StepCalibration,
    StepCosts,
    choose,
    drafting_could_win,
    expected_tokens,
    live_batch_plan,
    step_seconds,
)
from jaxspec.engine.tree import TreeConfig

# This CPU's measured costs for SmolLM2 at batch 1 (BENCHMARKS.md): decode 26.2 ms, verify of 6 tokens 53.4 ms,
# head step 1.56 ms; verify of k+1 tokens interpolated linearly between them.
CPU = StepCosts(decode=0.0262, verify=(0.0,) + tuple(0.0262 + (0.0534 - 0.0262) * k / 5 for k in range(1, 8)),
                draft=0.00156)
# an accelerator's: a verify of a few tokens costs about one decode step
GPU = StepCosts(decode=0.008, verify=(0.0,) + tuple(0.008 * (1 + 0.02 * k) for k in range(1, 8)), draft=0.0006)
TREE = TreeConfig(12, 5, 3)


def _with_tree(costs: StepCosts, tree: TreeConfig, expansion: float) -> StepCosts:
    """`costs` with the verify extended to the tree's TOTAL tokens along the last slope, and its expansion timed."""
    v = list(costs.verify)
    while len(v) < tree.total_tokens:
        v.append(v[-1] + (v[-1] - v[-2]))
    return StepCosts(costs.decode, tuple(v), costs.draft, ((tree, expansion),))


def test_expected_tokens_is_the_bonus_plus_accepted_drafts():
    assert expected_tokens([0.8, 0.6, 0.3], 0) == 1.0
    assert expected_tokens([0.8, 0.6, 0.3], 2) == pytest.approx(2.4)
    assert expected_tokens([0.8, 0.6, 0.3], 5) == pytest.approx(2.7)  # past the profile: nothing more


def test_choice_maximizes_expected_tokens_per_second_by_brute_force():
    rng = np.random.default_rng(0)
    for _ in range(200):
        rates = tuple(np.sort(rng.uniform(0, 1, 7))[::-1])
        costs = StepCosts(rng.uniform(0.005, 0.05), (0.0,) + tuple(np.cumsum(rng.uniform(0.001, 0.02, 7)) + 0.01),
                          rng.uniform(0, 0.005))
        choice = choose(costs, AcceptanceProfile(rates, 100))
        speeds = [1 / costs.decode] + [(1 + sum(rates[:k])) / (costs.verify[k] + k * costs.draft) for k in range(1, 8)]
        assert choice.num_draft == int(np.argmax(speeds))
        assert choice.tokens_per_second == pytest.approx(max(speeds))


def test_low_acceptance_on_this_cpu_picks_target_only_and_high_acceptance_speculates():
    # the shipped head on MT-Bench (tokens per verify 1.32): a verify costs more than it yields here
    weak = AcceptanceProfile((0.24, 0.06, 0.015, 0.004, 0.001), 1000)
    assert choose(CPU, weak).num_draft == 0
    # the same head on a GPU, where verifying 2 tokens costs about a decode: one draft pays
    assert choose(GPU, weak).num_draft >= 1
    strong = AcceptanceProfile((0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3), 1000)
    assert choose(CPU, strong).num_draft >= 3
    assert choose(CPU, strong, max_draft=2).num_draft == 2  # an explicit cap is honoured


def _gpu_at(rows: int) -> StepCosts:
    """An accelerator's costs at `rows` rows: a decode bound by weight reads until ~64 tokens a step, a verify of
    k + 1 tokens by rows × (k + 1) tokens past that (compute-bound)."""
    step = lambda tokens: 0.008 * max(1.0, tokens / 64)  # noqa: E731
    return StepCosts(step(rows), (0.0,) + tuple(step(rows * (k + 1)) for k in range(1, 8)), 0.0006 * max(1, rows / 16))


def test_a_live_batch_speculates_in_the_buckets_where_it_pays_and_not_above():
    """The server's auto (`live_batch_plan`): the smallest bucket's method, drafting where it beats target-only at
    that bucket's costs; on the accelerator's costs speculation stops paying as rows grow (vLLM's batch-size-aware
    speculation), on this CPU's a weak head pays nowhere."""
    profile = AcceptanceProfile((0.7, 0.5, 0.35, 0.2, 0.1), 1000)
    buckets = (1, 2, 4, 8, 16, 32, 64)
    plan = live_batch_plan({rows: choose(_gpu_at(rows), profile) for rows in buckets})
    assert isinstance(plan.method, int) and plan.method >= 2
    assert 1 in plan.drafting_rows and 64 not in plan.drafting_rows
    on = sorted(plan.drafting_rows)
    assert on == [r for r in buckets if r <= on[-1]]  # a threshold: drafting pays below it, not above
    for rows, choice in plan.choices:  # by brute force at each bucket's costs
        speeds = dict(choice.candidates)
        assert (rows in plan.drafting_rows) == (speeds[plan.method] > speeds[0])
    assert plan.describe() == f"chain K={plan.method} at 1-{on[-1]} rows, target-only steps at {on[-1] * 2}-64"
    weak = AcceptanceProfile((0.24, 0.06, 0.015, 0.004, 0.001), 1000)
    cpu = live_batch_plan({1: choose(CPU, weak)})
    assert cpu.method == 0 and not cpu.drafting_rows and cpu.describe() == "target-only"
    # no acceptance profile yet (a first batch: no candidates): the default chain drafts everywhere
    from jaxspec.engine.auto.config import Choice

    first = live_batch_plan({1: Choice(5, 0.0, 0.0, ()), 4: Choice(5, 0.0, 0.0, ())})
    assert first.method == 5 and first.drafting_rows == {1, 4} and first.describe() == "chain K=5 at 1-4 rows"


def test_a_probe_is_worth_running_only_while_the_counts_leave_drafting_a_chance():
    # one draft pays above a first-draft rate of 0.6 here: (1 + r) / (15 ms + 1 ms) > 1 / 10 ms
    costs = StepCosts(decode=0.01, verify=(0.0, 0.015), draft=0.001)
    assert drafting_could_win(costs, AcceptanceProfile((), 0))  # nothing observed: the head may draft perfectly
    assert not drafting_could_win(costs, AcceptanceProfile((0.1,), 100))  # 0.1 + 2 * 0.05 = 0.2 < 0.6
    assert drafting_could_win(costs, AcceptanceProfile((0.55,), 100))  # 0.55 + 0.1 = 0.65: a chance left
    assert not drafting_could_win(costs, AcceptanceProfile((0.55,), 10_000))  # 0.55 + 0.01: more counts, none
    assert drafting_could_win(costs, AcceptanceProfile((0.55,), 10_000), z=12.0)  # 0.55 + 12 * 0.005
    # a verify dearer than two decodes: even a head that is always right loses, so no probe ever pays
    dear = StepCosts(decode=0.01, verify=(0.0, 0.025), draft=0.001)
    assert not drafting_could_win(dear, AcceptanceProfile((), 0))


def test_calibration_scales_each_choice_by_what_its_steps_took():
    cal = StepCalibration()
    for k in range(CPU.max_draft + 1):  # nothing ran yet: the timed costs
        assert cal.seconds(CPU, k) == pytest.approx(step_seconds(CPU, k))
    cal.add(0, 0.9, 1.0)  # target-only ran at 0.9x its timed decode
    cal.add(1, 2.0, 1.6)  # K=1 at 1.25x, in two batches
    cal.add(1, 0.5, 0.4)
    assert cal.seconds(CPU, 0) == pytest.approx(0.9 * CPU.decode)
    assert cal.seconds(CPU, 1) == pytest.approx(1.25 * step_seconds(CPU, 1))
    assert cal.seconds(CPU, 4) == pytest.approx(3.4 / 3.0 * step_seconds(CPU, 4))  # did not run: all pooled
    assert cal.as_dict() == {"0": 0.9, "1": 1.25}
    cal.add(4, 1.0, 1.0)
    assert cal.ratio(4) == 1.0 and cal.ratio(2) == pytest.approx(4.4 / 4.0)
    cal.add(TREE, 3.0, 2.0)  # a tree's steps are a method of their own
    assert cal.ratio(TREE) == 1.5 and cal.as_dict()["tree 12,5,3"] == 1.5 and list(cal.as_dict())[-1] == "tree 12,5,3"
    only_chains = StepCalibration()  # target-only never ran (a speculating head): it takes the chains' ratio
    only_chains.add(1, 0.9, 1.0)
    assert only_chains.seconds(CPU, 0) == pytest.approx(0.9 * CPU.decode)


def test_a_close_call_flips_when_the_measured_steps_disagree_with_the_timed_ones():
    # grounded prompts (BENCHMARKS.md): timed costs, and the head's recorded a_1 of 0.35, choose one draft...
    costs = StepCosts(decode=0.0417, verify=(0.0, 0.0523), draft=0.0023)
    assert choose(costs, AcceptanceProfile((0.35,), 100)).num_draft == 1
    # ...which measures a_1 = 0.262 and steps at 0.9x of their timing; alone, that calibration keeps the draft
    # (25.6 expected tokens/s vs 24.0), but the same machine would decode at 0.9x too: target-only wins (26.6)
    measured = AcceptanceProfile((0.262,), 100)
    cal = StepCalibration()
    cal.add(1, 0.9, 1.0)
    assert choose(costs, measured, calibration=cal).num_draft == 0
    # once target-only ran, its own ratio decides: a slower decode than timed brings the draft back
    cal.add(0, 1.2, 1.0)
    assert choose(costs, measured, calibration=cal).num_draft == 1


def test_lookups_runs_past_a_chain_are_credited_to_every_chain_length():
    from jaxspec.engine.auto.config import RunningPastChain

    past = RunningPastChain()
    assert past.tokens(2) == 0.0  # nothing observed
    past.add(2, [60, 30, 20, 10], 100)  # a chain of 2 whose lookup rows ran to 4: positions 3 and 4 are lookup's
    past.add(2, [5, 1, 0, 0], 50)
    past.add(3, [50, 20, 12, 6], 100)  # a chain of 3: position 4 is lookup's
    assert past.steps == [0, 0, 150, 250] and past.accepted == [0, 0, 20, 16]
    assert past.tokens(2) == pytest.approx(20 / 150 + 16 / 250)
    assert past.tokens(3) == pytest.approx(16 / 250)
    assert past.tokens(4) == 0.0
    # a chain of 1 never ran: its position 2 takes position 3's rate (a lower bound)
    assert past.tokens(1) == pytest.approx(2 * 20 / 150 + 16 / 250)
    assert past.as_dict(2) == {"1": round(past.tokens(1), 4), "2": round(past.tokens(2), 4)}
    # the credit moves the choice: chains of 1 or 2 lose to target-only on this CPU's costs...
    profile = AcceptanceProfile((0.25, 0.15), 100)
    assert choose(CPU, profile).num_draft == 0
    # ...and K=2 wins once its lookups' long runs add 0.4 tokens per verify (1.8 tokens in 40.2 ms)
    choice = choose(CPU, profile, past_chain={2: 0.4})
    assert choice.num_draft == 2 and choice.tokens_per_step == pytest.approx(1.8)


def test_running_counts_pool_with_the_prior_position_by_position():
    from jaxspec.engine.auto.config import RunningAcceptance

    prior = AcceptanceProfile((0.8, 0.6, 0.4), 300)
    seen = RunningAcceptance()
    seen.add([50, 20], 100)  # drafts 1 and 2 accepted in 50 and 20 of 100 steps
    assert seen.profile().rates == (0.5, 0.2)
    both = seen.pooled_with(prior)
    assert both.rates[0] == pytest.approx((300 * 0.8 + 100 * 0.5) / 400)
    assert both.rates[1] == pytest.approx((300 * 0.6 + 100 * 0.2) / 400)
    assert both.rates[2] == pytest.approx(both.rates[1] * 0.4 / 0.6)  # undrafted: the prior's decay
    assert both.verify_steps == 400
    assert RunningAcceptance().pooled_with(prior) == prior
    many = RunningAcceptance()
    many.add([5000, 2000, 500], 10000)
    assert many.pooled_with(prior).rates == pytest.approx((0.5087, 0.2117, 0.0602), abs=1e-3)  # counts dominate
    # many one-draft steps, few three-draft ones: the far positions rest on the steps that drafted them
    mixed = RunningAcceptance()
    mixed.add([6000], 10000)
    mixed.add([30, 20, 10], 100)
    pooled = mixed.pooled_with(prior)
    assert pooled.rates[0] == pytest.approx((240 + 6030) / 10400)
    assert pooled.rates[2] == pytest.approx((120 + 10) / 400)  # not (120 + 10 * 101) / 10400


def test_bad_inputs_are_one_line_errors():
    with pytest.raises(JaxspecError, match="positive seconds"):
        StepCosts(0.0, (0.0, 0.01), 0.001)
    with pytest.raises(JaxspecError, match="never grow"):
        AcceptanceProfile((0.2, 0.5), 10)


def test_verify_lengths_time_decode_the_shortest_and_the_longest_verify():
    from jaxspec.engine.auto.step_costs import verify_lengths

    assert verify_lengths(1) == [1, 2]
    assert verify_lengths(5) == [1, 2, 6]
    assert verify_lengths(7) == [1, 2, 8]


@pytest.mark.slow
def test_measured_costs_of_a_tiny_target_feed_the_choice():
    """Timing runs on the real forward functions and gives a usable StepCosts (values are this machine's)."""
    from spec_fixtures import random_head, tiny_target

    from jaxspec.engine.auto.step_costs import add_tree_costs, measure_step_costs

    costs = measure_step_costs(tiny_target(), random_head(), batch=2, capacity=64, max_draft=5, repeats=2)
    assert costs.max_draft == 5 and costs.decode > 0 and costs.draft > 0
    assert all(v > 0 for v in costs.verify[1:])
    choice = choose(costs, AcceptanceProfile((0.9, 0.8, 0.7, 0.6, 0.5), 100))
    assert 0 <= choice.num_draft <= 5 and dict(choice.candidates)[choice.num_draft] == choice.tokens_per_second
    alone = measure_step_costs(tiny_target(), None, batch=1, capacity=64, max_draft=1, repeats=1)
    assert alone.draft == 0.0 and alone.max_draft == 1
    tree = TreeConfig(8, 3, 2)  # its verify of 8 tokens extends the costs past the chains' 6
    both = add_tree_costs(costs, tiny_target(), random_head(), 2, 64, (tree,), repeats=1)
    assert both.max_draft == 7 and both.trees == (tree,) and both.tree_draft(tree) > 0
    assert both.verify[:6] == costs.verify and both.decode == costs.decode  # the chains' timings are kept
    assert step_seconds(both, tree) > both.verify[7]


def test_the_prior_comes_from_the_heads_chain_measurements():
    from jaxspec.engine.auto.config import profile_from_record

    record = [
        {"prompts": "mt_bench", "method": "chain K=5", "mean_accepted_length": 1.3, "num_prompts": 80,
         "acceptance_per_position": [0.24, 0.06, 0.015, 0.005, 0.002]},
        {"prompts": "mt_bench", "method": "tree 12,5,3", "mean_accepted_length": 1.55, "num_prompts": 80,
         "acceptance_per_position": [0.385, 0.134, 0.03, 0.007, 0.002]},  # a tree's rates are not a chain's
        {"prompts": "gsm8k", "method": "chain K=5", "mean_accepted_length": 1.8, "num_prompts": 40,
         "acceptance_per_position": [0.45, 0.22, 0.1, 0.05, 0.03]},
    ]
    prior = profile_from_record(record, weight=50)
    assert prior.verify_steps == 50 and len(prior.rates) == 5
    assert prior.rates[0] == pytest.approx((80 * 0.24 + 40 * 0.45) / 120)
    assert profile_from_record(record[1:2]) is None and profile_from_record(None) is None


def test_the_shipped_heads_profile_gives_a_prior():
    import json

    from jaxspec.checkpoints import builtin
    from jaxspec.engine.auto.config import profile_from_record

    config = json.loads((builtin.default_head_dir() / "config.json").read_text())
    prior = profile_from_record(config["jaxspec"]["acceptance"])
    assert prior is not None and 0.2 < prior.rates[0] < 0.5
    assert choose(CPU, prior).num_draft in (0, 1)  # the shipped head on this CPU: little or no speculation
    from jaxspec.engine.auto.config import trees_from_record

    trees = trees_from_record(config["jaxspec"]["acceptance"])  # its tree measurements: candidates on a GPU
    assert trees and all(n > prior.rates[0] + 1 for n in trees.values())
    from jaxspec.engine.auto.config import tree_worth_timing

    # on this CPU none is worth timing (no compilation spent on them); where a verify costs about a decode, all are
    assert not any(tree_worth_timing(CPU, t, n, 1 / CPU.decode) for t, n in trees.items())
    assert all(tree_worth_timing(GPU, t, n, 1 / GPU.decode) for t, n in trees.items())


def test_a_tree_is_chosen_where_it_yields_more_per_second_than_any_chain():
    # the chat-mix head on GSM8K (BENCHMARKS.md, the suite): chain K=5 rates, and 2.58 tokens per verify for the tree
    profile = AcceptanceProfile((0.545, 0.297, 0.153, 0.078, 0.048), 1000)
    gpu = _with_tree(GPU, TREE, expansion=4 * GPU.draft)
    choice = choose(gpu, profile, trees={TREE: 2.58})
    assert choice.method == TREE and choice.tree == TREE and choice.num_draft == TREE.depth
    assert choice.tokens_per_step == 2.58
    seconds = gpu.verify[11] + gpu.draft + 4 * GPU.draft  # its verify, the head's step after the root, expansion
    assert choice.tokens_per_second == pytest.approx(2.58 / seconds)
    assert max(v for m, v in choice.candidates if m != TREE) < 0.97 * choice.tokens_per_second
    assert choice.as_dict()["method"] == "tree 12,5,3" and choice.as_dict()["tree"] == "12,5,3"
    assert set(choice.as_dict()["candidates"]) == {"0", "1", "2", "3", "4", "5", "tree 12,5,3"}
    # on this CPU a 12-token verify costs ~3.3 decodes: the tree loses even to target-only
    cpu = _with_tree(CPU, TREE, expansion=4 * CPU.draft)
    assert choose(cpu, profile, trees={TREE: 2.58}).method != TREE  # 27.5 tokens/s against target-only's 38
    # a tree whose expansion was not timed is no candidate; nor one whose verify is not costed
    assert choose(GPU, profile, trees={TREE: 2.58}).method != TREE
    short = StepCosts(GPU.decode, GPU.verify, GPU.draft, ((TREE, 0.001),))  # verify up to 8 tokens only
    assert short.trees == () and choose(short, profile, trees={TREE: 2.58}).method != TREE
    # its measured steps' ratio prices it like any method's
    cal = StepCalibration()
    cal.add(0, 1.0, 1.0)  # target-only as timed, the tree's steps 15% dearer: K=3 wins
    cal.add(TREE, 1.15, 1.0)
    assert choose(gpu, profile, trees={TREE: 2.58}, calibration=cal).method != TREE


def test_a_trees_record_scales_with_how_the_head_drafts_here_and_pools_with_its_counts():
    from jaxspec.engine.auto.config import RunningTrees, tree_tokens

    prior = AcceptanceProfile((0.4, 0.2, 0.1), 200)
    assert tree_tokens(2.0, prior, prior) == pytest.approx(2.0)
    half = AcceptanceProfile((0.2, 0.1, 0.05), 300)  # the chain gains half its record here: so does the tree
    assert tree_tokens(2.0, prior, half) == pytest.approx(1.5)
    assert tree_tokens(2.0, AcceptanceProfile((0.0, 0.0, 0.0), 200), half) == 2.0  # no chain gain recorded: as is
    running = RunningTrees()
    assert running.pooled(TREE, 1.5, 200) == 1.5
    running.add(TREE, [80, 50, 20], 100)  # one row: 150 accepted drafts + 100 bonus tokens in 100 verify steps
    running.add(TREE, [0, 0, 0], 0)  # a row that never verified adds nothing
    assert running.pooled(TREE, 1.5, 200) == pytest.approx((300 + 250) / 300)
    assert running.as_dict() == {"tree 12,5,3": {"tokens_per_verify": 2.5, "verify_steps": 100}}


def test_trees_come_from_the_heads_tree_measurements():
    from jaxspec.engine.auto.config import trees_from_record

    record = [
        {"prompts": "mt_bench", "method": "chain K=5", "mean_accepted_length": 1.3, "num_prompts": 80},
        {"prompts": "mt_bench", "method": "tree 12,5,3", "mean_accepted_length": 1.6, "num_prompts": 20},
        {"prompts": "gsm8k", "method": "tree 12,5,3", "mean_accepted_length": 2.6, "num_prompts": 10},
        {"prompts": "gsm8k", "method": "tree 32,6,8", "mean_accepted_length": 3.0},
    ]
    trees = trees_from_record(record)
    assert trees == {TREE: pytest.approx((20 * 1.6 + 10 * 2.6) / 30), TreeConfig(32, 6, 8): 3.0}
    assert trees_from_record(record[:1]) == {} and trees_from_record(None) == {}
    # with its rates per position, a record counts what a step yields: its last step, cut at max-new-tokens,
    # lowered the mean accepted length (1.6) below 1 + the accepted drafts per step (1.62)
    record[1]["acceptance_per_position"] = [0.42, 0.15, 0.05]
    assert trees_from_record(record[:2]) == {TREE: pytest.approx(1.62)}


def test_a_tree_is_timed_only_where_an_estimate_from_the_chain_costs_says_it_could_win():
    from jaxspec.engine.auto.config import tree_worth_timing

    best_gpu = 1 / GPU.decode  # target-only's tokens/s: the least a tree must beat
    assert tree_worth_timing(GPU, TREE, 1.6, best_gpu)  # verify of 12 ~ a decode: worth it
    assert not tree_worth_timing(CPU, TREE, 1.6, 1 / CPU.decode)  # ~5 decodes for 1.6 tokens: not even at 1.5x
    assert not tree_worth_timing(CPU, TreeConfig(32, 6, 8), 3.0, 1 / CPU.decode)


def test_methods_have_names_that_read_back():
    from jaxspec.engine.auto.config import method_key, method_label, parse_method_key

    for m in (0, 1, 7, TREE):
        assert parse_method_key(method_key(m)) == m
    assert [method_label(m) for m in (0, 3, TREE)] == ["target-only", "K=3", "tree 12,5,3"]
    for bad in ("x", "-1", "tree 1,2"):
        with pytest.raises(JaxspecError):
            parse_method_key(bad)


def test_trees_timed_after_the_chains_join_their_costs_at_one_machine_speed(monkeypatch):
    from jaxspec.engine.auto import step_costs

    chains = StepCosts(decode=0.010, verify=(0.0, 0.012, 0.014, 0.016), draft=0.001)  # timed for K <= 3
    small, big = TreeConfig(4, 2, 2), TreeConfig(8, 3, 2)
    asked = []

    def timed(model, head, batch, capacity, lengths, repeats, trees, time_draft=True):  # ran 20% slower
        asked.append((lengths, trees, time_draft))
        return {1: 0.012, 8: 0.024}, 0.0012, {small: 0.0024, big: 0.0036}

    monkeypatch.setattr(step_costs, "time_forwards", timed)
    got = step_costs.add_tree_costs(chains, None, None, 1, 64, (small, big))
    # the chains' lengths (a 4-token verify among them) are not timed again, nor is the head's step
    assert asked == [([1, 8], (small, big), False)]
    assert got.verify[:4] == chains.verify and got.decode == chains.decode and got.draft == chains.draft
    assert got.verify[7] == pytest.approx(0.020)  # 24 ms at the slower speed: 20 ms at the chains'
    assert got.verify[5] == pytest.approx(0.016 + (0.020 - 0.016) * 2 / 4)  # between: interpolated
    assert got.trees == (small, big) and got.tree_draft(big) == pytest.approx(0.003)
