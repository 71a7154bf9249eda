"""`jaxspec.bench.suite.measure_interleaved`: every generator sees every batch once, in an order rotated batch by batch, and
each generator's seconds are its own batches' seconds (warm-up excluded)."""

from __future__ import annotations

import dataclasses

import pytest

from jaxspec.bench.suite import measure_interleaved


@dataclasses.dataclass
class FakeCompletion:
    token_ids: list[int]
    seconds: float

    @property
    def num_generated(self) -> int:
        return len(self.token_ids)


class FakeGenerator:
    """Records the global call order; a batch of n prompts takes `cost` seconds per prompt row's first token."""

    def __init__(self, name: str, batch_size: int, cost: float, calls: list):
        self.name, self.batch_size, self.cost, self.calls = name, batch_size, cost, calls

    def generate(self, prompts, *, max_new_tokens, stop_ids, processors=None):
        self.calls.append((self.name, tuple(map(tuple, prompts))))
        return [FakeCompletion(list(p)[:max_new_tokens], self.cost) for p in prompts]


@pytest.mark.parametrize("batch_size,num_prompts", [(1, 5), (2, 5), (3, 3)])
def test_each_batch_runs_every_generator_in_rotated_order(batch_size, num_prompts):
    calls: list = []
    gens = [FakeGenerator(n, batch_size, c, calls) for n, c in (("a", 1.0), ("b", 2.0), ("c", 4.0))]
    prompts = [[i + 1] * (i + 1) for i in range(num_prompts)]
    results = measure_interleaved(gens, prompts, max_new_tokens=3, stops=())

    warm, timed = calls[:3], calls[3:]
    assert [name for name, _ in warm] == ["a", "b", "c"]  # each warms up on the first batch, before timing
    num_batches = -(-num_prompts // batch_size)
    assert len(timed) == 3 * num_batches
    for n in range(num_batches):
        group = timed[3 * n : 3 * n + 3]
        assert [name for name, _ in group] == [["a", "b", "c"][(i + n) % 3] for i in range(3)]
        assert {batch for _, batch in group} == {tuple(map(tuple, prompts[n * batch_size : (n + 1) * batch_size]))}
    for (out, tokens, seconds), g in zip(results, gens):
        assert [c.token_ids for c in out] == [p[:3] for p in prompts]  # input order, one completion per prompt
        assert tokens == sum(min(len(p), 3) for p in prompts)
        assert seconds == pytest.approx(g.cost * num_batches)  # a batch's seconds counted once, not per row


def test_generators_must_share_a_batch_size():
    calls: list = []
    with pytest.raises(ValueError, match="one batch size"):
        measure_interleaved([FakeGenerator("a", 1, 1.0, calls), FakeGenerator("b", 2, 1.0, calls)], [[1]], 2, ())
    assert calls == []
