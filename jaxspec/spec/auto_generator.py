"""Speculation configured per batch (`--num-speculative-tokens auto`): before each batch, the chain length — or
target-only — with the most expected tokens per second on this machine (`auto_config.choose_chain`).

The inputs are measured, not guessed: the step costs are timed once per machine and cache bucket on the real
forwards (`step_costs.measure_step_costs`; kept on disk for later processes by `step_cost_store`, with the
calibration) and then scaled by what each batch's steps really took (`auto_config.StepCalibration`), and the
acceptance profile is the head's recorded one (`auto_config.profile_from_record`) refined with the counts of every
batch generated so far. A head without a record drafts the default chain on its first batch, so that the next choice rests on measured counts. Trees are not
chosen automatically: `--tree` names one. Output never depends on the choice: every chain length, and target-only,
give the target's tokens (greedy) or its distribution (sampling).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

from jaxspec import sharding
from jaxspec.errors import JaxspecError
from jaxspec.generation import Completion, Generator
from jaxspec.models.eagle3 import Eagle3Head
from jaxspec.models.llama import LlamaModel
from jaxspec.spec.auto_config import (
    AcceptanceProfile,
    Choice,
    RunningAcceptance,
    StepCalibration,
    StepCosts,
    choose_chain,
    drafting_could_win,
    expected_tokens,
    step_seconds,
)
from jaxspec.spec.generator import SpeculativeGenerator, check_head_fits
from jaxspec.spec.step_cost_store import CALIBRATION_SECONDS, StepCostStore, calibration_key, cost_key
from jaxspec.spec.step_costs import measure_step_costs

FIRST_CHAIN = 5  # drafts of the first batch when the head records no acceptance profile
MAX_AUTO_DRAFT = 8  # the longest chain considered (its verify of 9 tokens is timed once per cache bucket)
PROBE_EVERY = 16  # while target-only is chosen, its 16th, 32nd, 64th, .. batch drafts one token to keep measuring,
# unless the counts so far rule drafting out (`auto_config.drafting_could_win`). A probe costs up to 1/PROBE_EVERY
# of the run so far where target-only is right (at 8, the probe batch took 1.24x a target-only one: ~3% of the
# grounded 8-prompt bench)


class AutoSpeculativeGenerator(Generator):
    """`Generator` that picks, before each batch, the chain length (0 = target-only) with the most expected tokens
    per second, from this machine's step costs at the batch's shape and the acceptance profile: `prior` (the head's
    record, or None) pooled with the counts observed so far. The choice made for each batch is in its completions'
    `stats["auto"]`, with the running acceptance after it. While target-only is the choice nothing is observed, so
    its PROBE_EVERY-th batch, then the 2×, 4×, .. PROBE_EVERY-th, drafts one token (basis "probe"): a head that does
    better on these prompts than its record says gets chosen, and one that does not costs less and less. A probe is
    skipped where it cannot change the choice: when one draft could not beat target-only even at a first-draft rate
    of 1.0, or at the optimistic end of the rate the probes so far observed (`auto_config.drafting_could_win`)."""

    def __init__(
        self,
        model: LlamaModel,
        head: Eagle3Head,
        *,
        prior: AcceptanceProfile | None,
        max_draft: int = MAX_AUTO_DRAFT,
        batch_size: int = 1,
        mesh: jax.sharding.Mesh | None = None,
        kernels: str | None = None,
        store: StepCostStore | None = None,
    ):
        if max_draft < 1:
            raise JaxspecError(f"automatic speculation needs max_draft >= 1, got {max_draft}")
        check_head_fits(model, head)
        super().__init__(model, batch_size=batch_size, mesh=mesh, kernels=kernels)  # batching; choices run elsewhere
        if mesh is not None:  # placed once: the chains built later find it on the mesh and share it
            sharding.check_fits(mesh, {"draft head": head.config}, batch_size)
            graphdef, params = nnx.split(head)
            head = nnx.merge(graphdef, sharding.shard_params(params, mesh))
        self.model, self.head = model, head
        self.prior = prior if prior is not None and prior.rates else None
        self.depth = min(max_draft, len(self.prior.rates) if self.prior else FIRST_CHAIN)  # longest chain considered
        self.running = RunningAcceptance()
        # Timed costs and calibration of earlier processes (None: time every bucket in this process). Multi-host,
        # every process times (the timed forwards are collectives, and the processes' disks may hold different
        # stores); process 0's timings decide (`choose`).
        self.store = store if jax.process_count() == 1 else None
        self.calibration_key = calibration_key(model, head, batch_size, self.depth, mesh)
        stored = self.store.get_calibration(self.calibration_key[0]) if self.store is not None else None
        self.calibration = stored.weighing_at_most(CALIBRATION_SECONDS) if stored else StepCalibration()
        self.step_costs: dict[int, StepCosts] = {}  # cache capacity → costs at this batch size
        self.timing_seconds = 0.0  # spent timing step costs (like compile time, outside generation time)
        self._generators: dict[int, Generator] = {}  # chain length (0: target-only) → its generator
        self._target_only_batches = 0

    @property
    def num_draft(self) -> int:
        """The longest chain this generator may choose (the statistics' depth)."""
        return self.depth

    @property
    def extra_capacity(self) -> int:
        """The longest chain's verify block: prompts are checked against it, so that every choice accepts them (each
        chain sizes its own caches; the costs are timed at this capacity's bucket)."""
        return self.depth + 1

    def acceptance(self) -> AcceptanceProfile:
        """The profile the next choice rests on: the prior pooled with the counts so far (the prior weighs as many
        verify steps as it was given), or the counts alone."""
        return self.running.profile() if self.prior is None else self.running.pooled_with(self.prior)

    def costs(self, capacity: int) -> StepCosts:
        """Step costs at this batch size and cache capacity: from the store if this machine timed them before,
        else timed now (and stored)."""
        if capacity not in self.step_costs:
            key, what = cost_key(self.model, self.head, self.batch_size, capacity, self.depth, self.mesh)
            stored = self.store.get(key) if self.store is not None else None
            if stored is not None:  # the key holds the chain depth, so the entry has this generator's lengths
                self.step_costs[capacity] = stored
                self._report(capacity, f"step costs (batch {self.batch_size}, cache {capacity}) timed earlier")
                return stored
            if self.on_compile is not None:
                self.on_compile(f"timing decode, verify and draft steps (batch {self.batch_size}, cache {capacity})...")
            start = time.perf_counter()
            with sharding.mesh_context(self.mesh):
                self.step_costs[capacity] = measure_step_costs(
                    self.model, self.head, self.batch_size, capacity, self.depth
                )
            self.timing_seconds += time.perf_counter() - start
            if self.store is not None:
                self.store.put(key, self.step_costs[capacity], what)
            self._report(capacity, f"timed in {time.perf_counter() - start:.1f}s")
        return self.step_costs[capacity]

    def _report(self, capacity: int, how: str) -> None:
        if self.on_compile is not None:
            c = self.step_costs[capacity]
            self.on_compile(
                f"{how}: decode {c.decode * 1e3:.1f} ms, verify of {self.depth + 1} tokens "
                f"{c.verify[-1] * 1e3:.1f} ms, head step {c.draft * 1e3:.2f} ms"
            )

    def choose(self, capacity: int) -> tuple[Choice, str]:
        """(the choice for a batch at this capacity, what it rests on: prior, observed, prior+observed, or first
        batch — no profile yet, so the default chain drafts to measure one)."""
        profile = self.acceptance()
        if not profile.rates:
            k = min(FIRST_CHAIN, self.depth)
            return Choice(k, 0.0, 0.0, ()), "first batch"
        observed = self.running.profile().verify_steps > 0
        basis = "prior+observed" if self.prior and observed else "observed" if observed else "prior"
        costs = self.calibration.calibrated(self.costs(capacity))
        choice = choose_chain(costs, profile, self.depth)
        if choice.num_draft == 0:
            # Counts come only from speculating: the PROBE_EVERY-th target-only batch, then the 2×, 4×, .. one
            # drafts one token, so that the choice follows the prompts; fewer and fewer, since a probe costs where
            # target-only is right, and none once the counts rule drafting out.
            self._target_only_batches += 1
            n = self._target_only_batches
            due = n % PROBE_EVERY == 0 and (n // PROBE_EVERY) & (n // PROBE_EVERY - 1) == 0
            if due and drafting_could_win(costs, self.running.profile()):
                choice, basis = _with_draft(choice, 1, profile), "probe"
        if jax.process_count() > 1:  # every process must run the same program: process 0's timings decide
            k = int(multihost_utils.broadcast_one_to_all(np.int32(choice.num_draft)))
            choice = _with_draft(choice, k, profile)
        return choice, basis

    def generate_batch(
        self, batch, offset, max_new_tokens, sampling, stop_ids, key, on_tokens, processor_values
    ) -> list[Completion]:
        capacity = self.batch_capacity(batch, max_new_tokens)
        choice, basis = self.choose(capacity)
        rates = self.acceptance().rates
        args = (batch, offset, max_new_tokens, sampling, stop_ids, key, on_tokens, processor_values)
        gen = self._generator(choice.num_draft)
        completions = gen.generate_batch(*args)
        self.memory = gen.memory
        if choice.num_draft:
            for c in completions:
                self.running.add(c.stats["accepted_per_position"], c.stats["verify_calls"])
        self._calibrate(choice.num_draft, capacity, completions)
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
            "step_costs_ms": _costs_ms(self.step_costs.get(capacity)),  # as timed; the choice used them calibrated
            "step_calibration": self.calibration.as_dict(),  # chain length → measured / timed step seconds
            "timing_seconds": round(self.timing_seconds, 2),
        }
        for c in completions:
            c.stats = {**c.stats, "auto": record}
        return completions

    def _calibrate(self, num_draft: int, capacity: int, completions: Sequence[Completion]) -> None:
        """Add this batch's step time (its wall time after the prefill) against the timed costs' prediction for as
        many steps: the batch ran until its longest row was done, so its steps are the most any row took."""
        costs = self.step_costs.get(capacity)
        if costs is None or num_draft > costs.max_draft:
            return  # the first batch of a head without a profile runs before anything is timed
        if num_draft:
            steps = max(c.stats["verify_calls"] for c in completions)
        else:  # the prefill gives each row its first token; every other token is a decode step
            steps = max(c.num_generated for c in completions) - 1
        seconds = completions[0].seconds - completions[0].prefill_seconds
        self.calibration.add(num_draft, seconds, steps * step_seconds(costs, num_draft))

    def _generator(self, num_draft: int) -> Generator:
        """The generator of one choice (0: target-only), built on first use; each compiles its own programs."""
        if num_draft not in self._generators:
            if num_draft == 0:
                gen = Generator(self.model, batch_size=self.batch_size, mesh=self.mesh, kernels=self.kernels)
            else:
                gen = SpeculativeGenerator(
                    self.model, self.head, num_draft=num_draft, batch_size=self.batch_size, mesh=self.mesh,
                    kernels=self.kernels,
                )
            gen.on_compile = self.on_compile
            self._generators[num_draft] = gen
        return self._generators[num_draft]



def _costs_ms(costs: StepCosts | None) -> dict | None:
    """Milliseconds: decode (T = 1), verify[k - 1] (a chain of k drafts: T = k + 1), one head step."""
    if costs is None:
        return None
    return {"decode": round(costs.decode * 1e3, 3), "verify": [round(v * 1e3, 3) for v in costs.verify[1:]],
            "draft": round(costs.draft * 1e3, 3)}


def chosen(completions: Sequence[Completion], batch_size: int) -> dict[int, int]:
    """{chain length: batches that ran it} over completions of an `AutoSpeculativeGenerator` (0: target-only)."""
    counts: dict[int, int] = {}
    for i, c in enumerate(completions):
        if i % batch_size == 0 and "auto" in c.stats:
            k = c.stats["auto"]["num_speculative_tokens"]
            counts[k] = counts.get(k, 0) + 1
    return dict(sorted(counts.items()))


def describe_choices(completions: Sequence[Completion], batch_size: int) -> str:
    """`K=1 for 9 batches, target-only for 1`: what the automatic choice ran."""
    parts = [("target-only" if k == 0 else f"K={k}") + f" for {n} batch{'es' if n > 1 else ''}"
             for k, n in chosen(completions, batch_size).items()]
    return ", ".join(parts) or "no batches"


def _with_draft(choice: Choice, num_draft: int, profile: AcceptanceProfile) -> Choice:
    """`choice` made to run `num_draft` drafts (a probe, or process 0's choice), with that length's expectations."""
    if num_draft == choice.num_draft:
        return choice
    return dataclasses.replace(
        choice, num_draft=num_draft, tokens_per_step=expected_tokens(profile.rates, num_draft),
        tokens_per_second=dict(choice.candidates).get(num_draft, 0.0),
    )
