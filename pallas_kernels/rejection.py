"""Verification of drafted chains and trees against the target, vectorized over the batch (DESIGN_NOTES §4).

A draft is a tree of N nodes in topological order: node 0 is the root (the last emitted token, already verified),
node n > 0 holds a drafted token `tokens[n]` whose parent is `parents[n]` (a chain: parents[n] = n - 1); probs[n]
is the target's distribution (or, greedy, its logits) for the token after node n. The walk starts at the root and
repeatedly accepts one child of the current node:

  greedy  the first child whose token is the target's argmax; the token emitted after the last accepted node is
          that node's argmax (the correction, or the bonus at a leaf).
  tree    (lossless sampling without draft probabilities, SGLang's "target-only") with the node's uniform u: the
          first child c, in index order, with u ≤ Σ_{children c' ≤ c} p(token c'); if none, the emitted token is
          drawn from p with the children's tokens removed. This is inverse-CDF sampling of p with the children
          ordered first, so the output is distributed exactly as p.
  chain   (Leviathan / Chen, draft probabilities q[n] of each node's child) accept child c iff
          u_c · q(token c) < p(token c); at the first rejection draw from max(p − q, 0), after the last node from p.

Draws are inputs: `uniforms` [B, N] (u of node n) and `noise` [B, V] i.i.d. Exp(1), used as an exponential race
(argmax of weight / noise samples weight ∝ itself, no normalization), so that kernel and reference agree exactly.

Returns (num_accepted [B], emitted [B, D+1], path [B, D+1]) with D = max_depth: emitted[:a] are the accepted
drafts and emitted[a] the target's own token; path[:a+1] are the node indices of the root and the accepted nodes.
Entries past a are -1.
"""

from __future__ import annotations

import functools
import logging
from typing import Literal

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.sharding import PartitionSpec as P

Mode = Literal["greedy", "tree", "chain"]


def _prepare(tokens, parents, probs, q, mode: Mode):
    """Per-node scalars read along the walk: p_parent(token) [B, N], q_parent(token) [B, N], argmax [B, N]."""
    parent = jnp.maximum(parents, 0)
    if mode == "greedy":
        best = jnp.argmax(probs, axis=-1).astype(jnp.int32)
        return jnp.zeros(tokens.shape, jnp.float32), jnp.zeros(tokens.shape, jnp.float32), best
    rows = jnp.take_along_axis(probs, parent[:, :, None], axis=1)  # [B, N, V] the parent's distribution
    node_p = jnp.take_along_axis(rows, tokens[:, :, None], axis=2)[..., 0]
    node_q = jnp.ones_like(node_p)
    if mode == "chain":
        qrows = jnp.take_along_axis(q, parent[:, :, None], axis=1)
        node_q = jnp.take_along_axis(qrows, tokens[:, :, None], axis=2)[..., 0]
    return node_p, node_q, jnp.zeros(tokens.shape, jnp.int32)


def _walk_row(tokens, parents, node_p, node_q, best, uniforms, *, mode: Mode, max_depth: int):
    """One sequence's walk on [N] vectors → (a, final node, path [D+1], emitted drafts [D+1] with -1 fill)."""
    n = tokens.shape[0]
    idx = jax.lax.broadcasted_iota(jnp.int32, (n,), 0)
    slots = jax.lax.broadcasted_iota(jnp.int32, (max_depth + 1,), 0)

    def step(_, carry):
        node, a, live, path, emitted = carry
        is_child = (parents == node) & (idx > 0)
        if mode == "greedy":
            target_best = jnp.sum(jnp.where(idx == node, best, 0))
            ok = is_child & (tokens == target_best)
        elif mode == "tree":
            u = jnp.sum(jnp.where(idx == node, uniforms, 0.0))
            cum = jnp.cumsum(jnp.where(is_child, node_p, 0.0))
            ok = is_child & (u <= cum)
        else:  # chain
            ok = is_child & (uniforms * node_q < node_p)
        child = jnp.min(jnp.where(ok, idx, n))
        take = live & (child < n)
        tok = jnp.sum(jnp.where(idx == child, tokens, 0))
        emitted = jnp.where(take & (slots == a), tok, emitted)
        path = jnp.where(take & (slots == a + 1), child, path)
        return jnp.where(take, child, node), a + take.astype(jnp.int32), take, path, emitted

    init = (jnp.int32(0), jnp.int32(0), jnp.bool_(True),
            jnp.where(slots == 0, 0, -1).astype(jnp.int32), jnp.full((max_depth + 1,), -1, jnp.int32))
    node, a, _, path, emitted = jax.lax.fori_loop(0, max_depth, step, init)
    return a, node, path, emitted


