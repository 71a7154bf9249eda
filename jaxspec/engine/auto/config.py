"""Automatic speculative configuration: the chain length or tree budget — or target-only — with the most expected
tokens per second.

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

Trees (EAGLE-2 dynamic trees, `tree.TreeConfig`) are candidates where the head's record measured them: a tree's
accepted path is not a chain's (a sibling catches a first token the chain's one draft misses), so its tokens per
verify cannot be derived from the chain rates and come from its own measurement — scaled by how the head drafts on
the prompts at hand against its record (`tree_tokens`), and pooled with the counts of the batches that ran it. A
tree step costs a verify of its TOTAL tokens, the head's step after the root and the tree's expansion
(`tree.draft_tree`: DEPTH - 1 head steps over TOPK nodes and the selection), all timed.

This module is the arithmetic only: pure functions of measured numbers, so that the decision can be tested and
logged exactly. Output never depends on the choice: every K, and target-only, give the target's tokens.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

from jaxspec.errors import JaxspecError
from jaxspec.engine.tree import TreeConfig

Method = int | TreeConfig  # 0: target-only; K >= 1: a chain of K drafts; a TreeConfig: that tree


def method_key(method: Method) -> str:
    """A method's name in JSON (stats, stored calibrations): "0" (target-only), "3" (a chain), "tree 12,5,3"."""
    return f"tree {method.spec}" if isinstance(method, TreeConfig) else str(method)


def parse_method_key(key: str) -> Method:
    """The inverse of `method_key` (a JaxspecError for anything else)."""
    if key.startswith("tree "):
        return TreeConfig.parse(key[len("tree "):])
    try:
        value = int(key)
    except ValueError:
        raise JaxspecError(f"not a speculative method: {key!r}") from None
    if value < 0:
        raise JaxspecError(f"not a speculative method: {key!r}")
    return value


def method_label(method: Method) -> str:
    """How reports name a method: target-only, K=3, tree 12,5,3."""
    if isinstance(method, TreeConfig):
        return method_key(method)
    return "target-only" if method == 0 else f"K={method}"


def method_order(method: Method) -> tuple[int, ...]:
    """Reports and ties: target-only, then chains by length, then trees by verified tokens."""
    if isinstance(method, TreeConfig):
        return (2, method.total_tokens, method.depth, method.top_k)
    return (0 if method == 0 else 1, method)


@dataclasses.dataclass(frozen=True)
class StepCosts:
    """Seconds per call, measured at one batch shape."""

    decode: float  # target forward of 1 token per row (target-only step)
    verify: tuple[float, ...]  # verify[k]: target forward of k+1 tokens per row (a chain of k drafts); [0] unused
    draft: float  # one head step (EAGLE-3: its forward over one new token per row); a block drafter's forward
    tree_drafts: tuple[tuple[TreeConfig, float], ...] = ()  # per timed tree: its expansion (`tree.draft_tree`)
    # a block drafter (DFlash): one forward drafts a chain of any length up to its block, so a chain's drafting
    # costs `draft` once; else (EAGLE-3) once per draft
    block_draft: bool = False

    def __post_init__(self):
        if (self.decode <= 0 or self.draft < 0 or any(v <= 0 for v in self.verify[1:])
                or any(v <= 0 for _, v in self.tree_drafts)):
            raise JaxspecError(f"step costs must be positive seconds, got {self}")

    @property
    def max_draft(self) -> int:
        """The longest chain whose verify is costed (a tree of TOTAL tokens needs max_draft >= TOTAL - 1)."""
        return len(self.verify) - 1

    @property
    def trees(self) -> tuple[TreeConfig, ...]:
        """The trees these costs can price: their expansion was timed and their verify is costed."""
        return tuple(t for t, _ in self.tree_drafts if t.total_tokens - 1 <= self.max_draft)

    def tree_draft(self, tree: TreeConfig) -> float:
        """Seconds of this tree's expansion (a JaxspecError if it was not timed: it cannot be priced)."""
        for t, seconds in self.tree_drafts:
            if t == tree:
                return seconds
        raise JaxspecError(f"tree {tree.spec} was not timed")


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
    method: Method  # 0: target-only; K: a chain; a TreeConfig: a tree
    tokens_per_step: float  # expected tokens per target call
    tokens_per_second: float  # expected, per row
    candidates: tuple[tuple[Method, float], ...]  # (method, expected tokens per second) for every one considered

    @property
    def num_draft(self) -> int:
        """Drafts per step: 0 for target-only, a chain's K, a tree's DEPTH (its longest acceptable run)."""
        return self.method.depth if isinstance(self.method, TreeConfig) else self.method

    @property
    def tree(self) -> TreeConfig | None:
        """The tree chosen, or None (target-only or a chain)."""
        return self.method if isinstance(self.method, TreeConfig) else None

    def as_dict(self) -> dict:
        return {"method": method_label(self.method), "num_speculative_tokens": self.num_draft,
                "tree": self.tree.spec if self.tree else None,
                "expected_tokens_per_step": round(self.tokens_per_step, 4),
                "expected_tokens_per_second": round(self.tokens_per_second, 2),
                "candidates": {method_key(k): round(v, 2) for k, v in self.candidates}}


