"""Automatic speculative configuration: the chain length — or target-only — with the most expected tokens per second.

A fixed K loses where acceptance is low or verifying is dear (a large batch, a CPU whose verify of K+1 tokens costs
twice a decode step). The choice needs two measurements, both cheap:
- costs of this machine at this batch shape: one-token target decode, target verify of K+1 tokens, one head step;
- the head's acceptance profile: a_k, the share of verify steps whose draft k was accepted (drafts 1..k all
  accepted; `accepted_per_position / verify_calls` of the generation stats). A chain's draft k is accepted or not
  regardless of later drafts, so rates measured with K_max drafts hold for every K <= K_max.
Then with K drafts a verify step yields 1 + a_1 + ... + a_K tokens (the bonus token included) in
verify(K+1) + K * draft seconds, and target-only yields one token per decode; the best ratio wins. The rates come
from the head's exported profile (measured at training time) and are refined by the running counts of generation,
pooled with the prior as if it were `verify_steps` verify steps (`RunningAcceptance.pooled_with`); the timed costs
are scaled by what the generation loop's own steps took against them (`StepCalibration`).

This module is the arithmetic only: pure functions of measured numbers, so that the decision can be tested and
logged exactly. Output never depends on the choice: every K, and target-only, give the target's tokens.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from jaxspec.errors import JaxspecError


@dataclasses.dataclass(frozen=True)
class StepCosts:
    """Seconds per call, measured at one batch shape."""

    decode: float  # target forward of 1 token per row (target-only step)
    verify: tuple[float, ...]  # verify[k]: target forward of k+1 tokens per row (a chain of k drafts); [0] unused
    draft: float  # one head step (EAGLE-3: its forward over one new token per row)

    def __post_init__(self):
        if self.decode <= 0 or self.draft < 0 or any(v <= 0 for v in self.verify[1:]):
            raise JaxspecError(f"step costs must be positive seconds, got {self}")

    @property
    def max_draft(self) -> int:
        return len(self.verify) - 1


@dataclasses.dataclass(frozen=True)
class AcceptanceProfile:
    """Unconditional acceptance per draft position (a_1, a_2, ...), and how many verify steps it rests on."""

    rates: tuple[float, ...]
    verify_steps: float

    def __post_init__(self):
        growing = any(b > a + 1e-9 for a, b in zip(self.rates, self.rates[1:]))
        if growing or any(not 0.0 <= r <= 1.0 for r in self.rates):
            raise JaxspecError(
                f"acceptance rates must lie in [0, 1] and never grow with the position, got {self.rates}"
            )

    @classmethod
    def from_counts(cls, accepted_per_position: Sequence[int], verify_calls: int) -> AcceptanceProfile:
        """From generation stats (`accepted_per_position`, `verify_calls`): entry k counts the verify steps that
        accepted draft k+1."""
        if verify_calls <= 0:
            return cls((), 0)
        return cls(tuple(min(1.0, n / verify_calls) for n in accepted_per_position), verify_calls)


def profile_from_record(acceptance: Sequence[dict] | None, weight: float = 200.0) -> AcceptanceProfile | None:
    """The prior from a head's exported acceptance profile (`checkpoints.verifier.check_acceptance`): the chain
    measurements' per-position rates, averaged over their prompt sets (weighted by prompt count), counted as
    `weight` verify steps when pooled with running counts. None when the head records no chain rates."""
    chains = [m for m in acceptance or ()
              if str(m.get("method", "")).startswith("chain") and m.get("acceptance_per_position")]
    if not chains:
        return None
    depth = min(len(m["acceptance_per_position"]) for m in chains)
    weights = [float(m.get("num_prompts") or 1) for m in chains]
    rates = [sum(w * m["acceptance_per_position"][k] for w, m in zip(weights, chains)) / sum(weights)
             for k in range(depth)]
    for k in range(1, depth):  # rounding in the record may leave a later position a hair above an earlier one
        rates[k] = min(rates[k], rates[k - 1])
    return AcceptanceProfile(tuple(rates), weight)


@dataclasses.dataclass(frozen=True)
class Choice:
    num_draft: int  # 0: target-only
    tokens_per_step: float  # expected tokens per target call
    tokens_per_second: float  # expected, per row
    candidates: tuple[tuple[int, float], ...]  # (K, expected tokens per second) for every K considered

    def as_dict(self) -> dict:
        return {"num_speculative_tokens": self.num_draft, "expected_tokens_per_step": round(self.tokens_per_step, 4),
                "expected_tokens_per_second": round(self.tokens_per_second, 2),
                "candidates": {k: round(v, 2) for k, v in self.candidates}}


def expected_tokens(rates: Sequence[float], num_draft: int) -> float:
    """Tokens per verify step with `num_draft` chained drafts: the bonus token plus each accepted draft."""
    return 1.0 + float(sum(rates[:num_draft]))


def step_seconds(costs: StepCosts, num_draft: int) -> float:
    """Seconds of one step: a target-only decode (0 drafts) or a chain's draft steps and its verify."""
    return costs.decode if num_draft == 0 else costs.verify[num_draft] + num_draft * costs.draft


