"""`step_costs.best_seconds_interleaved`: one untimed round, then rounds that call every function once in turn; each
function's best call is its own."""

from __future__ import annotations

import pytest

from jaxspec.engine.auto import step_costs


def test_rounds_call_every_function_in_turn_and_keep_each_ones_best(monkeypatch):
    calls: list[str] = []
    clock = iter(range(10_000))
    monkeypatch.setattr(step_costs.time, "perf_counter", lambda: next(clock))
    durations = {"a": [5, 3, 4], "b": [2, 7, 1]}  # ticks each timed call takes, round by round

    def make(name):
        def fn(x):
            calls.append(name)
            if len(calls) > 2:  # timed rounds: advance the fake clock by this call's duration
                for _ in range(durations[name][(len(calls) - 3) // 2] - 1):
                    next(clock)
            return x
        return fn

    best = step_costs.best_seconds_interleaved({"a": (make("a"), (1,)), "b": (make("b"), (2,))}, repeats=3)
    assert calls == ["a", "b"] * 4  # warm-up round, then 3 rounds
    assert best == {"a": 3, "b": 1}


@pytest.mark.parametrize("repeats", [1, 2])
def test_every_name_gets_a_time(repeats):
    best = step_costs.best_seconds_interleaved({t: (lambda x: x, (t,)) for t in (1, 2, 6)}, repeats=repeats)
    assert set(best) == {1, 2, 6} and all(0 <= v < 1 for v in best.values())


def test_a_carried_call_is_handed_back_the_state_it_returned():
    seen: list[int] = []

    def fn(state, x):
        seen.append(state)
        return state * 10 + x, state + 1

    call = step_costs.Carried(fn, 0, 5)
    assert [call(), call(), call()] == [5, 15, 25]
    assert seen == [0, 1, 2]


def test_a_carried_jitted_call_donates_its_state_as_the_engine_does():
    import jax
    import jax.numpy as jnp

    fn = jax.jit(lambda state, x: (state.sum(), state + x), donate_argnums=0)
    first = jnp.zeros(4)
    call = step_costs.Carried(fn, first, 1.0)
    assert [float(call()) for _ in range(3)] == [0.0, 4.0, 8.0]
    assert first.is_deleted()  # written in place, not copied: what a timed forward must cost
