"""DFlash as a proposer: a chain of K <= B - 1 drafts from ONE forward of a block drafter (jaxspec.models.dflash).

State between steps, per row (m = tokens committed in the target cache): the drafter's cache holds the context
keys and values of positions [0, m - p); the target features of the last p verified tokens (the root and the drafts
it accepted, 1 <= p <= K + 1) are pending. A step writes the pending context (its keys and values only: no query
runs on it), then drafts the block [root, MASK x (B - 1)] at positions m .. m + B - 1 against context [0, m), and
the verify's features of the accepted path become the next pending context (`commit`). The block's own keys and
values are never stored, so rejected drafts leave nothing to roll back (BLOCK_DRAFTERS.md §1.3; the pitfall of
tpu-inference PR #1868, stale block entries, cannot happen).

The drafts are the drafter's argmax: deterministic, so sampling verifies them with the walk that needs no draft
probabilities (lossless for a one-hot q, as vLLM's NO_DRAFT_PROBS). Logit processors are not applied to the drafts:
the verifier applies them, so they only change which drafts are accepted.

A tree (`tree`: EAGLE-2's dynamic tree, `engine.tree.draft_tree`) is grown from the same one forward: a block's
slots never see each other, so slot d's distribution is every depth-d node's, whatever its parent; the tree keeps
the `total_tokens - 1` candidates of highest cumulative log-probability over the slots' top-k, and the target
verifies them in one pass. The accepted path's features become the pending context as a chain's do.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jaxspec.errors import JaxspecError
from jaxspec.models import kv_cache as kvc
from jaxspec.models.dflash import DFlashDrafter
from jaxspec.engine.proposers.base import ChainDrafts, LongerRuns, PrefillView, Proposal, StepView, Verified
from jaxspec.engine.tree import TreeConfig, draft_tree

TELEMETRY_TOP_K = 8  # candidates per position for the rejection telemetry (`jaxspec.engine.telemetry`)


class _BlockSlots:
    """A block's slot distributions as `draft_tree` drives a head, one level at a time: the children of a frontier
    node at depth d come from slot d + 1, whatever the node (its position says its depth); nothing runs and the
    drafter's cache is untouched."""

    def __init__(self, slot_logits: jax.Array):
        self.slot_logits = slot_logits  # [B, D, V]: slot d (0-based) drafts depth d + 1

    def __call__(self, tokens, state, positions, cache, embed_table, *, block_mask, write_offset):
        del tokens, embed_table, block_mask, write_offset
        level = positions - cache.lengths[:, None] + 1  # [B, k]: the frontier's depth, whose children come next
        logits = jnp.take_along_axis(self.slot_logits, level[:, :, None], axis=1)  # [B, k, V]
        return logits, state, cache

    @staticmethod
    def to_target_ids(ids: jax.Array) -> jax.Array:
        return ids


class DFlashState(NamedTuple):
    cache: kvc.KVCache  # the context's keys and values, every drafter layer; lengths = context committed
    # [B, W, n_aux * Ht] target features of the tokens verified last, not yet context (W: the proposer's
    # pending_width, K + 1 unless runs are longer)
    pending_feat: jax.Array
    num_pending: jax.Array  # [B] in 0..W (0 after the prefill, whose context is written whole)


