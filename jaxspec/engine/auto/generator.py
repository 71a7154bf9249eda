"""Speculation configured per batch (`--num-speculative-tokens auto`): before each batch, the chain length or tree
— or target-only — with the most expected tokens per second on this machine (`auto.config.choose`).

The inputs are measured, not guessed: the step costs are timed once per machine and cache bucket on the real
forwards (`step_costs.measure_step_costs`; kept on disk for later processes by `step_cost_store`, with the
calibration) and then scaled by what each batch's steps really took (`auto.config.StepCalibration`), and the
acceptance profile is the head's recorded one (`auto.config.profile_from_record`) refined with the counts of every
batch generated so far. A head without a record drafts the default chain on its first batch, so that the next
choice rests on measured counts. The trees the head's record measured (`auto.config.trees_from_record`) are
candidates too, timed where an estimate from the chain costs says they could win (`auto.config.tree_worth_timing`:
on an accelerator, not on a CPU, whose verify pays a weight pass per token); `--tree` names one for every batch.
Output never depends on the choice: every chain length, tree, and target-only give the target's tokens (greedy) or
its distribution (sampling).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence

import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

from jaxspec import sharding
from jaxspec.errors import JaxspecError
from jaxspec.engine.generation import Completion, Generator, capacity_bucket
from jaxspec.models.dflash import DFlashDrafter
from jaxspec.models.eagle3 import Eagle3Head
from jaxspec.models.llama import LlamaModel
from jaxspec.engine.auto.config import (
    AcceptanceProfile,
    Choice,
    Method,
    RunningAcceptance,
    RunningPastChain,
    RunningTrees,
    StepCalibration,
    StepCosts,
    choose,
    drafting_could_win,
    LiveBatchPlan,
    expected_tokens,
    live_batch_plan,
    method_key,
    method_label,
    method_order,
    step_seconds,
    tree_tokens,
    tree_worth_timing,
)
from jaxspec.engine.generator import SpeculativeGenerator, check_head_fits
from jaxspec.engine.proposers.dflash import DFlashProposer
from jaxspec.engine.proposers.draft_model import DraftModelProposer, check_draft_model_fits
from jaxspec.engine.proposers.lookup import PromptLookup, beside
from jaxspec.engine.auto.step_cost_store import CALIBRATION_SECONDS, StepCostStore, calibration_key, cost_key
from jaxspec.engine.auto.step_costs import add_tree_costs, measure_step_costs
from jaxspec.engine.tree import TreeConfig

FIRST_CHAIN = 5  # drafts of the first batch when the head records no acceptance profile
MAX_AUTO_DRAFT = 8  # an EAGLE-3 head's longest chain considered (its verify of 9 tokens is timed once per cache
# bucket); a DFlash drafter's is its block's B - 1 drafts, all from one forward
PROBE_EVERY = 16  # while target-only is chosen, its 16th, 32nd, 64th, .. batch drafts one token to keep measuring,
# unless the counts so far rule drafting out (`auto.config.drafting_could_win`). A probe costs up to 1/PROBE_EVERY
# of the run so far where target-only is right (at 8, the probe batch took 1.24x a target-only one: ~3% of the
# grounded 8-prompt bench)


class AutoSpeculativeGenerator(Generator):
    """`Generator` that picks, before each batch, the chain length (0 = target-only) or one of `trees` with the most
    expected tokens per second, from this machine's step costs at the batch's shape and the acceptance profile:
    `prior` (the head's record, or None) pooled with the counts observed so far; `trees` maps each candidate tree
    to its recorded tokens per verify, which counts as `prior.verify_steps` steps when pooled with the tree's own.
    The choice made for each batch is in its completions' `stats["auto"]`, with the running acceptance after it.
    While target-only is the choice nothing is observed, so its PROBE_EVERY-th batch, then the 2×, 4×, ..
    PROBE_EVERY-th, drafts one token (basis "probe"): a head that does better on these prompts than its record says
    gets chosen, and one that does not costs less and less. A probe is skipped where it cannot change the choice:
    when one draft could not beat target-only even at a first-draft rate of 1.0, or at the optimistic end of the
    rate the probes so far observed (`auto.config.drafting_could_win`).

    `head` may be a DFlash block drafter (chains only): one forward drafts any chain up to its block, so a chain of
    K costs that forward and a verify of K + 1 tokens (`StepCosts.block_draft`), and chains up to B - 1 are
    candidates. Or an independent draft model (a `LlamaModel`, chains only, `DraftModelProposer`): a chain of K
    costs K of its one-token forwards and a verify, priced as a head's K steps are (its catch-up forward over the
    tokens verified last counted as one step, as a head's is).

    `lookup`: prompt lookup beside every chain (`proposers.lookup`; a tree drafts from the head alone). Its drafts
    cost ~nothing and are priced as the drafter's: the running acceptance counts what the chains with lookup
    accepted at positions 1..K, and what lookup's longer chains accepted past a chain's K is credited to every chain
    length from the positions observed (`RunningPastChain`); each K's measured steps price its wider verifies, so
    the choice follows them after the first batches."""

    def __init__(
        self,
        model: LlamaModel,
        head: Eagle3Head | DFlashDrafter | LlamaModel,
        *,
        prior: AcceptanceProfile | None,
        trees: Mapping[TreeConfig, float] | None = None,
        max_draft: int | None = None,  # None: MAX_AUTO_DRAFT for a head, the block's B - 1 for a DFlash drafter
        batch_size: int = 1,
        mesh: jax.sharding.Mesh | None = None,
        kernels: str | None = None,
        store: StepCostStore | None = None,
        lookup: PromptLookup | None = None,
    ):
        self.block = isinstance(head, DFlashDrafter)
        self.lookup = lookup
        self.draft_model = isinstance(head, LlamaModel)
        self.peagle = not (self.block or self.draft_model) and head.config.mask_token_id is not None
        if (self.block or self.draft_model) and trees:
            raise JaxspecError(f"automatic speculation prices a {self.drafter_name}'s chains only: its record's "
                               "trees cannot be candidates (name one with --tree)")
        if self.block:
            from jaxspec.checkpoints.dflash import check_drafter_fits

            check_drafter_fits(head.config, model.config)
            blocks = head.config.max_drafts
            max_draft = blocks if max_draft is None else min(max_draft, blocks)
        else:
            if self.draft_model:
                check_draft_model_fits(head, model)
            else:
                check_head_fits(model, head)
            max_draft = MAX_AUTO_DRAFT if max_draft is None else max_draft
        if max_draft < 1:
            raise JaxspecError(f"automatic speculation needs max_draft >= 1, got {max_draft}")
        super().__init__(model, batch_size=batch_size, mesh=mesh, kernels=kernels)  # batching; choices run elsewhere
        if mesh is not None:  # placed once: the chains built later find it on the mesh and share it
            sharding.check_fits(mesh, {self.drafter_name: head.config}, batch_size)
            graphdef, params = nnx.split(head)
            head = nnx.merge(graphdef, sharding.shard_params(params, mesh))
        self.model, self.head = model, head
        self.prior = prior if prior is not None and prior.rates else None
        # the longest chain considered; without a prior the first batch measures this many positions (a block
        # drafter drafts its whole block for the price of a shorter chain's drafting)
        first = max_draft if self.block else FIRST_CHAIN
        self.depth = min(max_draft, len(self.prior.rates) if self.prior else first)
        # trees need a chain prior too: a tree's record is scaled by the chain's counts on these prompts. A
        # P-EAGLE head's timed draft is its parallel forward, which prices its chains, not its step-by-step trees:
        # chains only (its record's trees are not candidates)
        self.trees = ({t: (trees or {})[t] for t in sorted(trees or {}, key=method_order)}
                      if self.prior and not self.peagle else {})
        for tree in self.trees:
            if tree.top_k > head.config.draft_vocab_size:
                raise JaxspecError(f"tree {tree.spec}: TOPK exceeds the head's draft vocabulary")
        self.running = RunningAcceptance()
        self.running_trees = RunningTrees()
        self.past_chain = RunningPastChain()
        # Timed costs and calibration of earlier processes (None: time every bucket in this process). Multi-host,
        # every process times (the timed forwards are collectives, and the processes' disks may hold different
        # stores); process 0's timings decide (`choose`).
        self.store = store if jax.process_count() == 1 else None
        # calibrations are kept per method, so they need not know the candidate trees; the costs do (`costs`)
        self.calibration_key = calibration_key(model, head, batch_size, self.depth, mesh)
        if lookup is not None and lookup.num_draft:  # a chain of K then verifies lookup's longer chains: its own steps
            key, what = self.calibration_key
            self.calibration_key = f"{key}-lookup{lookup.num_draft}", {**what, "prompt_lookup_tokens": lookup.num_draft}
        stored = self.store.get_calibration(self.calibration_key[0]) if self.store is not None else None
        self.calibration = stored.weighing_at_most(CALIBRATION_SECONDS) if stored else StepCalibration()
        self.step_costs: dict[int, StepCosts] = {}  # cache capacity → costs at this batch size
        self.timing_seconds = 0.0  # spent timing step costs (like compile time, outside generation time)
        self._generators: dict[Method, Generator] = {}  # chain length (0: target-only) or tree → its generator
        self._target_only_batches = 0
        # this process's steps alone (the probe's gate): a stored ratio may be stale, and only a probe measures
        # one draft's again
        self.own_calibration = StepCalibration()

    @property
    def drafter_name(self) -> str:
        return "DFlash drafter" if self.block else "draft model" if self.draft_model else "draft head"

    @property
    def num_draft(self) -> int:
        """The most drafts per step any choice may accept (the longest chain, the deepest tree): the statistics'
        depth."""
        return max([self.depth, *(t.depth for t in self.trees), (self.lookup.num_draft or 0) if self.lookup else 0])

    @property
    def methods(self) -> list[Method]:
        """Every method this generator may run, in one order on every process: target-only, the chains, the trees."""
        return [*range(self.depth + 1), *self.trees]

    def cost_capacity(self, batch: Sequence[Sequence[int]], max_new_tokens: int) -> int:
        """The cache bucket whose costs price a batch: the longest chain's (each choice sizes its own caches). A
        tree's step writes more slots ahead (32,6,8: 46), so its own bucket may be the next one up; its costs are
        timed at this one all the same, so that every method of a batch is priced at one cache size, and its
        measured steps (`StepCalibration`) absorb the difference."""
        longest = max(len(p) for p in batch)
        return capacity_bucket(longest + max_new_tokens + self.depth + 1, self.config.context_length + self.depth + 1)

    def acceptance(self) -> AcceptanceProfile:
        """The profile the next choice rests on: the prior pooled with the counts so far (the prior weighs as many
        verify steps as it was given), or the counts alone."""
        return self.running.profile() if self.prior is None else self.running.pooled_with(self.prior)

    def tokens_past_chain(self) -> dict[int, float]:
        """{K: tokens per verify a chain of K gets past its K from lookup's longer chains} (`RunningPastChain`)."""
        return {k: self.past_chain.tokens(k) for k in range(1, self.depth + 1)}

    def tree_tokens(self) -> dict[TreeConfig, float]:
        """Each candidate tree's expected tokens per verify: its record scaled as the chain's counts on these prompts
        scale the chain's (`auto.config.tree_tokens`), pooled with the tree's own counts."""
        now = self.acceptance()
        return {t: self.running_trees.pooled(t, tree_tokens(n, self.prior, now), self.prior.verify_steps)
                for t, n in self.trees.items()}

    def _time(self, capacity: int) -> StepCosts:
        """Time the chains at this capacity, then the trees that an estimate from those costs says could win
        (`auto.config.tree_worth_timing`, against the best chain or target-only as timed), if any. Multi-host,
        process 0's estimate decides which, since the timed forwards are collectives every process must run."""
        with sharding.mesh_context(self.mesh):
            costs = measure_step_costs(self.model, self.head, self.batch_size, capacity, self.depth)
            if self.trees:
                best = choose(costs, self.acceptance(), self.depth,
                              past_chain=self.tokens_past_chain()).tokens_per_second
                worth = [tree_worth_timing(costs, t, n, best) for t, n in self.tree_tokens().items()]
                if jax.process_count() > 1:
                    worth = list(multihost_utils.broadcast_one_to_all(np.asarray(worth, np.int32)) > 0)
                timed = tuple(t for t, w in zip(self.trees, worth) if w)
                if timed:
                    costs = add_tree_costs(costs, self.model, self.head, self.batch_size, capacity, timed)
        return costs

    def costs(self, capacity: int) -> StepCosts:
        """Step costs at this batch size and cache capacity: from the store if this machine timed them before,
        else timed now (and stored)."""
        if capacity not in self.step_costs:
            key, what = cost_key(self.model, self.head, self.batch_size, capacity, self.depth, self.mesh,
                                 tuple(self.trees))
            stored = self.store.get(key) if self.store is not None else None
            if stored is not None:  # the key holds the chain depth, so the entry has this generator's lengths
                self.step_costs[capacity] = stored
                self._report(capacity, f"step costs (batch {self.batch_size}, cache {capacity}) timed earlier")
                return stored
            if self.on_compile is not None:
                self.on_compile(f"timing decode, verify and draft steps (batch {self.batch_size}, cache {capacity})...")
            start = time.perf_counter()
            self.step_costs[capacity] = self._time(capacity)
            self.timing_seconds += time.perf_counter() - start
            if self.store is not None:
                self.store.put(key, self.step_costs[capacity], what)
            self._report(capacity, f"timed in {time.perf_counter() - start:.1f}s")
        return self.step_costs[capacity]

    def _report(self, capacity: int, how: str) -> None:
        if self.on_compile is not None:
            c = self.step_costs[capacity]
            trees = "".join(f", tree {t.spec} {step_seconds(c, t) * 1e3:.1f} ms" for t in c.trees)
            self.on_compile(
                f"{how}: decode {c.decode * 1e3:.1f} ms, verify of {self.depth + 1} tokens "
                f"{c.verify[self.depth] * 1e3:.1f} ms, {self.draft_step_name} "
                f"{c.draft * 1e3:.2f} ms{trees}"
            )

    @property
    def draft_step_name(self) -> str:
        """What `StepCosts.draft` times for this drafter."""
        return ("drafter forward" if self.block else "draft model step" if self.draft_model
                else "P-EAGLE forward" if self.peagle else "head step")

    def choose(self, capacity: int) -> tuple[Choice, str]:
        """(the choice for a batch at this capacity, what it rests on: prior, observed, prior+observed, or first
        batch — no profile yet, so the default chain drafts to measure one)."""
        profile = self.acceptance()
        if not profile.rates:
            k = self.depth if self.block else min(FIRST_CHAIN, self.depth)
            return Choice(k, 0.0, 0.0, ()), "first batch"
        observed = self.running.profile().verify_steps > 0 or bool(self.running_trees.steps)
        basis = "prior+observed" if self.prior and observed else "observed" if observed else "prior"
        costs, trees = self.costs(capacity), self.tree_tokens()
        choice = choose(costs, profile, self.depth, trees, self.calibration, self.tokens_past_chain())
        if choice.method == 0:
            # Counts come only from speculating: the PROBE_EVERY-th target-only batch, then the 2×, 4×, .. one
            # drafts one token, so that the choice follows the prompts; fewer and fewer, since a probe costs where
            # target-only is right, and none once the counts rule drafting out.
            self._target_only_batches += 1
            n = self._target_only_batches
            due = n % PROBE_EVERY == 0 and (n // PROBE_EVERY) & (n // PROBE_EVERY - 1) == 0
            # Ratios stored by earlier processes (perhaps measured under load) are not trusted here: only a probe
            # measures one draft's again, so a stale one must not keep the probes off. The gate costs one draft at
            # what this process measured (its own probes, else the pooled ratio of its other batches), and before
            # this process has measured anything, at the stored ratios less one draft's.
            own = self.own_calibration
            gate = own if own.measured else self.calibration.without(1)
            if due and drafting_could_win(costs, self.running.profile(), calibration=gate):
                choice, basis = _running(choice, 1, profile, trees), "probe"
        if jax.process_count() > 1:  # every process must run the same program: process 0's timings decide
            methods = self.methods
            i = int(multihost_utils.broadcast_one_to_all(np.int32(methods.index(choice.method))))
            choice = _running(choice, methods[i], profile, trees)
        return choice, basis

    def with_batch_size(self, batch_size: int) -> AutoSpeculativeGenerator:
        """This generator's choices at another batch size (its costs timed there): the same drafter, prior,
        candidates, store and mesh."""
        if batch_size == self.batch_size:
            return self
        twin = AutoSpeculativeGenerator(self.model, self.head, prior=self.prior, trees=self.trees,
                                        max_draft=self.depth, batch_size=batch_size, mesh=self.mesh,
                                        kernels=self.kernels, store=self.store, lookup=self.lookup)
        twin.on_compile = self.on_compile
        return twin

    def live_batch_plan(self, capacity: int, buckets: Sequence[int]) -> LiveBatchPlan:
        """For a continuous batcher whose steps run on buckets of live rows (`engine.slots`): the method its state
        speculates with, the best at the smallest bucket (speculation pays most with fewest rows), and the buckets
        where that method beats target-only at their own batch size's step costs (`auto.config.live_batch_plan`).
        Without an acceptance profile (a first batch) the default chain drafts at every bucket."""
        choices = {}
        for rows in sorted(buckets):
            choices[rows] = self.with_batch_size(rows).choose(capacity)[0]
            if rows == min(buckets) and choices[rows].method == 0:
                break  # target-only where speculation pays most: target-only everywhere
        return live_batch_plan(choices)

    def generate_batch(
        self, batch, offset, max_new_tokens, stop_ids, keys, on_tokens, processor_values, sampling=None
    ) -> list[Completion]:
        capacity = self.cost_capacity(batch, max_new_tokens)
        choice, basis = self.choose(capacity)
        return self.run_choice(choice, basis, capacity, batch, offset, max_new_tokens, stop_ids, keys, on_tokens,
                               processor_values, sampling)

    def run_choice(
        self, choice: Choice, basis: str, capacity: int, batch, offset, max_new_tokens, stop_ids, keys, on_tokens,
        processor_values, sampling=None,
    ) -> list[Completion]:
        """One batch with `choice` (this generator's `choose` made it, on `basis`), its counts and step time taken
        in, and the choice recorded in each completion's `stats["auto"]`."""
        rates = self.acceptance().rates
        args = (batch, offset, max_new_tokens, stop_ids, keys, on_tokens, processor_values, sampling)
        trees = self.tree_tokens()
        gen = self.generator_for(choice.method)
        completions = gen.generate_batch(*args)
        self.memory = gen.memory
        for c in completions:  # a tree's path is not a chain's: its counts are kept apart
            if choice.tree is not None:
                self.running_trees.add(choice.tree, c.stats["accepted_per_position"], c.stats["verify_calls"])
            elif choice.method:  # a chain of K: positions past K are lookup's longer chains (`RunningPastChain`)
                self.running.add(c.stats["accepted_per_position"][: choice.method], c.stats["verify_calls"])
                if self.lookup is not None:
                    self.past_chain.add(choice.method, c.stats["accepted_per_position"], c.stats["verify_calls"])
        self._calibrate(choice.method, capacity, completions)
        if self.store is not None:
            key, what = self.calibration_key
            self.store.put_calibration(key, self.calibration, what)
        self.compile_seconds = sum(g.compile_seconds for g in self._generators.values())
        running = self.running.profile()
        record = {
            **choice.as_dict(),
            "basis": basis,
            "acceptance_per_position": [round(r, 4) for r in rates],  # what the choice rested on
            "running_acceptance_per_position": [round(r, 4) for r in running.rates],  # observed, this batch included
            "running_verify_steps": int(running.verify_steps),
            "tree_tokens_per_step": {method_key(t): round(n, 4) for t, n in trees.items()},  # what the choice used
            "running_trees": self.running_trees.as_dict(),  # observed, this batch included
            # prompt lookup's drafts accepted past each chain's K, per verify step, this batch included
            **({"tokens_past_chain": self.past_chain.as_dict(self.depth)} if self.lookup is not None else {}),
            "step_costs_ms": _costs_ms(self.step_costs.get(capacity)),  # as timed; the choice used them calibrated
            "step_calibration": self.calibration.as_dict(),  # method → measured / timed step seconds
            "timing_seconds": round(self.timing_seconds, 2),
        }
        for c in completions:
            c.stats = {**c.stats, "auto": record}
        return completions

    def _calibrate(self, method: Method, capacity: int, completions: Sequence[Completion]) -> None:
        """Add this batch's step time (its wall time after the prefill) against the timed costs' prediction for as
        many steps: the batch ran until its longest row was done, so its steps are the most any row took."""
        costs = self.step_costs.get(capacity)
        if costs is None or (method not in costs.trees if isinstance(method, TreeConfig) else method > costs.max_draft):
            return  # the first batch of a head without a profile runs before anything is timed
        if method:
            steps = max(c.stats["verify_calls"] for c in completions)
        else:  # the prefill gives each row its first token; every other token is a decode step
            steps = max(c.num_generated for c in completions) - 1
        seconds = completions[0].seconds - completions[0].prefill_seconds
        predicted = steps * step_seconds(costs, method)
        for calibration in (self.calibration, self.own_calibration):
            calibration.add(method, seconds, predicted)

    def generator_for(self, method: Method) -> Generator:
        """The generator of one choice (0: target-only), built on first use; each compiles its own programs (the
        server runs the one `choose` picks at start-up)."""
        if method not in self._generators:
            if method == 0:
                gen = Generator(self.model, batch_size=self.batch_size, mesh=self.mesh, kernels=self.kernels)
            elif self.block or self.draft_model:
                of = DFlashProposer.of if self.block else DraftModelProposer.of
                proposer, params = of(self.head, method)
                gen = Generator(self.model, proposer=beside(proposer, self.lookup), proposer_params=params,
                                batch_size=self.batch_size, mesh=self.mesh, kernels=self.kernels)
            else:
                tree = method if isinstance(method, TreeConfig) else None
                gen = SpeculativeGenerator(
                    self.model, self.head, num_draft=1 if tree else method, tree=tree, batch_size=self.batch_size,
                    mesh=self.mesh, kernels=self.kernels, lookup=self.lookup,
                )
            gen.on_compile = self.on_compile
            self._generators[method] = gen
        return self._generators[method]



def _costs_ms(costs: StepCosts | None) -> dict | None:
    """Milliseconds: decode (T = 1), verify[k - 1] (a chain of k drafts: T = k + 1), one head step, each timed
    tree's expansion."""
    if costs is None:
        return None
    return {"decode": round(costs.decode * 1e3, 3), "verify": [round(v * 1e3, 3) for v in costs.verify[1:]],
            "draft": round(costs.draft * 1e3, 3),
            "tree_drafts": {t.spec: round(v * 1e3, 3) for t, v in costs.tree_drafts}}


def _method_of(record: dict) -> Method:
    """The method a batch's `stats["auto"]` record ran."""
    return TreeConfig.parse(record["tree"]) if record.get("tree") else record["num_speculative_tokens"]


def chosen(completions: Sequence[Completion], batch_size: int) -> dict[Method, int]:
    """{method: batches that ran it} over completions of an `AutoSpeculativeGenerator` (0: target-only, K: a chain,
    a TreeConfig: a tree), target-only first, then chains by length, then trees."""
    counts: dict[Method, int] = {}
    for i, c in enumerate(completions):
        if i % batch_size == 0 and "auto" in c.stats:
            m = _method_of(c.stats["auto"])
            counts[m] = counts.get(m, 0) + 1
    return {m: counts[m] for m in sorted(counts, key=method_order)}


def describe_choices(completions: Sequence[Completion], batch_size: int) -> str:
    """`K=1 for 9 batches, target-only for 1`: what the automatic choice ran."""
    parts = [f"{method_label(m)} for {n} batch{'es' if n > 1 else ''}"
             for m, n in chosen(completions, batch_size).items()]
    return ", ".join(parts) or "no batches"


def _running(choice: Choice, method: Method, profile: AcceptanceProfile, trees: Mapping[TreeConfig, float]) -> Choice:
    """`choice` made to run `method` (a probe's one draft, or process 0's choice), with its expectations."""
    if method == choice.method:
        return choice
    per_step = trees[method] if isinstance(method, TreeConfig) else expected_tokens(profile.rates, method)
    return dataclasses.replace(choice, method=method, tokens_per_step=per_step,
                               tokens_per_second=dict(choice.candidates).get(method, 0.0))
