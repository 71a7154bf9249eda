"""The automatic speculative configuration's arithmetic: expected tokens, the chain-length choice, and the
acceptance profile pooled with running counts."""

import numpy as np
import pytest

from jaxspec.errors import JaxspecError
from jaxspec.spec.auto_config import (
    AcceptanceProfile,
    StepCalibration,
    StepCosts,
    choose_chain,
    drafting_could_win,
    expected_tokens,
    step_seconds,
)

# This CPU's measured costs for SmolLM2 at batch 1 (BENCHMARKS.md): decode 26.2 ms, verify of 6 tokens 53.4 ms,
# head step 1.56 ms; verify of k+1 tokens interpolated linearly between them.
CPU = StepCosts(decode=0.0262, verify=(0.0,) + tuple(0.0262 + (0.0534 - 0.0262) * k / 5 for k in range(1, 8)),
                draft=0.00156)
# an accelerator's: a verify of a few tokens costs about one decode step
GPU = StepCosts(decode=0.008, verify=(0.0,) + tuple(0.008 * (1 + 0.02 * k) for k in range(1, 8)), draft=0.0006)


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
        choice = choose_chain(costs, AcceptanceProfile(rates, 100))
        speeds = [1 / costs.decode] + [(1 + sum(rates[:k])) / (costs.verify[k] + k * costs.draft) for k in range(1, 8)]
        assert choice.num_draft == int(np.argmax(speeds))
        assert choice.tokens_per_second == pytest.approx(max(speeds))


def test_low_acceptance_on_this_cpu_picks_target_only_and_high_acceptance_speculates():
    # the shipped head on MT-Bench (tokens per verify 1.32): a verify costs more than it yields here
    weak = AcceptanceProfile((0.24, 0.06, 0.015, 0.004, 0.001), 1000)
    assert choose_chain(CPU, weak).num_draft == 0
    # the same head on a GPU, where verifying 2 tokens costs about a decode: one draft pays
    assert choose_chain(GPU, weak).num_draft >= 1
    strong = AcceptanceProfile((0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3), 1000)
    assert choose_chain(CPU, strong).num_draft >= 3
    assert choose_chain(CPU, strong, max_draft=2).num_draft == 2  # an explicit cap is honoured


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
        assert step_seconds(cal.calibrated(CPU), k) == pytest.approx(step_seconds(CPU, k))
    cal.add(0, 0.9, 1.0)  # target-only ran at 0.9x its timed decode
    cal.add(1, 2.0, 1.6)  # K=1 at 1.25x, in two batches
    cal.add(1, 0.5, 0.4)
    got = cal.calibrated(CPU)
    assert got.decode == pytest.approx(0.9 * CPU.decode)
    assert step_seconds(got, 1) == pytest.approx(1.25 * step_seconds(CPU, 1))
    assert step_seconds(got, 4) == pytest.approx(3.4 / 3.0 * step_seconds(CPU, 4))  # did not run: all pooled
    assert got.draft == 0.0 and cal.as_dict() == {0: 0.9, 1: 1.25}  # head steps folded into each chain's cost
    cal.add(4, 1.0, 1.0)
    assert cal.ratio(4) == 1.0 and cal.ratio(2) == pytest.approx(4.4 / 4.0)
    only_chains = StepCalibration()  # target-only never ran (a speculating head): it takes the chains' ratio
    only_chains.add(1, 0.9, 1.0)
    assert only_chains.calibrated(CPU).decode == pytest.approx(0.9 * CPU.decode)


def test_a_close_call_flips_when_the_measured_steps_disagree_with_the_timed_ones():
    # grounded prompts (BENCHMARKS.md): timed costs, and the head's recorded a_1 of 0.35, choose one draft...
    costs = StepCosts(decode=0.0417, verify=(0.0, 0.0523), draft=0.0023)
    assert choose_chain(costs, AcceptanceProfile((0.35,), 100)).num_draft == 1
    # ...which measures a_1 = 0.262 and steps at 0.9x of their timing; alone, that calibration keeps the draft
    # (25.6 expected tokens/s vs 24.0), but the same machine would decode at 0.9x too: target-only wins (26.6)
    measured = AcceptanceProfile((0.262,), 100)
    cal = StepCalibration()
    cal.add(1, 0.9, 1.0)
    assert choose_chain(cal.calibrated(costs), measured).num_draft == 0
    # once target-only ran, its own ratio decides: a slower decode than timed brings the draft back
    cal.add(0, 1.2, 1.0)
    assert choose_chain(cal.calibrated(costs), measured).num_draft == 1


def test_running_counts_pool_with_the_prior_position_by_position():
    from jaxspec.spec.auto_config import RunningAcceptance

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
    from jaxspec.spec.step_costs import verify_lengths

    assert verify_lengths(1) == [1, 2]
    assert verify_lengths(5) == [1, 2, 6]
    assert verify_lengths(7) == [1, 2, 8]


def test_measured_costs_of_a_tiny_target_feed_the_choice():
    """Timing runs on the real forward functions and gives a usable StepCosts (values are this machine's)."""
    from spec_fixtures import random_head, tiny_target

    from jaxspec.spec.step_costs import measure_step_costs

    costs = measure_step_costs(tiny_target(), random_head(), batch=2, capacity=64, max_draft=5, repeats=2)
    assert costs.max_draft == 5 and costs.decode > 0 and costs.draft > 0
    assert all(v > 0 for v in costs.verify[1:])
    choice = choose_chain(costs, AcceptanceProfile((0.9, 0.8, 0.7, 0.6, 0.5), 100))
    assert 0 <= choice.num_draft <= 5 and dict(choice.candidates)[choice.num_draft] == choice.tokens_per_second
    alone = measure_step_costs(tiny_target(), None, batch=1, capacity=64, max_draft=1, repeats=1)
    assert alone.draft == 0.0 and alone.max_draft == 1


def test_the_prior_comes_from_the_heads_chain_measurements():
    from jaxspec.spec.auto_config import profile_from_record

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
    from jaxspec.spec.auto_config import profile_from_record

    config = json.loads((builtin.default_head_dir() / "config.json").read_text())
    prior = profile_from_record(config["jaxspec"]["acceptance"])
    assert prior is not None and 0.2 < prior.rates[0] < 0.5
    assert choose_chain(CPU, prior).num_draft in (0, 1)  # the shipped head on this CPU: little or no speculation
