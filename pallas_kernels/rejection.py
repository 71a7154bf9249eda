"""Verification of drafted chains and trees against the target, vectorized over the batch (DESIGN_NOTES §4).

A draft is a tree of N nodes in topological order: node 0 is the root (the last emitted token, already verified),
node n > 0 holds a drafted token `tokens[n]` whose parent is `parents[n]` (a chain: parents[n] = n - 1); probs[n]
is the target's distribution (or, greedy, its logits) for the token after node n. The walk starts at the root and
repeatedly accepts one child of the current node:

  greedy  the first child whose token is the target's argmax; the token emitted after the last accepted node is
          that node's argmax (the correction, or the bonus at a leaf).
  tree    (lossless sampling without draft probabilities, SGLang's "target-only") with the node's uniform u: the
          first child c, in index order, with u ≤ Σ_{children c' ≤ c} p(token c') (added in index order); if none,
          the emitted token is drawn from p with the children's tokens removed. This is inverse-CDF sampling of p
          with the children ordered first, so the output is distributed exactly as p.
  chain   (Leviathan / Chen, draft probabilities q[n] of each node's child) accept child c iff
          u_c · q(token c) < p(token c); at the first rejection draw from max(p − q, 0), after the last node from p.

Draws are inputs: `uniforms` [B, N] (u of node n) and `noise` [B, V] i.i.d. Exp(1), used as an exponential race:
the token drawn from weights w is argmax over {v : w_v > 0} of w_v · (1 / noise_v) (that samples w_v / Σ w, no
normalization); if no weight is positive (the residual of q = p), the race runs over p instead. Tokens of zero
weight never take part: Exp(1) draws from jax.random are exactly 0 with probability 2^-23 per entry (about once
per 65 rows of a 128k vocabulary), and 0 / 0 would be a NaN that an argmax picks. The reciprocal of the noise is
computed by XLA for the kernel and the reference alike, so that the kernel itself only multiplies (Triton compiles
`/` to the approximate div.full.f32): no operation in the kernel rounds differently from XLA's.

Returns (num_accepted [B], emitted [B, D+1], path [B, D+1]) with D = max_depth: emitted[:a] are the accepted
drafts and emitted[a] the target's own token; path[:a+1] are the node indices of the root and the accepted nodes.
Entries past a are -1.

Both paths share `_prepare`, which turns each node into one flag, "accepted if its parent is reached", from per-node
scalars (p and q of the parent at the node's token: B·N elements gathered, not [B, N, V] rows; greedy: the
argmax of every row, an XLA reduction). What is left is the walk (integers only) and the race over the last
accepted node's row, which the Pallas kernel (`verify`) runs blocked over the vocabulary:

  grid (B, C): sequence b, vocabulary chunk c of CHUNK_BLOCKS blocks of VOCAB_BLOCK entries (C = 1 for greedy,
          which reads no vocabulary). Every program walks its sequence's tree ([N] vectors, N padded to a power of
          two, a few integer reductions per step; repeated per chunk, which is cheaper than a second launch), then
          reads its chunk of the final node's row one block at a time (`pl.ds` in a `fori_loop`): p, q (chain) and
          1 / noise as [VOCAB_BLOCK] vectors, never a whole row. Per block it keeps two running (max, first argmax)
          pairs, of the race over the weights and over p. The children's tokens (tree) are removed per block by a
          `while_loop` over the children that fall in the block (usually none).
  blocks  full blocks at multiples of the block size; a ragged vocabulary's last block is read at V − block (it
          overlaps the one before, whose entries it masks), so no input is padded or copied: the rows are
          [B, N, V], 250 MB at B = 8, N = 60, V = 128256. Vocabularies below the block size use the largest power
          of two below V.
  merge   XLA takes, per sequence, the first chunk holding the maximum: the first index of the maximum over the
          row, as `jnp.argmax` in the reference. Only exact operations (compares, max, min, products, p − q)
          touch floats in the kernel, so its result is the reference's whatever the block order.

On GPUs it is lowered with Triton, chosen explicitly (`compiler_params=pallas.triton.CompilerParams`): since JAX
0.10 a plain `pallas_call` goes to Mosaic GPU, which stages every block in shared memory (the [N, V] rows did not
fit at a 128k vocabulary); Triton reads through pointers, wants power-of-two value shapes (node and slot vectors
padded, blocks of 2^k) and has no value slicing (none used).

On TPUs (`backend="tpu"`, pallas_kernels/variants.py) a Mosaic variant computes the same race with the same float
operations, shaped by what Mosaic asks: its own CompilerParams (both grid axes parallel), blocks whose last two
dimensions are multiples of (8, 128) or whole, scalars in SMEM rather than read from vector blocks, 2-D vectors.
The walk is XLA's there (the reference's vmapped `_walk_row`, integers only; greedy then needs no kernel at all),
and the final node, its children's tokens and their number ([B], [B, N], [B]) go to SMEM as scalar-prefetch
operands. The rows stay in HBM (`pl.ANY`): per block a DMA copies [1, block] of p (q, 1 / noise) into a
double-buffered VMEM scratch, straight from row `node` for 32-bit rows; 16-bit rows are gathered by XLA first
([B, 1, V]), since Mosaic packs two of their rows per word in HBM and slices rows only at multiples of 8. Children
are removed by a loop over the children's SMEM tokens, a select for each that falls in the block; each chunk's two
(max, argmax) pairs leave as lanes 0 and 1 of a [1, 128] row, merged by XLA as above. At 128256 tokens every DMA
starts at a multiple of 128 (the last block at V − 1024 = 994 · 128). Checked without a TPU: the Mosaic lowering
(`jax.export`) and libtpu's ahead-of-time compilation for v5e and v4 (tests/test_rejection_lowering.py), and TPU
interpret mode bit for bit against the reference (tests/test_tpu_interpret.py); not yet run on a TPU.
"""

