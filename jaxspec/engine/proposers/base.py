"""The contract between the engine and a draft proposer (EAGLE-3 chains and trees, n-gram prompt lookup, MTP-style
heads): what a proposer sees, what it returns, and when it is told what the target accepted.

Why an interface: every serving system our users compare us with (vLLM's `ProposerInterface`, SGLang's
speculative algorithms, TensorRT-LLM) offers several draft methods behind one verifier. The engine owns the target,
its cache, the emitted tokens, logit processors and statistics; a proposer owns only its own state (a head's KV
cache and pending features, a token history) and never reaches into the engine's. Data flows one way per step:

    propose(state, StepView)  ->  Proposal (tokens, a tree or a chain, draft probabilities or none)
    engine: verify all nodes in one target forward, accept, emit, commit the target cache
    commit(state, Verified)   ->  state  (the accepted tokens and the target's outputs at them)

A step may also draft nothing (the engine's `drafting=False`): the proposer only keeps up (`keep_up`, optional),
the target runs the root alone, and `commit` sees a step that accepted no draft.

A proposer is a static, hashable object (a frozen dataclass: it is a static argument of the jitted prefill and
step, holding e.g. a head's graphdef) plus a parameter pytree passed beside it (None when it has none). It says
which target outputs it needs (`needs_aux`: the EAGLE-3 features; `needs_hidden`: the final hidden state, as MTP
heads read) so the target computes only those.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Protocol

import jax

from jaxspec.models import kv_cache as kvc
from jaxspec.processors import ProcessorState
from jaxspec.sampling import RowSampling
from jaxspec.engine.tree import DraftTree, TreeConfig


class PrefillView(NamedTuple):
    """The prompt's target pass, for `Proposer.init`."""

    prompt: jax.Array  # [B, Tp] int32, right-padded
    prompt_lens: jax.Array  # [B] int32 (0 for padding rows)
    first_token: jax.Array  # [B] int32, the token the prefill emitted (x_n for a prompt of n tokens)
    aux: jax.Array | None  # [B, Tp, F] EAGLE-3 features of every prompt position (needs_aux)
    hidden: jax.Array | None  # [B, 1, H] the last prompt position's final hidden state, before the norm (needs_hidden)


class StepView(NamedTuple):
    """What a proposer may read from the engine when drafting (read-only)."""

    last_token: jax.Array  # [B] the last emitted token (the root of this step's draft; not yet in the target cache)
    committed: jax.Array  # [B] tokens in the target cache (the root's position)
    running: jax.Array  # [B] int32, 1 for rows still generating
    processors: ProcessorState | None  # logit processors, for drafting what the processed target would pick
    sampling: RowSampling | None = None  # the rows' sampling settings (None: all greedy), for sampled drafts
    # the target's KV cache, committed [0, committed) per row (read-only): for drafters that attend to the target's
    # own keys and values (Gemma 4's assistant, MTP heads) instead of keeping a cache
    target_cache: kvc.KVCache | None = None


class Proposal(NamedTuple):
    """Draft nodes to verify. Node 0 is the root (the engine puts the last emitted token there)."""

    tokens: jax.Array  # [B, N] target ids
    tree: DraftTree | None  # parents, depths, mask, ancestors; None: a chain (node j's parent is j - 1)
    q: jax.Array | None  # [B, N-1, V] a chain's draft distributions over the target vocabulary (sampling); None:
    # deterministic drafts or a tree — sampling then verifies with the lossless walk that needs no q
    # For the rejection telemetry only (`jaxspec.engine.telemetry`):
    candidates: jax.Array | None = None  # [B, N, C] node i's top-C next-token candidates (target ids, best first,
    # -1 where none); None: the drafted children
    draft_vocab: jax.Array | None = None  # [V] bool, the target tokens the proposer can draft; None: all
    # [B] bool, rows whose drafts are real proposals (an n-gram that matched); None: every row's. When no running
    # row has one, the engine runs the root alone (a one-token decode) instead of verifying N nodes: same output,
    # a cheaper step.
    has_draft: jax.Array | None = None
    # [B] bool, rows whose drafts `draft_vocab` does not limit (prompt lookup's beside a head); None: none
    any_vocab: jax.Array | None = None