def _final_token(final_p, final_q, children_tokens, noise, best_final, mode: Mode):
    """The target's token after the last accepted node, for one sequence: argmax (greedy), or an exponential race
    over p minus the children's tokens (tree) or max(p − q, 0) (chain); p itself if that leaves no mass."""
    if mode == "greedy":
        return best_final
    vocab = jax.lax.broadcasted_iota(jnp.int32, final_p.shape, 0)
    if mode == "tree":
        removed = jnp.any(vocab[:, None] == children_tokens[None, :], axis=1)
        weight = jnp.where(removed, 0.0, final_p)
    else:
        weight = jnp.maximum(final_p - final_q, 0.0)
    weight = jnp.where(jnp.sum(weight) > 0, weight, final_p)
    return jnp.argmax(weight / noise).astype(jnp.int32)


def verify_reference(tokens, parents, probs, uniforms, noise, q=None, *, mode: Mode, max_depth: int):
    """jax.numpy specification of `verify` (vmapped walk)."""
    node_p, node_q, best = _prepare(tokens, parents, probs, q, mode)
    walk = functools.partial(_walk_row, mode=mode, max_depth=max_depth)
    a, node, path, emitted = jax.vmap(walk)(tokens, parents, node_p, node_q, best, uniforms)
    final_p = jnp.take_along_axis(probs, node[:, None, None], axis=1)[:, 0]  # [B, V]
    final_q = jnp.zeros_like(final_p) if q is None else jnp.take_along_axis(q, node[:, None, None], axis=1)[:, 0]
    children = jnp.where((parents == node[:, None]) & (jnp.arange(tokens.shape[1]) > 0), tokens, -1)
    best_final = jnp.take_along_axis(best, node[:, None], axis=1)[:, 0]
    token = jax.vmap(functools.partial(_final_token, mode=mode))(final_p, final_q, children, noise, best_final)
    slots = jnp.arange(max_depth + 1)[None]
    return a, jnp.where(slots == a[:, None], token[:, None], emitted), path


def _kernel(tokens_ref, parents_ref, p_ref, q_ref, best_ref, u_ref, probs_ref, qd_ref, noise_ref,
            a_ref, emitted_ref, path_ref, *, mode: Mode, max_depth: int):
    """One sequence: the walk on [N] vectors, then the final token from the last accepted node's row."""
    tokens, parents = tokens_ref[0], parents_ref[0]
    a, node, path, emitted = _walk_row(tokens, parents, p_ref[0], q_ref[0], best_ref[0], u_ref[0],
                                       mode=mode, max_depth=max_depth)
    idx = jax.lax.broadcasted_iota(jnp.int32, tokens.shape, 0)
    best_final = jnp.sum(jnp.where(idx == node, best_ref[0], 0))
    if mode == "greedy":
        token = best_final
    else:
        final_p = probs_ref[0, pl.ds(node, 1), :][0]  # [V]
        final_q = qd_ref[0, pl.ds(node, 1), :][0] if mode == "chain" else jnp.zeros_like(final_p)
        children = jnp.where((parents == node) & (idx > 0), tokens, -1)
        token = _final_token(final_p, final_q, children, noise_ref[0], best_final, mode)
    slots = jax.lax.broadcasted_iota(jnp.int32, (max_depth + 1,), 0)
    a_ref[0] = jnp.full((1,), a, jnp.int32)
    emitted_ref[0] = jnp.where(slots == a, token, emitted)
    path_ref[0] = path


