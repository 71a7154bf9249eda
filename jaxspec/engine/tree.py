"""EAGLE-2 dynamic draft trees with a fixed budget, built inside jit (DESIGN_NOTES §4).

From the head's distribution after the root, `depth` levels are expanded: each level runs the head once on the
`top_k` frontier nodes (each sees its ancestors through a window mask over the levels drafted so far), every
frontier node proposes its top_k children, and the top_k of those top_k² children by cumulative log-probability
become the next frontier. All proposed children are candidates; the best `total_tokens − 1` candidates overall,
in candidate order (parents before children, since a child's cumulative log-probability never exceeds its
parent's and `lax.top_k` breaks ties toward the lower index), form the tree under the root.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxspec.config import TreeConfig  # noqa: F401  (defined with the other frozen configs; imported from here too)
from jaxspec.models import kv_cache as kvc


class DraftTree(NamedTuple):
    tokens: jax.Array  # [B, N] target ids; node 0 is the root (filled by the caller)
    parents: jax.Array  # [B, N] int32, -1 for the root; parents[i] < i
    depths: jax.Array  # [B, N] int32, 0 for the root
    mask: jax.Array  # [B, N, N] bool: node i sees node j iff j is i or an ancestor of i
    ancestors: jax.Array  # [B, N, depth+1] int32: node i's ancestor at depth j (i itself at its depth; 0 past it)
    candidates: jax.Array | None = None  # [B, N, top_k] node i's top_k children as the head ranked them (target
    # ids, best first; -1 for nodes never expanded), selected or not: for the rejection telemetry


def draft_tree(
    head, embed_table, logits0: jax.Array, state0: jax.Array, head_cache, cfg: TreeConfig, process=None
) -> DraftTree:
    """Expand and select a tree. logits0 [B, V_d]: the head's distribution after the root; state0 [B, H]: its state
    there; head_cache: committed through the root (levels are written above it and dropped by the caller).
    process(logits [B, n, V_d], path [B, n, D]): the logit processors (`engine.draft_processor`), applied to each
    frontier node's children with the node's own path (branch-aware); None: none."""
    b = logits0.shape[0]
    k = cfg.top_k
    h = head_cache.lengths  # [B]
    if process is not None:
        logits0 = process(logits0[:, None], jnp.full((b, 1, cfg.depth), -1, jnp.int32))[:, 0]
    score, ids = jax.lax.top_k(jax.nn.log_softmax(logits0, axis=-1), k)  # [B, k]
    cand_tok, cand_score, cand_parent = [head.to_target_ids(ids)], [score], [jnp.full((b, k), -1, jnp.int32)]
    front_idx = jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32), (b, k))  # candidate index of each frontier node
    front_tok, front_score = cand_tok[0], score
    front_path = jnp.full((b, k, cfg.depth), -1, jnp.int32).at[:, :, 0].set(front_tok)  # tokens below the root
    front_state = jnp.broadcast_to(state0[:, None], (b, k, state0.shape[-1]))
    slots = jnp.arange(cfg.window)
    front_mask = jnp.broadcast_to(slots[None, :] == jnp.arange(k)[:, None], (b, k, cfg.window))  # own slot only
    expanded = jnp.full((b, cfg.num_candidates, k), -1, jnp.int32)  # [B, C, k] each expanded candidate's children
    rows = jnp.arange(b)[:, None]
    base = k
    for level in range(1, cfg.depth):
        positions = jnp.broadcast_to((h + level - 1)[:, None], (b, k))
        logits, out, head_cache = head(
            front_tok, front_state, positions, head_cache, embed_table, block_mask=front_mask,
            write_offset=(level - 1) * k,
        )
        if process is not None:
            logits = process(logits, front_path)
        child_score, child_ids = jax.lax.top_k(jax.nn.log_softmax(logits, axis=-1), k)  # [B, k, k]
        child_score = (front_score[:, :, None] + child_score).reshape(b, k * k)
        child_tok = head.to_target_ids(child_ids).reshape(b, k * k)
        expanded = expanded.at[rows, front_idx].set(child_tok.reshape(b, k, k))
        cand_tok.append(child_tok)
        cand_score.append(child_score)
        cand_parent.append(jnp.repeat(front_idx, k, axis=1))
        if level < cfg.depth - 1:  # the next frontier: the best k children
            front_score, sel = jax.lax.top_k(child_score, k)  # [B, k]
            parent_slot = sel // k  # which frontier node each comes from
            front_idx = base + sel
            front_tok = jnp.take_along_axis(child_tok, sel, axis=1)
            front_path = jnp.take_along_axis(front_path, parent_slot[:, :, None], axis=1).at[:, :, level].set(front_tok)
            front_state = jnp.take_along_axis(out, parent_slot[:, :, None], axis=1)
            own = slots[None, None, :] == (level * k + jnp.arange(k))[None, :, None]
            front_mask = jnp.take_along_axis(front_mask, parent_slot[:, :, None], axis=1) | own
        base += k * k

    all_tok = jnp.concatenate(cand_tok, axis=1)  # [B, C]
    all_parent = jnp.concatenate(cand_parent, axis=1)
    _, best = jax.lax.top_k(jnp.concatenate(cand_score, axis=1), cfg.total_tokens - 1)
    sel = jnp.sort(best, axis=1)  # [B, N-1] candidate order: parents first
    parent_cand = jnp.take_along_axis(all_parent, sel, axis=1)
    match = sel[:, None, :] == parent_cand[:, :, None]  # [B, N-1, N-1]: which selected node is the parent
    parent_node = jnp.where(jnp.any(match, axis=-1), 1 + jnp.argmax(match, axis=-1), 0).astype(jnp.int32)
    parents = jnp.concatenate([jnp.full((b, 1), -1, jnp.int32), parent_node], axis=1)  # [B, N]
    tokens = jnp.concatenate([jnp.zeros((b, 1), jnp.int32), jnp.take_along_axis(all_tok, sel, axis=1)], axis=1)
    candidates = jnp.concatenate([cand_tok[0][:, None], jnp.take_along_axis(expanded, sel[:, :, None], axis=1)], axis=1)
    return tree_from_parents(tokens, parents, cfg.depth)._replace(candidates=candidates)


def tree_from_parents(tokens: jax.Array, parents: jax.Array, max_depth: int) -> DraftTree:
    """Depths and the ancestor mask from parent pointers (parents[i] < i, -1 at the root)."""
    b, n = parents.shape
    safe = jnp.maximum(parents, 0)
    eye = jnp.broadcast_to(jnp.eye(n, dtype=bool), (b, n, n))
    mask, depths = eye, jnp.zeros((b, n), jnp.int32)
    for _ in range(max_depth):  # each round extends every node's known ancestry by one level
        mask = eye | (jnp.take_along_axis(mask, safe[:, :, None], axis=1) & (parents >= 0)[:, :, None])
        depths = jnp.where(parents >= 0, jnp.take_along_axis(depths, safe, axis=1) + 1, 0)
    return DraftTree(tokens, parents, depths, mask, kvc.ancestors_from_mask(mask, max_depth + 1))


def random_parents(rng, n: int, max_depth: int):
    """Parent pointers of a random tree of n nodes (node 0 the root, parents before children, depth ≤ max_depth),
    drawn with a numpy Generator: tree shapes for the kernel tests and `bench --kernels-micro`."""
    import numpy as np

    parents, depth = [-1], [0]
    for _ in range(1, n):
        p = int(rng.choice([i for i in range(len(parents)) if depth[i] < max_depth]))
        parents.append(p)
        depth.append(depth[p] + 1)
    return np.asarray(parents, np.int32)