@dataclasses.dataclass(frozen=True)
class DFlashProposer(LongerRuns, ChainDrafts):
    """Static half of the DFlash proposer (the drafter's graphdef, K or a tree); its parameters are passed beside it.
    A chain of K drafts: the verify block and the pending context are K + 1 slots past the committed length. A
    tree of depth K (num_draft = its depth): its nodes are verified, the accepted path's K + 1 at most pending."""

    drafter_graphdef: nnx.GraphDef
    num_draft: int  # a chain's K (a tree's depth when `tree` is set)
    block_size: int
    mask_token_id: int
    tree: TreeConfig | None = None
    name: str = "dflash"
    needs_aux: bool = True
    needs_hidden: bool = False
    forwards_per_step: int = 1  # one drafter forward drafts the whole block (a tree's too)
    accept_depth: int = 0  # `LongerRuns`

    def __post_init__(self):
        what = f"--tree {self.tree.spec}: DEPTH" if self.tree is not None else "--num-speculative-tokens"
        if not 1 <= self.num_draft <= self.block_size - 1:
            raise JaxspecError(f"{what} {self.num_draft}: a DFlash drafter with block size {self.block_size} drafts "
                               f"1..{self.block_size - 1} tokens per step")
        if self.tree is not None and self.tree.depth != self.num_draft:
            raise ValueError(f"a tree of depth {self.tree.depth} drafts num_draft={self.tree.depth}")

    @property
    def verify_width(self) -> int:
        return self.tree.total_tokens if self.tree is not None else self.num_draft + 1

    def extra_capacity(self) -> int:
        """The verify block in the target's cache (a tree's nodes), the pending context in the drafter's."""
        return max(self.verify_width, self.pending_width)

    @classmethod
    def of(cls, drafter: DFlashDrafter, num_draft: int | None = None,
           tree: TreeConfig | None = None) -> tuple[DFlashProposer, nnx.State]:
        """(the proposer, its parameters) for a drafter drafting chains of `num_draft` (None: the whole block's
        B - 1 drafts) or `tree` (num_draft is then its depth)."""
        cfg = drafter.config
        graphdef, params = nnx.split(drafter)
        k = tree.depth if tree is not None else cfg.max_drafts if num_draft is None else num_draft
        return cls(graphdef, k, cfg.block_size, cfg.mask_token_id, tree), params

    def init(self, params, target, view: PrefillView, capacity: int) -> DFlashState:
        drafter = nnx.merge(self.drafter_graphdef, params)
        b, t = view.prompt.shape
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        cache = drafter.write_context(view.aux, positions, kvc.constrain(drafter.init_cache(b, capacity)))
        width = self.pending_width
        return DFlashState(
            cache=kvc.advance(cache, view.prompt_lens),  # the prompt is context; its last token's root comes next
            pending_feat=jnp.zeros((b, width, view.aux.shape[-1]), view.aux.dtype),
            num_pending=jnp.zeros((b,), jnp.int32),
        )

    def propose(self, params, target, st: DFlashState, view: StepView, keys) -> tuple[Proposal, DFlashState]:
        drafter = nnx.merge(self.drafter_graphdef, params)
        b, width = st.pending_feat.shape[:2]
        positions = st.cache.lengths[:, None] + jnp.arange(width, dtype=jnp.int32)  # [B, W]
        cache = drafter.write_context(st.pending_feat, positions, st.cache)
        cache = kvc.advance(cache, st.num_pending * view.running)  # context [0, m): m = view.committed
        block = jnp.full((b, self.block_size), self.mask_token_id, jnp.int32).at[:, 0].set(view.last_token)
        block_positions = cache.lengths[:, None] + jnp.arange(self.block_size, dtype=jnp.int32)  # [B, B_s]
        states = drafter(target.embed(block), block_positions, cache)  # [B, B_s, H]
        logits = target.vocab_logits(states[:, 1 : self.num_draft + 1], drafting=True)  # [B, K, V] slot k: m + k
        if self.tree is not None:
            dt = draft_tree(_BlockSlots(logits), None, logits[:, 0], jnp.zeros((b, 1), jnp.float32), cache, self.tree)
            return Proposal(dt.tokens, dt, None, dt.candidates), st._replace(cache=cache)
        best = jax.lax.top_k(logits, min(TELEMETRY_TOP_K, logits.shape[-1]))[1].astype(jnp.int32)  # [B, K, C]
        drafts = best[..., 0]  # [B, K] the argmax (top_k breaks ties toward the lower index, as argmax does)
        tokens = jnp.concatenate([jnp.zeros((b, 1), jnp.int32), drafts], axis=1)  # [B, K+1], root set by the engine
        # node j's candidates are those of the slot that drafted node j + 1; the last node has none
        candidates = jnp.concatenate([best, jnp.full_like(best[:, :1], -1)], axis=1)  # [B, K+1, C]
        return Proposal(tokens, None, None, candidates), st._replace(cache=cache)

    def commit(self, params, st: DFlashState, verified: Verified) -> DFlashState:
        """The accepted path's features (the root and the accepted drafts) become the pending context."""
        keep = verified.running > 0
        return st._replace(
            pending_feat=jnp.where(keep[:, None, None], verified.aux, st.pending_feat),
            num_pending=jnp.where(keep, verified.num_accepted + 1, st.num_pending),
        )

    def kv_cache(self, st: DFlashState) -> kvc.KVCache:
        return st.cache