@functools.partial(jax.jit, static_argnames=("mode", "max_depth", "interpret"))
def verify(tokens, parents, probs, uniforms, noise, q=None, *, mode: Mode, max_depth: int, interpret: bool = False):
    """The Pallas kernel (one program per sequence); same signature and results as `verify_reference`."""
    b, n = tokens.shape
    v = probs.shape[-1]
    node_p, node_q, best = _prepare(tokens, parents, probs, q, mode)
    q_in = q if q is not None else jnp.zeros((b, 1, 1), jnp.float32)
    width = max_depth + 1
    vec = pl.BlockSpec((1, n), lambda i: (i, 0))
    a, emitted, path = pl.pallas_call(
        functools.partial(_kernel, mode=mode, max_depth=max_depth),
        grid=(b,),
        in_specs=[vec, vec, vec, vec, vec, vec,
                  pl.BlockSpec((1, n, v), lambda i: (i, 0, 0)),
                  pl.BlockSpec((1, *q_in.shape[1:]), lambda i: (i, 0, 0)),
                  pl.BlockSpec((1, v), lambda i: (i, 0))],
        out_specs=[pl.BlockSpec((1, 1), lambda i: (i, 0)), pl.BlockSpec((1, width), lambda i: (i, 0)),
                   pl.BlockSpec((1, width), lambda i: (i, 0))],
        out_shape=[jax.ShapeDtypeStruct((b, 1), jnp.int32), jax.ShapeDtypeStruct((b, width), jnp.int32),
                   jax.ShapeDtypeStruct((b, width), jnp.int32)],
        interpret=interpret,
        name="verify_" + mode,
    )(tokens, parents, node_p, node_q, best, uniforms.astype(jnp.float32), probs, q_in, noise)
    return a[:, 0], emitted, path


def chain_parents(batch: int, num_nodes: int) -> jax.Array:
    """Parent pointers of a chain: node n's parent is n − 1."""
    return jnp.broadcast_to(jnp.arange(num_nodes, dtype=jnp.int32) - 1, (batch, num_nodes))


_announced: set[str] = set()


def per_shard(fn, mesh=None, *, with_q: bool):
    """`fn(tokens, parents, probs, uniforms, noise[, q])` run per shard of a (data, model) mesh in `jax.shard_map`:
    rows split over data, each row's whole vocabulary on its device (gathered over model), outputs split by row.
    `mesh=None` uses the mesh set with `jax.set_mesh`."""
    rows = P("data")
    return jax.shard_map(
        fn, mesh=mesh, in_specs=(rows,) * (6 if with_q else 5), out_specs=(rows, rows, rows), check_vma=False
    )


def verify_draft(tokens, parents, probs, uniforms, noise, q=None, *, mode: Mode, max_depth: int):
    """Dispatch: the Pallas kernel on a validated backend (per shard under a mesh), the jax.numpy reference
    elsewhere (said once in the log)."""
    from pallas_kernels.tree_attention import kernel_platform, on_mesh

    if kernel_platform() is None:
        backend = jax.default_backend()
        if backend not in _announced:
            _announced.add(backend)
            logging.getLogger(__name__).info(
                "draft verification: no Pallas kernel enabled for %s; using the jax.numpy reference", backend
            )
        return verify_reference(tokens, parents, probs, uniforms, noise, q, mode=mode, max_depth=max_depth)
    fn = functools.partial(verify, mode=mode, max_depth=max_depth)
    args = (tokens, parents, probs, uniforms, noise) + (() if q is None else (q,))
    return (per_shard(fn, with_q=q is not None) if on_mesh() else fn)(*args)