@dataclasses.dataclass
class StepCalibration:
    """The generation loop's own step times against what the timed costs predicted for them, per chain length.

    Why: the costs are timed one forward per dispatch, at one moment, while the engine runs its steps in an
    on-device loop that also drafts, accepts, commits and syncs with the host once per chunk, on a machine whose
    speed drifts. Measured on a 2-core CPU over three prompt sets, the loop's steps ran at 0.85-1.13x of the timed
    prediction, target-only and one draft mostly alike, enough to flip a close choice. So each generated batch adds
    its measured seconds and the seconds its steps were predicted to take; a chain length (or target-only) that
    ran is then costed at its own measured/predicted ratio, one that has not at the ratio pooled over all that ran:
    the common part of the error, the machine's speed against the timing's, moves every choice alike."""

    measured: dict[int, float] = dataclasses.field(default_factory=dict)  # chain length → seconds its steps took
    predicted: dict[int, float] = dataclasses.field(default_factory=dict)  # chain length → seconds predicted

    def add(self, num_draft: int, seconds: float, predicted_seconds: float) -> None:
        if seconds > 0 and predicted_seconds > 0:
            self.measured[num_draft] = self.measured.get(num_draft, 0.0) + seconds
            self.predicted[num_draft] = self.predicted.get(num_draft, 0.0) + predicted_seconds

    def ratio(self, num_draft: int) -> float:
        """measured / predicted for this chain length (1.0 where nothing comparable ran)."""
        if num_draft in self.measured:
            return self.measured[num_draft] / self.predicted[num_draft]
        if self.measured:
            return sum(self.measured.values()) / sum(self.predicted.values())
        return 1.0

    def calibrated(self, costs: StepCosts) -> StepCosts:
        """`costs` with every choice's whole step scaled by its ratio; the head steps are folded into each chain's
        verify (draft 0), since chains of different lengths may scale by different ratios."""
        verify = [0.0] + [self.ratio(k) * step_seconds(costs, k) for k in range(1, costs.max_draft + 1)]
        return StepCosts(decode=costs.decode * self.ratio(0), verify=tuple(verify), draft=0.0)

    def as_dict(self) -> dict[int, float]:
        return {k: round(self.ratio(k), 4) for k in sorted(self.measured)}

    def weighing_at_most(self, seconds: float) -> StepCalibration:
        """A copy with every sum scaled by one factor (the ratios unchanged) so that the measured steps weigh at most
        `seconds`: a history from earlier processes (`step_cost_store`) that this process's batches soon outweigh
        where the machine has changed since."""
        total = sum(self.measured.values())
        scale = min(1.0, seconds / total) if total > 0 else 1.0
        return StepCalibration({k: v * scale for k, v in self.measured.items()},
                               {k: v * scale for k, v in self.predicted.items()})