from __future__ import annotations

import functools
from typing import Literal

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as plgpu
from jax.sharding import PartitionSpec as P

from pallas_kernels.mesh_axes import DATA
from pallas_kernels.dispatch import on_mesh
from pallas_kernels.primitives import first_argmax
from pallas_kernels.variants import kernel_variant, prefetch_next_then_wait, tpu_interpret

Mode = Literal["greedy", "tree", "chain"]

NEG_INF = float("-inf")
VOCAB_BLOCK = 1024  # vocabulary entries per block: 4 KB per float32 row read, a few registers per thread
CHUNK_BLOCKS = 8  # blocks per program: a 128256-token row is read by 16 programs
NUM_WARPS, NUM_STAGES = 4, 2  # Triton launch parameters
RACE_LANES = 128  # Mosaic TPU: a chunk's two (max, argmax) pairs go out as one [1, 128] row (lanes 0 and 1)


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _node_values(x, parents, tokens):
    """x[b, parents[b, n], tokens[b, n]] as float32 [B, N]: one element per node, not its parent's row."""
    rows = jnp.arange(x.shape[0])[:, None]
    return x[rows, jnp.maximum(parents, 0), tokens].astype(jnp.float32)


def _sibling_sums(parents, x):
    """cum[b, n] = Σ x[b, j] over node n's siblings j ≤ n (itself included; parents[j] = parents[n], j > 0), added in
    index order by a loop, so that the order is the same on every backend."""
    nodes = jnp.arange(x.shape[1])[None]

    def step(j, carry):
        run, cum = carry  # run[b, m]: the sum so far over node m's children
        par = jax.lax.dynamic_index_in_dim(parents, j, axis=1)  # [B, 1]
        run = jnp.where(nodes == par, run + jax.lax.dynamic_index_in_dim(x, j, axis=1), run)
        mine = jnp.take_along_axis(run, jnp.maximum(par, 0), axis=1)
        return run, jax.lax.dynamic_update_index_in_dim(cum, mine, j, axis=1)

    zeros = jnp.zeros_like(x)
    return jax.lax.fori_loop(1, x.shape[1], step, (zeros, zeros))[1]


def _prepare(tokens, parents, probs, uniforms, q, mode: Mode):
    """→ ok [B, N] (node n is accepted if the walk reaches its parent and no earlier sibling is accepted; never
    for the root) and, greedy, the argmax of every row [B, N] (zeros otherwise)."""
    parent = jnp.maximum(parents, 0)
    nonroot = jnp.arange(tokens.shape[1])[None] > 0
    if mode == "greedy":
        best = first_argmax(probs)  # jnp.argmax's index, faster on CPU
        return nonroot & (tokens == jnp.take_along_axis(best, parent, axis=1)), best
    best = jnp.zeros(tokens.shape, jnp.int32)
    node_p = _node_values(probs, parents, tokens)
    uniforms = uniforms.astype(jnp.float32)
    if mode == "tree":
        u = jnp.take_along_axis(uniforms, parent, axis=1)  # the parent's uniform
        return nonroot & (u <= _sibling_sums(parents, node_p)), best
    return nonroot & (uniforms * _node_values(q, parents, tokens) < node_p), best


