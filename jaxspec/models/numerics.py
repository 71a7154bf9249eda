"""Batch-invariant numerics for the target: a token's logits and features are a function of that token, its
position and its ancestors' keys/values only, bit for bit, whatever else goes through the target with it.

Why: speculative decoding promises the target's own greedy output, but the same token is computed in different
company: alone (a decode step), in a block of K+1 (chain verify), among tree siblings (tree verify), in a prefill,
next to other batch rows. XLA picks reduction orders by shape: measured on XLA:CPU, `x @ w` for rows 0..m-1 gives
other bits than the first m rows of a larger `x @ w`, and `jnp.sum(x, -1)` changes with the number of rows too. In
float32 those are last-bit differences that rarely flip an argmax; in bfloat16 they survive the rounding between
layers and the texts part (the technique: He et al., "Defeating Nondeterminism in LLM Inference", 2025).

What holds on every backend we measured: elementwise ops are invariant, and a dot or reduction of one fixed shape
gives each row the same bits wherever the row sits and whatever its neighbours hold. So every order-dependent
reduction of the target is built from those two:
- matmuls run on fixed tiles of `row_tile` rows (`tiled_matmul`), one dot shape for every call, and long inputs
  also on tiles of `wide_row_tile` rows where a measurement on this machine shows that shape gives a row the same
  bits (`wide_tiles_agree`: on some CPUs XLA's one-row dot and its dots of 61 or more rows share one order); on
  CPU, where one-row tiles made a verify of T tokens pay T weight passes, decode and verify matmuls run instead on
  jaxspec's row kernel (`panel_matmul`, pallas_kernels/row_matmul.py), whose every row is the same bits at any
  row count by construction, for about one weight pass per call;
- sums over a feature axis (RMSNorm, softmax denominators) are pairwise halvings of elementwise adds
  (`halving_sum`), which have no shape-dependent order at all;
- attention (pallas_kernels/invariant_attention.py) reduces over keys in absolute position order in fixed blocks;
  on CPU, where that compiles into ~22 small kernels a layer, it runs instead on jaxspec's row attention (`attend`,
  pallas_kernels/row_attention.py: one call per layer, each query row's keys in position order, its own bits);
- no product meets an add inside one fusion (`exact_mul`), since XLA contracts those into FMAs program by program;
  dots are fenced by optimization barriers (`fenced`) against algebraic rewrites, and each weight is contracted in
  its stored layout (`tiled_matmul`'s w_out_in), never through a transpose XLA may fold in one program only.

A prefill may have tiles of its own (`Numerics.prefill_row_tile`; CPU without the row kernel: 64 rows, where a decode
has one): a prompt's
rows only ever meet prompt rows. Target-only and speculative generation run the same prefill, whose first token,
keys and values are then the same bits in both; every generated token is decoded or verified, on the decode's
tiles, after the same prompt keys and values. So a prompt row must get the same bits whatever the batch or padding
around it (one tile shape: `for_prefill` drops the wide/narrow split), but need not get the bits a decode would have
given it. On CPU without the row kernel that is the difference between one weight pass per prompt row and one per
64 (2x the prefill speed); with it, a prefill's matmuls run on the kernel (a prompt row then gets a decode's bits),
and a whole prompt's prefill loops over chunks of `prefill_loop_chunk` positions up to the longest prompt's last token,
so it costs the prompt's rows rather than its bucket's (`engine.core.prefill`).

The draft head does not use any of this, bar the CPU row attention for its causal calls (`draft_attend`) and its
matmuls on the row kernel (`llama.hold_draft_weights`): drafts only change speed, never output.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec

from pallas_kernels import row_attention
from pallas_kernels import row_matmul as row_kernel
from pallas_kernels.dispatch import IMPLEMENTATIONS, resolve_kernels
from pallas_kernels.invariant_attention import invariant_attend, per_shard
from pallas_kernels.mesh_axes import DATA, MODEL
from pallas_kernels.primitives import exact_mul, fenced, halving_max, halving_sum, held_dtype  # noqa: F401


@dataclasses.dataclass(frozen=True)
class Numerics:
    """The fixed shapes that define the target's floating-point operations. Two runs agree bit for bit only with the
    same Numerics (and the same backend and mesh); a model takes `default_numerics()` of its backend when built."""

    row_tile: int = 8  # rows per matmul call; every target matmul is a [row_tile, K] x [K, N] dot ...
    wide_row_tile: int | None = None  # ... or, for the bulk of many rows, [wide_row_tile, K] x [K, N] (tile_split)
    # where that shape was measured to give a row the narrow tiles' bits (`wide_tile`)
    key_block: int = 64  # keys per attention block; blocks start at absolute positions 0, key_block, ...
    kernels: str = "reference"  # how attention runs: "reference", "pallas" or "interpret" (pallas_kernels.dispatch)
    prefill_row_tile: int | None = None  # a prefill's rows on [prefill_row_tile, K] dots (with the row kernel: only
    # the matmuls it does not run, experts and model-split ones); None: as above
    fused_qkv: bool = False  # q, k and v projected by one dot over the three kernels side by side (CPU; see below)
    row_kernel: bool = False  # decode, verify and prefill matmuls on the CPU row kernel (`panel_matmul`), not on tiles
    row_attention: bool = False  # the target's attention on the CPU row attention (`attend`), not the block fold
    prefill_loop_chunk: int | None = None  # a whole prompt's prefill runs as a loop over chunks of this many
    # positions, up to the chunk holding the longest prompt's last token (`engine.core.prefill`); None: one pass
    # over the bucket (not the server's chunked prefill of a long prompt joining running ones: `engine.slots`)

    def __post_init__(self):
        if self.kernels not in IMPLEMENTATIONS:
            raise ValueError(f"Numerics.kernels must be one of {', '.join(IMPLEMENTATIONS)}, got {self.kernels!r}")

    def narrow(self) -> Numerics:
        """These numerics without wide tiles (for a matmul `wide_tiles_agree` does not measure)."""
        return dataclasses.replace(self, wide_row_tile=None)

    def wide_tile(self, x: jax.Array, w: jax.Array) -> int | None:
        """The wide_row_tile for `tiled_matmul(x, w, ...)` with w [K, N]: these numerics' wide tile where x has rows
        enough to fill one (per data shard, `tile_split`), no `model` mesh axis splits w, and `wide_tiles_agree` for
        w's shape and x's dtype on this backend; else None (narrow tiles only).

        Why at trace time, per matmul, and not when the model is built: the measurement compiles and runs 4 small
        programs per weight shape (~2-3 s each shape on a 2-core CPU, ~10 s per model), and only a program with a
        long verify block (40 rows or more: a large tree) can use its answer. Decode steps, chains and prefills
        (`for_prefill`) never pay it; a process measures each shape once (`wide_tiles_agree` is cached)."""
        if self.wide_row_tile is None or model_sharded():
            return None
        rows = math.prod(x.shape[:-1]) // data_shards()
        if tile_split(rows, self.row_tile, self.wide_row_tile)[0] == 0:
            return None
        k, n = w.shape
        agree = wide_tiles_agree(k, n, jnp.dtype(x.dtype).name, self.row_tile, self.wide_row_tile,
                                 jax.default_backend())
        return self.wide_row_tile if agree else None

    def compiler_options(self, backend: str | None = None) -> dict[str, int]:
        """XLA options for a program that runs a target with these numerics on `backend` (default: JAX's).

        GPU: no split-K GEMMs (`xla_gpu_experimental_force_split_k=1`). On its row tiles every matmul has row_tile
        (64) rows even when one is real (a decode), and XLA:GPU splits the contraction of such a skinny GEMM into
        chunks whose float32 partials, [splits, 64, N], it writes and then reads back to sum them: compiled for an
        H100 at Llama-3.1-8B shapes, 8-way splits of the o/down projections and 2-16-way splits of the others, ~100
        MB per layer next to 436 MB of weights (a decode at 1.24x its weight + KV bytes; 1.03x without them:
        `python -m jaxspec.bench --compiled-cost`). A split chooses no other bits from program to program (the same
        tile shape gets the same split), so this is for bytes, not invariance. Not yet timed on a GPU against the
        split form (which the autotuner may prefer for parallelism on the o and down projections' 4096 columns):
        JAXSPEC_GPU_SPLIT_K=xla leaves the choice to XLA, for that comparison."""
        if (backend or jax.default_backend()) != "gpu" or os.environ.get("JAXSPEC_GPU_SPLIT_K") == "xla":
            return {}
        return {"xla_gpu_experimental_force_split_k": 1}

    def for_prefill(self) -> Numerics:
        """The numerics of a prefill's layers (the module docstring says why a prefill may have its own): every row
        on prefill_row_tile-row tiles where that is set, with separate q/k/v dots (a 64-row dot is not
        overhead-bound, and side-by-side kernels would cost a prefill their concatenation), else these numerics;
        with the row kernel, these numerics' matmuls (fused q/k/v included), see below.

        With the CPU row kernel a prefill's matmuls stay on it, so a prompt row gets the bits a decode would give it:
        its rows are their own bits at any count, so a prefill can run in chunks of any size
        (`prefill_loop_chunk`), where a chunk on 64-row tiles pays for 64 rows. One pass over a bucket costs about
        what 64-row tiles cost (BENCHMARKS.md, "Prefills on the row kernel, in chunks"). Matmuls the kernel does
        not run (a `model` mesh axis, experts) keep prefill_row_tile-row tiles."""
        if self.prefill_row_tile is None:
            return self
        if self.row_kernel:
            return dataclasses.replace(self, row_tile=self.prefill_row_tile, wide_row_tile=None)
        return dataclasses.replace(self, row_tile=self.prefill_row_tile, wide_row_tile=None, fused_qkv=False,
                                   row_kernel=False)


def default_numerics(backend: str | None = None, kernels: str | None = None) -> Numerics:
    """One-row tiles on CPU, where a dot's cost grows with its rows and a one-row dot is XLA:CPU's fastest
    (measured, SmolLM2-135M float32 decode step on 2 cores: 26-30 ms with 1-row tiles, as fast as plain XLA; 47 ms
    with 4-row and 56 ms with 8-row tiles); a verify then pays one weight pass per row (a verify of 6 tokens: 77-93
    ms vs 52-55 ms plain). Long verify blocks (40 rows or more: large trees) run the bulk of their rows on 64-row
    tiles in each matmul whose 64-row dot gives a row the one-row dot's bits on this machine (`Numerics.wide_tile`,
    measured when a program first has such a block). 64-row tiles on accelerators, where a [64, 4096] x [4096,
    14336] bfloat16 dot takes what a one-row dot takes (0.13 ms on an H100: both read the weights once). kernels:
    the user's choice (auto / pallas / reference, `pallas_kernels.dispatch.resolve_kernels`); None is auto.

    On CPU the q, k and v projections run as one dot over their kernels side by side (`fused_qkv`): a one-row dot
    costs XLA:CPU a fixed overhead besides its weight traffic (~75 µs per dot saved below), and the k and v kernels
    are small (SmolLM2: [576, 192]).
    Measured, SmolLM2's 211 weight dots of a decode step chained alone on this project's 2-core AVX-512 CPU: 26.5 ms
    with separate q/k/v dots, 22.0 ms with one (gate and up side by side gained nothing: 26.4 ms). Not measured on
    accelerators, where it stays off.

    Without the row kernel a CPU prefill runs all its rows on 64-row tiles (`Numerics.for_prefill`), whether or not
    they give the one-row bits: measured, SmolLM2 float32 prefill on this project's 2-core AVX-512 CPU (where
    64-row dots do not agree with one-row ones, so wide tiles were off): 64 tokens 368 ms on one-row tiles, 176 ms
    on 64-row tiles; 128 tokens 709 ms and 422 ms.

    Where the CPU row kernel builds (pallas_kernels/row_matmul.py: a C++ compiler on the machine; on by default,
    JAXSPEC_CPU_ROW_KERNEL=off), decode and verify matmuls run on it instead of one-row tiles (`row_kernel`,
    `panel_matmul`): each row gets the same bits at any row count, so a verify of T tokens streams the weights once
    instead of T times, and so do prefills' (`for_prefill`), in chunks of CPU_PREFILL_CHUNK positions up to the
    longest prompt (`prefill_loop_chunk`). Attention, prefills' too, runs on the row attention built into the same
    library (`row_attention`, pallas_kernels/row_attention.py: one call per layer over the keys each token sees)."""
    backend = backend or jax.default_backend()
    impl = resolve_kernels(kernels, backend)
    if backend == "cpu":
        built = row_kernel.available()
        return Numerics(row_tile=1, wide_row_tile=CPU_WIDE_ROW_TILE, prefill_row_tile=CPU_PREFILL_ROW_TILE,
                        kernels=impl, fused_qkv=True, row_kernel=built, row_attention=built,
                        prefill_loop_chunk=CPU_PREFILL_CHUNK if built else None)
    return Numerics(row_tile=64, kernels=impl)


CPU_WIDE_ROW_TILE = 64
CPU_PREFILL_ROW_TILE = 64
# a prefill chunk costs ~9 ms besides its rows' ~1.55 ms each (SmolLM2, 2-core AVX-512 CPU): 32 positions waste
# ~16 rows a prompt, 16 run twice the chunks, 64 waste twice the rows (BENCHMARKS.md, "Prefills on the row kernel,
# in chunks")
CPU_PREFILL_CHUNK = 32


def attend(numerics: Numerics, q, k_cache, v_cache, lengths, positions, ancestors, *, num_blocks: int | None,
           scale: float | None = None, window: int | None = None, softcap: float | None = None) -> jax.Array:
    """The target's attention under `numerics` → [B, T, Hq, D] in q's dtype: the CPU row attention where
    `row_attention` is set and it takes the layer (float32 or bfloat16 caches, no soft-capping:
    pallas_kernels/row_attention.py), else the block-fold attention (`invariant_attend`: accelerators, Gemma 2's
    capped layers). Either way a row's bits are its own. On a (data, model) mesh both kernels run per shard
    (`per_shard`: rows over data, KV heads over model)."""
    if numerics.row_attention and row_attention.supports(k_cache.dtype, softcap):
        fn = functools.partial(row_attention.row_attention, scale=scale, window=window)
        return per_shard(fn, q, k_cache, v_cache, lengths, positions, ancestors)
    return invariant_attend(q, k_cache, v_cache, lengths, positions, ancestors, key_block=numerics.key_block,
                            num_blocks=num_blocks, impl=numerics.kernels, scale=scale, window=window, softcap=softcap)


def draft_attend(q, k_cache, v_cache, lengths, positions) -> jax.Array:
    """A drafter's causal attention on the CPU row attention → [B, T, Hq, D]: the new tokens at their positions
    (their slots), each seeing the slots up to its own, as a head's prefill, catch-up and chain steps attend. Drafts
    only change speed, so any numerics serve; the kernel reads only the slots each token sees where XLA's masked
    attention reads the whole cache: the shipped head's step 6-9% faster at 512 slots, 12-18% at 2,048
    (BENCHMARKS.md, "The head's attention on the row attention"). Per shard on a mesh, as the target's
    (`per_shard`)."""
    return per_shard(row_attention.row_attention, q, k_cache, v_cache, lengths, positions, None)


def normal_weight(rngs, shape: tuple[int, ...], dtype) -> jax.Array | jax.ShapeDtypeStruct:
    """N(0, 0.02²) weights of a model computing in `dtype`, rounded to it and held in `held_dtype(dtype)`; with
    `rngs=None` (an nnx.Rngs or None) only their shape, for loaders that fill every weight (cheaper than
    `nnx.eval_shape`, whose tracing of the RNG stream costs O(weights²) in flax 0.12: 0.8 s for SmolLM2)."""
    if rngs is None:
        return jax.ShapeDtypeStruct(shape, held_dtype(dtype))
    return hold(0.02 * jax.random.normal(rngs.params(), shape, jnp.float32), dtype)


def hold(w: jax.Array, dtype) -> jax.Array:
    """A weight for a model computing in `dtype`: rounded to `dtype`, held in `held_dtype(dtype)`."""
    return w.astype(dtype).astype(held_dtype(dtype))


def contract(x: jax.Array, w: jax.Array, dims, scale: jax.Array | None = None) -> jax.Array:
    """`lax.dot_general(x, w, (dims, ((), ())))` for activations x and a weight held in `held_dtype`: both meet in
    the wider of the two dtypes (x widened on CPU; nothing changes where they agree) and the result is rounded back
    to x's dtype. With `scale` [N] (an 8-bit weight, models/quantize.py): w's values meet x in x's widened dtype, the
    dot accumulates in float32, and the scale multiplies that result (a rounded product: exact_mul) before it is
    rounded to x's dtype."""
    if scale is None:
        wide = jnp.promote_types(x.dtype, w.dtype)
        return jax.lax.dot_general(x.astype(wide), w.astype(wide), (dims, ((), ()))).astype(x.dtype)
    wide = held_dtype(x.dtype)
    y = jax.lax.dot_general(x.astype(wide), w.astype(wide), (dims, ((), ())), preferred_element_type=jnp.float32)
    return exact_mul(y, scale.astype(jnp.float32)).astype(x.dtype)


