"""Attention with canonical, batch-invariant numerics: each query's result is a function of its own q, its position
p and the keys/values at positions 0..p, bit for bit, whether it is decoded alone, verified in a chain or a tree, or
prefilled, whatever the batch (jaxspec/models/numerics.py says why).

The caller has written this call's K/V into the cache first (write before read), so a chain's or a prefill's keys
already sit at their positions. A tree node's ancestors do not (siblings share positions), so for the tail blocks
(those holding positions ≥ the committed length) each node's ancestors are gathered into position order.

The canonical operations, per (sequence, KV head, query token):
    keys in blocks of `key_block` at absolute positions [n·Bk, (n+1)·Bk), n = 0, 1, ...
    per block: s = q_G · k_n as one [G, D] x [D, Bk] dot (G = query heads of the KV head);
               m_n = max visible s; p = exp((s − m_n)·D^-½) (0 where invisible); l_n = halving sum of p;
               a_n = p (in v's dtype) · v_n as one [G, Bk] x [Bk, D] dot
    fold blocks in order: m = max(m, m_n); l = l·e^((m_old−m)·D^-½) + l_n·e^((m_n−m)·D^-½); a likewise;
    out = a · (1/l). Products are rounded before they are added (no FMA contraction: numerics.exact_mul).
A block with nothing visible leaves (m, l, a) exactly unchanged, so the number of blocks past p (the cache
capacity) does not matter either.

Three static arguments serve Gemma: `scale` (None: D^-½; Gemma 4 norms q and k and scales by 1.0, Gemma 2/3 use
query_pre_attn_scalar^-½), `window` (a sliding layer's query at p sees keys at p - window < position ≤ p) and
`softcap` (Gemma 2: the scores are softcap·tanh(s·scale / softcap), and the exponent's scale is then 1; `Scores`).
They are part of the visible mask and the canonical operations, the same in every path. A fold that starts on
blocks with nothing visible ends with exactly the partial of the first visible block (m = -1e30, l = a = 0 merge
into it as e^-∞ = 0 and e^0 = 1), so the kernels start their loop at the first block the window reaches
(`_first_visible_block`; the TPU variant copies nothing before it) and give the reference's bits, which folds every
block.

The query rows of those dots are zero-padded to QUERY_ROWS (16; G rounded up to a power of two where that is
more): the kernel pads each token's G rows, and every one of its dots is [16, D] x [D, Bk] and [16, Bk] x [Bk, D].
The reference (`_attend_tokens`) packs all its tokens' rows into whole 16-row tiles and meets each key block with
all of them in one dot ([16·n, D] x [D, Bk]), so that it reads each key block once instead of once per token or
tile. Either way a row's products do not depend on the rows beside it, nor on how many there are: each output of a
dot over D (or Bk) is its own row's sum in the same order (measured on XLA:CPU for 16-64 rows; the earlier
reference, 16-row dots, gave the compiled kernel's bits on an H200; the reference's 32-row dots are to be checked
on a GPU by the compiled suite of `scripts/gpu_sitting.sh`).

The Pallas kernel (`invariant_attention`), in its one-pass form, runs those operations one program per (query token,
KV head, sequence): grid (T, Hkv, B), the token axis first so that the programs reading one cache row run side by
side. Its cache BlockSpec spans the row's S slots, but the kernel reads it `key_block` rows at a time (`pl.ds` in a
`fori_loop`, as jax's own ops/gpu/decode_attention.py does), so one key block and one value block are live at a time,
never the row; the loop stops at the query's last visible block. The G query heads are zero-padded to QUERY_ROWS (16)
rows, the smallest Triton dot: every call has the same [16, D] x [D, Bk] and [16, Bk] x [Bk, D] dots, and a padding
row changes no bit of a real one (each output of a dot is its own row's product; measured on XLA:CPU in interpret
mode). Tree tails are gathered by XLA before the call (as the reference gathers them) and read per token, two [Bk, D]
blocks.

The split (flash-decoding) form, Triton variant only. The one-pass grid has T·Hkv·B programs, each walking its
blocks in turn: a decode of one sequence on Llama-3.1-8B is 8 programs walking 256 blocks each at 16k keys, on a
GPU with 132 SMs (H100). The block partials do not depend on each other; only the fold is sequential, and it must
stay so: `merge` rounds at every step and is not associative, so running states of separate ranges cannot be
combined into the same bits (flash-decoding's usual combine would change them). So the split form computes the
partials in parallel and folds them afterwards, in two calls:
- phase 1 (`_kernel_partials`), grid (T, Hkv, B, splits): program c takes the contiguous blocks [c·P, (c + 1)·P),
  computes each block the query can see with the one-pass kernel's code (`_partials`: `block_partial` on the same
  [16, D] query rows and [Bk, D] blocks, tree tails included) and stores its (m, l, a) in float32 buffers
  [B, T, Hkv, nb·G' (+ R − G'), (D)], G' = G rounded up to a power of two (masked stores: the padding rows are
  neither written nor read; the R − G' spare rows keep the last block's 16-row store in bounds). Blocks past the
  query's last visible block are skipped and their rows left unwritten;
- phase 2 (`_kernel_fold`), grid (T, Hkv, B): folds blocks 0 .. end − 1 left to right with `merge`, then `finish`,
  as the one-pass kernel does, elementwise on the G' kept rows instead of all 16 (an elementwise op's bits do not
  depend on how many rows it runs on; the stored partials read back exactly). It loads 8 blocks' partials (G' = 4)
  before folding them, so their loads are in flight together.
Same operations, same order, same bits as the one-pass form and the reference. The price is the partials' traffic:
G'·(D + 2)·4 bytes per token, KV head and block, written once and read once (2 KB on Llama-3.1-8B, against 32 KB of
keys and values per block and sequence, which the one-pass form shares among a sequence's tokens). Hence the rule
(`split_blocks`, static shapes): split when T·Hkv·B ≤ SPLIT_MAX_PROGRAMS (64) and nb ≥ SPLIT_MIN_BLOCKS (32, 2048
keys), with P = max(4, ceil(T·Hkv·B·nb / 1024)) blocks per program (about 1024 programs): on Llama-3.1-8B, decodes of
up to 8 sequences and verifies of up to 8 tokens of one sequence; its buffers then take at most 64·nb·G'·(D + 2)·4
bytes (68 MB at 32k keys). The thresholds are estimates, not yet measured on a GPU. `split` forces either form
(tests). The TPU variant has the one-pass form only.

On GPUs it is lowered with Triton, chosen explicitly (`compiler_params=pallas.triton.CompilerParams`, a public name
in JAX 0.10 and 0.11): since JAX 0.10 a plain `pallas_call` goes to Mosaic GPU, which stages every block in shared
memory (the whole cache row: 16 MB at S = 32768, against 227 KB per SM on an H100) and needs Hopper; Triton
reads blocks through pointers and runs on any CUDA GPU from Ampere on and on ROCm. What Triton asks of the kernel:
power-of-two tensor sizes (Bk, D and the padded rows), dots of at least 16 in every dimension, and no slicing of
values: numerics' halving max/sum are written with `lax.split`, which lowers there, and the
optimization barriers (`fenced`, against XLA's algebraic simplifier, which never sees a compiled kernel; Triton has
no rule for them) are kept only in interpret mode, where XLA does run the kernel body.

On TPUs (`backend="tpu"`, pallas_kernels/variants.py) a Mosaic variant (`_kernel_tpu`) runs the same grid, the same
per-block operations and fold (block_partial, merge, finish) and the same 16 padded query rows, laid out as Mosaic
asks: its own CompilerParams (every grid axis parallel); positions and the tree tails' first block n0 as
scalar-prefetch operands (Mosaic reads scalars from SMEM, not from vector blocks); the caches left in HBM (`pl.ANY`),
each [Bk, D] key and value block copied by DMA into a double-buffered VMEM scratch, up to the query's last visible
block only; query rows, outputs and tree tails as VMEM blocks whose last two dimensions are whole ([16, D], [Bk, D]),
as Mosaic's (8, 128) tiling wants. Dots of 16-bit operands say precision "default" (Mosaic takes no fp32 contract
precision for them; their products are exact in float32 either way). Checked without a TPU: the Mosaic lowering
(`jax.export`) and libtpu's ahead-of-time compilation for v5e and v4 (tests/test_invariant_kernel_lowering.py), and
TPU interpret mode bit for bit against the reference (tests/test_tpu_interpret.py); not yet run on a TPU, whose
exp and division need not round as XLA:TPU's do (the kernel against itself is what invariance needs).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as plgpu
from jax.sharding import PartitionSpec as P

from pallas_kernels.dispatch import on_mesh
from pallas_kernels.mesh_axes import DATA, MODEL
from pallas_kernels.primitives import exact_mul, fenced, halving_max, halving_sum, held_dtype
from pallas_kernels.variants import kernel_variant, prefetch_next_then_wait, tpu_interpret

NEG_INF = -1e30


@dataclasses.dataclass(frozen=True)
class Scores:
    """How a dot product s = q·k becomes a score (a static argument: hashable): s·scale, or, with `softcap` (Gemma
    2), softcap·tanh(s·scale / softcap). Uncapped, the scale is applied after the max is subtracted (no product
    meets an add: `exp_scale`); capped, the capped value is the score and the exponent's scale is 1."""

    scale: float
    softcap: float | None = None

    @staticmethod
    def of(head_dim: int, scale: float | None = None, softcap: float | None = None) -> Scores:
        """The public arguments: scale None is D^-½."""
        return Scores(head_dim**-0.5 if scale is None else float(scale), None if softcap is None else float(softcap))

    @property
    def exp_scale(self) -> float:
        return self.scale if self.softcap is None else 1.0

    def cap(self, s: jax.Array) -> jax.Array:
        """The scores as the max and the exponent see them: unchanged uncapped; capped, each product rounded."""
        if self.softcap is None:
            return s
        return exact_mul(jnp.tanh(exact_mul(s, self.scale / self.softcap)), self.softcap)


