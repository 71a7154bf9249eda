"""This machine's speculative step costs at one batch shape, timed: the input of `auto.config.choose`.

What is timed is what a step's cost is made of: the target's forward over T tokens per row into a half-full cache
(T = 1: a target-only decode step; T = K+1: the verify of a K-draft chain) with the model's own numerics, and the
head's forward over one token per row (one draft step). Accept and commit are the same few elementwise operations
for every K and are left out. Verify lengths between the measured ones are interpolated linearly (a CPU's cost
grows about linearly in T; an accelerator's stays near one decode step until its matmul tiles fill), so any K
costs three compilations (T = 1, 2, K + 1), not K + 1 (with invariant numerics each takes ~20 s on a 2-core
CPU). Each shape compiles once per process (and once per machine with the persistent compilation cache). Trees
are timed afterwards, only those worth it (`add_tree_costs`): their verify length (TOTAL tokens) and their
expansion (`tree.draft_tree`, timed whole).
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxspec.models import kv_cache as kvc
from jaxspec.models.dflash import DFlashDrafter
from jaxspec.models.eagle3 import Eagle3Head
from jaxspec.models.llama import LlamaModel
from jaxspec.engine.auto.config import StepCosts
from jaxspec.engine.proposers.base import StepView
from jaxspec.engine.proposers.dflash import DFlashProposer, DFlashState
from jaxspec.engine.tree import TreeConfig, draft_tree

ROUNDS = 5  # timed rounds per measurement (`best_seconds_interleaved`)
TIMING = f"best of {ROUNDS} interleaved rounds, caches donated"  # how costs are timed: part of a stored entry's key
# (`step_cost_store`); entries timed before the caches were donated have other keys and are timed again


class Carried:
    """A call that donates its state and is handed back the state it returned, as the engine threads its state from
    step to step: fn(state, *args) -> (out, state), fn jitted with the state donated.

    Why: a forward whose KV cache is not donated cannot write its new keys and values in place, so XLA copies the
    whole cache first, and on CPU that copy's fresh buffer is page-faulted in on every call (glibc maps buffers
    over 32 MB anew each time). Timed that way, SmolLM2's decode at 1,024 slots cost 46.3 ms where the engine's
    donated step costs 33.8 ms (2,048 slots: 74.4 against 49.6; 512: 28.7 against 27.9), the same ~12-25 ms on
    every verify length too, which made a verify look cheaper against a decode than it is (2026-12-02)."""

    def __init__(self, fn, state, *args):
        self.fn, self.state, self.args = fn, state, args

    def __call__(self):
        out, self.state = self.fn(self.state, *self.args)
        return out


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
    model: LlamaModel,
    head: Eagle3Head | DFlashDrafter | LlamaModel | None,  # LlamaModel: a draft model
    batch: int,
    capacity: int,
    lengths: list[int],
    repeats: int = ROUNDS,
    trees: tuple[TreeConfig, ...] = (),
    time_draft: bool = True,  # False: the trees' lengths and expansions only (`add_tree_costs`)
) -> tuple[dict[int, float], float, dict[TreeConfig, float]]:
    """({T: seconds of a target forward over T tokens per row}, seconds of one head step (0 without a head),
    {tree: seconds of its expansion}), at this batch size and cache capacity, the caches half full, with the model's
    own numerics, timed in interleaved rounds (`best_seconds_interleaved`). A DFlash drafter's step is its
    proposer's whole draft (the pending context written, one forward over the block, the longest chain's logits),
    a P-EAGLE head's likewise (one forward over the pending pairs and the mask slots). The target's forwards, a
    head's step and a draft model's step donate their caches (`Carried`); a whole block draft and a tree's expansion
    do not (their state is the drafter's own one- or two-layer cache: a few MB copied at 1,024 slots), so they
    carry that copy."""
    tg, tp = nnx.split(model.hold_step_weights())  # as its generators run it (Generator.__init__ holds the same)

    options = model.numerics.compiler_options() if model.numerics is not None else {}  # as Generator compiles

    @functools.partial(jax.jit, donate_argnums=0, compiler_options=options or None)
    def target_forward(cache, params, tokens):  # [B, T]
        m = nnx.merge(tg, params)
        positions = cache.lengths[:, None] + jnp.arange(tokens.shape[1], dtype=jnp.int32)
        out = m(tokens, positions, cache, return_aux=head is not None)
        return (out.logits, out.aux), out.cache  # the lengths unchanged (callers commit): half full again

    calls = {  # each length its own cache: a donated one is gone
        t: (Carried(target_forward, _half_full(model, batch, capacity), tp, jnp.zeros((batch, t), jnp.int32)), ())
        for t in lengths
    }
    if isinstance(head, DFlashDrafter):
        if time_draft:
            calls["head"] = _block_draft_call(model, tp, head, batch, capacity, max(lengths) - 1)
    elif isinstance(head, LlamaModel):  # a draft model: one token per row through its own cache
        if time_draft:
            calls["head"] = _draft_model_step_call(head, batch, capacity)
    elif head is not None:
        hg, hp = nnx.split(head)
        table = model.embed_tokens[...]

        @functools.partial(jax.jit, donate_argnums=0)
        def head_step(cache, params, tokens, state):  # one new token per row
            h = nnx.merge(hg, params)
            logits, state, cache = h(tokens, state, cache.lengths[:, None], cache, table)
            return (logits, state), cache

        state = jnp.zeros((batch, 1, head.config.hidden_size), head.dtype)
        if time_draft and is_parallel(head):  # P-EAGLE: a chain's drafts from one head forward
            calls["head"] = _parallel_draft_call(model, tp, head, batch, capacity, max(lengths) - 1)
        elif time_draft:
            calls["head"] = (Carried(head_step, _half_full(head, batch, capacity), hp,
                                     jnp.zeros((batch, 1), jnp.int32), state), ())
        for tree in trees:  # its expansion after the root, as the proposer runs it (step by step, P-EAGLE too)
            def expand(params, logits0, state0, cache, tree=tree):
                dt = draft_tree(nnx.merge(hg, params), table, logits0, state0, cache, tree)
                return dt.tokens, dt.mask

            logits0 = jax.random.normal(jax.random.key(0), (batch, head.config.draft_vocab_size), jnp.float32)
            calls[tree] = (jax.jit(expand), (hp, logits0, state[:, 0], _half_full(head, batch, capacity)))
    best = best_seconds_interleaved(calls, repeats)
    return {t: best[t] for t in lengths}, best.get("head", 0.0), {t: best[t] for t in trees}


def _half_full(module, batch: int, capacity: int) -> kvc.KVCache:
    """A target's, head's or draft model's cache with half its slots committed: where every forward is timed."""
    return kvc.advance(module.init_cache(batch, capacity), capacity // 2)


def _propose_call(model: LlamaModel, target_params, proposer, params, state, batch: int, capacity: int) -> tuple:
    """(fn, args) of one whole draft as the engine runs it: `proposer.propose`, greedy, every row running, the
    root at the half-full cache's length."""
    tg = nnx.graphdef(model)
    ones = jnp.ones((batch,), jnp.int32)
    view = StepView(jnp.zeros((batch,), jnp.int32), jnp.full((batch,), capacity // 2, jnp.int32), ones, None)

    @jax.jit
    def draft(target_params, params, state, view):
        keys = jax.random.split(jax.random.key(0), batch)
        proposal, _ = proposer.propose(params, nnx.merge(tg, target_params), state, view, keys)
        return proposal.tokens

    return draft, (target_params, params, state, view)


def _block_draft_call(model: LlamaModel, target_params, drafter: DFlashDrafter, batch: int, capacity: int,
                      num_draft: int) -> tuple:
    """One DFlash draft (`_propose_call`) for chains of num_draft: its context half full, a whole chain's features
    pending."""
    proposer, params = DFlashProposer.of(drafter, num_draft)
    cfg = drafter.config
    state = DFlashState(
        cache=kvc.advance(drafter.init_cache(batch, capacity), capacity // 2 - (num_draft + 1)),
        pending_feat=jnp.zeros((batch, num_draft + 1, cfg.num_aux * cfg.target_hidden_size), model.dtype),
        num_pending=jnp.full((batch,), num_draft + 1, jnp.int32),
    )
    return _propose_call(model, target_params, proposer, params, state, batch, capacity)


def is_parallel(head) -> bool:
    """Whether a drafter drafts a whole chain in one forward, so that a chain of any K costs that forward
    (`StepCosts.block_draft`): a DFlash drafter, a P-EAGLE head."""
    return isinstance(head, DFlashDrafter) or (isinstance(head, Eagle3Head) and head.config.mask_token_id is not None)


def _parallel_draft_call(model: LlamaModel, target_params, head: Eagle3Head, batch: int, capacity: int,
                         num_draft: int) -> tuple:
    """One P-EAGLE draft (`_propose_call`) for chains of num_draft: the head's cache half full, a whole chain's
    pairs pending."""
    from jaxspec.engine.proposers.eagle3 import Eagle3State, PEagleProposer

    hg, hp = nnx.split(head)
    cfg = head.config
    state = Eagle3State(
        head_cache=kvc.advance(head.init_cache(batch, capacity), capacity // 2 - (num_draft + 1)),
        pending_feat=jnp.zeros((batch, num_draft + 1, cfg.num_aux * cfg.target_hidden_size), model.dtype),
        pending_tok=jnp.zeros((batch, num_draft + 1), jnp.int32),
        num_pending=jnp.full((batch,), num_draft + 1, jnp.int32),
    )
    return _propose_call(model, target_params, PEagleProposer(hg, num_draft=num_draft), hp, state, batch, capacity)


def _draft_model_step_call(draft: LlamaModel, batch: int, capacity: int) -> tuple:
    """(fn, args) of one draft-model forward over one token per row, its cache half full, with the plain numerics
    `DraftModelProposer` runs it with."""
    from jaxspec.engine.proposers.draft_model import DraftModelProposer

    proposer, params = DraftModelProposer.of(draft, 1)
    graphdef = proposer.draft_graphdef

    @functools.partial(jax.jit, donate_argnums=0)
    def draft_step(cache, params, tokens):
        m = nnx.merge(graphdef, params)
        out = m(tokens, cache.lengths[:, None], cache)
        return out.logits, out.cache

    return Carried(draft_step, _half_full(draft, batch, capacity), params, jnp.zeros((batch, 1), jnp.int32)), ()


def _costs(seconds: dict[int, float], draft: float, expansions: dict[TreeConfig, float],
           block_draft: bool = False) -> StepCosts:
    """StepCosts from forwards timed at some token counts T (1 among them): every T up to the largest, the ones
    between interpolated."""
    measured = sorted(seconds)
    per_t = np.interp(np.arange(1, measured[-1] + 1), measured, [seconds[t] for t in measured])  # [T = 1..]
    return StepCosts(decode=float(per_t[0]), verify=(0.0, *(float(x) for x in per_t[1:])), draft=draft,
                     tree_drafts=tuple(expansions.items()), block_draft=block_draft)


def measure_step_costs(
    model: LlamaModel, head: Eagle3Head | DFlashDrafter | LlamaModel | None, batch: int, capacity: int, max_draft: int,
    repeats: int = ROUNDS,
) -> StepCosts:
    """Step costs for chains of up to max_draft drafts: target forwards timed at `verify_lengths(max_draft)`, the
    lengths between interpolated, and one head step (a DFlash drafter: one draft of the longest chain, which every
    chain's step then costs: `StepCosts.block_draft`)."""
    seconds, draft, _ = time_forwards(model, head, batch, capacity, verify_lengths(max_draft), repeats)
    return _costs(seconds, draft, {}, block_draft=is_parallel(head))


def add_tree_costs(
    costs: StepCosts, model: LlamaModel, head: Eagle3Head, batch: int, capacity: int, trees: tuple[TreeConfig, ...],
    repeats: int = ROUNDS,
) -> StepCosts:
    """`costs` (timed for chains) with `trees` timed too: their verify lengths and expansions, in rounds with a
    decode, the new lengths scaled by the two decodes' ratio so that both timings speak of one machine speed. Why
    a second timing rather than one with everything: which trees are worth timing (`auto.config.tree_worth_timing`)
    is known only from the chains' costs, and the chains' programs need not compile twice."""
    lengths = sorted({1, *(t.total_tokens for t in trees if t.total_tokens > costs.max_draft + 1)})
    seconds, _, expansions = time_forwards(model, head, batch, capacity, lengths, repeats, trees, time_draft=False)
    scale = costs.decode / seconds[1]
    points = {t: costs.verify[t - 1] if t > 1 else costs.decode for t in range(1, costs.max_draft + 2)}
    points.update({t: scale * s for t, s in seconds.items() if t > costs.max_draft + 1})
    return _costs(points, costs.draft, {t: scale * s for t, s in expansions.items()}, costs.block_draft)
