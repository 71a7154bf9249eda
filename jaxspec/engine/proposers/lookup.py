"""Prompt lookup beside a drafter: each row drafts its chain from the text it has already seen (`ngram_match`)
where that has been beating the drafter on that row, and from the drafter everywhere else.

Why: a drafter (an EAGLE-3 head, a block drafter, a draft model) predicts text in general; prompt lookup predicts
text that repeats: quoted or edited input, code identifiers, numbers a solution restates, and a small model's own
loops. On the built-in SmolLM2's held-out answers the lookup's chains beat the head's on 2- and 3-token matches
often enough that one choice per row and step (same chain length, one verify) raises the replayed tokens per verify
of chains of 2 from 1.47 to 1.70 on MT-Bench and from 1.89 to 2.02 on GSM8K (BENCHMARKS.md). vLLM and SGLang offer
prompt lookup as a method of its own; Snowflake's Arctic Inference pairs suffix decoding with EAGLE-3 this way.

Which rows look up is learned, not fixed: a row keeps a score per match length (the longest suffix of its text,
1..max_n tokens, that occurred before), an exponential average of how many more tokens the lookup's drafts got
right than the drafter's. Both chains are compared with what the target emitted after every step (the accepted
drafts and the target's own token): the chosen chain's run is the accepted count, the other's is known up to one
token past it, which is all a comparison needs. A row looks up where its match length's score is positive. With a
drafter that beats lookup (a strong head on open text), the scores go negative within a few steps and the row
drafts as the drafter alone would; the prior (`PromptLookup.prior`) decides only the first steps.

Lookup's chains may be longer than the drafter's (`PromptLookup.num_draft`, `--prompt-lookup-tokens`): its drafts
cost nothing, and where a row copies text it copies runs. Every step then verifies lookup's L + 1 nodes; a drafter
row's chain goes on past its K with lookup's drafts there (its last token repeated where nothing matched),
verified like any draft, and the drafter's pending buffers take the longer accepted runs (`base.LongerRuns`). Off
by default (L = K): on this project's 2-core CPU a verify of 5 tokens costs ~1.09 of 3, which the longer runs
about pay back (L = 4: +2% on GSM8K 80 and on MT-Bench 80 against the default, within the machine's drift);
verifying the longer width only on steps where some row looks up (`lax.cond` between two widths) made XLA copy the
target's whole KV cache every step, a loss (BENCHMARKS.md, "Longer chains for the rows that look up"). Where a few
more verified tokens cost ~nothing (an accelerator at small batch) they are the point.

Output is unchanged whatever is chosen: greedy verification accepts only the target's own tokens, and sampled
verification sees the lookup's deterministic drafts with one-hot draft distributions, for which the rejection rule
is lossless (a drafter row's drafts past its K are lookup's, one-hot too). Chains only: a tree's drafts are the
drafter's own.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxspec.errors import JaxspecError
from jaxspec.engine.proposers.base import PrefillView, Proposal, Proposer, StepView, Verified
from jaxspec.engine.proposers.ngram import NgramProposer, NgramState, ngram_match


@dataclasses.dataclass(frozen=True)
class PromptLookup:
    """How rows choose between prompt lookup and the drafter (module docstring)."""

    min_n: int = 1  # the shortest suffix looked up
    max_n: int = 3  # the longest
    # a row's starting score for match lengths 1..max_n: 1-token matches start against lookup, longer ones for it
    prior: tuple[float, ...] = (-0.1, 0.1, 0.1)
    decay: float = 0.8  # each step's comparison weighs 1 - decay in the running score
    # lookup's chains: this many drafts, or the drafter's K where that is more (None: K; a drafter whose state cannot
    # take longer accepted runs keeps lookup to K)
    num_draft: int | None = None

    def __post_init__(self):
        if self.num_draft is not None and self.num_draft < 1:
            raise JaxspecError(f"prompt lookup drafts at least 1 token per step, got {self.num_draft}")
        if not 1 <= self.min_n <= self.max_n:
            raise JaxspecError(f"prompt lookup needs 1 <= min_n <= max_n, got {self.min_n} and {self.max_n}")
        if len(self.prior) != self.max_n:
            raise JaxspecError(f"prompt lookup's prior needs one score per match length 1..{self.max_n}, "
                               f"got {len(self.prior)}")
        if not 0.0 <= self.decay < 1.0:
            raise JaxspecError(f"prompt lookup's decay must lie in [0, 1), got {self.decay}")


class LookupState(NamedTuple):
    inner: Any  # the drafter's own state
    history: NgramState  # the row's text: prompt and every emitted token
    score: jax.Array  # [B, max_n] float32: lookup's running advantage per match length
    match: jax.Array  # [B] int32: this step's match length (0: none, or a step that drafted nothing)
    lookup_drafts: jax.Array  # [B, L] this step's lookup chain (L: `WithPromptLookup.depth`)
    inner_drafts: jax.Array  # [B, K] this step's drafter chain
    used: jax.Array  # [B] bool: this step's chain was lookup's
    lookup_steps: jax.Array  # [B] int32: steps whose chain was lookup's, for the statistics


def chain_run(drafts: jax.Array, emitted: jax.Array, num_accepted: jax.Array) -> jax.Array:
    """[B] leading drafts [B, K] equal to the emitted tokens [B, >= K], counted within the a + 1 tokens the step
    emitted (the accepted drafts and the target's own): the run a chain would have had, cut one past the accepted
    run — exact for the chain that ran (its run is a), and enough to say whether another chain's was longer."""
    k = drafts.shape[1]
    known = jnp.arange(k)[None, :] <= num_accepted[:, None]  # [B, K]
    right = (drafts == emitted[:, :k]) & known
    return jnp.sum(jnp.cumprod(right.astype(jnp.int32), axis=1), axis=1)


@dataclasses.dataclass(frozen=True)
class WithPromptLookup:
    """A chain proposer with prompt lookup beside it (module docstring). The drafter's K drafts and lookup's L
    (`depth`, K unless `PromptLookup.num_draft` is more) share one verify of L + 1 nodes; the caches and target
    outputs are the drafter's; the lookup adds a [B, T] token history and a few numbers per row."""

    inner: Proposer
    lookup: PromptLookup = PromptLookup()

    def __post_init__(self):
        if self.inner.tree is not None:
            raise JaxspecError("prompt lookup drafts chains; a tree's drafts are the drafter's own (turn lookup off "
                               "with --prompt-lookup off, or drop --tree)")
        if self.depth > self.inner.depth and hasattr(self.inner, "accepting"):  # its commits take lookup's runs
            object.__setattr__(self, "inner", self.inner.accepting(self.depth))

    tree = None

    @property
    def name(self) -> str:
        return f"{self.inner.name}+lookup"

    @property
    def depth(self) -> int:
        """Lookup's chain length L: its `num_draft`, at least the drafter's K; K where the drafter's commit cannot
        take longer runs (no `accepting`) or none was asked for."""
        k, n = self.inner.depth, self.lookup.num_draft
        return max(k, n) if n is not None and hasattr(self.inner, "accepting") else k

    @property
    def needs_aux(self) -> bool:
        return self.inner.needs_aux

    @property
    def needs_hidden(self) -> bool:
        return self.inner.needs_hidden

    @property
    def forwards_per_step(self) -> int:
        return self.inner.forwards_per_step

    @property
    def verify_width(self) -> int:
        return self.depth + 1

    def extra_capacity(self) -> int:
        return max(self.inner.extra_capacity(), self.depth + 1)

    def kv_cache(self, st: LookupState):
        return self.inner.kv_cache(st.inner)

    @property
    def _history(self) -> NgramProposer:
        return NgramProposer(self.depth, self.lookup.min_n, self.lookup.max_n)

    def init(self, params, target, view: PrefillView, capacity: int) -> LookupState:
        b = view.prompt.shape[0]
        return LookupState(
            inner=self.inner.init(params, target, view, capacity),
            history=self._history.init(None, target, view, capacity),
            score=jnp.broadcast_to(jnp.asarray(self.lookup.prior, jnp.float32), (b, self.lookup.max_n)),
            match=jnp.zeros((b,), jnp.int32), lookup_drafts=jnp.zeros((b, self.depth), jnp.int32),
            inner_drafts=jnp.zeros((b, self.inner.depth), jnp.int32),
            used=jnp.zeros((b,), jnp.bool_), lookup_steps=jnp.zeros((b,), jnp.int32),
        )

    def propose(self, params, target, st: LookupState, view: StepView, keys: jax.Array
                ) -> tuple[Proposal, LookupState]:
        proposal, inner = self.inner.propose(params, target, st.inner, view, keys)
        k, n = self.inner.depth, self.depth
        looked, match = ngram_match(st.history.history, st.history.length, num_draft=n,
                                    min_n=self.lookup.min_n, max_n=self.lookup.max_n)  # [B, L], [B]
        score = jnp.take_along_axis(st.score, jnp.maximum(match - 1, 0)[:, None], axis=1)[:, 0]  # [B]
        use = (match > 0) & (score > 0)  # [B]
        drafted = proposal.tokens[:, 1:]  # [B, K] the drafter's
        # a drafter row's chain, then lookup's drafts past K (deterministic, verified as any: the run may go on)
        mine = jnp.concatenate([drafted, looked[:, k:]], axis=1)  # [B, L]
        tokens = jnp.concatenate([proposal.tokens[:, :1], jnp.where(use[:, None], looked, mine)], axis=1)
        q = proposal.q
        if q is not None:  # a deterministic draft's distribution is one-hot: the rejection rule stays lossless
            one_hot = jax.nn.one_hot(looked, q.shape[-1], dtype=q.dtype)  # [B, L, V]
            q = jnp.where(use[:, None, None], one_hot, jnp.concatenate([q, one_hot[:, k:]], axis=1))
        candidates = proposal.candidates
        if candidates is not None:  # node j's one candidate is lookup draft j + 1 (the telemetry's)
            candidates = jnp.pad(candidates, ((0, 0), (0, n - k), (0, 0)), constant_values=-1)  # [B, L+1, C]
            candidates = candidates.at[:, k:n, 0].set(looked[:, k:])  # a drafter row's nodes past K: lookup's
            lookups = jnp.full_like(candidates, -1).at[:, :n, 0].set(looked)
            candidates = jnp.where(use[:, None, None], lookups, candidates)
        has_draft = proposal.has_draft if proposal.has_draft is None else proposal.has_draft | use
        any_vocab = use if proposal.any_vocab is None else proposal.any_vocab | use  # lookup drafts any token
        proposal = proposal._replace(tokens=tokens, q=q, candidates=candidates, has_draft=has_draft,
                                     any_vocab=any_vocab)
        return proposal, st._replace(inner=inner, match=match, lookup_drafts=looked, inner_drafts=drafted, used=use)

    def keep_up(self, params, target, st: LookupState, view: StepView) -> LookupState:
        """A step that drafts nothing: the drafter keeps up; no comparison is made (match 0). A drafter without a
        `keep_up` of its own proposes and its drafts are dropped, as the engine's `keep_up` does; they are never
        verified, so the keys it draws them with (fixed here: the engine gives `keep_up` none) cannot matter."""
        if hasattr(self.inner, "keep_up"):
            inner = self.inner.keep_up(params, target, st.inner, view)
        else:
            keys = jax.random.split(jax.random.key(0), view.last_token.shape[0])
            inner = self.inner.propose(params, target, st.inner, view, keys)[1]
        return st._replace(inner=inner, match=jnp.zeros_like(st.match), used=jnp.zeros_like(st.used))

    def commit(self, params, st: LookupState, verified: Verified) -> LookupState:
        """The drafter's commit, the emitted tokens appended to the history, and each compared row's score moved
        toward how many more tokens the lookup's chain got right than the drafter's."""
        gain = (chain_run(st.lookup_drafts, verified.emitted, verified.num_accepted)
                - chain_run(st.inner_drafts, verified.emitted, verified.num_accepted)).astype(jnp.float32)  # [B]
        bucket = jax.nn.one_hot(jnp.maximum(st.match - 1, 0), self.lookup.max_n, dtype=jnp.bool_)  # [B, max_n]
        compared = bucket & ((st.match > 0) & (verified.running > 0))[:, None]
        d = self.lookup.decay
        score = jnp.where(compared, d * st.score + (1.0 - d) * gain[:, None], st.score)
        return st._replace(
            inner=self.inner.commit(params, st.inner, verified),
            history=self._history.commit(None, st.history, verified),
            score=score,
            lookup_steps=st.lookup_steps + (st.used & (verified.running > 0)).astype(jnp.int32),
        )

    def row_counts(self, st: LookupState) -> dict[str, jax.Array]:
        """Per-row counters for the generation statistics: {"lookup_steps": [B] steps drafted by lookup}."""
        return {"lookup_steps": st.lookup_steps}


def beside(proposer: Proposer, lookup: PromptLookup | None) -> Proposer:
    """`proposer` with prompt lookup beside its chains (`WithPromptLookup`), or as it is: no lookup asked for, or
    a tree (drafted by its drafter alone). Every generator that builds a drafter's proposer goes through this."""
    if lookup is None or proposer.tree is not None:
        return proposer
    return WithPromptLookup(proposer, lookup)