def expected_tokens(rates: Sequence[float], num_draft: int) -> float:
    """Tokens per verify step with `num_draft` chained drafts: the bonus token plus each accepted draft."""
    return 1.0 + float(sum(rates[:num_draft]))


def step_seconds(costs: StepCosts, method: Method) -> float:
    """Seconds of one step: a target-only decode (0), a chain's K head steps (a block drafter's one forward) and
    its verify of K+1 tokens, or a tree's head step after the root, its expansion and its verify of TOTAL tokens."""
    if isinstance(method, TreeConfig):
        return costs.verify[method.total_tokens - 1] + costs.draft + costs.tree_draft(method)
    if method == 0:
        return costs.decode
    return costs.verify[method] + (costs.draft if costs.block_draft else method * costs.draft)


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

    measured: dict[Method, float] = dataclasses.field(default_factory=dict)  # method → seconds its steps took
    predicted: dict[Method, float] = dataclasses.field(default_factory=dict)  # method → seconds predicted

    def add(self, method: Method, seconds: float, predicted_seconds: float) -> None:
        if seconds > 0 and predicted_seconds > 0:
            self.measured[method] = self.measured.get(method, 0.0) + seconds
            self.predicted[method] = self.predicted.get(method, 0.0) + predicted_seconds

    def ratio(self, method: Method) -> float:
        """measured / predicted for this method (the pooled ratio where it has not run; 1.0 where nothing ran)."""
        if method in self.measured:
            return self.measured[method] / self.predicted[method]
        if self.measured:
            return sum(self.measured.values()) / sum(self.predicted.values())
        return 1.0

    def seconds(self, costs: StepCosts, method: Method) -> float:
        """One step of `method`, its timed cost scaled by its ratio."""
        return self.ratio(method) * step_seconds(costs, method)

    def as_dict(self) -> dict[str, float]:
        return {method_key(k): round(self.ratio(k), 4) for k in sorted(self.measured, key=method_order)}

    def without(self, method: Method) -> StepCalibration:
        """A copy that has not measured `method`: it is costed at the pooled ratio of the others."""
        return StepCalibration({k: v for k, v in self.measured.items() if k != method},
                               {k: v for k, v in self.predicted.items() if k != method})

    def weighing_at_most(self, seconds: float) -> StepCalibration:
        """A copy with every sum scaled by one factor (the ratios unchanged) so that the measured steps weigh at most
        `seconds`: a history from earlier processes (`step_cost_store`) that this process's batches soon outweigh
        where the machine has changed since."""
        total = sum(self.measured.values())
        scale = min(1.0, seconds / total) if total > 0 else 1.0
        return StepCalibration({k: v * scale for k, v in self.measured.items()},
                               {k: v * scale for k, v in self.predicted.items()})


def choose(
    costs: StepCosts,
    profile: AcceptanceProfile,
    max_draft: int | None = None,
    trees: Mapping[TreeConfig, float] | None = None,
    calibration: StepCalibration | None = None,
    past_chain: Mapping[int, float] | None = None,
) -> Choice:
    """The method with the most expected tokens per second: target-only, a chain of 1..max_draft drafts (as far
    as `profile` and the costs reach), or one of `trees` ({tree: expected tokens per verify}) whose costs were
    timed; each step's seconds scaled by `calibration`. `past_chain` ({K: tokens per verify}): what a chain of K is
    expected to accept past its K drafts, from prompt lookup's longer chains (`RunningPastChain`), added to its
    expected tokens. Ties go to the
    cheaper method (target-only, then the shorter chain, then the smaller tree): less work for the same speed."""
    limit = min(costs.max_draft, len(profile.rates), costs.max_draft if max_draft is None else max_draft)
    tokens: dict[Method, float] = {0: 1.0}
    tokens.update({k: expected_tokens(profile.rates, k) + (past_chain or {}).get(k, 0.0)
                   for k in range(1, limit + 1)})
    tokens.update({t: n for t, n in (trees or {}).items() if t in costs.trees})
    cal = calibration or StepCalibration()
    candidates = [(m, tokens[m] / cal.seconds(costs, m)) for m in sorted(tokens, key=method_order)]
    rank = {m: i for i, (m, _) in enumerate(candidates)}
    best, best_tps = max(candidates, key=lambda c: (c[1], -rank[c[0]]))
    return Choice(best, tokens[best], best_tps, tuple(candidates))


