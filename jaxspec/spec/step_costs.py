"""This machine's speculative step costs at one batch shape, timed: the input of `auto_config.choose_chain`.

What is timed is what a step's cost is made of: the target's forward over T tokens per row into a half-full cache
(T = 1: a target-only decode step; T = K+1: the verify of a K-draft chain) with the model's own numerics, and the
head's forward over one token per row (one draft step). Accept and commit are the same few elementwise operations
for every K and are left out. Verify lengths between the measured ones are interpolated linearly (a CPU's cost
grows about linearly in T; an accelerator's stays near one decode step until its matmul tiles fill), so any K
costs three compilations (T = 1, 2, K + 1), not K + 1 (with invariant numerics each takes ~20 s on a 2-core
CPU). Each shape compiles once per process (and once per machine with the persistent compilation cache).
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxspec.models import kv_cache as kvc
from jaxspec.models.eagle3 import Eagle3Head
from jaxspec.models.llama import LlamaModel
from jaxspec.spec.auto_config import StepCosts

ROUNDS = 5  # timed rounds per measurement (`best_seconds_interleaved`)
TIMING = f"best of {ROUNDS} interleaved rounds"  # how costs are timed: part of a stored entry's key (`step_cost_store`)


def best_seconds_interleaved(calls: dict, repeats: int = ROUNDS) -> dict:
    """{name: the fastest of `repeats` timed calls} for calls {name: (fn, args)}, timed in rounds — each round
    calls every fn once, in turn — after one untimed round (which compiles and warms up).

    Why rounds: what the choice needs is the costs' ratios (a verify against a decode), and a machine's speed
    drifts. Timed one function after another, right after a model was loaded, a SmolLM2 decode on a 2-core CPU
    measured 40-48 ms where the generation loop's steps took 31-37 ms and the verify after it was timed at its
    usual cost: one draft then looked cheaper than it was. In rounds, a slow stretch slows every length alike."""
    for fn, args in calls.values():
        jax.block_until_ready(fn(*args))
    best = dict.fromkeys(calls, float("inf"))
    for _ in range(repeats):
        for name, (fn, args) in calls.items():
            begin = time.perf_counter()
            jax.block_until_ready(fn(*args))
            best[name] = min(best[name], time.perf_counter() - begin)
    return best


def verify_lengths(max_draft: int) -> list[int]:
    """Token counts T to time: 1 (decode), 2 (the shortest verify) and max_draft + 1 (the longest); each is one more
    compilation before the first batch, so the lengths between are interpolated rather than timed."""
    return sorted({1, 2, max_draft + 1})


def time_forwards(
    model: LlamaModel, head: Eagle3Head | None, batch: int, capacity: int, lengths: list[int], repeats: int = ROUNDS
) -> tuple[dict[int, float], float]:
    """({T: seconds of a target forward over T tokens per row}, seconds of one head step, 0 without a head), at this
    batch size and cache capacity, the cache half full, with the model's own numerics, timed in interleaved rounds
    (`best_seconds_interleaved`)."""
    tg, tp = nnx.split(model.hold_fused_qkv())  # as its generators run it (Generator.__init__ holds the same)

    @jax.jit
    def target_forward(params, cache, tokens):  # [B, T]
        m = nnx.merge(tg, params)
        positions = cache.lengths[:, None] + jnp.arange(tokens.shape[1], dtype=jnp.int32)
        out = m(tokens, positions, cache, return_aux=head is not None)
        return out.logits, out.aux

    cache = kvc.advance(model.init_cache(batch, capacity), capacity // 2)
    calls = {t: (target_forward, (tp, cache, jnp.zeros((batch, t), jnp.int32))) for t in lengths}
    if head is not None:
        hg, hp = nnx.split(head)
        table = model.embed_tokens[...]

        @jax.jit
        def head_step(params, cache, tokens, state):  # one new token per row
            h = nnx.merge(hg, params)
            return h(tokens, state, cache.lengths[:, None], cache, table)[:2]

        hcache = kvc.advance(head.init_cache(batch, capacity), capacity // 2)
        state = jnp.zeros((batch, 1, head.config.hidden_size), head.dtype)
        calls["head"] = (head_step, (hp, hcache, jnp.zeros((batch, 1), jnp.int32), state))
    best = best_seconds_interleaved(calls, repeats)
    return {t: best[t] for t in lengths}, best.get("head", 0.0)


def measure_step_costs(
    model: LlamaModel, head: Eagle3Head | None, batch: int, capacity: int, max_draft: int, repeats: int = ROUNDS
) -> StepCosts:
    """Step costs for chains of up to max_draft drafts: target forwards timed at `verify_lengths(max_draft)`, the
    lengths between interpolated, and one head step."""
    seconds, draft = time_forwards(model, head, batch, capacity, verify_lengths(max_draft), repeats)
    measured = sorted(seconds)
    per_t = np.interp(np.arange(1, max_draft + 2), measured, [seconds[t] for t in measured])  # [T = 1..K+1]
    return StepCosts(decode=float(per_t[0]), verify=(0.0, *(float(x) for x in per_t[1:])), draft=draft)