def _walk_row(parents, ok, tokens, *, max_depth: int, width: int):
    """One sequence's walk on [N] vectors → (a, final node, path [width], emitted drafts [width], -1 filled)."""
    n = tokens.shape[0]
    idx = jax.lax.broadcasted_iota(jnp.int32, (n,), 0)
    slots = jax.lax.broadcasted_iota(jnp.int32, (width,), 0)

    def step(_, carry):
        node, a, live, path, emitted = carry
        child = jnp.min(jnp.where(ok & (parents == node), idx, n))
        take = live & (child < n)
        tok = jnp.sum(jnp.where(idx == child, tokens, 0))
        emitted = jnp.where(take & (slots == a), tok, emitted)
        path = jnp.where(take & (slots == a + 1), child, path)
        return jnp.where(take, child, node), a + take.astype(jnp.int32), take, path, emitted

    init = (jnp.int32(0), jnp.int32(0), jnp.bool_(True),
            jnp.where(slots == 0, 0, -1).astype(jnp.int32), jnp.full((width,), -1, jnp.int32))
    node, a, _, path, emitted = jax.lax.fori_loop(0, max_depth, step, init)
    return a, node, path, emitted


def _reciprocal(noise):
    return 1.0 / noise.astype(jnp.float32)


def _scores(weight, inv_noise):
    """The race's scores: weight · (1 / noise) where the weight is positive, -inf elsewhere (never drawn)."""
    return jnp.where(weight > 0, weight * inv_noise, NEG_INF)


def _race(weight, p, inv_noise):
    """The token drawn from `weight`, or from p if no weight is positive ([B, V] → [B])."""
    s_w, s_p = _scores(weight, inv_noise), _scores(p, inv_noise)
    return jnp.where(jnp.max(s_w, axis=-1) > NEG_INF, first_argmax(s_w), first_argmax(s_p))


def _with_token(emitted, a, token):
    slots = jnp.arange(emitted.shape[1])[None]
    return jnp.where(slots == a[:, None], token.astype(jnp.int32)[:, None], emitted)


def verify_reference(tokens, parents, probs, uniforms, noise, q=None, *, mode: Mode, max_depth: int):
    """jax.numpy specification of `verify` (vmapped walk, the race over the final node's whole row)."""
    b, n = tokens.shape
    ok, best = _prepare(tokens, parents, probs, uniforms, q, mode)
    walk = functools.partial(_walk_row, max_depth=max_depth, width=max_depth + 1)
    a, node, path, emitted = jax.vmap(walk)(parents, ok, tokens)
    if mode == "greedy":
        return a, _with_token(emitted, a, jnp.take_along_axis(best, node[:, None], axis=1)[:, 0]), path

    def final_row(x):  # [B, V]: one row per sequence, the last accepted node's
        return jnp.take_along_axis(x, node[:, None, None], axis=1)[:, 0].astype(jnp.float32)

    p = final_row(probs)
    if mode == "tree":
        v = p.shape[-1]
        children = jnp.where((parents == node[:, None]) & (jnp.arange(n)[None] > 0), tokens, v)  # v: dropped
        removed = jnp.zeros((b, v), bool).at[jnp.arange(b)[:, None], children].set(True, mode="drop")
        weight = jnp.where(removed, 0.0, p)
    else:
        weight = jnp.maximum(p - final_row(q), 0.0)
    return a, _with_token(emitted, a, _race(weight, p, _reciprocal(noise))), path


def _without_children(weight, vocab_ids, children, start, block: int):
    """weight with the entries of the children's tokens ([N] ids, -1 for non-children) zeroed, for one block at
    `start`: one pass per child whose token falls in the block (a while_loop: usually no pass at all)."""
    nodes = jax.lax.broadcasted_iota(jnp.int32, children.shape, 0)
    hits = ((children >= start) & (children < start + block)).astype(jnp.int32)

    def body(carry):
        hits, weight = carry
        j = jnp.min(jnp.where(hits > 0, nodes, children.shape[0]))
        token = jnp.sum(jnp.where(nodes == j, children, 0))
        return jnp.where(nodes == j, 0, hits), jnp.where(vocab_ids == token, 0.0, weight)

    return jax.lax.while_loop(lambda carry: jnp.max(carry[0]) > 0, body, (hits, weight))[1]


