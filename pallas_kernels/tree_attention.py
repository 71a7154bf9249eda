"""Tree-masked attention of T new query tokens over a KV cache (DESIGN_NOTES §4).

Each sequence b has `lengths[b]` committed cache slots (ragged, 0 allowed) that every new token sees, and a window
of W uncommitted key/value entries (the new tokens themselves for a verify; all tree levels drafted so far for the
head) that new token t sees where `mask[b, t, w]` is set: a causal mask for chains, an ancestor mask for trees.

    out[b, t, h] = softmax over {slots s < lengths[b]} ∪ {w : mask[b, t, w]} of q·k / sqrt(D), applied to v

A row that sees nothing gets zeros. Cache slots past the committed length must hold finite values (caches are
zero-initialized and only written with finite K/V; the kernel ignores even non-finite ones there). GQA: query head h reads KV head h // (Hq / Hkv).

`tree_attention` is one Pallas kernel per (sequence, KV head): the T·G query rows of a KV head (GQA groups absorb
T) first attend to the window, then walk the committed prefix block by block with an online softmax, reading only
the blocks below `lengths[b]`. `tree_attention_reference` is the same function in jax.numpy. `attend` dispatches
by platform.
"""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.sharding import PartitionSpec as P

NEG_INF = -1e30  # finite: a fully masked row stays NaN-free

log = logging.getLogger(__name__)


