"""An independent small draft model as the proposer: the original speculative sampling (Leviathan et al.; Chen et
al.), what transformers calls `assistant_model` and vLLM `draft_model` (e.g. Llama-3.2-1B drafting for
Llama-3.1-8B, Qwen3-0.6B for Qwen3-32B).

The draft is any supported target architecture sharing the target's tokenizer. It keeps its own KV cache in the
engine's fixed shapes. State between steps, per row (m = tokens committed in the target cache): the draft's cache
holds positions [0, m - p + 1) committed; the p tokens verified last (the accepted drafts and the target's own
token, which is this step's root at position m) are pending. A step feeds the pending tokens in one forward (the
catch-up, as EAGLE-3's head catches up on its pending pairs), whose last logits draft d_1, then K - 1 one-token
forwards draft d_2..d_K. Those drafts' keys and values are written past the committed length and never committed:
the next catch-up writes the tokens the target accepted over them, so a rejection leaves nothing to roll back.

A tree (`tree`: EAGLE-2's dynamic tree, `engine.tree.draft_tree`) is grown from the catch-up's distribution the
way a head grows one: each level runs the draft model once on the frontier's top_k nodes, each seeing the
committed cache and its own ancestors among the levels written above it (a window mask), and the best
`total_tokens - 1` candidates by cumulative log-probability are verified; sampling then verifies with the walk
that needs no draft probabilities.

Greedy drafts are the draft's argmax (verified by the walk that needs no draft probabilities); sampled drafts come
from the draft's own distribution at the run's temperature, top-k and top-p, which is passed as q, so the
rejection rule keeps the target's distribution exactly. The draft runs with plain XLA numerics: drafts only change
speed, never output. A vocabulary that differs from the target's only by padding rows is handled: logits past the
target's vocabulary are dropped, a shorter one's missing ids are never drafted.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jaxspec import processors as procs
from jaxspec.config import TreeConfig
from jaxspec.errors import JaxspecError
from jaxspec.models import kv_cache as kvc
from jaxspec.models.llama import LlamaModel
from jaxspec.sampling import RowSampling, draw_draft, split_rows
from jaxspec.engine.proposers.base import ChainDrafts, LongerRuns, PrefillView, Proposal, StepView, Verified
from jaxspec.engine.tree import draft_tree

TELEMETRY_TOP_K = 8  # candidates per position for the rejection telemetry (`jaxspec.engine.telemetry`)


class DraftModelState(NamedTuple):
    cache: kvc.KVCache  # the draft's own keys and values; lengths = positions committed
    # [B, W] tokens emitted last (the accepted drafts, then the target's own; the first token after the prefill),
    # not yet in the cache (W: the proposer's pending_width, K + 1 unless runs are longer)
    pending_tok: jax.Array
    num_pending: jax.Array  # [B] in 1..W


def check_draft_model_fits(draft: LlamaModel, target: LlamaModel) -> None:
    """A draft model must share the target's tokenizer: its vocabulary may differ only by padding rows (the
    tokenizer check itself is the CLI's, which has both tokenizers), and it must reach the target's context."""
    if draft.config.context_length < target.config.context_length:
        raise JaxspecError(f"the draft model's context ({draft.config.context_length} tokens) is shorter than the "
                           f"target's ({target.config.context_length}); pick a draft model that reaches it")


def _to_target_vocab(logits: jax.Array, vocab: int) -> jax.Array:
    """Draft logits [..., V_d] over the target's vocabulary [..., V]: padding rows past V dropped, ids the draft
    lacks (V_d < V) never drafted."""
    v_d = logits.shape[-1]
    if v_d >= vocab:
        return logits[..., :vocab]
    pad = jnp.full((*logits.shape[:-1], vocab - v_d), -jnp.inf, logits.dtype)
    return jnp.concatenate([logits, pad], axis=-1)


def _draft_one(logits: jax.Array, sampling: RowSampling | None, keys: jax.Array):
    """(draft [B], the best TELEMETRY_TOP_K tokens [B, C], q [B, V] or None) from logits [B, V] (target ids)."""
    best = jax.lax.top_k(logits, min(TELEMETRY_TOP_K, logits.shape[-1]))[1].astype(jnp.int32)
    if sampling is None:
        return best[:, 0], best, None
    draft, q = draw_draft(logits, best[:, 0], sampling, keys)
    return draft, best, q


class _TreeLevels:
    """The draft model as `draft_tree` drives a head: one forward per level over the frontier (tokens [B, k] at
    their positions, a window mask over the levels above the committed length), logits over the target's
    vocabulary. A draft model has no recurrent state: the head's `state` is passed through untouched."""

    def __init__(self, draft: LlamaModel, vocab: int):
        self.draft, self.vocab = draft, vocab

    def __call__(self, tokens, state, positions, cache, embed_table, *, block_mask, write_offset):
        del embed_table  # the draft embeds with its own table
        out = self.draft(jnp.minimum(tokens, self.draft.config.vocab_size - 1), positions, cache,
                         block_mask=block_mask, write_offset=write_offset)
        return _to_target_vocab(out.logits, self.vocab), state, out.cache

    @staticmethod
    def to_target_ids(ids: jax.Array) -> jax.Array:
        return ids  # the logits are over the target's vocabulary already


