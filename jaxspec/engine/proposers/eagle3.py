"""EAGLE-3 as a proposer: chains of K drafts, or EAGLE-2 dynamic trees, from a head reading the target's features.

State between steps, per row (m = tokens committed in the target cache): the head has consumed the pairs
(g_t, x_{t+1}) for t < h; pairs h .. m-1 are pending (1 ≤ m - h ≤ pending_width: depth + 1, or more beside prompt
lookup's longer chains): `pending_feat` holds their target features g_t, `pending_tok` their next tokens x_{t+1}. A
step's proposal: the head catches up on the pending pairs in one forward and proposes draft 1; K - 1 more head
steps propose drafts 2..K (or `tree.draft_tree` expands a tree). The verify's features of the accepted path become
the next pending pairs (`commit`), so no extra target call is needed. Draft entries in the head cache are rolled
back by resetting its length: the next catch-up overwrites them.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jaxspec import processors as procs
from jaxspec.models import kv_cache as kvc
from jaxspec.sampling import RowSampling, draw_draft, split_rows
from jaxspec.engine.proposers.base import LongerRuns, PrefillView, Proposal, StepView, Verified
from jaxspec.engine.tree import TreeConfig, draft_tree

TELEMETRY_TOP_K = 8  # a chain's candidates per position for the rejection telemetry (a tree uses its own TOPK)


class Eagle3State(NamedTuple):
    head_cache: kvc.KVCache
    pending_feat: jax.Array  # [B, W, n_aux * Ht], W = the proposer's pending_width (D + 1 unless runs are longer)
    pending_tok: jax.Array  # [B, W]
    num_pending: jax.Array  # [B] in 1..W


def _embed_table(target, head):
    """The target's embedding table when the head shares it (heads without their own embeddings)."""
    return None if head.embed_tokens is not None else target.embed_tokens[...]


def draft_processor(head, processors: procs.ProcessorState | None):
    """The logit processors on the head's draft vocabulary: process(logits [B, N, V_d], path [B, N, D]) with the
    committed counts plus each position's path, as the target will apply them (drafts only change speed, but a
    draft the processed target would not pick is a wasted one)."""
    if processors is None:
        return None
    columns = head.to_target_ids(jnp.arange(head.config.draft_vocab_size, dtype=jnp.int32))
    return lambda logits, path: procs.process(logits, processors, path, columns)


def draft_vocab(head, vocab: int) -> jax.Array:
    """[V] bool: the target tokens the head can draft (all of them unless its draft vocabulary is reduced)."""
    ids = head.to_target_ids(jnp.arange(head.config.draft_vocab_size, dtype=jnp.int32))
    return jnp.zeros((vocab,), jnp.bool_).at[ids].set(True)


def _propose_one(head, logits, sampling: RowSampling | None, keys, vocab: int, processors, path):
    """Draft token (target id) from draft logits [B, V_d] (processed with the drafts so far, path [B, D]), the
    head's best TELEMETRY_TOP_K tokens there [B, C] (target ids), and the draft's distribution over the target
    vocab when sampling."""
    process = draft_processor(head, processors)
    if process is not None:
        logits = process(logits[:, None], path[:, None])[:, 0]
    top = jax.lax.top_k(logits, min(TELEMETRY_TOP_K, logits.shape[-1]))[1]  # [B, C] draft-vocabulary columns
    best = head.to_target_ids(top)
    if sampling is None:
        return best[:, 0], best, None
    draft, q_draft = draw_draft(logits, top[:, 0], sampling, keys, procs.min_p_of(processors))
    ids = head.to_target_ids(jnp.arange(logits.shape[-1], dtype=jnp.int32))
    q = jnp.zeros((logits.shape[0], vocab), jnp.float32).at[:, ids].set(q_draft)
    return head.to_target_ids(draft), best, q


def _catch_up(head, st: Eagle3State, embed):
    """The head consumes the pending pairs in one forward: (logits after the last one [B, V_d], its state [B, H],
    the head cache committed through them, the committed length before)."""
    h0 = st.head_cache.lengths
    width = st.pending_tok.shape[1]
    positions = h0[:, None] + jnp.arange(width, dtype=jnp.int32)
    last = (st.num_pending - 1)[:, None]
    logits, out, head_cache = head(
        st.pending_tok, head.project(st.pending_feat), positions, st.head_cache, embed, logit_indices=last
    )
    state = jnp.take_along_axis(out, last[:, :, None], axis=1)[:, 0]  # [B, H]
    return logits[:, 0], state, kvc.advance(head_cache, st.num_pending), h0


