"""Gemma 4's assistant as a proposer: a chain of K drafts, each one forward of the assistant (models/
gemma4_assistant.py) reading the target's own keys and values through the engine's view of the target cache
(`StepView.target_cache`): no cache of its own, nothing to roll back.

The state is one vector per row: the target's final hidden state (before its norm) at the node whose logits gave
the root, i.e. the last prompt position after the prefill, then the last accepted node of each verify (`commit`).
A step starts from concat(target.embed(root), target.norm(state)) at the root's position m (the committed length)
and feeds each draft back with the assistant's projected state, as transformers' Gemma4AssistantCandidateGenerator
does; every step keeps position m and attends to the target's committed keys [0, m) (the root is not in the target
cache yet: its embedding is the input). transformers hands the assistant the keys its verify forward returned
instead, which after a rejection include the rejected drafts' (at the root's position and, for sliding layers whose
cache is a window, past it); here only committed keys are read. Drafts differ there, the output never does.

Drafts are the assistant's argmax: deterministic, so sampling verifies them with the walk that needs no draft
probabilities (lossless for a one-hot q, as for DFlash)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from jaxspec.engine.proposers.base import ChainDrafts, PrefillView, Proposal, StepView, Verified
from jaxspec.errors import JaxspecError
from jaxspec.models.gemma4_assistant import Gemma4Assistant, target_cache_layers

TELEMETRY_TOP_K = 8  # candidates per position for the rejection telemetry (`jaxspec.engine.telemetry`)


@dataclasses.dataclass(frozen=True)
class AssistantProposer(ChainDrafts):
    """Static half (the assistant's graphdef, K, which target cache entries it reads); parameters beside it."""

    graphdef: nnx.GraphDef
    num_draft: int
    cache_index: tuple[tuple[str, int], ...]  # layer type → the target cache entry it reads (target_cache_layers)
    name: str = "gemma4-assistant"
    needs_aux: bool = False
    needs_hidden: bool = True
    needs_target_cache: bool = True

    def __post_init__(self):
        if self.num_draft < 1:
            raise JaxspecError(f"a Gemma 4 assistant drafts at least one token per step, got {self.num_draft}")

    @property
    def forwards_per_step(self) -> int:
        return self.num_draft

    @classmethod
    def of(cls, assistant: Gemma4Assistant, target_config, num_draft: int) -> tuple[AssistantProposer, nnx.State]:
        graphdef, params = nnx.split(assistant)
        return cls(graphdef, num_draft, tuple(target_cache_layers(target_config).items())), params

    def accepting(self, depth: int) -> AssistantProposer:
        """Itself: its commit reads the last accepted node's state from a run of any length (`LongerRuns`)."""
        del depth
        return self

    def init(self, params, target, view: PrefillView, capacity: int) -> jax.Array:
        return view.hidden[:, -1]  # [B, Hb] the state that gave the first token

    def propose(self, params, target, state: jax.Array, view: StepView, keys) -> tuple[Proposal, jax.Array]:
        if view.target_cache is None:
            raise ValueError("the Gemma 4 assistant reads the target cache: the engine must pass StepView.target_cache")
        assistant = nnx.merge(self.graphdef, params)
        cache = view.target_cache
        cache_k = {kind: cache.k[n] for kind, n in self.cache_index}
        cache_v = {kind: cache.v[n] for kind, n in self.cache_index}
        b = view.last_token.shape[0]
        positions = view.committed[:, None]  # [B, 1] the root's position, for every draft
        token = view.last_token  # [B]
        hidden = target.norm(state[:, None].astype(target.dtype))  # [B, 1, Hb] transformers' hidden_states[-1]
        drafts, best = [], []
        for _ in range(self.num_draft):
            inputs = jnp.concatenate([target.embed(token[:, None]), hidden.astype(target.dtype)], axis=-1)
            logits, hidden = assistant(inputs, positions, cache_k, cache_v, view.committed)  # [B, 1, V], [B, 1, Hb]
            best.append(jax.lax.top_k(logits[:, 0], min(TELEMETRY_TOP_K, logits.shape[-1]))[1].astype(jnp.int32))
            token = best[-1][:, 0]  # the argmax (top_k breaks ties toward the lower index, as argmax does)
            drafts.append(token)
        tokens = jnp.concatenate([jnp.zeros((b, 1), jnp.int32), jnp.stack(drafts, axis=1)], axis=1)  # [B, K+1]
        candidates = jnp.stack(best + [jnp.full_like(best[0], -1)], axis=1)  # [B, K+1, C]
        return Proposal(tokens, None, None, candidates), state

    def commit(self, params, state: jax.Array, verified: Verified) -> jax.Array:
        """The state of the last accepted node (the root when none was), which gave the next root."""
        last = jnp.take_along_axis(verified.hidden, verified.num_accepted[:, None, None], axis=1)[:, 0]  # [B, Hb]
        return jnp.where(verified.running[:, None] > 0, last, state)