@dataclasses.dataclass(frozen=True)
class DraftModelProposer(LongerRuns, ChainDrafts):
    """Static half of the draft-model proposer (the draft's graphdef, K or a tree); its parameters are passed
    beside it."""

    draft_graphdef: nnx.GraphDef
    num_draft: int  # a chain's K (a tree's depth when `tree` is set)
    tree: TreeConfig | None = None
    name: str = "draft-model"
    needs_aux: bool = False
    needs_hidden: bool = False
    accept_depth: int = 0  # `LongerRuns`

    def __post_init__(self):
        if self.num_draft < 1:
            raise JaxspecError(f"a draft model drafts at least 1 token per step, got {self.num_draft}")
        if self.tree is not None and self.tree.depth != self.num_draft:
            raise ValueError(f"a tree of depth {self.tree.depth} drafts num_draft={self.tree.depth}")

    @property
    def forwards_per_step(self) -> int:
        """The catch-up forward (which drafts d_1, or the tree's first level), then K - 1 one-token forwards (a
        tree: one forward per further level)."""
        return self.num_draft

    @property
    def verify_width(self) -> int:
        return self.tree.total_tokens if self.tree is not None else self.num_draft + 1

    def extra_capacity(self) -> int:
        """The verify block (the pending tokens' catch-up), and the tree's levels above the draft's committed
        length."""
        return max(self.tree.cache_slots, self.pending_width) if self.tree is not None else self.pending_width

    @classmethod
    def of(cls, draft: LlamaModel, num_draft: int, tree: TreeConfig | None = None,
           ) -> tuple[DraftModelProposer, nnx.State]:
        """(the proposer, its parameters) for a draft model drafting chains of `num_draft` or `tree` (num_draft is
        then its depth); it computes with plain numerics (a copy is changed)."""
        draft = nnx.clone(draft)
        draft.numerics = None
        graphdef, params = nnx.split(draft)
        return cls(graphdef, tree.depth if tree is not None else num_draft, tree), params

    def init(self, params, target, view: PrefillView, capacity: int) -> DraftModelState:
        draft = nnx.merge(self.draft_graphdef, params)
        b, t = view.prompt.shape
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        tokens = jnp.minimum(view.prompt, draft.config.vocab_size - 1)
        out = draft(tokens, positions, kvc.constrain(draft.init_cache(b, capacity)),
                    logit_indices=jnp.zeros((b, 1), jnp.int32), empty_cache=True)  # logits unused
        width = self.pending_width
        return DraftModelState(
            cache=kvc.advance(out.cache, view.prompt_lens),  # the prompt; the first token (the root) is pending
            pending_tok=jnp.zeros((b, width), jnp.int32).at[:, 0].set(view.first_token),
            num_pending=jnp.ones((b,), jnp.int32),
        )

    def propose(
        self, params, target, st: DraftModelState, view: StepView, keys: jax.Array
    ) -> tuple[Proposal, DraftModelState]:
        draft = nnx.merge(self.draft_graphdef, params)
        b, k = st.pending_tok.shape[0], self.num_draft
        vocab, v_d = target.config.vocab_size, draft.config.vocab_size
        keys = split_rows(keys, k)  # [K, B]
        out, cache = _catch_up(draft, st, view)
        if self.tree is not None:  # the levels' entries are written above the committed length and dropped
            process = None if view.processors is None else (
                lambda logits, path: procs.process(logits, view.processors, path))
            dt = draft_tree(_TreeLevels(draft, vocab), None, _to_target_vocab(out.logits[:, 0], vocab),
                            jnp.zeros((b, 1), jnp.float32), cache, self.tree, process)
            return Proposal(dt.tokens, dt, None, dt.candidates), st._replace(cache=cache)
        first, best, q = _draft_one(_to_target_vocab(out.logits[:, 0], vocab), view.sampling, keys[0])

        def draft_step(carry, step_key):  # d_2..d_K: written past the committed length, never committed
            c, token = carry
            o = draft(jnp.minimum(token, v_d - 1)[:, None], c.lengths[:, None], c)
            nxt, best, q = _draft_one(_to_target_vocab(o.logits[:, 0], vocab), view.sampling, step_key)
            return (kvc.advance(o.cache, 1), nxt), (nxt, best, q)

        (drafted, _), (more, more_best, more_q) = jax.lax.scan(draft_step, (cache, first), keys[1:])
        cache = drafted._replace(lengths=cache.lengths)  # the drafts' entries stay uncommitted
        drafts = jnp.concatenate([first[:, None], jnp.moveaxis(more, 0, 1)], axis=1)  # [B, K]
        tokens = jnp.concatenate([jnp.zeros((b, 1), jnp.int32), drafts], axis=1)  # [B, K+1], root set by the engine
        qs = None if q is None else jnp.concatenate([q[:, None], jnp.moveaxis(more_q, 0, 1)], axis=1)  # [B, K, V]
        # node j's candidates are those of the distribution that drafted node j + 1; the last node has none
        cands = jnp.concatenate([best[:, None], jnp.moveaxis(more_best, 0, 1), jnp.full_like(best[:, None], -1)],
                                axis=1)
        return Proposal(tokens, None, qs, cands), st._replace(cache=cache)

    def keep_up(self, params, target, st: DraftModelState, view: StepView) -> DraftModelState:
        """A step that drafts nothing: the catch-up forward on the pending tokens alone."""
        return st._replace(cache=_catch_up(nnx.merge(self.draft_graphdef, params), st, view)[1])

    def commit(self, params, st: DraftModelState, verified: Verified) -> DraftModelState:
        """The accepted drafts and the target's own token become the pending tokens."""
        keep = verified.running > 0
        return st._replace(
            pending_tok=jnp.where(keep[:, None], verified.emitted, st.pending_tok),
            num_pending=jnp.where(keep, verified.num_accepted + 1, st.num_pending),
        )

    def kv_cache(self, st: DraftModelState) -> kvc.KVCache:
        return st.cache


def _catch_up(draft, st: DraftModelState, view: StepView):
    """The pending tokens through the draft at its committed length: (its output, whose logits at the last pending
    token draft d_1; the cache with them committed for running rows, the root included)."""
    width = st.pending_tok.shape[1]
    positions = st.cache.lengths[:, None] + jnp.arange(width, dtype=jnp.int32)  # [B, W]
    last = (st.num_pending - 1)[:, None]
    out = draft(jnp.minimum(st.pending_tok, draft.config.vocab_size - 1), positions, st.cache, logit_indices=last)
    return out, kvc.advance(out.cache, jnp.where(view.running > 0, st.num_pending, 0))