def block_partial(q, k, v, visible, scores: Scores, *, fence=fenced, per_row: bool = False,
                  materialize: bool = False):
    """One key block's softmax partial, the canonical operations shared by the reference and the kernel.

    q [..., G, D]; k, v [..., Bk, D]; visible [..., Bk], or [..., G, Bk] with per_row (each query row its own; the
    reference's dots hold several tokens), leading axes broadcast → m, l [..., G], a [..., G, D].
    The dots are one [G, D] x [D, Bk] and one [G, Bk] x [Bk, D] product per leading index: with leading axes they
    are batched dots of that fixed per-batch shape, whose bits do not depend on the batch count (measured on XLA:CPU
    and on an H100); the kernel runs the same products one program at a time. The kernel passes its own `fence`
    (none when compiled). `materialize` (the reference on GPU) ends the halving max and sum in a two-value reduce: the
    same bits, and XLA:GPU then does not recompute their trees in every consumer (primitives.halving_sum)."""
    if q.shape[-2] == 1:  # one query row (MHA): XLA:CPU compiles [1, D] x [D, Bk] as a matrix-vector product, which
        # sums in another order than any dot of two or more rows (the kernel's have 16); a zero row gives the same bits
        # (per_row never meets one row: the reference's dots have query_tile_rows >= 16)
        m, l, a = block_partial(jnp.concatenate([q, jnp.zeros_like(q)], axis=-2), k, v, visible, scores, fence=fence,
                                materialize=materialize)
        return m[..., :1], l[..., :1], a[..., :1, :]
    # The barriers (`fenced`) keep XLA's algebraic simplifier from folding broadcast operands (keys shared by every
    # token, a token's query shared by every block) into a larger dot (seen on XLA:CPU).
    # 16-bit operands meet in float32 on CPU (numerics.held_dtype; the products are exact, so the math is the same):
    # on CPUs with AMX, XLA:CPU's own bfloat16 dot (YNNPACK) sums in an order that depends on the batch count, so the
    # kernel's one-program products and the reference's batched ones differed in the last bit (measured)
    wide = held_dtype(q.dtype)
    s = fence(functools.partial(jnp.einsum, "...gd,...cd->...gc", preferred_element_type=jnp.float32),
              q.astype(wide), k.astype(wide))
    vis = visible if per_row else visible[..., None, :]  # [..., G or 1, Bk]
    s = jnp.where(vis, scores.cap(s), NEG_INF)
    m = halving_max(s, materialize=materialize)  # of the unscaled scores: the scale comes after the subtraction,
    # so no product meets an add
    p = jnp.where(vis, jnp.exp(exact_mul(s - m[..., None], scores.exp_scale)), 0.0)
    l = halving_sum(p, materialize=materialize)
    a = fence(
        functools.partial(jnp.einsum, "...gc,...cd->...gd", preferred_element_type=jnp.float32),
        p.astype(v.dtype).astype(wide), v.astype(wide),  # probabilities rounded to v's dtype, then widened on CPU
    )
    return m, l, a


