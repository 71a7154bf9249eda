"""This machine's speculative step costs at one batch shape, timed: the input of `auto_config.choose_chain`.

What is timed is what a step's cost is made of: the target's forward over T tokens per row into a half-full cache
(T = 1: a target-only decode step; T = K+1: the verify of a K-draft chain) with the model's own numerics, and the
head's forward over one token per row (one draft step). Accept and commit are the same few elementwise operations
for every K and are left out. Verify lengths between the measured ones are interpolated linearly (a CPU's cost
grows about linearly in T; an accelerator's stays near one decode step until its matmul tiles fill), so a K of 7
costs four compilations (T = 1, 2, 4, 8), not eight. Each shape compiles once per process (and once per machine
with the persistent compilation cache).
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxspec.models.eagle3 import Eagle3Head
from jaxspec.models.llama import LlamaModel
from jaxspec.spec.auto_config import StepCosts


def _best_seconds(fn, args, repeats: int) -> float:
    """The fastest of `repeats` timed calls after one untimed call (which compiles)."""
    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(repeats):
        begin = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - begin)
    return best


def verify_lengths(max_draft: int) -> list[int]:
    """Token counts T to time: 1, 2, 4, ... and max_draft + 1."""
    lengths, t = [1], 2
    while t < max_draft + 1:
        lengths.append(t)
        t *= 2
    return sorted({*lengths, max_draft + 1})


def measure_step_costs(
    model: LlamaModel, head: Eagle3Head | None, batch: int, capacity: int, max_draft: int, repeats: int = 3
) -> StepCosts:
    """Seconds of a target forward over T tokens per row for T in `verify_lengths(max_draft)` (others interpolated)
    and of one head step, at this batch size and cache capacity (the cache half full)."""
    graphdef, params = nnx.split(model)
    filled = capacity // 2

    @jax.jit
    def target_forward(params, tokens):  # [B, T]
        m = nnx.merge(graphdef, params)
        b, t = tokens.shape
        cache = m.init_cache(b, capacity)
        cache = cache._replace(lengths=jnp.full((b,), filled, jnp.int32))
        positions = filled + jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        out = m(tokens, positions, cache, return_aux=head is not None)
        return out.logits, out.aux

    seconds = {}
    for t in verify_lengths(max_draft):
        tokens = jnp.zeros((batch, t), jnp.int32)
        seconds[t] = _best_seconds(target_forward, (params, tokens), repeats)
    measured = sorted(seconds)
    per_t = np.interp(np.arange(1, max_draft + 2), measured, [seconds[t] for t in measured])  # [T = 1..K+1]
    draft = 0.0
    if head is not None:
        hgraph, hparams = nnx.split(head)
        table = model.embed_tokens[...]

        @jax.jit
        def head_step(hparams, tokens, state):  # one new token per row
            h = nnx.merge(hgraph, hparams)
            b = tokens.shape[0]
            cache = h.init_cache(b, capacity)
            cache = cache._replace(lengths=jnp.full((b,), filled, jnp.int32))
            return h(tokens, state, jnp.full((b, 1), filled, jnp.int32), cache, table)[:2]

        state = jnp.zeros((batch, 1, head.config.hidden_size), head.dtype)
        draft = _best_seconds(head_step, (hparams, jnp.zeros((batch, 1), jnp.int32), state), repeats)
    return StepCosts(decode=float(per_t[0]), verify=(0.0, *(float(x) for x in per_t[1:])), draft=draft)