def panel_matmul(x: jax.Array, panels: jax.Array, n: int, bias: jax.Array | None = None,
                 scale: jax.Array | None = None) -> jax.Array:
    """x [..., K] @ a weight held as row-kernel panels [P, K, 16] (`row_kernel.pack_panels`; n: its real columns)
    (+ bias) → [..., n] in x's dtype, as `contract` computes it: the dot in float32 on the weight's values (a 16-bit
    x widened, an 8-bit weight's values held as floats), an 8-bit weight's `scale` [n] applied to that result, then
    rounded to x's dtype, then the bias. Each row's bits are its own (pallas_kernels/row_matmul.py), so no tiles.
    On a data mesh each device runs its own rows (the weight replicated); never under a `model` axis, whose split
    weights `tiled_matmul` handles."""
    shards = data_shards()
    lead, k = x.shape[:-1], x.shape[-1]

    def dot(a, p, *s):  # a [shards, rows, K] in x's dtype → [shards, rows, n] in x's dtype
        a = a.astype(jnp.float32)
        if shards == 1:
            y = row_kernel.row_matmul(a, p, n)
        else:
            y = jax.shard_map(lambda b, q: row_kernel.row_matmul(b, q, n), out_specs=PartitionSpec(DATA),
                              in_specs=(PartitionSpec(DATA), PartitionSpec()), check_vma=False)(a, p)
        if s:
            y = exact_mul(y, s[0].astype(jnp.float32))
        return y.astype(x.dtype)

    # fenced, with the casts inside: XLA may otherwise drop a 16-bit rounding between the cast and its neighbours
    # (excess precision), program by program (seen in bfloat16: rows of a 2-row batch off a decode's bits)
    y = fenced(dot, x.reshape(shards, math.prod(lead) // shards, k), panels, *(() if scale is None else (scale,)))
    y = y.reshape(*lead, n)
    return y if bias is None else y + bias.astype(x.dtype)


HELD_ATTRIBUTES = ("qkv_fused", "qkv_panels", "panels", "head_panels", "draft_panels", "draft_scale")  # llama.hold_*


def drop_held_weights(model) -> None:
    """Forget, in place, what `llama.hold_step_weights` and `llama.hold_draft_weights` held on `model`'s modules
    (side-by-side q/k/v kernels, row-kernel panels, a drafter's int8 panels and scales): after its weights changed
    (quantization), or for a copy that must not carry them."""
    for _, node in list(nnx.iter_graph(model)):
        for name in HELD_ATTRIBUTES:
            if getattr(node, name, None) is not None:
                setattr(node, name, None)


def data_shards() -> int:
    """Rows are split over the mesh's `data` axis when one is set; tiles are cut inside each shard."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or DATA not in mesh.axis_names:
        return 1
    return mesh.shape[DATA]


def model_sharded() -> bool:
    """Whether weights are split over a `model` axis: each device's dot then has other shapes than the whole
    weight's, which `wide_tiles_agree` did not measure."""
    mesh = jax.sharding.get_abstract_mesh()
    return not mesh.empty and MODEL in mesh.axis_names and mesh.shape[MODEL] > 1


def tile_split(rows: int, row_tile: int, wide_row_tile: int | None) -> tuple[int, int]:
    """(wide tiles, narrow tiles) for `rows` rows of one data shard. Rows go to wide tiles while a whole one fills;
    the rest go to narrow tiles of row_tile rows, unless they fill at least WIDE_FILL of one more wide tile, which
    then costs less than their narrow tiles (measured on this project's CPU: a 64-row dot costs what ~40 one-row
    dots cost). At least one tile, so that an empty input still has a dot shape."""
    if wide_row_tile is None:
        return 0, max(-(-rows // row_tile), 1)
    wide, rest = divmod(rows, wide_row_tile)
    if rest >= WIDE_FILL * wide_row_tile:
        return wide + 1, 0
    narrow = -(-rest // row_tile)
    return wide, narrow if wide + narrow else 1


WIDE_FILL = 0.625  # the share of a wide tile that real rows must fill for it to beat one-row tiles (40 of 64 rows)


def _tile_loop(xs: jax.Array, tile_rows: int, dot) -> jax.Array:
    """dot on tiles of tile_rows rows of xs [shards, rows, K] (zero-padded to whole tiles) → [shards, rows, N]. More
    than one tile runs in a loop, so XLA cannot merge the tiles back into one larger dot."""
    shards, rows, k = xs.shape
    tiles = -(-rows // tile_rows)
    xs = jnp.pad(xs, ((0, 0), (0, tiles * tile_rows - rows), (0, 0)))
    xs = xs.reshape(shards, tiles, tile_rows, k).transpose(1, 0, 2, 3)  # [tiles, shards, tile_rows, K]
    y = dot(xs[0])[None] if tiles == 1 else jax.lax.map(dot, xs)  # [tiles, shards, tile_rows, N]
    return y.transpose(1, 0, 2, 3).reshape(shards, tiles * tile_rows, -1)[:, :rows]


def tiled_matmul(
    x: jax.Array, w: jax.Array, row_tile: int, bias: jax.Array | None = None, *, w_out_in: bool = False,
    wide_row_tile: int | None = None, scale: jax.Array | None = None,
) -> jax.Array:
    """x [..., K] @ w [K, N] (+ bias) → [..., N] in x's dtype, computed per data shard as dots of exactly
    [row_tile, K] x [K, N] (rows zero-padded to whole tiles), and, with wide_row_tile, the bulk of a long input as
    dots of [wide_row_tile, K] x [K, N] (`tile_split`). Wide tiles are only for a dot whose wide_row_tile rows were
    measured to get the bits of narrow tiles (`wide_tiles_agree`), and never under a `model` mesh axis. The bias
    is added inside the tile, next to its dot in every program (XLA:CPU fuses a one-row dot with a following add when
    they meet, which adds the bias first).

    scale: w holds 8-bit values (int8 or e4m3) with one float32 scale per output column (models/quantize.py); the
    scale is applied inside the tile as well (`contract`).

    w_out_in: w is stored [N, K] (a tied embedding table used as the LM head) and each tile contracts over its last
    axis in place. Transposing it first is slower and not invariant: XLA:CPU folded the transpose into a one-row
    dot in a decode step but materialized it (a 113 MB copy for SmolLM2) before a verify's loop of tiles, and the two
    dot forms gave other bits (measured: tied-embedding logits; 57 ms of a SmolLM2 decode step behind a loop)."""
    wide = None if model_sharded() else wide_row_tile
    return _tiled_matmul(x, w, row_tile, bias, w_out_in, wide, data_shards(), scale)


def _tiled_matmul(x, w, row_tile, bias, w_out_in, wide_row_tile, shards: int, scale=None) -> jax.Array:
    lead, k = x.shape[:-1], x.shape[-1]
    n = w.shape[0] if w_out_in else w.shape[-1]
    per_shard = math.prod(lead) // shards
    xs = x.reshape(shards, per_shard, k)  # [shards, rows, K]
    dims = ((2,), (1,) if w_out_in else (0,))

    def dot(tile):  # [shards, tile_rows, K] -> [shards, tile_rows, N]
        if scale is None:
            y = fenced(lambda a, b: contract(a, b, dims), tile, w)  # [shards, tile_rows, N] in x's dtype
        else:  # an int8 weight: its scale applied inside the tile too
            y = fenced(lambda a, b, c: contract(a, b, dims, c), tile, w, scale)
        return y if bias is None else y + bias.astype(x.dtype)

    wide, narrow = tile_split(per_shard, row_tile, wide_row_tile)
    parts = []
    if wide:
        wide_rows = min(wide * wide_row_tile, per_shard)
        parts.append(_tile_loop(xs[:, :wide_rows], wide_row_tile, dot))
        xs = xs[:, wide_rows:]
    if narrow:
        parts.append(_tile_loop(xs, row_tile, dot))
    y = parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=1)  # [shards, rows, N]
    return y.reshape(*lead, n)


@functools.cache
def wide_tiles_agree(k: int, n: int, dtype: str, row_tile: int, wide_row_tile: int, backend: str) -> bool:
    """Whether a [wide_row_tile, K] x [K, N] dot gives each row the bits that [row_tile, K] x [K, N] dots give it,
    measured on random inputs of `dtype` (the weight held in held_dtype) on this machine and backend, in both forms
    a prefill runs it: one wide tile alone and wide tiles in a loop (XLA:CPU may compile a dot behind a loop
    differently). Why a measurement: which rows share a reduction order is the dot library's choice, by shape and
    by processor (XLA:CPU, JAX 0.10: on an AVX2 CPU 1 row and 61 or more rows shared one order, 2-60 rows another;
    on an AVX-512/AMX CPU no row count from 2 to 256 shared the one-row order for SmolLM2's shapes)."""
    # Each device of a data mesh runs the dot a single device runs, so the forms are measured with one shard; a
    # model may be built under the caller's mesh or inside a trace, and this still runs (and compares) real dots.
    with jax.ensure_compile_time_eval(), jax.default_device(jax.local_devices(backend=backend)[0]):
        kx, kw = jax.random.split(jax.random.key(0))
        w = hold(jax.random.normal(kw, (k, n), jnp.float32), dtype)  # [K, N]
        for tiles in (1, 2):  # one wide dot; two in a loop
            x = jax.random.normal(kx, (tiles * wide_row_tile, k), jnp.float32).astype(dtype)  # [rows, K]
            one = jax.jit(lambda a, b: _tiled_matmul(a, b, row_tile, None, False, None, 1))(x, w)
            wide = jax.jit(lambda a, b: _tiled_matmul(a, b, row_tile, None, False, wide_row_tile, 1))(x, w)
            if not jnp.array_equal(one, wide):
                return False
        return True


def materialized_sums(backend: str | None = None) -> bool:
    """Whether halving reductions at the XLA level end in a reduce op (`halving_sum(materialize=True)`): on GPU,
    where XLA otherwise recomputes the whole tree inside every consumer fusion; same bits either way."""
    return (backend or jax.default_backend()) == "gpu"


def invariant_mean_square(xf: jax.Array) -> jax.Array:
    """mean(xf²) over the last axis of a float32 array [..., H] → [..., 1], by halving sum: the RMSNorms' statistic
    (Llama's and Gemma 4's) in batch-invariant numerics. A multiply by 1/H, not a division (XLA rewrites divisions
    case by case); products rounded before adds."""
    return exact_mul(halving_sum(exact_mul(xf, xf), materialize=materialized_sums())[..., None], 1.0 / xf.shape[-1])


def invariant_rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm as Hugging Face computes it (float32, cast back, scale), with the mean of squares by halving."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(invariant_mean_square(xf) + eps)
    return weight.astype(x.dtype) * xf.astype(x.dtype)