def merge(state, partial, scores: Scores):
    """Fold the next block's partial into the running (m, l, a): an elementwise left fold, the same in every path."""
    m_run, l_run, a_run = state
    m, l, a = partial
    m_new = jnp.maximum(m_run, m)
    old, new = jnp.exp(exact_mul(m_run - m_new, scores.exp_scale)), jnp.exp(exact_mul(m - m_new, scores.exp_scale))
    return (
        m_new,
        exact_mul(l_run, old) + exact_mul(l, new),
        exact_mul(a_run, old[..., None]) + exact_mul(a, new[..., None]),
    )


def finish(state):
    """a / l with an explicit reciprocal (XLA rewrites `a / broadcast(l)` into a multiply by 1/l in some programs
    and not in others, seen on XLA:CPU); rows that saw nothing give zeros."""
    _, l, a = state
    inv_l = jnp.where(l > 0, 1.0 / jnp.where(l > 0, l, 1.0), 0.0)
    return a * inv_l[..., None]


# On a TPU, partials of more than FOLD_ALL_BYTES (a batch of 8 at 8k keys on Llama-3.1-8B: 69 MB a layer for a
# decode, 138 for a verify of 6) go in groups of blocks of at most FOLD_GROUP_BYTES each, folded before the next
# group's dots (`_attend_tokens`). Below it grouping cost bytes on a v5e (a verify of 6 at batch 1, 8k: 17 MB of
# partials, 1.096x its weight + KV bytes at once, 1.181x in groups)
FOLD_ALL_BYTES = 32 << 20
FOLD_GROUP_BYTES = 2 << 20
QUERY_CHUNK = 16  # query tokens per pass: bounds the per-token copies of the cache the batched dots read