def _fold(scores, vocab_ids, best, keepdims: bool = False):
    """Running (max, first index of the max) with one more block: a later block wins only if strictly greater.
    keepdims: [1, block] scores and [1, 1] pairs (Mosaic TPU) instead of [block] and scalars (Triton)."""
    m = jnp.max(scores, keepdims=keepdims)
    i = jnp.min(jnp.where(scores == m, vocab_ids, jnp.iinfo(jnp.int32).max), keepdims=keepdims)
    better = m > best[0]
    return jnp.where(better, m, best[0]), jnp.where(better, i, best[1])


def _kernel(parents_ref, ok_ref, tokens_ref, *refs, mode: Mode, max_depth: int, vocab: int, block: int,
            chunk_blocks: int):
    """One (sequence, vocabulary chunk): the walk, then the race over the chunk of the final node's row."""
    if mode == "greedy":
        path_ref, emitted_ref = refs
    elif mode == "tree":
        p_ref, inv_ref, path_ref, emitted_ref, val_ref, idx_ref = refs
    else:
        p_ref, q_ref, inv_ref, path_ref, emitted_ref, val_ref, idx_ref = refs
    parents, tokens = parents_ref[...], tokens_ref[...]
    _, node, path, emitted = _walk_row(parents, ok_ref[...] != 0, tokens, max_depth=max_depth,
                                       width=path_ref.shape[-1])
    path_ref[...] = path
    emitted_ref[...] = emitted
    if mode == "greedy":
        return
    nodes = jax.lax.broadcasted_iota(jnp.int32, tokens.shape, 0)
    children = jnp.where((parents == node) & (nodes > 0), tokens, -1)
    lanes = jax.lax.broadcasted_iota(jnp.int32, (block,), 0)

    def visit(k, start, carry, overlap: bool):
        vocab_ids = start + lanes
        p = p_ref[node, pl.ds(start, block)].astype(jnp.float32)
        inv = inv_ref[pl.ds(start, block)]
        if mode == "tree":
            weight = _without_children(p, vocab_ids, children, start, block)
        else:
            weight = jnp.maximum(p - q_ref[node, pl.ds(start, block)].astype(jnp.float32), 0.0)
        s_w, s_p = _scores(weight, inv), _scores(p, inv)
        if overlap:  # the entries before k · block were the previous block's
            fresh = vocab_ids >= k * block
            s_w, s_p = jnp.where(fresh, s_w, NEG_INF), jnp.where(fresh, s_p, NEG_INF)
        return _fold(s_w, vocab_ids, carry[0]), _fold(s_p, vocab_ids, carry[1])

    num_full, num_blocks = vocab // block, pl.cdiv(vocab, block)
    first = pl.program_id(1) * chunk_blocks
    last = jnp.minimum(first + chunk_blocks, num_blocks)
    none = (jnp.float32(NEG_INF), jnp.int32(0))
    best = jax.lax.fori_loop(
        first, jnp.minimum(last, num_full),
        lambda k, c: visit(k, pl.multiple_of(k * block, block), c, overlap=False), (none, none),
    )
    if num_full < num_blocks:  # the ragged last block, read at vocab − block (by the chunk holding it)
        best = jax.lax.fori_loop(
            jnp.maximum(first, num_full), last, lambda k, c: visit(k, vocab - block, c, overlap=True), best
        )
    (m_w, i_w), (m_p, i_p) = best
    two = jax.lax.broadcasted_iota(jnp.int32, (2,), 0)
    val_ref[...] = jnp.where(two == 0, m_w, m_p)
    idx_ref[...] = jnp.where(two == 0, i_w, i_p)


