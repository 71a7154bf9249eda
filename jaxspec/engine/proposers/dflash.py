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
from jaxspec.engine.proposers.base import ChainDrafts, PrefillView, Proposal, StepView, Verified

TELEMETRY_TOP_K = 8  # candidates per position for the rejection telemetry (`jaxspec.engine.telemetry`)


class DFlashState(NamedTuple):
    cache: kvc.KVCache  # the context's keys and values, every drafter layer; lengths = context committed
    pending_feat: jax.Array  # [B, K+1, n_aux * Ht] target features of the tokens verified last, not yet context
    num_pending: jax.Array  # [B] in 0..K+1 (0 after the prefill, whose context is written whole)


@dataclasses.dataclass(frozen=True)
class DFlashProposer(ChainDrafts):
    """Static half of the DFlash proposer (the drafter's graphdef and K); its parameters are passed beside it. A
    chain of K drafts: the verify block and the pending context are K + 1 slots past the committed length."""

    drafter_graphdef: nnx.GraphDef
    num_draft: int
    block_size: int
    mask_token_id: int
    name: str = "dflash"
    needs_aux: bool = True
    needs_hidden: bool = False
    forwards_per_step: int = 1  # one drafter forward drafts the whole block

    def __post_init__(self):
        if not 1 <= self.num_draft <= self.block_size - 1:
            raise JaxspecError(f"--num-speculative-tokens {self.num_draft}: a DFlash drafter with block size "
                               f"{self.block_size} drafts 1..{self.block_size - 1} tokens per step")

    @classmethod
    def of(cls, drafter: DFlashDrafter, num_draft: int | None = None) -> tuple[DFlashProposer, nnx.State]:
        """(the proposer, its parameters) for a drafter; num_draft None: the whole block's B - 1 drafts."""
        cfg = drafter.config
        graphdef, params = nnx.split(drafter)
        k = cfg.max_drafts if num_draft is None else num_draft
        return cls(graphdef, k, cfg.block_size, cfg.mask_token_id), params

    def init(self, params, target, view: PrefillView, capacity: int) -> DFlashState:
        drafter = nnx.merge(self.drafter_graphdef, params)
        b, t = view.prompt.shape
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        cache = drafter.write_context(view.aux, positions, kvc.constrain(drafter.init_cache(b, capacity)))
        width = self.num_draft + 1
        return DFlashState(
            cache=kvc.advance(cache, view.prompt_lens),  # the prompt is context; its last token's root comes next
            pending_feat=jnp.zeros((b, width, view.aux.shape[-1]), view.aux.dtype),
            num_pending=jnp.zeros((b,), jnp.int32),
        )

    def propose(self, params, target, st: DFlashState, view: StepView, keys) -> tuple[Proposal, DFlashState]:
        drafter = nnx.merge(self.drafter_graphdef, params)
        b, width = st.pending_feat.shape[:2]
        positions = st.cache.lengths[:, None] + jnp.arange(width, dtype=jnp.int32)  # [B, K+1]
        cache = drafter.write_context(st.pending_feat, positions, st.cache)
        cache = kvc.advance(cache, st.num_pending * view.running)  # context [0, m): m = view.committed
        block = jnp.full((b, self.block_size), self.mask_token_id, jnp.int32).at[:, 0].set(view.last_token)
        block_positions = cache.lengths[:, None] + jnp.arange(self.block_size, dtype=jnp.int32)  # [B, B_s]
        states = drafter(target.embed(block), block_positions, cache)  # [B, B_s, H]
        logits = target.vocab_logits(states[:, 1 : self.num_draft + 1])  # [B, K, V] slot k drafts position m + k
        drafts = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [B, K]
        tokens = jnp.concatenate([jnp.zeros((b, 1), jnp.int32), drafts], axis=1)  # [B, K+1], root set by the engine
        best = jax.lax.top_k(logits, min(TELEMETRY_TOP_K, logits.shape[-1]))[1].astype(jnp.int32)  # [B, K, C]
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
