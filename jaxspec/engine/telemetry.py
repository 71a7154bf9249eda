"""Why drafts are rejected: one outcome per verify step, counted on device beside the acceptance counters.

A step accepts a drafts (a prefix of the chain, or a path down the tree) and then emits the target's own token t at
the last accepted node u. Unless the proposer's whole depth was accepted, t is where the draft went wrong, and the
reason tells what would help:

    all_accepted          every draft position accepted (only the bonus token came from the target)
    outside_draft_vocab   t cannot be drafted at all (an EAGLE-3 head's reduced vocabulary lacks it): a wider
                          draft vocabulary is the fix, not more training
    in_draft_topk         t is among the proposer's top candidates at u but not what it drafted (a chain's top-1,
                          a tree's selected children): a wider tree would have caught it
    miss                  t is not among the proposer's candidates at u (a plain miss)
    no_draft              the proposer had no candidate at u (an n-gram without a match, a tree leaf the tree
                          did not expand, a row whose Proposal.has_draft is False)
    cut_by_stop           emission stopped inside the accepted tokens (EOS, or the row's budget), whatever came after

The outcomes partition a row's verify steps (they sum to `verify_calls`). Separately, `accepted_via_sibling`
counts accepted tree nodes that were not their parent's first child: acceptance a chain of top-1 drafts would
have missed.

A proposer describes its candidates in `Proposal.candidates` [B, N, C] (node i's top-C next-token candidates,
best first, target ids, -1 where it has none; None: the drafted children) and its draft
vocabulary in `Proposal.draft_vocab` [V] bool (None: every target token can be drafted).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

OUTCOMES = ("all_accepted", "outside_draft_vocab", "in_draft_topk", "miss", "no_draft", "cut_by_stop")


def step_outcome(
    num_accepted: jax.Array,  # [B] a
    depth: int,  # the proposer's longest acceptable path
    node: jax.Array,  # [B] the last accepted node u (a chain: a)
    target_token: jax.Array,  # [B] t, the target's own token emitted at u
    tokens: jax.Array,  # [B, N] the verified nodes
    parents: jax.Array,  # [B, N] -1 at the root
    candidates: jax.Array | None,  # [B, N, C] or None (see the module docstring)
    draft_vocab: jax.Array | None,  # [V] bool or None
    cut: jax.Array,  # [B] bool: emission stopped before a + 1 tokens
    has_draft: jax.Array | None = None,  # [B] bool, Proposal.has_draft (False: the row proposed nothing)
    any_vocab: jax.Array | None = None,  # [B] bool, Proposal.any_vocab (True: draft_vocab does not apply)
) -> jax.Array:
    """The step's outcome per row, as an index into OUTCOMES [B] int32."""
    if candidates is None:
        ranked = jnp.where(parents == node[:, None], tokens, -1)  # [B, N] u's drafted children
    else:
        ranked = jnp.take_along_axis(candidates, node[:, None, None], axis=1)[:, 0]  # [B, C]
    has_draft = jnp.any(ranked >= 0, axis=1) & (True if has_draft is None else has_draft)  # [B]
    in_vocab = jnp.ones_like(has_draft) if draft_vocab is None else draft_vocab[target_token]
    if any_vocab is not None:
        in_vocab = in_vocab | any_vocab
    in_ranked = jnp.any(ranked == target_token[:, None], axis=1)
    outcome = jnp.where(
        ~has_draft, 4, jnp.where(~in_vocab, 1, jnp.where(in_ranked, 2, 3))
    )  # no_draft / outside_draft_vocab / in_draft_topk / miss
    outcome = jnp.where(num_accepted >= depth, 0, outcome)
    return jnp.where(cut, 5, outcome).astype(jnp.int32)


def sibling_accepts(parents: jax.Array, path: jax.Array, num_accepted: jax.Array) -> jax.Array:
    """Accepted nodes that were not their parent's first (best-ranked) child: parents [B, N] (children in rank
    order, as `tree.draft_tree` builds them), path [B, D+1] the accepted nodes (path[:, 0] the root) -> [B]."""
    n = parents.shape[1]
    earlier = jnp.arange(n)[None, :] < jnp.arange(n)[:, None]  # [N, N]: j < i
    same_parent = parents[:, :, None] == parents[:, None, :]  # [B, N, N]
    first = ~jnp.any(same_parent & earlier[None], axis=-1)  # [B, N]
    on_path = jnp.take_along_axis(first, jnp.maximum(path, 0), axis=1)  # [B, D+1]
    j = jnp.arange(path.shape[1])[None, :]
    return jnp.sum((~on_path) & (j >= 1) & (j <= num_accepted[:, None]), axis=1).astype(jnp.int32)