def _race_kernel_tpu(node_ref, children_ref, num_children_ref, *refs, mode: Mode, vocab: int, block: int,
                     chunk_blocks: int, by_node: tuple[bool, ...]):
    """Mosaic TPU: one (sequence, vocabulary chunk)'s race over the final node's row (`node_ref`, `children_ref`,
    `num_children_ref`: the walk's results in SMEM; a row's children's tokens come first). The operands stay in
    HBM as [B, rows, V]: rows = N where `by_node` (the kernel reads row `node`), 1 otherwise (the final rows,
    gathered by XLA, and 1 / noise). Each block of p (q) and 1 / noise is copied into VMEM by DMA, double-buffered
    (block k + 1 is on its way while block k is raced). Values are [1, block] (a TPU vector is 2-D)."""
    if mode == "tree":
        p_hbm, inv_hbm, val_ref, idx_ref, p_buf, inv_buf, sems = refs
        rows, bufs = (p_hbm, inv_hbm), (p_buf, inv_buf)
    else:
        p_hbm, q_hbm, inv_hbm, val_ref, idx_ref, p_buf, q_buf, inv_buf, sems = refs
        rows, bufs = (p_hbm, q_hbm, inv_hbm), (p_buf, q_buf, inv_buf)
    b = pl.program_id(0)
    node = node_ref[b]
    first = pl.program_id(1) * chunk_blocks
    last = jnp.minimum(first + chunk_blocks, pl.cdiv(vocab, block))
    lanes = jax.lax.broadcasted_iota(jnp.int32, (1, block), 1)

    def start_of(k):  # a ragged vocabulary's last block is read at vocab − block (overlapping the one before)
        return jnp.minimum(k * block, vocab - block)

    def copies(k, slot):
        cols = pl.ds(start_of(k), block)
        srcs = [x.at[b, pl.ds(node if indexed else 0, 1), cols] for x, indexed in zip(rows, by_node)]
        return [pltpu.make_async_copy(src, buf.at[slot], sems.at[slot, j])
                for j, (src, buf) in enumerate(zip(srcs, bufs))]

    for copy in copies(first, 0):
        copy.start()

    def visit(k, best):
        slot = jax.lax.rem(k - first, 2)
        prefetch_next_then_wait(copies, k, slot, k + 1 < last)
        start = start_of(k)
        vocab_ids = start + lanes
        p = p_buf[slot].astype(jnp.float32)
        inv = inv_buf[slot]
        if mode == "tree":
            def remove(j, weight):  # child j's token, if it falls in this block
                token = children_ref[b, j]
                return jax.lax.cond(
                    (token >= start) & (token < start + block),
                    lambda w: jnp.where(vocab_ids == token, 0.0, w), lambda w: w, weight,
                )

            weight = jax.lax.fori_loop(0, num_children_ref[b], remove, p)
        else:
            weight = jnp.maximum(p - q_buf[slot].astype(jnp.float32), 0.0)
        fresh = vocab_ids >= k * block  # the entries before k · block were the previous block's
        s_w = jnp.where(fresh, _scores(weight, inv), NEG_INF)
        s_p = jnp.where(fresh, _scores(p, inv), NEG_INF)
        return _fold(s_w, vocab_ids, best[0], keepdims=True), _fold(s_p, vocab_ids, best[1], keepdims=True)

    none = (jnp.full((1, 1), NEG_INF, jnp.float32), jnp.zeros((1, 1), jnp.int32))
    (m_w, i_w), (m_p, i_p) = jax.lax.fori_loop(first, last, visit, (none, none))
    lane = jax.lax.broadcasted_iota(jnp.int32, val_ref.shape, 1)
    val_ref[...] = jnp.where(lane == 0, m_w, m_p)
    idx_ref[...] = jnp.where(lane == 0, i_w, i_p)


def _first_max(val, idx):
    """Per row of [B, C] chunk results: the value and index of the first chunk holding the maximum."""
    c = jnp.argmax(val, axis=1)[:, None]
    return jnp.take_along_axis(val, c, axis=1)[:, 0], jnp.take_along_axis(idx, c, axis=1)[:, 0]


def _chunk_token(val, idx):
    """The race's token from per-chunk results [B, C, 2] (weights, p): the weights' first maximum, or p's if no
    weight is positive."""
    top_w, token_w = _first_max(val[..., 0], idx[..., 0])
    return jnp.where(top_w > NEG_INF, token_w, _first_max(val[..., 1], idx[..., 1])[1])


