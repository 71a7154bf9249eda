"""Automatic speculation among several drafters of one target (`--also-draft`): an EAGLE-3 head and a DFlash block
drafter, say. Before each batch every drafter's `AutoSpeculativeGenerator` makes its own choice (its chains and
trees, or target-only) from its own acceptance and this machine's step costs; the batch runs the choice with the
most expected tokens per second, and only the drafter that ran takes in its counts.

Why one choice per drafter rather than one pool of methods: each drafter's acceptance profile, step costs and
calibration are its own (a block drafter's K drafts cost one forward, a head's K), and each already decides well
among its own methods; what is left is comparing their best. A drafter that has no acceptance yet (no record) runs
first, to measure one, as it would alone; while target-only wins everywhere, a drafter whose probe is due drafts
its probe batch. Output never depends on the choice: every method gives the target's tokens (greedy) or its
distribution (sampling).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxspec.engine.auto.config import method_label
from jaxspec.engine.auto.generator import AutoSpeculativeGenerator, chosen
from jaxspec.engine.generation import Completion, Generator
from jaxspec.errors import JaxspecError


class AutoAmongDrafters(Generator):
    """`Generator` over several `AutoSpeculativeGenerator`s (`drafters`, named by `names`) of one target at one
    batch size; each completion's `stats["auto"]` records the drafter that ran (`drafter`) and every drafter's best
    expected tokens per second (`drafters`)."""

    def __init__(self, drafters: Sequence[AutoSpeculativeGenerator], names: Sequence[str]):
        if len(drafters) < 2 or len(names) != len(drafters):
            raise ValueError("AutoAmongDrafters takes two or more drafters, each named")
        first = drafters[0]
        if any(d.batch_size != first.batch_size for d in drafters):
            raise JaxspecError("the drafters' generators must share one batch size")
        if len(set(names)) < len(names):
            raise JaxspecError(f"the drafters must differ; got {list(names)}")
        self.drafters, self.names = list(drafters), list(names)
        super().__init__(first.model, batch_size=first.batch_size, mesh=first.mesh, kernels=first.kernels)

    @property
    def on_compile(self):
        return self.drafters[0].on_compile

    @on_compile.setter
    def on_compile(self, say) -> None:  # each drafter's compiles and timings are what is said
        for d in self.drafters:
            d.on_compile = say

    @property
    def num_draft(self) -> int:
        """The most drafts per step any drafter's choice may accept: the statistics' depth."""
        return max(d.num_draft for d in self.drafters)

    def pick(self, capacity: int) -> tuple[int, object, str, dict[str, float]]:
        """(which drafter runs, its choice, its basis, every drafter's expected tokens per second for its own
        choice): a drafter without an acceptance profile first (its first batch measures one), else the best
        expected tokens per second; where that is target-only, the first drafter whose probe is due probes."""
        picks = [d.choose(capacity) for d in self.drafters]
        expected = {name: round(choice.tokens_per_second, 3) for name, (choice, _) in zip(self.names, picks)}
        first = next((i for i, (_, basis) in enumerate(picks) if basis == "first batch"), None)
        if first is not None:  # (every process's: a drafter's record, or its counts, are the same everywhere)
            return first, *picks[first], expected
        best = max(range(len(picks)), key=lambda i: (picks[i][0].tokens_per_second, -i))
        if picks[best][0].method == 0:
            best = next((i for i, (_, basis) in enumerate(picks) if basis == "probe"), best)
        if jax.process_count() > 1:  # every process must run the same drafter's program: process 0's pick decides
            best = int(multihost_utils.broadcast_one_to_all(np.int32(best)))
        return best, *picks[best], expected

    def generate_batch(
        self, batch, offset, max_new_tokens, stop_ids, keys, on_tokens, processor_values, sampling=None
    ) -> list[Completion]:
        capacity = max(d.cost_capacity(batch, max_new_tokens) for d in self.drafters)
        i, choice, basis, expected = self.pick(capacity)
        completions = self.drafters[i].run_choice(choice, basis, capacity, batch, offset, max_new_tokens, stop_ids,
                                                  keys, on_tokens, processor_values, sampling)
        self.memory = self.drafters[i].memory
        self.compile_seconds = sum(d.compile_seconds for d in self.drafters)
        for c in completions:
            c.stats = {**c.stats, "auto": {**c.stats["auto"], "drafter": self.names[i], "drafters": expected}}
        return completions


def describe_among(completions: Sequence[Completion], batch_size: int) -> str:
    """`head: K=3 for 2 batches; dflash: K=7 for 1 batch`: what each drafter's choices ran (target-only under
    the drafter whose choice it was)."""
    names = []
    for i, c in enumerate(completions):
        name = c.stats.get("auto", {}).get("drafter")
        if i % batch_size == 0 and name is not None and name not in names:
            names.append(name)
    parts = []
    for name in names:
        mine = [c for i, c in enumerate(completions) if c.stats.get("auto", {}).get("drafter") == name
                and (i // batch_size) * batch_size == i]  # each batch's first completion stands for its batch
        runs = chosen(mine, 1)
        parts.append(f"{name}: " + ", ".join(f"{method_label(m)} for {n} batch{'es' if n > 1 else ''}"
                                             for m, n in runs.items()))
    return "; ".join(parts) or "no batches"