class Verified(NamedTuple):
    """What the target accepted this step, for `Proposer.commit`."""

    emitted: jax.Array  # [B, D+1] accepted drafts then the target's own token at num_accepted (>= 0 everywhere)
    num_accepted: jax.Array  # [B] drafts accepted (a); a + 1 tokens were emitted
    running: jax.Array  # [B] int32, rows that ran this step (others must keep their state)
    aux: jax.Array | None  # [B, D+1, F] features of the root and accepted nodes, path order (needs_aux)
    hidden: jax.Array | None  # [B, D+1, H] final hidden states there (needs_hidden)


class ChainDrafts:
    """The shape of a proposer that drafts one chain of `num_draft` tokens per step (no tree): mixed into such
    proposers (n-gram lookup, a DFlash block drafter, an MTP head) so they state only what they draft. One with a
    KV cache of its own (DFlash) overrides `kv_cache`."""

    tree = None

    @property
    def depth(self) -> int:
        return self.num_draft

    @property
    def verify_width(self) -> int:
        return self.num_draft + 1

    def extra_capacity(self) -> int:
        return self.num_draft + 1

    def kv_cache(self, state) -> None:
        return None


class LongerRuns:
    """Mixed into a chain drafter whose state keeps the tokens (or features) a step accepted for its next step (a
    head's pending pairs, a draft model's pending tokens, a block drafter's pending context), so that a wrapper
    verifying longer chains in its place (prompt lookup, `proposers.lookup`) can size that buffer for them:
    `accepting(depth)` is the same drafter with room for runs of up to `depth` accepted drafts. Its dataclass
    declares `accept_depth: int = 0` (0: its own depth)."""

    accept_depth: int

    @property
    def pending_width(self) -> int:
        """Entries of the pending buffer: the longest accepted run a commit may carry, plus the target's token."""
        return max(self.depth, self.accept_depth) + 1

    def accepting(self, depth: int):
        return dataclasses.replace(self, accept_depth=depth)


class Proposer(Protocol):
    """A draft method. `depth` is the longest run of drafts one step can accept (a chain's K, a tree's depth): it
    sizes the verifier's walk and the per-position statistics (a drafter's pending buffers: `LongerRuns`)."""

    depth: int
    tree: TreeConfig | None
    needs_aux: bool
    needs_hidden: bool
    name: str

    @property
    def forwards_per_step(self) -> int:
        """Model forwards the proposer runs per step (0 for prompt lookup), for the draft-call statistics."""

    @property
    def verify_width(self) -> int:
        """Nodes per verify (root included): target cache slots one step writes past the committed length."""

    def extra_capacity(self) -> int:
        """Slots past the committed length one step may write, in the target's cache and the proposer's own."""

    def init(self, params: Any, target, view: PrefillView, capacity: int) -> Any:
        """The proposer's state after the prompt (a pytree; batch-major arrays)."""

    def propose(
        self, params: Any, target, state: Any, view: StepView, keys: jax.Array
    ) -> tuple[Proposal, Any]:
        """Draft this step's nodes. `target` is the target module (e.g. its embedding table), read-only; keys [B]:
        each row's PRNG key for this step (a row's draws must use its own key only)."""

    def commit(self, params: Any, state: Any, verified: Verified) -> Any:
        """Take in what was accepted; rows with running == 0 keep their state."""

    # Optional: keep_up(params, target, state, view) -> state, what a step that drafts nothing needs of the
    # proposer (the engine's `drafting=False` steps: a continuous batcher's speculation off at high load), e.g. a
    # head's catch-up on its pending pairs without the drafts after it. A proposer without it runs `propose` and
    # the engine drops the drafts (`engine.core.keep_up`).

    # Optional: accepting(depth) -> Proposer, this drafter with a commit that takes runs of up to `depth` accepted
    # drafts (`LongerRuns`), for a wrapper that verifies longer chains than it drafts; without it, a wrapper keeps
    # to the drafter's own depth.

    def kv_cache(self, state: Any) -> kvc.KVCache | None:
        """The proposer's KV cache in its state, if it has one (the memory report counts it)."""