@dataclasses.dataclass(frozen=True)
class LiveBatchPlan:
    """How a continuous batcher speculates (`AutoSpeculativeGenerator.live_batch_plan`): one method for its state,
    drafting only in the buckets of live rows where it pays (vLLM's batch-size-aware speculation: off at high
    load)."""

    method: Method  # what the state is built for (0: target-only, nothing drafts)
    drafting_rows: frozenset[int]  # the buckets of rows whose steps draft
    choices: tuple[tuple[int, Choice], ...]  # (rows, the choice at that batch size) per bucket considered

    def describe(self) -> str:
        """`chain K=3 at 1-2 rows, target-only steps at 4-16` (the server's start-up line)."""
        if self.method == 0:
            return "target-only"
        rows = [r for r, _ in self.choices]
        on = [r for r in rows if r in self.drafting_rows]
        off = [r for r in rows if r not in self.drafting_rows]
        span = lambda rs: f"{rs[0]}" if len(rs) == 1 else f"{rs[0]}-{rs[-1]}"  # noqa: E731
        label = method_label(self.method)
        label = label if isinstance(self.method, TreeConfig) else f"chain {label}"
        text = f"{label} at {span(on)} rows" if on else f"{label} nowhere"
        return text + (f", target-only steps at {span(off)}" if off else "")


def live_batch_plan(choices: Mapping[int, Choice]) -> LiveBatchPlan:
    """The plan from each bucket's choice ({rows: Choice}): the smallest bucket's method, drafting in every bucket
    where its expected tokens per second beat target-only's (a bucket whose costs never priced it, e.g. a tree not
    worth timing there, does not draft). Choices without candidates (no acceptance profile yet: a first batch)
    draft everywhere: nothing says where they would not pay."""
    rows = sorted(choices)
    method = choices[rows[0]].method
    drafting = set()
    for r in rows:
        candidates = dict(choices[r].candidates)
        if method != 0 and (not candidates or candidates.get(method, 0.0) > candidates[0]):
            drafting.add(r)
    return LiveBatchPlan(method, frozenset(drafting), tuple((r, choices[r]) for r in rows))


def tree_tokens(recorded: float, prior: AcceptanceProfile, now: AcceptanceProfile) -> float:
    """A tree's expected tokens per verify on the prompts at hand, before it has run on them: its recorded tokens
    per verify (`trees_from_record`) with the part above the bonus token scaled as the chain's is (the chain's
    expected tokens past the bonus under the current profile `now`, against the recorded `prior`'s, over the
    positions both reach). Why: a tree's acceptance is measured on the record's prompts; where the running counts
    say the head drafts worse (or better) here, its tree does too (the shipped SmolLM2 head: the tree gains
    1.4-1.7x what a K=5 chain gains over the bonus, on MT-Bench, GSM8K and HumanEval alike)."""
    depth = min(len(prior.rates), len(now.rates))
    base = expected_tokens(prior.rates, depth) - 1.0
    if depth == 0 or base <= 0:
        return recorded
    return 1.0 + (recorded - 1.0) * (expected_tokens(now.rates, depth) - 1.0) / base


@dataclasses.dataclass
class RunningTrees:
    """Tokens per verify of each tree, counted over the batches that ran it."""

    tokens: dict[TreeConfig, int] = dataclasses.field(default_factory=dict)  # yielded by verify steps (bonus included)
    steps: dict[TreeConfig, int] = dataclasses.field(default_factory=dict)  # verify steps

    def add(self, tree: TreeConfig, accepted_per_position: Sequence[int], verify_calls: int) -> None:
        """One row's counts (its `accepted_per_position` and `verify_calls` stats): each verify step yields its
        accepted drafts plus the bonus token.

        Why not the row's generated tokens: a row's last step is cut at max-new-tokens (or EOS), so counting
        what was emitted undercounts what a step yields (~1% at 128 tokens), where the chain counts
        (`RunningAcceptance`) and the records (`trees_from_record`) count the accepted drafts."""
        if verify_calls > 0:
            tokens = int(verify_calls) + sum(int(n) for n in accepted_per_position)
            self.tokens[tree] = self.tokens.get(tree, 0) + tokens
            self.steps[tree] = self.steps.get(tree, 0) + int(verify_calls)

    def pooled(self, tree: TreeConfig, prior_tokens: float, weight: float) -> float:
        """The prior's tokens per verify (weighing as `weight` verify steps) pooled with this tree's counts."""
        steps = self.steps.get(tree, 0)
        return (weight * prior_tokens + self.tokens.get(tree, 0)) / (weight + steps) if weight + steps else prior_tokens

    def as_dict(self) -> dict[str, dict]:
        return {method_key(t): {"tokens_per_verify": round(self.tokens[t] / self.steps[t], 4),
                                "verify_steps": self.steps[t]} for t in sorted(self.steps, key=method_order)}