def tree_attention_reference(
    q: jax.Array,  # [B, T, Hq, D]
    k_cache: jax.Array,  # [B, Hkv, S, D]
    v_cache: jax.Array,  # [B, Hkv, S, D]
    lengths: jax.Array,  # [B] int32 committed slots
    k_win: jax.Array,  # [B, Hkv, W, D] the uncommitted window
    v_win: jax.Array,  # [B, Hkv, W, D]
    mask: jax.Array,  # [B, T, W] bool
) -> jax.Array:
    """→ [B, T, Hq, D] in q's dtype. Plain jax.numpy; the specification of the kernel."""
    b, t, hq, d = q.shape
    hkv, s = k_cache.shape[1], k_cache.shape[2]
    # float32 math on the inputs' values (for bfloat16: exact products, float32 accumulation, like the kernel).
    # Prefix and window are scored separately and share one softmax, so the cache is never copied.
    qg = q.reshape(b, t, hkv, hq // hkv, d).astype(jnp.float32)  # [B, T, Hkv, G, D]
    prefix = jnp.arange(s)[None, None, :] < lengths[:, None, None]  # [B, 1, S]
    visible = jnp.concatenate([jnp.broadcast_to(prefix, (b, t, s)), mask], axis=2)  # [B, T, S + W]
    scores = jnp.concatenate([
        jnp.einsum("btkgd,bksd->bkgts", qg, k_cache.astype(jnp.float32)),
        jnp.einsum("btkgd,bksd->bkgts", qg, k_win.astype(jnp.float32)),
    ], axis=-1) * d**-0.5  # [B, Hkv, G, T, S + W]
    scores = jnp.where(visible[:, None, None], scores, NEG_INF)
    probs = jax.nn.softmax(scores, axis=-1)
    probs = jnp.where(jnp.any(visible, axis=-1)[:, None, None, :, None], probs, 0.0)
    probs = probs.astype(v_cache.dtype).astype(jnp.float32)  # the kernel feeds probabilities to the MXU in v's dtype
    out = jnp.einsum("bkgts,bksd->btkgd", probs[..., :s], v_cache.astype(jnp.float32))
    out = out + jnp.einsum("bkgts,bksd->btkgd", probs[..., s:], v_win.astype(jnp.float32))
    return out.reshape(b, t, hq, d).astype(q.dtype)


def _kernel(lengths_ref, q_ref, k_ref, v_ref, kw_ref, vw_ref, mask_ref, *out_refs, block_s: int, scale: float, upcast: bool):
    """One (sequence, KV head): q [R, D] with R = T·G rows; window first, then prefix blocks below the length."""
    o_ref = out_refs[-1]  # (an aliased poison input comes first when given)
    b = pl.program_id(0)
    length = lengths_ref[b]
    q = q_ref[0, 0]  # [R, D]
    # XLA:CPU (interpret mode) has no bf16 x bf16 -> f32 dot; exact f32 products of the bf16 values there instead.
    dtype = jnp.float32 if upcast else q.dtype
    q = q.astype(dtype)

    def scores(keys):  # [R, n] float32
        keys = keys.astype(dtype)
        return jax.lax.dot_general(q, keys, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32) * scale

    def weighted(p, values):  # [R, D] float32
        return jnp.dot(p.astype(dtype), values.astype(dtype), preferred_element_type=jnp.float32)

    visible = mask_ref[0] != 0  # [R, W]
    s = jnp.where(visible, scores(kw_ref[0, 0]), NEG_INF)
    m = jnp.max(s, axis=-1)  # [R]
    p = jnp.where(visible, jnp.exp(s - m[:, None]), 0.0)
    l = jnp.sum(p, axis=-1)
    acc = weighted(p, vw_ref[0, 0])

    def body(i, carry):
        m, l, acc = carry
        start = pl.multiple_of(i * block_s, block_s)
        keys = k_ref[0, 0, pl.ds(start, block_s), :]  # [block_s, D]
        values = v_ref[0, 0, pl.ds(start, block_s), :]
        valid = (start + jax.lax.broadcasted_iota(jnp.int32, (1, block_s), 1)) < length  # [1, block_s]
        s = jnp.where(valid, scores(keys), NEG_INF)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        alpha = jnp.exp(m - m_new)
        p = jnp.where(valid, jnp.exp(s - m_new[:, None]), 0.0)
        values = jnp.where(valid.reshape(block_s, 1), values, jnp.zeros_like(values))
        return m_new, alpha * l + jnp.sum(p, axis=-1), alpha[:, None] * acc + weighted(p, values)

    m, l, acc = jax.lax.fori_loop(0, pl.cdiv(length, block_s), body, (m, l, acc))
    out = jnp.where(l[:, None] > 0, acc / jnp.where(l > 0, l, 1.0)[:, None], 0.0)
    o_ref[0, 0] = out.astype(o_ref.dtype)


def _block_size(capacity: int, preferred: int = 256) -> int:
    """The largest power of two ≤ preferred dividing the capacity (the whole capacity if none ≥ 8 does)."""
    size = preferred
    while size >= 8:
        if capacity % size == 0:
            return size
        size //= 2
    return capacity


@functools.partial(jax.jit, static_argnames=("interpret",))
def tree_attention(
    q, k_cache, v_cache, lengths, k_win, v_win, mask, *, interpret: bool = False, poison: jax.Array | None = None
) -> jax.Array:
    """The Pallas kernel; same signature and result as `tree_attention_reference`.

    `poison` (tests): a [B, Hkv, R, D] buffer the kernel writes into in place, to show every output is written."""
    b, t, hq, d = q.shape
    if k_cache.shape[2] == 0:  # no committed prefix (a prefill): an all-masked stand-in block
        k_cache = v_cache = jnp.zeros((b, k_cache.shape[1], 8, d), k_cache.dtype)
        lengths = jnp.zeros_like(lengths)
    hkv, s, w = k_cache.shape[1], k_cache.shape[2], k_win.shape[2]
    g = hq // hkv
    # Rows of KV head h are ordered (t, g): row r is query token r // G. Rows and window are padded to powers of
    # two (Triton needs power-of-two blocks); padded rows see nothing and are dropped.
    rows, w = _pow2(t * g), _pow2(w)
    qh = q.reshape(b, t, hkv, g, d).transpose(0, 2, 1, 3, 4).reshape(b, hkv, t * g, d)
    qh = jnp.pad(qh, ((0, 0), (0, 0), (0, rows - t * g), (0, 0)))
    row_mask = jnp.repeat(mask.astype(jnp.int32), g, axis=1)  # [B, T·G, W]
    row_mask = jnp.pad(row_mask, ((0, 0), (0, rows - t * g), (0, w - k_win.shape[2])))
    k_win = jnp.pad(k_win, ((0, 0), (0, 0), (0, w - k_win.shape[2]), (0, 0)))
    v_win = jnp.pad(v_win, ((0, 0), (0, 0), (0, w - v_win.shape[2]), (0, 0)))
    block_s = _block_size(s)
    kernel = functools.partial(_kernel, block_s=block_s, scale=d**-0.5, upcast=bool(interpret))
    out = pl.pallas_call(
        kernel,
        grid=(b, hkv),
        in_specs=[
            pl.BlockSpec((b,), lambda i, h: (0,)),  # lengths, whole
            pl.BlockSpec((1, 1, rows, d), lambda i, h: (i, h, 0, 0)),
            pl.BlockSpec((1, 1, s, d), lambda i, h: (i, h, 0, 0)),
            pl.BlockSpec((1, 1, s, d), lambda i, h: (i, h, 0, 0)),
            pl.BlockSpec((1, 1, w, d), lambda i, h: (i, h, 0, 0)),
            pl.BlockSpec((1, 1, w, d), lambda i, h: (i, h, 0, 0)),
            pl.BlockSpec((1, rows, w), lambda i, h: (i, 0, 0)),
        ]
        + ([] if poison is None else [pl.BlockSpec((1, 1, rows, d), lambda i, h: (i, h, 0, 0))]),
        out_specs=pl.BlockSpec((1, 1, rows, d), lambda i, h: (i, h, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((b, hkv, rows, d), q.dtype),
        interpret=interpret,
        name="tree_attention",
        input_output_aliases={} if poison is None else {7: 0},
    )(lengths.astype(jnp.int32), qh, k_cache, v_cache, k_win, v_win, row_mask, *(() if poison is None else (poison,)))
    out = out[:, :, : t * g]
    return out.reshape(b, hkv, t, g, d).transpose(0, 2, 1, 3, 4).reshape(b, t, hq, d)


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


_announced: set[str] = set()


# Backends where the kernels run compiled in the engine. Empty until a backend's lowering is validated on real
# hardware: this project's machines have run them only in interpret mode (CPU), so the engine uses the references.
# On a GPU, check `pytest tests/test_tree_attention.py tests/test_rejection.py` with interpret=False, then add "gpu".
VALIDATED_BACKENDS: frozenset[str] = frozenset()


def kernel_platform() -> str | None:
    """The backend the kernels are compiled for on this machine, or None where the references run instead."""
    platform = jax.default_backend()
    return platform if platform in VALIDATED_BACKENDS else None


def per_shard(fn, mesh=None):
    """`fn` (the kernel or the reference) run per shard of a (data, model) mesh in `jax.shard_map`: rows split over
    data, KV heads and their query heads over model, so each device attends with its own cache shard and no
    collective. `mesh=None` uses the mesh set with `jax.set_mesh`. Needs KV heads divisible by the model axis."""
    rows, q_heads, kv_heads = P("data"), P("data", None, "model", None), P("data", "model", None, None)
    return jax.shard_map(
        fn, mesh=mesh, in_specs=(q_heads, kv_heads, kv_heads, rows, kv_heads, kv_heads, rows), out_specs=q_heads,
        check_vma=False,
    )


def on_mesh() -> bool:
    """Whether a (data, model) mesh is set for the function being traced."""
    mesh = jax.sharding.get_abstract_mesh()
    return not mesh.empty and {"data", "model"} <= set(mesh.axis_names)


def attend(q, k_cache, v_cache, lengths, k_win, v_win, mask) -> jax.Array:
    """Dispatch: the Pallas kernel on a validated backend (per shard under a mesh), the jax.numpy reference
    elsewhere (said once in the log; XLA partitions it like any other op)."""
    platform = kernel_platform()
    if platform is None:
        backend = jax.default_backend()
        if backend not in _announced:
            _announced.add(backend)
            log.info("tree attention: no Pallas kernel enabled for %s; using the jax.numpy reference", backend)
        return tree_attention_reference(q, k_cache, v_cache, lengths, k_win, v_win, mask)
    fn = per_shard(tree_attention) if on_mesh() else tree_attention
    return fn(q, k_cache, v_cache, lengths, k_win, v_win, mask)