def invariant_attention_reference(
    q: jax.Array,  # [B, T, Hq, D]
    k_cache: jax.Array,  # [B, Hkv, S, D] this call's K/V already written at slots lengths + i
    v_cache: jax.Array,  # [B, Hkv, S, D]
    lengths: jax.Array,  # [B] committed slots
    positions: jax.Array,  # [B, T] each query's absolute position (its slot, for chains and prefills)
    ancestors: jax.Array | None = None,  # [B, T, L] tree: block index of query t's ancestor at depth j (itself at
    # j = depth_t; entries past it are ignored); None: the new tokens sit at their positions (chain, prefill, decode)
    *,
    key_block: int = 64,
    num_blocks: int | None = None,  # static bound on the blocks any query can see (prefills: ceil(T / Bk))
    scale: float | None = None,  # the scores' scale; None: D^-½ (Gemma 4 norms q and k instead: 1.0)
    window: int | None = None,  # sliding window: a query at p sees keys at p - window < position <= p
    softcap: float | None = None,  # scores capped at softcap·tanh(s·scale / softcap) (Gemma 2)
    fold_group: int | None = None,  # key blocks per group of partials (`_attend_tokens`); None: `fold_group_for`
) -> jax.Array:
    """→ [B, T, Hq, D] in q's dtype. More than QUERY_CHUNK tokens go QUERY_CHUNK at a time (a loop): each token's
    operations are the same, and memory stays O(QUERY_CHUNK · S) instead of O(T · S) for a long prefill."""
    t = q.shape[1]
    attend = functools.partial(_attend_tokens, key_block=key_block, num_blocks=num_blocks,
                               scores=Scores.of(q.shape[-1], scale, softcap), window=window, fold_group=fold_group)
    if t <= QUERY_CHUNK:
        return attend(q, k_cache, v_cache, lengths, positions, ancestors)
    chunks = -(-t // QUERY_CHUNK)
    pad = chunks * QUERY_CHUNK - t

    def split(x):  # [B, T, ...] -> [chunks, B, QUERY_CHUNK, ...] (padding tokens see position 0; dropped)
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        return jnp.moveaxis(x.reshape(x.shape[0], chunks, QUERY_CHUNK, *x.shape[2:]), 1, 0)

    xs = (split(q), split(positions)) + (() if ancestors is None else (split(ancestors),))
    out = jax.lax.map(
        lambda c: attend(c[0], k_cache, v_cache, lengths, c[1], c[2] if ancestors is not None else None), xs
    )  # [chunks, B, QUERY_CHUNK, Hq, D]
    return jnp.moveaxis(out, 0, 1).reshape(q.shape[0], chunks * QUERY_CHUNK, *q.shape[2:])[:, :t]


def fold_group_for(partial_bytes: int, blocks: int, backend: str | None = None) -> int:
    """Key blocks per group of partials: all of them, except on a TPU where they would take more than
    FOLD_ALL_BYTES (`partial_bytes`, every block's a-partials): there XLA keeps them in HBM, written by the dots and
    read back by the fold (a v5e, batch 8, 8k keys: 1.16 GB a layer of Llama-3.1-8B against the 0.70 it must read),
    so groups of at most FOLD_GROUP_BYTES, each folded before the next group's dots (0.72 GB)."""
    if (backend or jax.default_backend()) != "tpu" or partial_bytes <= FOLD_ALL_BYTES:
        return blocks
    return max(1, FOLD_GROUP_BYTES // max(1, partial_bytes // blocks))


def _attend_tokens(q, k_cache, v_cache, lengths, positions, ancestors, *, key_block: int, num_blocks: int | None,
                   scores: Scores, window: int | None, fold_group: int | None = None):
    """invariant_attention_reference on one group of query tokens.

    Each KV head's T·G query rows are packed into R rows, whole tiles of `query_tile_rows(G)` (16 on most models:
    four tokens of G = 4), and every key block is met by all of them at once: one [R, D] x [D, Bk] and one
    [R, Bk] x [Bk, D] dot per (sequence, KV head, block). A row's products do not depend on the other rows of its
    dot, nor on their number (module docstring), so a token gets its decode's bits at any row. What this saves is
    the cache: each key block is read once per call. A copy of the cache per token (before 2026-11-27) made XLA
    write and read it 6 times over for a verify of 6 tokens, and then a copy per 16-row tile, materialized by
    XLA:GPU as a broadcast, twice (compiled for an H100 at 8k keys: 104 MB per layer of 296 for the attention).
    The partials keep the block axis where the dots put it ([B, H, N, R, ...]) and the fold reads the real rows
    only. With `fold_group` < N (`fold_group_for`: large batches on a TPU), the dots meet the blocks a group at a
    time, each group folded before the next: the same per-block dots and the same left fold, so the same bits."""
    b, t, hq, d = q.shape
    hkv, s = k_cache.shape[1], k_cache.shape[2]
    g = hq // hkv
    bk = key_block
    nb = -(-s // bk) if num_blocks is None else num_blocks
    if nb * bk > s:  # whole blocks only: the padding is never visible
        pad = ((0, 0), (0, 0), (0, nb * bk - s), (0, 0))
        k_cache, v_cache = jnp.pad(k_cache, pad), jnp.pad(v_cache, pad)
    k_blocks = k_cache[:, :, : nb * bk].reshape(b, hkv, nb, bk, d)
    v_blocks = v_cache[:, :, : nb * bk].reshape(b, hkv, nb, bk, d)
    rows = t * g
    r = -(-rows // query_tile_rows(g)) * query_tile_rows(g)  # whole tiles, all of them in one dot
    qg = q.reshape(b, t, hkv, g, d).transpose(0, 2, 1, 3, 4)  # [B, H, T, G, D]
    qt = jnp.pad(qg.reshape(b, hkv, rows, d), ((0, 0), (0, 0), (0, r - rows), (0, 0)))[:, :, None]  # [B, H, 1, R, D]
    row_pos = jnp.pad(jnp.repeat(positions, g, axis=1), ((0, 0), (0, r - rows)), constant_values=-1)  # [B, R]
    slots = jnp.arange(nb * bk, dtype=jnp.int32).reshape(nb, bk)
    visible = in_window(slots[None, None], row_pos[:, :, None, None], window)  # [B, R, N, Bk]; padding: nothing
    visible = visible.transpose(0, 2, 1, 3)[:, None]  # [B, 1, N, R, Bk]
    def per_token(x):  # [B, H, N, R, ...] -> [B, H, N, T, G, ...] (the padding rows dropped)
        return x[:, :, :, :rows].reshape(b, hkv, x.shape[2], t, g, *x.shape[4:])

    def partials(lo, hi):  # blocks lo .. hi - 1: m, l [B, H, n, T, G]; a [B, H, n, T, G, D]
        m, l, a = block_partial(
            jnp.broadcast_to(qt, (b, hkv, hi - lo, r, d)), k_blocks[:, :, lo:hi], v_blocks[:, :, lo:hi],
            visible[:, :, lo:hi], scores, per_row=True, materialize=jax.default_backend() == "gpu",
        )
        m, l, a = per_token(m), per_token(l), per_token(a)
        if ancestors is not None:  # a tree's tail blocks, by absolute block index: one group of every block
            m, l, a = _tree_tail(qg, k_cache, v_cache, lengths, positions, ancestors, (m, l, a), bk, scores, window)
        return m, l, a

    # groups of blocks (`fold_group_for`; a-partials are float32): the same partials and left fold, the same bits
    group = nb if ancestors is not None else fold_group or fold_group_for(b * hkv * nb * r * d * 4, nb)
    state = None
    for lo in range(0, nb, group):
        m, l, a = partials(lo, min(nb, lo + group))
        for n in range(m.shape[2]):  # fold the blocks in position order
            part = (m[:, :, n], l[:, :, n], a[:, :, n])
            state = part if state is None else merge(state, part, scores)
    out = finish(state)  # [B, H, T, G, D]
    return out.transpose(0, 2, 1, 3, 4).reshape(b, t, hq, d).astype(q.dtype)


def query_tile_rows(g: int) -> int:
    """Query rows per dot for G query heads per KV head: the kernel's (QUERY_ROWS, or G rounded up to a power of two
    where that is more), so that the reference and the kernel run one dot shape."""
    return max(QUERY_ROWS, 1 << (g - 1).bit_length())


def in_window(key_pos, query_pos, window: int | None):
    """Whether a query at query_pos sees the key at key_pos (broadcast): causal, and within a sliding window.
    Keys left of the window fall out of whole blocks as well as parts: a block with nothing visible leaves the fold
    exactly unchanged (module docstring), so the window needs no other change to the canonical operations."""
    visible = key_pos <= query_pos
    return visible if window is None else visible & (key_pos > query_pos - window)


def tree_tail_keys(k_cache, v_cache, lengths, positions, ancestors, bk, window: int | None = None):
    """The two blocks from the committed length on (n0 = lengths // Bk and n0 + 1) as each tree node sees them:
    committed slots as they are, then its ancestors gathered into position order. Needs depth + 1 ≤ Bk, so that
    every node's positions end inside those two blocks. → k, v [B, H, T, 2, Bk, D], visible [B, T, 2, Bk], n0 [B]."""
    b, hkv, _, d = k_cache.shape
    t, depth = ancestors.shape[1], ancestors.shape[2]
    if depth > bk:
        raise ValueError(f"tree depth {depth - 1} needs key_block > depth (got key_block={bk})")
    n0 = lengths // bk  # [B]
    slots = n0[:, None] * bk + jnp.arange(2 * bk, dtype=jnp.int32)[None]  # [B, 2Bk] absolute slots
    rel = slots - lengths[:, None]  # [B, 2Bk] offset past the committed length
    anc = jnp.take_along_axis(
        ancestors, jnp.broadcast_to(jnp.clip(rel, 0, depth - 1)[:, None, :], (b, t, 2 * bk)), axis=2
    )  # [B, T, 2Bk]
    src = jnp.where(rel[:, None, :] < 0, slots[:, None, :], lengths[:, None, None] + anc)
    src = jnp.clip(src, 0, k_cache.shape[2] - 1)  # [B, T, 2Bk] which cache slot holds the key at each position

    def gather(cache):  # [B, H, S, D] -> [B, H, T, 2, Bk, D]
        idx = jnp.broadcast_to(src[:, None, :, :, None], (b, hkv, t, 2 * bk, 1))
        rows = jnp.take_along_axis(cache[:, :, None], idx, axis=3)
        return rows.reshape(b, hkv, t, 2, bk, d)

    visible = in_window(slots[:, None, :], positions[:, :, None], window).reshape(b, t, 2, bk)
    return gather(k_cache), gather(v_cache), visible, n0


def _tree_tail(qg, k_cache, v_cache, lengths, positions, ancestors, partials, bk, scores, window):
    """Replace the partials [B, H, N, T, G, ...] of the two tail blocks by ones over each node's own keys
    (tree_tail_keys); qg [B, H, T, G, D]."""
    b, hkv, t, g, d = qg.shape
    k_tail, v_tail, visible, n0 = tree_tail_keys(k_cache, v_cache, lengths, positions, ancestors, bk, window)
    m, l, a = partials
    nb = m.shape[2]
    tm, tl, ta = block_partial(
        jnp.broadcast_to(qg[:, :, :, None], (b, hkv, t, 2, g, d)), k_tail, v_tail, visible[:, None], scores,
        materialize=jax.default_backend() == "gpu",
    )  # m, l [B, H, T, 2, G]; a [B, H, T, 2, G, D]
    which = jnp.arange(nb)[None, :] - n0[:, None]  # [B, N]: 0 / 1 at the tail blocks

    def pick(shared, tail):  # shared [B, H, N, T, G, ...], tail [B, H, T, 2, G, ...]
        sel = which.reshape(b, 1, nb, *(1,) * (shared.ndim - 3))
        return jnp.where(sel == 0, tail[:, :, None, :, 0], jnp.where(sel == 1, tail[:, :, None, :, 1], shared))

    return pick(m, tm), pick(l, tl), pick(a, ta)


def _unfenced(fn, *operands):
    return fn(*operands)


def _visible_blocks(pos, key_block: int, num_blocks: int):
    """The number of blocks a query at `pos` can see: blocks 0 .. end - 1 (at least one, at most num_blocks)."""
    return jnp.clip(jax.lax.div(jnp.maximum(pos, 0), key_block) + 1, 1, num_blocks)


def _first_visible_block(pos, key_block: int, window: int | None, end):
    """The first block a query at `pos` can see under a sliding window (0 without one; at most end - 1). The blocks
    before it hold nothing visible, and a fold that starts at block 0 leaves its state exactly as this block's
    partial (module docstring), so skipping them changes no bit: a sliding layer reads its window, not its past."""
    if window is None:
        return 0
    return jnp.minimum(jax.lax.div(jnp.maximum(pos - window + 1, 0), key_block), end - 1)


def _rows(n, size: int):
    """Rows n·size .. (n + 1)·size - 1 of a ref (`pl.ds`), with the alignment said for a traced n."""
    start = n * size
    return pl.ds(start if isinstance(start, int) or size == 1 else pl.multiple_of(start, size), size)


def _partials(pos, q_ref, k_ref, v_ref, tail_refs, *, key_block: int, scores: Scores, window: int | None,
              fence: bool):
    """→ partial(n): block n's (m, l, a) for one query token's padded rows (Triton kernels), by `block_partial`.
    Block n is read from the cache `key_block` rows at a time, or, for a tree's tail blocks (n0 and n0 + 1),
    from the pre-gathered tails (`tail_refs` = (n0_ref, kt_ref, vt_ref); None: no tree)."""
    q = q_ref[...]  # [R, D]
    canonical = functools.partial(block_partial, fence=fenced if fence else _unfenced)

    def cache_block(n):
        rows = _rows(n, key_block)
        return k_ref[rows, :], v_ref[rows, :]  # [Bk, D]

    def load(n):
        if tail_refs is None:
            return cache_block(n)
        n0_ref, kt_ref, vt_ref = tail_refs
        n0 = n0_ref[...]
        shared = (n < n0) | (n > n0 + 1)  # past n0 + 1 only if positions overrun the tree: the reference's choice too
        return jax.lax.cond(shared, cache_block, lambda n: (kt_ref[n - n0], vt_ref[n - n0]), n)

    def partial(n):
        k, v = load(n)
        visible = in_window(n * key_block + jax.lax.broadcasted_iota(jnp.int32, (key_block,), 0), pos, window)
        return canonical(q, k, v, visible, scores)

    return partial


def _unpack_refs(refs, tree: bool, outputs: int):
    """(q_ref, k_ref, v_ref, tail_refs or None, output refs) from a Triton kernel's refs after the positions."""
    if tree:
        n0_ref, q_ref, k_ref, v_ref, kt_ref, vt_ref, *outs = refs
        tail = (n0_ref, kt_ref, vt_ref)
    else:
        q_ref, k_ref, v_ref, *outs = refs
        tail = None
    assert len(outs) == outputs
    return q_ref, k_ref, v_ref, tail, outs


def _kernel(pos_ref, *refs, key_block: int, num_blocks: int, scores: Scores, window: int | None, tree: bool,
            fence: bool):
    """One (sequence, query token, KV head): its query rows (the G heads, zero-padded) against the key blocks in
    position order, one block live at a time, with the same per-block operations and fold as the reference. Blocks
    past the query's position are not visited: with nothing visible they would leave (m, l, a) exactly unchanged.
    Tree tails (blocks n0 and n0 + 1, per token) come pre-gathered; the other blocks are read from the cache."""
    q_ref, k_ref, v_ref, tail, (o_ref,) = _unpack_refs(refs, tree, 1)
    pos = pos_ref[...]
    partial = _partials(pos, q_ref, k_ref, v_ref, tail, key_block=key_block, scores=scores, window=window,
                        fence=fence)
    end = _visible_blocks(pos, key_block, num_blocks)
    start = _first_visible_block(pos, key_block, window, end)
    state = jax.lax.fori_loop(start + 1, end, lambda n, st: merge(st, partial(n), scores), partial(start))
    o_ref[...] = finish(state).astype(o_ref.dtype)


def _kernel_partials(pos_ref, *refs, key_block: int, num_blocks: int, blocks_per_split: int, kept: int,
                     scores: Scores, window: int | None, tree: bool, fence: bool):
    """Split form, phase 1: one (query token, KV head, sequence, split) computes the partials (m, l, a) of its
    contiguous range of blocks [c·P, (c + 1)·P), those the query can see, each exactly as `_kernel` computes it, and
    stores block n's first `kept` rows at rows n·kept .. of the token's buffers (masked stores: the padding rows past
    the G' kept are neither written nor read). Blocks past the query's last visible one are skipped, their rows left
    unwritten: the fold never reads them."""
    q_ref, k_ref, v_ref, tail, (m_ref, l_ref, a_ref) = _unpack_refs(refs, tree, 3)
    pos = pos_ref[...]
    rows = q_ref.shape[0]
    partial = _partials(pos, q_ref, k_ref, v_ref, tail, key_block=key_block, scores=scores, window=window,
                        fence=fence)
    end = _visible_blocks(pos, key_block, num_blocks)
    first = jnp.maximum(pl.program_id(3) * blocks_per_split, _first_visible_block(pos, key_block, window, end))
    stop = jnp.minimum(pl.program_id(3) * blocks_per_split + blocks_per_split, end)
    keep = jax.lax.broadcasted_iota(jnp.int32, (rows,), 0) < kept

    def store(ref, value, n):
        at = ref.at[pl.ds(_rows(n, kept).start, rows)]  # R rows from block n's first: R - kept rows to spare
        if kept == rows:
            at[...] = value
        else:
            plgpu.store(at, value, mask=keep if value.ndim == 1 else keep[:, None])

    def block(n, carry):
        for ref, value in zip((m_ref, l_ref, a_ref), partial(n)):  # (m, l, a)
            store(ref, value, n)
        return carry

    jax.lax.fori_loop(first, stop, block, jnp.int32(0))


def _kernel_fold(pos_ref, m_ref, l_ref, a_ref, o_ref, *, key_block: int, num_blocks: int, scores: Scores,
                 window: int | None, unroll: int):
    """Split form, phase 2: one (query token, KV head, sequence) folds the stored partials of blocks 0 .. end - 1
    left to right with `merge`, as `_kernel` folds them, then `finish`. Elementwise on the kept rows [G', D]: each
    row's bits are those of the same row in `_kernel`'s [R, D]. `unroll` blocks' partials are loaded before they
    are folded, so that their loads are in flight together."""
    kept = o_ref.shape[0]
    pos = pos_ref[...]
    end = _visible_blocks(pos, key_block, num_blocks)

    def load(n):
        rows = _rows(n, kept)
        return m_ref[rows], l_ref[rows], a_ref[rows, :]

    def group(i, state):
        first = start + 1 + i * unroll
        parts = [load(first + u) for u in range(unroll)]
        for part in parts:
            state = merge(state, part, scores)
        return state

    start = _first_visible_block(pos, key_block, window, end)  # phase 1 stored blocks start .. end - 1 only
    groups = jax.lax.div(end - 1 - start, unroll)
    state = jax.lax.fori_loop(0, groups, group, load(start))
    state = jax.lax.fori_loop(start + 1 + groups * unroll, end, lambda n, st: merge(st, load(n), scores), state)
    o_ref[...] = finish(state).astype(o_ref.dtype)


def _kernel_tpu(pos_ref, n0_ref, q_ref, k_hbm, v_hbm, *refs, key_block: int, num_blocks: int, scores: Scores,
                window: int | None, tree: bool, fence: bool):
    """Mosaic TPU: `_kernel`'s operations for one (query token, KV head, sequence), with the scalars (positions,
    tree tails' first blocks n0) in SMEM (scalar prefetch) and the cache left in HBM: each [Bk, D] key and value
    block is copied into VMEM by DMA, double-buffered (block n + 1 is on its way while block n is used). Tree tails
    come pre-gathered as VMEM blocks."""
    if tree:
        kt_ref, vt_ref, o_ref, k_buf, v_buf, sems = refs
    else:
        o_ref, k_buf, v_buf, sems = refs
    j, h, i = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    pos = pos_ref[i, j]
    q = q_ref[...]  # [R, D]
    fence_fn = fenced if fence else _unfenced

    def canonical(q, k, v, visible, scores):
        # Mosaic takes no fp32 contract precision (jax_default_matmul_precision="highest") for 16-bit operands,
        # whose products are exact in float32 at any precision: their dots say "default"
        precision = "default" if k.dtype.itemsize < 4 else None
        with jax.default_matmul_precision(precision):
            return block_partial(q, k, v, visible, scores, fence=fence_fn)

    def copies(n, slot):
        rows = pl.ds(pl.multiple_of(n * key_block, key_block), key_block)
        return [pltpu.make_async_copy(cache.at[i, h, rows], buf.at[slot], sems.at[slot, c])
                for c, (cache, buf) in enumerate(((k_hbm, k_buf), (v_hbm, v_buf)))]

    def partial(n, slot):
        k, v = k_buf[slot], v_buf[slot]
        if tree:
            n0 = n0_ref[i]
            shared = (n < n0) | (n > n0 + 1)  # as in `_kernel`
            k, v = jax.lax.cond(shared, lambda: (k, v), lambda: (kt_ref[n - n0], vt_ref[n - n0]))
        visible = in_window(n * key_block + jax.lax.broadcasted_iota(jnp.int32, (key_block,), 0), pos, window)
        return canonical(q, k, v, visible, scores)

    def step(n, state):
        slot = jax.lax.rem(n, 2)
        prefetch_next_then_wait(copies, n, slot, n + 1 < end)
        return merge(state, partial(n, slot), scores)

    end = _visible_blocks(pos, key_block, num_blocks)
    start = _first_visible_block(pos, key_block, window, end)
    slot = jax.lax.rem(start, 2)
    for copy in copies(start, slot):
        copy.start()

    @pl.when(end > start + 1)
    def _():
        for copy in copies(start + 1, 1 - slot):
            copy.start()

    for copy in copies(start, slot):
        copy.wait()
    first = partial(start, slot)
    state = jax.lax.fori_loop(start + 1, end, step, first)
    o_ref[...] = finish(state).astype(o_ref.dtype)


QUERY_ROWS = 16  # the kernel's dot has at least this many query rows (Triton's tl.dot needs M >= 16)
NUM_WARPS, NUM_STAGES = 4, 2  # Triton launch parameters (as jax's own decode attention kernel)

# The split (flash-decoding) form, Triton variant: when the one-pass grid has few programs and the cache is long.
SPLIT_MAX_PROGRAMS = 64  # split when T·Hkv·B is at most this (an H100 has 132 SMs: most would sit idle)
SPLIT_MIN_BLOCKS = 32  # ... and the cache holds at least this many key blocks (2048 keys at Bk = 64)
SPLIT_TARGET_PROGRAMS = 1024  # phase 1 aims at about this many programs (several per SM)
SPLIT_MIN_BLOCKS_PER_PROGRAM = 4  # ... each with at least this many blocks (its query rows are loaded once)
FOLD_UNROLL_ROWS = 32  # phase 2 loads up to 8 blocks' partials at a time, G' · unroll ≤ this (registers)


def split_blocks(programs: int, num_blocks: int, split: bool | int | None = None) -> int:
    """Blocks per phase-1 program of the split form, 0 for the one-pass form, from static shapes: `programs` is
    T·Hkv·B (the one-pass grid), `num_blocks` the key blocks. `split` None: split when programs ≤
    SPLIT_MAX_PROGRAMS and num_blocks ≥ SPLIT_MIN_BLOCKS; False / True: never / always; an int n ≥ 1: always,
    n blocks per program (tests use it to cut ragged ranges). The split form aims at SPLIT_TARGET_PROGRAMS programs
    of at least SPLIT_MIN_BLOCKS_PER_PROGRAM blocks."""
    if split is None:
        split = programs <= SPLIT_MAX_PROGRAMS and num_blocks >= SPLIT_MIN_BLOCKS
    if split is False:
        return 0
    if split is True:
        return min(num_blocks, max(SPLIT_MIN_BLOCKS_PER_PROGRAM, -(-programs * num_blocks // SPLIT_TARGET_PROGRAMS)))
    if isinstance(split, int) and split >= 1:
        return min(num_blocks, split)
    raise ValueError(f"split must be None, a bool or a positive number of blocks, got {split!r}")


@functools.partial(jax.jit, static_argnames=("key_block", "num_blocks", "scale", "window", "softcap", "interpret",
                                             "backend", "split"))
def invariant_attention(
    q, k_cache, v_cache, lengths, positions, ancestors=None, *, key_block: int = 64, num_blocks: int | None = None,
    scale: float | None = None, window: int | None = None, softcap: float | None = None,
    interpret: bool | pltpu.InterpretParams = False, backend: str | None = None, split: bool | int | None = None,
) -> jax.Array:
    """The Pallas kernel; same signature and bits as `invariant_attention_reference` (see the module docstring for
    its grid, blocks and lowering). `backend` picks the variant: "tpu" the Mosaic TPU one, anything else ("cuda",
    "rocm", "gpu", "cpu") the Triton one; None is jax.default_backend(), so name it when exporting for another
    platform (`jax.export` traces on the host). `interpret` runs the variant in Pallas interpret mode: TPU interpret
    mode for "tpu" (True, or its `pltpu.InterpretParams`), the generic one otherwise (pallas_kernels/variants.py).
    `split` (Triton variant) picks the one-pass or the split form, the same bits either way: None by shapes
    (`split_blocks`), False / True to force one, an int to force the split form with that many blocks per program.
    The TPU variant has the one-pass form only (None or False)."""
    b, t, hq, d = q.shape
    hkv, s = k_cache.shape[1], k_cache.shape[2]
    g = hq // hkv
    bk = key_block
    nb = -(-s // bk) if num_blocks is None else num_blocks
    if nb * bk > s:
        pad = ((0, 0), (0, 0), (0, nb * bk - s), (0, 0))
        k_cache, v_cache = jnp.pad(k_cache, pad), jnp.pad(v_cache, pad)
    s = k_cache.shape[2]
    rows = query_tile_rows(g)
    qg = jnp.pad(q.reshape(b, t, hkv, g, d), ((0, 0),) * 3 + ((0, rows - g), (0, 0)))  # [B, T, H, R, D]
    tree = ancestors is not None
    if kernel_variant(backend) == "tpu":
        if split not in (None, False):
            raise ValueError("the TPU variant has no split form (split=None or False)")
        return _call_tpu(qg, k_cache, v_cache, lengths, positions, ancestors, key_block=bk, num_blocks=nb,
                         scores=Scores.of(d, scale, softcap), window=window,
                         interpret=interpret)[:, :, :, :g].reshape(b, t, hq, d)
    interpret = bool(interpret)
    # grid (token, KV head, sequence[, split]): the first axis is CUDA's x, whose blocks start first, so the tokens
    # that read one cache row run side by side (their key blocks meet in L2). Index maps ignore the split axis.
    token = pl.BlockSpec((None, None), lambda j, h, i, *_: (i, j))  # one scalar per (sequence, token)
    cache = pl.BlockSpec((None, None, s, d), lambda j, h, i, *_: (i, h, 0, 0))  # read Bk rows at a time
    in_specs = [token, pl.BlockSpec((None, None, None, rows, d), lambda j, h, i, *_: (i, j, h, 0, 0)), cache, cache]
    operands = [positions.astype(jnp.int32), qg, k_cache, v_cache]
    if tree:
        k_tail, v_tail, _, n0 = tree_tail_keys(k_cache, v_cache, lengths, positions, ancestors, bk, window)
        tail = pl.BlockSpec((None, None, None, 2, bk, d), lambda j, h, i, *_: (i, h, j, 0, 0, 0))
        in_specs[1:1] = [pl.BlockSpec((None,), lambda j, h, i, *_: (i,))]
        in_specs += [tail, tail]
        operands[1:1] = [n0.astype(jnp.int32)]
        operands += [k_tail, v_tail]
    opts = {"key_block": bk, "num_blocks": nb, "scores": Scores.of(d, scale, softcap), "window": window}
    params = plgpu.CompilerParams(num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    per = split_blocks(t * hkv * b, nb, split)
    if not per:
        out = pl.pallas_call(
            functools.partial(_kernel, **opts, tree=tree, fence=interpret),
            grid=(t, hkv, b),
            in_specs=in_specs,
            out_specs=pl.BlockSpec((None, None, None, rows, d), lambda j, h, i: (i, j, h, 0, 0)),
            out_shape=jax.ShapeDtypeStruct((b, t, hkv, rows, d), q.dtype),
            compiler_params=params,
            interpret=interpret,
            name="invariant_attention",
        )(*operands)
        return out[:, :, :, :g].reshape(b, t, hq, d)
    # split form: phase 1 stores every visible block's partial (G' = the kept rows, a power of two ≥ G), phase 2
    # folds them in order. Each token's buffers hold nb blocks of G' rows, and R - G' rows to spare so that the last
    # block's [R]-row store (masked past G') stays in bounds.
    kept = 1 << (g - 1).bit_length()
    length = nb * kept + rows - kept
    row_spec = pl.BlockSpec((None, None, None, length), lambda j, h, i, *_: (i, j, h, 0))
    a_spec = pl.BlockSpec((None, None, None, length, d), lambda j, h, i, *_: (i, j, h, 0, 0))
    partials = pl.pallas_call(  # (m, l, a)
        functools.partial(_kernel_partials, **opts, blocks_per_split=per, kept=kept, tree=tree, fence=interpret),
        grid=(t, hkv, b, -(-nb // per)),
        in_specs=in_specs,
        out_specs=[row_spec, row_spec, a_spec],
        out_shape=[jax.ShapeDtypeStruct((b, t, hkv, length), jnp.float32)] * 2
        + [jax.ShapeDtypeStruct((b, t, hkv, length, d), jnp.float32)],
        compiler_params=params,
        interpret=interpret,
        name="invariant_attention_partials",
    )(*operands)
    out = pl.pallas_call(
        functools.partial(_kernel_fold, **opts, unroll=max(1, min(8, FOLD_UNROLL_ROWS // kept))),
        grid=(t, hkv, b),
        in_specs=[token, row_spec, row_spec, a_spec],
        out_specs=pl.BlockSpec((None, None, None, kept, d), lambda j, h, i: (i, j, h, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((b, t, hkv, kept, d), q.dtype),
        compiler_params=params,
        interpret=interpret,
        name="invariant_attention_fold",
    )(positions.astype(jnp.int32), *partials)
    return out[:, :, :, :g].reshape(b, t, hq, d)


def _call_tpu(qg, k_cache, v_cache, lengths, positions, ancestors, *, key_block: int, num_blocks: int,
              scores: Scores, window: int | None, interpret: bool | pltpu.InterpretParams):
    """The Mosaic TPU call on the padded queries qg [B, T, H, R, D] → [B, T, H, R, D]: positions and n0 as
    scalar-prefetch operands, the caches in HBM (`pl.ANY`, copied block by block), queries, outputs and tree tails
    as VMEM blocks whose last two dimensions are whole ([R, D], [Bk, D]), as Mosaic's (8, 128) tiling asks."""
    b, t, hkv, rows, d = qg.shape
    tree = ancestors is not None
    per_token = pl.BlockSpec((None, None, None, rows, d), lambda j, h, i, *_: (i, j, h, 0, 0))
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    in_specs, operands = [per_token, hbm, hbm], [qg, k_cache, v_cache]
    if tree:
        k_tail, v_tail, _, n0 = tree_tail_keys(k_cache, v_cache, lengths, positions, ancestors, key_block, window)
        tail = pl.BlockSpec((None, None, None, 2, key_block, d), lambda j, h, i, *_: (i, h, j, 0, 0, 0))
        in_specs += [tail, tail]
        operands += [k_tail, v_tail]
    else:
        n0 = jnp.zeros((b,), jnp.int32)
    kernel = functools.partial(
        _kernel_tpu, key_block=key_block, num_blocks=num_blocks, scores=scores, window=window, tree=tree,
        fence=bool(interpret)
    )
    return pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(t, hkv, b),
            in_specs=in_specs,
            out_specs=per_token,
            scratch_shapes=[pltpu.VMEM((2, key_block, d), k_cache.dtype), pltpu.VMEM((2, key_block, d), v_cache.dtype),
                            pltpu.SemaphoreType.DMA((2, 2))],
        ),
        out_shape=jax.ShapeDtypeStruct(qg.shape, qg.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel")),
        interpret=tpu_interpret(interpret),
        name="invariant_attention",
    )(positions.astype(jnp.int32), n0.astype(jnp.int32), *operands)


def invariant_attend(q, k_cache, v_cache, lengths, positions, ancestors, *, key_block: int, num_blocks, impl: str,
                     scale: float | None = None, window: int | None = None, softcap: float | None = None):
    """Dispatch for the target's attention by implementation (`pallas_kernels.dispatch`): "reference" (jax.numpy,
    every backend), "pallas" (compiled kernel) or "interpret" (the kernel in Pallas interpret mode: CPU). Under a (data, model) mesh the
    kernel runs per shard in `jax.shard_map` (rows over data, KV heads over model: no collective)."""
    if impl == "reference":
        return invariant_attention_reference(
            q, k_cache, v_cache, lengths, positions, ancestors, key_block=key_block, num_blocks=num_blocks,
            scale=scale, window=window, softcap=softcap,
        )
    fn = functools.partial(
        invariant_attention, key_block=key_block, num_blocks=num_blocks, scale=scale, window=window, softcap=softcap,
        interpret=impl == "interpret",
    )
    return per_shard(fn, q, k_cache, v_cache, lengths, positions, ancestors)


def per_shard(fn, q, k_cache, v_cache, lengths, positions, ancestors):
    """fn(q, k_cache, v_cache, lengths, positions, ancestors) → [B, T, Hq, D], an attention kernel XLA cannot
    partition (a Pallas or FFI call), run per shard in `jax.shard_map` under a (data, model) mesh: rows over data,
    KV heads (and their query heads) over model, so no collective; called directly without one."""
    if not on_mesh():
        return fn(q, k_cache, v_cache, lengths, positions, ancestors)
    rows, q_heads, kv_heads = P(DATA), P(DATA, None, MODEL, None), P(DATA, MODEL, None, None)
    tokens = P(DATA, None)
    specs = (q_heads, kv_heads, kv_heads, rows, tokens) + (() if ancestors is None else (P(DATA, None, None),))
    sharded = jax.shard_map(
        lambda *a: fn(*a) if ancestors is not None else fn(*a, None), in_specs=specs, out_specs=q_heads,
        check_vma=False,
    )
    return sharded(q, k_cache, v_cache, lengths, positions, *(() if ancestors is None else (ancestors,)))