@dataclasses.dataclass(frozen=True)
class Eagle3Proposer(LongerRuns):
    """Static half of the EAGLE-3 proposer (the head's graphdef and the draft shape); its parameters are passed
    beside it. `num_draft` K for chains; with `tree`, its depth. `accept_depth`: see `LongerRuns`."""

    head_graphdef: nnx.GraphDef
    num_draft: int = 5
    tree: TreeConfig | None = None
    name: str = "eagle3"
    needs_aux: bool = True
    needs_hidden: bool = False
    accept_depth: int = 0

    @property
    def depth(self) -> int:
        return self.tree.depth if self.tree is not None else self.num_draft

    @property
    def forwards_per_step(self) -> int:
        """Head forwards per step: the catch-up, then K - 1 chain steps (or depth - 1 tree levels)."""
        return self.depth

    @property
    def verify_width(self) -> int:
        return self.tree.total_tokens if self.tree is not None else self.num_draft + 1

    def extra_capacity(self) -> int:
        """The verify block (the pending pairs' catch-up), and the head's tree levels above its committed length."""
        if self.tree is None:
            return self.pending_width
        return max(self.tree.cache_slots, self.pending_width)

    def init(self, params, target, view: PrefillView, capacity: int) -> Eagle3State:
        head = nnx.merge(self.head_graphdef, params)
        b, t = view.prompt.shape
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        last = jnp.maximum(view.prompt_lens - 1, 0)
        # The head consumes pairs (g_t, x_{t+1}) for t < n - 1; the pair (g_{n-1}, x_n) is left pending.
        next_tokens = jnp.concatenate([view.prompt[:, 1:], jnp.zeros((b, 1), view.prompt.dtype)], axis=1)
        _, _, head_cache = head(
            next_tokens, head.project(view.aux), positions, kvc.constrain(head.init_cache(b, capacity)),
            _embed_table(target, head), logit_indices=jnp.zeros((b, 1), jnp.int32), empty_cache=True,
        )
        g_last = jnp.take_along_axis(view.aux, last[:, None, None], axis=1)  # [B, 1, F]
        width = self.pending_width
        return Eagle3State(
            head_cache=kvc.advance(head_cache, last),
            pending_feat=jnp.zeros((b, width, view.aux.shape[-1]), view.aux.dtype).at[:, :1].set(g_last),
            pending_tok=jnp.zeros((b, width), jnp.int32).at[:, 0].set(view.first_token),
            num_pending=jnp.ones((b,), jnp.int32),
        )

    def propose(
        self, params, target, st: Eagle3State, view: StepView, keys: jax.Array
    ) -> tuple[Proposal, Eagle3State]:
        head = nnx.merge(self.head_graphdef, params)
        embed = _embed_table(target, head)
        logits0, state, head_cache, h0 = _catch_up(head, st, embed)
        if self.tree is not None:
            dt = draft_tree(head, embed, logits0, state, head_cache, self.tree, draft_processor(head, view.processors))
            proposal = Proposal(dt.tokens, dt, None, dt.candidates)
        else:
            proposal, head_cache = self._chain(head, target, embed, logits0, state, head_cache, view, keys)
        proposal = proposal._replace(draft_vocab=draft_vocab(head, target.config.vocab_size))
        # Drop the draft entries (chain steps, tree levels): the next catch-up overwrites them.
        head_cache = head_cache._replace(lengths=h0 + st.num_pending * view.running)
        return proposal, st._replace(head_cache=head_cache)

    def keep_up(self, params, target, st: Eagle3State, view: StepView) -> Eagle3State:
        """A step that drafts nothing: the catch-up on the pending pairs alone (one head forward, no drafts)."""
        head = nnx.merge(self.head_graphdef, params)
        _, _, head_cache, h0 = _catch_up(head, st, _embed_table(target, head))
        return st._replace(head_cache=head_cache._replace(lengths=h0 + st.num_pending * view.running))

    def _chain(self, head, target, embed, logits0, state, head_cache, view: StepView, keys):
        b, k = logits0.shape[0], self.num_draft
        vocab, sampling = target.config.vocab_size, view.sampling
        keys = split_rows(keys, k)  # [K, B]
        path = jnp.full((b, k), -1, jnp.int32)  # drafts so far, for the logit processors
        draft, best, q = _propose_one(head, logits0, sampling, keys[0], vocab, view.processors, path)

        def draft_step(carry, step):  # drafts 2..K: the head feeds its own state back
            head_cache, state, token, path = carry
            j, step_key = step
            path = path.at[:, j].set(token)
            logits, out, head_cache = head(
                token[:, None], state[:, None], head_cache.lengths[:, None], head_cache, embed
            )
            nxt, best, q = _propose_one(head, logits[:, 0], sampling, step_key, vocab, view.processors, path)
            return (kvc.advance(head_cache, 1), out[:, 0], nxt, path), (nxt, best, q)

        (head_cache, _, _, _), (more, more_best, more_q) = jax.lax.scan(
            draft_step, (head_cache, state, draft, path), (jnp.arange(k - 1), keys[1:])
        )
        drafts = jnp.concatenate([draft[:, None], jnp.moveaxis(more, 0, 1)], axis=1)  # [B, K]
        tokens = jnp.concatenate([jnp.zeros((b, 1), jnp.int32), drafts], axis=1)  # [B, K+1], root set by the engine
        qs = None if q is None else jnp.concatenate([q[:, None], jnp.moveaxis(more_q, 0, 1)], axis=1)  # [B, K, V]
        # node j's candidates are those of the distribution that drafted node j + 1; the last node has none
        cands = jnp.concatenate([best[:, None], jnp.moveaxis(more_best, 0, 1), jnp.full_like(best[:, None], -1)], axis=1)
        return Proposal(tokens, None, qs, cands), head_cache

    def commit(self, params, st: Eagle3State, verified: Verified) -> Eagle3State:
        """The accepted path's features and next tokens become the pending pairs."""
        keep = verified.running[:, None] > 0
        return st._replace(
            pending_feat=jnp.where(keep[:, :, None], verified.aux, st.pending_feat),
            pending_tok=jnp.where(keep, verified.emitted, st.pending_tok),
            num_pending=jnp.where(verified.running > 0, verified.num_accepted + 1, st.num_pending),
        )

    def kv_cache(self, st: Eagle3State) -> kvc.KVCache:
        return st.head_cache