@functools.partial(
    jax.jit, static_argnames=("mode", "max_depth", "interpret", "vocab_block", "chunk_blocks", "backend")
)
def verify(tokens, parents, probs, uniforms, noise, q=None, *, mode: Mode, max_depth: int,
           interpret: bool | pltpu.InterpretParams = False, vocab_block: int = VOCAB_BLOCK,
           chunk_blocks: int = CHUNK_BLOCKS, backend: str | None = None):
    """The Pallas kernel; same signature and results as `verify_reference` (grid, blocks and lowering: see the
    module docstring). `vocab_block` (a power of two) and `chunk_blocks` set the blocking (tests). `backend` picks
    the variant: "tpu" the Mosaic TPU one, anything else ("cuda", "rocm", "gpu", "cpu") the Triton one; None is
    jax.default_backend(), so name it when exporting for another platform (`jax.export` traces on the host).
    `interpret` runs the variant in Pallas interpret mode: TPU interpret mode for "tpu" (True, or its
    `pltpu.InterpretParams`), the generic one otherwise (pallas_kernels/variants.py)."""
    if vocab_block & (vocab_block - 1):
        raise ValueError(f"vocab_block must be a power of two, got {vocab_block}")
    if kernel_variant(backend) == "tpu":
        return _verify_tpu(tokens, parents, probs, uniforms, noise, q, mode=mode, max_depth=max_depth,
                           interpret=interpret, vocab_block=vocab_block, chunk_blocks=chunk_blocks)
    b, n = tokens.shape
    v = probs.shape[-1]
    ok, best = _prepare(tokens, parents, probs, uniforms, q, mode)
    n_pad, width = _pow2(n), _pow2(max_depth + 1)

    def pad_nodes(x, fill):  # padding nodes have no parent and are never accepted
        return jnp.pad(x.astype(jnp.int32), ((0, 0), (0, n_pad - n)), constant_values=fill)

    operands = [pad_nodes(parents, -1), pad_nodes(ok, 0), pad_nodes(tokens, 0)]
    in_specs = [pl.BlockSpec((None, n_pad), lambda i, c: (i, 0))] * 3
    walk_spec = pl.BlockSpec((None, None, width), lambda i, c: (i, c, 0))
    if mode == "greedy":
        block, chunks = 0, 1
        out_specs, out_shape = [walk_spec] * 2, [jax.ShapeDtypeStruct((b, 1, width), jnp.int32)] * 2
    else:
        block = min(vocab_block, 1 << (v.bit_length() - 1))  # ≤ V: the last block never reads past the row
        chunks = pl.cdiv(pl.cdiv(v, block), chunk_blocks)
        rows = pl.BlockSpec((None, n, v), lambda i, c: (i, 0, 0))  # an address range, read one block at a time
        operands += [probs] + ([q] if mode == "chain" else []) + [_reciprocal(noise)]
        in_specs += [rows] * (2 if mode == "chain" else 1) + [pl.BlockSpec((None, v), lambda i, c: (i, 0))]
        race_spec = pl.BlockSpec((None, None, 2), lambda i, c: (i, c, 0))
        out_specs = [walk_spec, walk_spec, race_spec, race_spec]
        out_shape = [jax.ShapeDtypeStruct((b, chunks, width), jnp.int32)] * 2 + [
            jax.ShapeDtypeStruct((b, chunks, 2), jnp.float32), jax.ShapeDtypeStruct((b, chunks, 2), jnp.int32)]
    out = pl.pallas_call(
        functools.partial(_kernel, mode=mode, max_depth=max_depth, vocab=v, block=block, chunk_blocks=chunk_blocks),
        grid=(b, chunks),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=NUM_WARPS, num_stages=NUM_STAGES),
        interpret=bool(interpret),
        name="verify_" + mode,
    )(*operands)
    path, emitted = out[0][:, 0, : max_depth + 1], out[1][:, 0, : max_depth + 1]
    a = jnp.sum(path[:, 1:] >= 0, axis=1).astype(jnp.int32)
    node = jnp.take_along_axis(path, a[:, None], axis=1)[:, 0]
    if mode == "greedy":
        token = jnp.take_along_axis(best, node[:, None], axis=1)[:, 0]
    else:
        token = _chunk_token(out[2], out[3])
    return a, _with_token(emitted, a, token), path


