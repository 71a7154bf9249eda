"""The device-side matcher of an n-gram (prompt lookup) proposer.

Prompt-lookup decoding (vLLM's `ngram` method, transformers' `prompt_lookup_num_tokens`) needs no draft model: it
drafts the next K tokens by finding an earlier occurrence of the sequence's last n tokens in its own history (prompt
plus generated tokens) and proposing the tokens that followed it. Code edits, summaries, retrieval answers and
repetitive generations copy long spans of their context, and there this free proposer is often accepted.

`ngram_match` runs inside `jax.jit` with fixed shapes, vectorized over a batch of ragged rows, so the proposal is
made on device between two verify steps with no host round trip. Only the number of rows, the buffer length and the
static arguments shape the program: rows' lengths are data, so a jitted step compiles once.

How: occurrences are indexed by their last position e = s + n - 1. For k = 0 .. max_n - 1,
`eq_k[b, e] = history[b, e - k] == history[b, len_b - 1 - k]` compares the history shifted right by k with the
suffix's k-th token from the end (one [B, L] compare per k), and the running AND `eq_0 & .. & eq_{n-1}` marks the
ends of the occurrences of length n. One pass over k yields every n in [min_n, max_n]: O(B * L * max_n) elementwise
work, [B, L] live memory, no [B, L, L] or [B, L, n] arrays, and one max-reduction over L per n. A [64, 32768] history
with max_n = 8 is a few dozen fused [B, L] passes.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxspec.errors import JaxspecError
from jaxspec.engine.proposers.base import ChainDrafts, PrefillView, Proposal, StepView, Verified


def ngram_match(
    history: jax.Array, length: jax.Array, *, num_draft: int, min_n: int, max_n: int
) -> tuple[jax.Array, jax.Array]:
    """Proposes `num_draft` tokens per row by prompt lookup: the tokens that followed the most recent earlier
    occurrence of the row's longest matching suffix.

    Args:
      history: [B, L] int32. Row b's tokens are `history[b, :length[b]]`; entries at or past `length[b]` are garbage
        and are never read as tokens of the row.
      length: [B] int32 in [0, L].
      num_draft: K >= 1, the number of drafted tokens (static).
      min_n, max_n: 1 <= min_n <= max_n, the suffix lengths tried (static).

    Returns:
      (drafts [B, K] int32, match_n [B] int32).

    Semantics, per row with len = length[b]:
    - For n from max_n down to min_n, the suffix is `history[len - n : len]`. An occurrence is a start s with
      0 <= s and s + n <= len - 1 (it ends before the suffix's last token, so at least one token follows it;
      overlapping the suffix is allowed) and `history[s : s + n] == suffix`. The longest n with an occurrence wins;
      among its occurrences the most recent (largest s) wins. match_n = that n, or 0 when no n in [min_n, max_n]
      has one (in particular when len < min_n + 1, e.g. len = 0 padding rows).
    - With a match, p = len - s - n >= 1 tokens follow the occurrence, and draft j is
      `history[s + n + (j mod p)]`: the tokens after the occurrence, then their periodic continuation. Since the
      suffix repeats `history[s : s + n]` at distance p, copying the sequence forward (x[len + i] = x[s + n + i])
      makes it periodic with period p past the history: draft j = draft j - p for j >= p. E.g. [a b c a b], n = 2,
      s = 0, p = 3, K = 5: drafts [c a b c a].
    - Without a match: every draft is the last token `history[len - 1]`, or 0 for an empty row. Drafts are only
      proposals that the verifier accepts or rejects, so any token is safe; this one is just deterministic.

    Raises:
      ValueError: at trace time, unless 1 <= min_n <= max_n and num_draft >= 1.
    """
    if not 1 <= min_n <= max_n:
        raise ValueError(f"ngram_match needs 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
    if num_draft < 1:
        raise ValueError(f"ngram_match needs num_draft >= 1, got {num_draft}")
    if history.ndim != 2 or history.shape[1] < 1 or length.shape != history.shape[:1]:
        raise ValueError(f"ngram_match needs history [B, L >= 1], length [B]; got {history.shape}, {length.shape}")
    history = history.astype(jnp.int32)  # [B, L]
    length = length.astype(jnp.int32)  # [B]
    b, seq = history.shape
    e = jnp.arange(seq, dtype=jnp.int32)[None, :]  # [1, L] last position of an occurrence
    last = length[:, None] - 1  # [B, 1] the suffix's last position
    ends_before_last = e <= last - 1  # [B, L]: s + n <= len - 1

    run = jnp.ones((b, seq), jnp.bool_)  # [B, L] the occurrence of length k ending at e matches the suffix's last k
    match_n = jnp.zeros((b,), jnp.int32)  # [B]
    match_e = jnp.zeros((b,), jnp.int32)  # [B] end of the winning occurrence
    for k in range(max_n):  # static: one [B, L] compare per suffix offset
        # history[b, e - k], shifted in from the left; e < k reads the fill, which `valid` below excludes.
        shifted = jnp.pad(history[:, : max(seq - k, 0)], ((0, 0), (min(k, seq), 0)))  # [B, L]
        # The suffix's k-th token from its end; clipped where len - 1 - k < 0 (then n = k + 1 > len - 1 and no e is
        # valid). Reads only positions < len.
        token = jnp.take_along_axis(history, jnp.clip(last - k, 0, seq - 1), axis=1)  # [B, 1]
        run = run & (shifted == token)  # [B, L]
        n = k + 1
        if n < min_n:
            continue
        valid = run & (e >= n - 1) & ends_before_last  # [B, L]: s = e - n + 1 >= 0; every position read is < len
        best = jnp.max(jnp.where(valid, e, -1), axis=1)  # [B] the most recent occurrence's end, or -1
        found = best >= 0  # [B]
        match_n = jnp.where(found, n, match_n)  # n increases: the longest matching n wins
        match_e = jnp.where(found, best, match_e)

    j = jnp.arange(num_draft, dtype=jnp.int32)[None, :]  # [1, K]
    period = jnp.maximum(length - 1 - match_e, 1)[:, None]  # [B, 1] p = len - s - n (>= 1 with a match)
    copy = match_e[:, None] + 1 + j % period  # [B, K] s + n + (j mod p), < len
    repeat = jnp.broadcast_to(jnp.maximum(last, 0), (b, num_draft))  # [B, K] len - 1
    index = jnp.where((match_n > 0)[:, None], copy, repeat)  # [B, K]
    drafts = jnp.take_along_axis(history, jnp.clip(index, 0, seq - 1), axis=1)  # [B, K]
    drafts = jnp.where((length > 0)[:, None], drafts, 0)  # empty rows: zeros, not garbage
    return drafts, match_n


class NgramState(NamedTuple):
    history: jax.Array  # [B, L] int32: the prompt and every emitted token (x_0 .. x_m), L = the cache capacity
    length: jax.Array  # [B] int32: tokens in history (0 for padding rows)


@dataclasses.dataclass(frozen=True)
class NgramProposer(ChainDrafts):
    """Prompt lookup as a proposer: chains of `num_draft` tokens from `ngram_match` over each row's own history,
    kept on device. No parameters, no target outputs, no model forwards; a step where no row's suffix matches runs
    the root alone (a one-token decode, `engine.spec_step`) instead of verifying K + 1 tokens. The drafts are
    deterministic, so sampling verifies them with the walk that needs no draft probabilities (lossless for a one-hot
    q)."""

    num_draft: int = 5
    min_n: int = 1
    max_n: int = 3
    name: str = "ngram"
    needs_aux: bool = False
    needs_hidden: bool = False
    forwards_per_step: int = 0

    def __post_init__(self):
        if not 1 <= self.min_n <= self.max_n:
            raise JaxspecError(f"--ngram-min/--ngram-max: need 1 <= min <= max, got {self.min_n} and {self.max_n}")
        if self.num_draft < 1:
            raise JaxspecError(f"--num-speculative-tokens must be >= 1, got {self.num_draft}")

    def init(self, params, target, view: PrefillView, capacity: int) -> NgramState:
        b, t = view.prompt.shape
        history = jnp.zeros((b, max(capacity, t + 1)), jnp.int32).at[:, :t].set(view.prompt)
        history = history.at[jnp.arange(b), view.prompt_lens].set(view.first_token)
        return NgramState(history, jnp.where(view.prompt_lens > 0, view.prompt_lens + 1, 0))

    def propose(self, params, target, st: NgramState, view: StepView, keys) -> tuple[Proposal, NgramState]:
        drafts, match_n = ngram_match(
            st.history, st.length, num_draft=self.num_draft, min_n=self.min_n, max_n=self.max_n
        )  # [B, K], [B]
        tokens = jnp.concatenate([jnp.zeros_like(drafts[:, :1]), drafts], axis=1)  # root set by the engine
        # Telemetry: node j's one candidate is draft j + 1 (rows without a match count as no_draft via has_draft).
        candidates = jnp.concatenate([drafts, jnp.full_like(drafts[:, :1], -1)], axis=1)[:, :, None]  # [B, K+1, 1]
        return Proposal(tokens, None, None, candidates, has_draft=match_n > 0), st

    def commit(self, params, st: NgramState, verified: Verified) -> NgramState:
        """Append the emitted tokens (accepted drafts and the target's own) of running rows."""
        b, width = verified.emitted.shape
        count = (verified.num_accepted + 1) * verified.running  # [B]
        j = jnp.arange(width)[None, :]
        slots = jnp.where(j < count[:, None], st.length[:, None] + j, st.history.shape[1])  # out of range: dropped
        history = st.history.at[jnp.arange(b)[:, None], slots].set(verified.emitted, mode="drop")
        return NgramState(history, st.length + count)