def trees_from_record(acceptance: Sequence[dict] | None) -> dict[TreeConfig, float]:
    """{tree: tokens per verify step} from a head's exported acceptance profile: its measurements of method "tree
    TOTAL,DEPTH,TOPK", averaged over their prompt sets (weighted by prompt count). A record's tokens per step are
    1 + the sum of its acceptance per position where it has them (what a step yields, as the chain rates and
    `RunningTrees` count it), else its mean accepted length (which a last step cut at max-new-tokens lowers)."""
    sums: dict[TreeConfig, list[float]] = {}
    for m in acceptance or ():
        method = str(m.get("method", ""))
        if not method.startswith("tree "):
            continue
        tree = parse_method_key(method)  # the records name a tree as method_key does
        w = float(m.get("num_prompts") or 1)
        rates = m.get("acceptance_per_position")
        tokens = 1.0 + sum(float(r) for r in rates) if rates else float(m["mean_accepted_length"])
        total = sums.setdefault(tree, [0.0, 0.0])
        total[0] += w * tokens
        total[1] += w
    return {t: s / w for t, (s, w) in sums.items()}


def tree_worth_timing(costs: StepCosts, tree: TreeConfig, tokens: float, best: float, margin: float = 1.5) -> bool:
    """Whether a tree could beat the best timed method (`best` tokens per second) at `margin` times its expected
    tokens per verify, with its verify costed by extending the timed chain verifies linearly (the last two timed
    lengths' slope, never below the longest's cost) and its head work as DEPTH one-token head steps (the step after
    the root and the DEPTH - 1 levels of its expansion).

    Why: timing a tree compiles its verify and its expansion (~20 s each with invariant numerics on a 2-core CPU),
    and where a verify costs a weight pass per token (a CPU), a 12-token tree at any acceptance its head reaches is
    far behind target-only; on an accelerator a verify costs about a decode step up to dozens of tokens, the
    estimate says so, and the tree is timed."""
    top = costs.max_draft
    slope = costs.verify[top] - costs.verify[top - 1] if top >= 2 else costs.verify[top] - costs.decode
    verify = costs.verify[top] + max(0.0, slope) * max(0, tree.total_tokens - 1 - top)
    seconds = verify + tree.depth * costs.draft
    return margin * tokens / seconds > best


def drafting_could_win(
    costs: StepCosts, observed: AcceptanceProfile, z: float = 2.0, calibration: StepCalibration | None = None
) -> bool:
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
    return choose(costs, AcceptanceProfile((rate,), observed.verify_steps), 1, calibration=calibration).method == 1


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


@dataclasses.dataclass
class RunningPastChain:
    """Per draft position, the drafts accepted there and the verify steps that drafted it, counted only past a
    chain's K (positions K+1..L of chains of K: prompt lookup's longer chains, `proposers.lookup`).

    Why: with lookup beside the drafter drafting L > K, a chain of K yields 1 + a_1 + .. + a_K tokens per verify and
    lookup's acceptance at positions K+1..L on top. Those rates are lookup's alone and say nothing of the drafter's
    chain of K + 1, so they are kept apart from `RunningAcceptance`. A chain of K' is credited with the rates of its
    positions past K' (`tokens`) whichever chain lengths observed them; a position no chain ran past (below every K
    that ran) takes the rate of the first observed position, a lower bound, since acceptance never grows with the
    position. So a K that has not run yet is credited too, and the first batch's K does not keep the choice by
    being the only one credited."""

    accepted: list[int] = dataclasses.field(default_factory=list)  # entry j: position j + 1
    steps: list[int] = dataclasses.field(default_factory=list)

    def add(self, k: int, accepted_per_position: Sequence[int], verify_calls: int) -> None:
        """One row's stats from a chain of K (`accepted_per_position` runs to lookup's L)."""
        grow = len(accepted_per_position) - len(self.accepted)
        self.accepted += [0] * grow
        self.steps += [0] * grow
        for j in range(k, len(accepted_per_position)):
            self.accepted[j] += int(accepted_per_position[j])
            self.steps[j] += int(verify_calls)

    def tokens(self, k: int) -> float:
        """Accepted drafts per verify step a chain of K gets past its K (0 before anything was observed)."""
        rates = [a / n if n else None for a, n in zip(self.accepted, self.steps)]
        seen = [r for r in rates if r is not None]
        if not seen:
            return 0.0
        return float(sum(seen[0] if r is None else r for r in rates[k:]))

    def as_dict(self, max_draft: int) -> dict[str, float]:
        """{K: tokens past K} for chains of 1..max_draft, as JSON."""
        return {str(k): round(self.tokens(k), 4) for k in range(1, max_draft + 1)}