def choose_chain(costs: StepCosts, profile: AcceptanceProfile, max_draft: int | None = None) -> Choice:
    """The chain length in 0..max_draft (0: target-only) with the most expected tokens per second; ties go to the
    shorter chain (less work for the same speed)."""
    limit = min(costs.max_draft, len(profile.rates), costs.max_draft if max_draft is None else max_draft)
    candidates = [(0, 1.0 / costs.decode)]
    for k in range(1, limit + 1):
        candidates.append((k, expected_tokens(profile.rates, k) / step_seconds(costs, k)))
    best_k, best = max(candidates, key=lambda c: (c[1], -c[0]))
    per_step = 1.0 if best_k == 0 else expected_tokens(profile.rates, best_k)
    return Choice(best_k, per_step, best, tuple(candidates))


def drafting_could_win(costs: StepCosts, observed: AcceptanceProfile, z: float = 2.0) -> bool:
    """Whether one draft per step could beat target-only at the optimistic end of what the observed first-draft
    rate allows: its count plus `z` standard errors of a rate over that many verify steps (at their widest, 0.5),
    or 1.0 with nothing observed.

    Why: while target-only is chosen, the only way to learn that a head drafts better on these prompts than its
    record says is to draft a batch (a probe), and a probe costs where the head is poor: on a 2-core CPU one K=1
    batch at a first-draft rate of 0.3 runs ~30% slower than target-only. Once the counts rule drafting out, a probe
    can no longer change the choice, so it is not run."""
    if observed.verify_steps > 0 and observed.rates:
        rate = min(1.0, observed.rates[0] + z * math.sqrt(0.25 / observed.verify_steps))
    else:
        rate = 1.0
    return choose_chain(costs, AcceptanceProfile((rate,), observed.verify_steps), 1).num_draft == 1


@dataclasses.dataclass
class RunningAcceptance:
    """Acceptance counts gathered over batches that may have drafted different chain lengths: per position k, the
    verify steps that accepted draft k+1 and the verify steps that drafted it (those of chains with K > k)."""

    accepted: list[int] = dataclasses.field(default_factory=list)
    drafted: list[int] = dataclasses.field(default_factory=list)

    def add(self, accepted_per_position: Sequence[int], verify_calls: int) -> None:
        """One row's generation stats (`accepted_per_position`, `verify_calls`) from a chain of
        len(accepted_per_position) drafts."""
        for k, n in enumerate(accepted_per_position):
            if k == len(self.accepted):
                self.accepted.append(0)
                self.drafted.append(0)
            self.accepted[k] += int(n)
            self.drafted[k] += int(verify_calls)

    def pooled_with(self, prior: AcceptanceProfile) -> AcceptanceProfile:
        """The prior (weighing as its `verify_steps`) pooled with these counts position by position, each observed
        position with the steps that drafted it (after many short chains, a few long ones do not outweigh the prior
        at the far positions); positions no batch drafted keep the prior's decay from the position before."""
        rates: list[float] = []
        for k in range(max(len(prior.rates), len(self.accepted))):
            drafted = self.drafted[k] if k < len(self.drafted) else 0
            if k < len(prior.rates) and drafted:
                w = prior.verify_steps
                rates.append((w * prior.rates[k] + self.accepted[k]) / (w + drafted))
            elif drafted:
                rates.append(self.accepted[k] / drafted)
            elif k == 0:
                rates.append(prior.rates[0])
            else:
                ratio = prior.rates[k] / prior.rates[k - 1] if prior.rates[k - 1] > 0 else 0.0
                rates.append(rates[k - 1] * ratio)
            if k:  # pooling keeps the rates non-increasing up to rounding; make it exact
                rates[k] = min(rates[k], rates[k - 1])
        return AcceptanceProfile(tuple(rates), prior.verify_steps + (self.drafted[0] if self.drafted else 0))

    def profile(self) -> AcceptanceProfile:
        """The observed rates (each position over the steps that drafted it; never growing with the position), resting
        on the verify steps of the first position."""
        rates: list[float] = []
        for n, d in zip(self.accepted, self.drafted):
            if d <= 0:
                break
            rates.append(min(n / d, rates[-1] if rates else 1.0))
        return AcceptanceProfile(tuple(rates), self.drafted[0] if rates else 0)