@dataclasses.dataclass(frozen=True)
class PEagleProposer(Eagle3Proposer):
    """P-EAGLE (parallel drafting, BLOCK_DRAFTERS.md §3.2; vLLM's `parallel_drafting`): a chain of K drafts from ONE
    forward of the head. Each row's pending pairs are followed by K - 1 slots holding the head's mask token with
    the state fc(mask_hidden), at the next positions; the last pending pair's logits draft d_1 and slot j's draft
    d_{j+1}, no draft feeding the next. The state, catch-up and commit are EAGLE-3's: the slots' keys and values
    land past the committed length and are overwritten by the next catch-up. Trees draft step by step
    (`Eagle3Proposer`), which a P-EAGLE head can do as well."""

    name: str = "peagle"

    def __post_init__(self):
        if self.tree is not None:
            raise ValueError("PEagleProposer drafts chains; a tree drafts step by step (Eagle3Proposer)")

    @property
    def forwards_per_step(self) -> int:
        return 1

    def propose(
        self, params, target, st: Eagle3State, view: StepView, keys: jax.Array
    ) -> tuple[Proposal, Eagle3State]:
        head = nnx.merge(self.head_graphdef, params)
        embed = _embed_table(target, head)
        b, width = st.pending_tok.shape
        k, vocab = self.num_draft, target.config.vocab_size
        total = width + k - 1
        slot = jnp.arange(total, dtype=jnp.int32)[None, :]  # [1, W + K - 1]
        pending = slot < st.num_pending[:, None]  # [B, W + K - 1]: the pending pairs, then the mask slots
        pad = ((0, 0), (0, k - 1))
        tokens = jnp.where(pending, jnp.pad(st.pending_tok, pad), head.config.mask_token_id)
        state = jnp.where(pending[..., None], jnp.pad(head.project(st.pending_feat), (*pad, (0, 0))),
                          head.project(head.mask_hidden[...])[None])  # [B, W + K - 1, H]
        h0 = st.head_cache.lengths
        positions = h0[:, None] + slot
        at = (st.num_pending - 1)[:, None] + jnp.arange(k, dtype=jnp.int32)[None, :]  # [B, K]: d_1 .. d_K's logits
        logits, _, head_cache = head(tokens, state, positions, st.head_cache, embed, logit_indices=at)
        keys = split_rows(keys, k)  # [K, B]
        path = jnp.full((b, k), -1, jnp.int32)  # drafts so far, for the logit processors
        drafts, bests, qs = [], [], []
        for j in range(k):  # each position's draft from its own logits (the processors see the drafts before it)
            draft, best, q = _propose_one(head, logits[:, j], view.sampling, keys[j], vocab, view.processors, path)
            path = path.at[:, j].set(draft)
            drafts.append(draft)
            bests.append(best)
            qs.append(q)
        tokens = jnp.concatenate([jnp.zeros((b, 1), jnp.int32), jnp.stack(drafts, axis=1)], axis=1)  # [B, K+1]
        q = None if qs[0] is None else jnp.stack(qs, axis=1)  # [B, K, V]
        cands = jnp.concatenate([jnp.stack(bests, axis=1), jnp.full_like(bests[0][:, None], -1)], axis=1)
        proposal = Proposal(tokens, None, q, cands, draft_vocab=draft_vocab(head, vocab))
        # Only the pending pairs are committed; the mask slots' entries are overwritten by the next catch-up.
        head_cache = head_cache._replace(lengths=h0 + st.num_pending * view.running)
        return proposal, st._replace(head_cache=head_cache)