def _verify_tpu(tokens, parents, probs, uniforms, noise, q, *, mode: Mode, max_depth: int,
                interpret: bool | pltpu.InterpretParams, vocab_block: int, chunk_blocks: int):
    """`verify` for Mosaic TPU: the walk by XLA (the reference's own vmapped walk: integers only), the race in the
    kernel, with the final node and its children's tokens as scalar-prefetch operands (SMEM); greedy needs no
    kernel. 32-bit rows are read in place at row `node`; narrower ones (bfloat16) are gathered by XLA first
    ([B, 1, V]: Mosaic packs two 16-bit rows per word in HBM, (8, 128)(2, 1) tiles, and slices rows only at
    multiples of 8)."""
    b, n = tokens.shape
    v = probs.shape[-1]
    ok, best = _prepare(tokens, parents, probs, uniforms, q, mode)
    walk = functools.partial(_walk_row, max_depth=max_depth, width=max_depth + 1)
    a, node, path, emitted = jax.vmap(walk)(parents, ok, tokens)
    if mode == "greedy":
        return a, _with_token(emitted, a, jnp.take_along_axis(best, node[:, None], axis=1)[:, 0]), path
    children = jnp.where((parents == node[:, None]) & (jnp.arange(n)[None] > 0), tokens, -1).astype(jnp.int32)
    children = jnp.sort(children, axis=1, descending=True)  # the children's tokens first, then -1s
    num_children = jnp.sum(children >= 0, axis=1, dtype=jnp.int32)
    block = min(vocab_block, 1 << (v.bit_length() - 1))
    chunks = pl.cdiv(pl.cdiv(v, block), chunk_blocks)
    rows = [probs] + ([q] if mode == "chain" else [])
    by_node = tuple(x.dtype.itemsize >= 4 for x in rows) + (False,)
    rows = [x if indexed else jnp.take_along_axis(x, node[:, None, None], axis=1) for x, indexed in zip(rows, by_node)]
    rows.append(_reciprocal(noise)[:, None])  # [B, 1, V]
    race = pl.BlockSpec((None, None, 1, RACE_LANES), lambda i, c, *_: (i, c, 0, 0))
    val, idx = pl.pallas_call(
        functools.partial(
            _race_kernel_tpu, mode=mode, vocab=v, block=block, chunk_blocks=chunk_blocks, by_node=by_node
        ),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3,
            grid=(b, chunks),
            in_specs=[pl.BlockSpec(memory_space=pl.ANY)] * len(rows),  # left in HBM, copied in block by block
            out_specs=[race, race],
            scratch_shapes=[pltpu.VMEM((2, 1, block), x.dtype) for x in rows]
            + [pltpu.SemaphoreType.DMA((2, len(rows)))],
        ),
        out_shape=[jax.ShapeDtypeStruct((b, chunks, 1, RACE_LANES), jnp.float32),
                   jax.ShapeDtypeStruct((b, chunks, 1, RACE_LANES), jnp.int32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        interpret=tpu_interpret(interpret),
        name="verify_" + mode,
    )(node.astype(jnp.int32), children, num_children, *rows)
    return a, _with_token(emitted, a, _chunk_token(val[:, :, 0, :2], idx[:, :, 0, :2])), path


def chain_parents(batch: int, num_nodes: int) -> jax.Array:
    """Parent pointers of a chain: node n's parent is n − 1."""
    return jnp.broadcast_to(jnp.arange(num_nodes, dtype=jnp.int32) - 1, (batch, num_nodes))


def per_shard(fn, mesh=None, *, with_q: bool):
    """`fn(tokens, parents, probs, uniforms, noise[, q])` run per shard of a (data, model) mesh in `jax.shard_map`:
    rows split over data, each row's whole vocabulary on its device (gathered over model), outputs split by row.
    `mesh=None` uses the mesh set with `jax.set_mesh`."""
    rows = P(DATA)
    return jax.shard_map(
        fn, mesh=mesh, in_specs=(rows,) * (6 if with_q else 5), out_specs=(rows, rows, rows), check_vma=False
    )


def verify_draft(tokens, parents, probs, uniforms, noise, q=None, *, mode: Mode, max_depth: int, impl: str):
    """Dispatch by implementation (`pallas_kernels.dispatch`): "reference" (jax.numpy), "pallas" (compiled) or
    "interpret"; the kernels run per shard under a mesh."""
    if impl == "reference":
        return verify_reference(tokens, parents, probs, uniforms, noise, q, mode=mode, max_depth=max_depth)
    fn = functools.partial(verify, mode=mode, max_depth=max_depth, interpret=impl == "interpret")
    args = (tokens, parents, probs, uniforms, noise) + (() if q is None else (q,))
    return (per_shard(fn, with_q=q is not None) if on_mesh() else fn)(*args)
