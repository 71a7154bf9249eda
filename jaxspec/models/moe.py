"""The sparse MLP of a mixture-of-experts target (Mixtral, Qwen2-MoE, Qwen3-MoE, Gemma 4 26B-A4B) as pure functions
of arrays: the router, the experts grouped by the tokens routed to them, and the weighted sum. The modules holding
the weights are in llama.py (`SparseMoe`, `Experts`) and gemma.py (`GemmaMoe`).

Why this is harder to keep exact than a dense MLP: which tokens an expert sees changes with the batch and with the
verify block, so a grouped matmul that computes an expert's tokens as one dot of their count gives a token other
bits depending on its neighbours (numerics.py: a dot's reduction order follows its shape). Under invariant numerics
every piece here keeps a token's bits a function of that token alone:
- the router's logits are a target matmul on fixed row tiles (`Linear`); its softmax and the top-k renormalization
  reduce by pairwise halving and divide by whole arrays (`_divide`), so no program rewrites them;
- top-k is comparisons only, and a token's k experts are put in ascending id order, the order transformers adds
  them in;
- the experts run on fixed tiles of `row_tile` rows (`grouped_experts`): each expert's tokens are padded to whole
  tiles, and every tile is the same [row_tile, H] x [H, I] / [row_tile, I] x [I, H] dot of one expert's weights,
  in a loop over the tiles in use (a dynamic trip count: only the experts some token chose are read);
- the k weighted outputs are added one after another, each product rounded first (`exact_mul`).
A token's output therefore does not depend on how many tokens share its experts, which tile it lands in, or
whether it is decoded, verified in a chain or a tree, or prefilled next to other rows (tests/test_moe.py).

Expert parallelism: under a (data, model) mesh whose model axis divides the experts, each device holds
num_experts / model of them (sharding.py) and runs the tiles of its own experts in `jax.shard_map`; a slot routed
elsewhere gives zeros there, and one `psum` over the model axis assembles the slots. Each slot's output is computed
whole on one device and meets only zeros in the sum, so it has the single device's bits.

Without invariant numerics (training features, speed comparisons) the experts are one `jax.lax.ragged_dot` per
projection over the slots sorted by expert.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxspec.config import MoeConfig
from jaxspec.models.numerics import contract, materialized_sums
from pallas_kernels.dispatch import on_mesh
from pallas_kernels.mesh_axes import DATA, MODEL
from pallas_kernels.primitives import exact_mul, fenced, halving_max, halving_sum, held_dtype


def _divide(a: jax.Array, b: jax.Array) -> jax.Array:
    """a / b[..., None] as a true IEEE quotient in every program: XLA rewrites a division by a broadcast value into a
    multiply by its reciprocal in some programs and not others, so the divisor is a whole array behind a barrier."""
    return a / jax.lax.optimization_barrier(jnp.broadcast_to(b[..., None], a.shape))


def route(logits: jax.Array, cfg: MoeConfig, dtype, invariant: bool) -> tuple[jax.Array, jax.Array]:
    """Router logits [N, E] (model dtype) → (experts [N, k] int32 in ascending id order, weights [N, k] float32).
    As transformers: softmax over all experts in float32, the top k kept, renormalized when `norm_topk_prob`, and
    rounded to the model dtype when `round_weights` (Qwen; Mixtral keeps float32)."""
    z = logits.astype(jnp.float32)
    if invariant:
        whole = materialized_sums()
        e = jnp.exp(z - halving_max(z, materialize=whole)[:, None])
        probs = _divide(e, halving_sum(e, materialize=whole))
    else:
        probs = jax.nn.softmax(z, axis=-1)
    weights, experts = jax.lax.top_k(probs, cfg.top_k)  # [N, k]
    if cfg.norm_topk_prob:
        if invariant:
            weights = _divide(weights, halving_sum(weights, materialize=materialized_sums()))
        else:
            weights = weights / weights.sum(-1, keepdims=True)
    if cfg.round_weights:
        weights = weights.astype(dtype).astype(jnp.float32)
    order = jnp.argsort(experts, axis=-1)
    return jnp.take_along_axis(experts, order, -1).astype(jnp.int32), jnp.take_along_axis(weights, order, -1)


def combine(outputs: jax.Array, weights: jax.Array) -> jax.Array:
    """outputs [N, k, H] (model dtype) and weights [N, k] float32 → [N, H]: each output times its weight, the product
    rounded to the model dtype (transformers: the expert's output times the weight, then cast), added one slot after
    another from zero in ascending expert order (transformers' `index_add_`)."""
    terms = exact_mul(outputs.astype(jnp.float32), weights[..., None]).astype(outputs.dtype)
    total = jnp.zeros_like(terms[:, 0])
    for j in range(terms.shape[1]):
        total = total + terms[:, j]
    return total


def gated_mlp(x: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array, dot, act=jax.nn.silu) -> jax.Array:
    """One expert on rows x [R, H]: down(act(x·gate) · (x·up)), each `dot(a, w)` in the model dtype; act: SiLU
    (SwiGLU: Mixtral, Qwen) or Gemma's tanh GELU."""
    return dot(act(dot(x, gate)) * dot(x, up), down)


def _tile_dot(a: jax.Array, w: jax.Array) -> jax.Array:
    """One tile's [R, K] x [K, N] dot in a's dtype, fenced, as every dense tile of the target is
    (numerics.tiled_matmul)."""
    return fenced(lambda x, y: contract(x, y, ((1,), (0,))), a, w)


def slots_by_expert(experts: jax.Array, num_local: int, first: int | jax.Array) -> tuple[jax.Array, ...]:
    """The slots (token, choice) of experts [N, k] sorted by local expert: (key [S], the local expert of each slot,
    num_local for a slot routed to another device's expert; order [S], the slots sorted by key, stably; counts
    [num_local], the slots of each local expert)."""
    local = experts.reshape(-1) - first  # [S]
    key = jnp.where((local >= 0) & (local < num_local), local, num_local)  # foreign slots sort last
    order = jnp.argsort(key, stable=True)
    counts = jnp.zeros((num_local + 1,), jnp.int32).at[key].add(1)[:num_local]
    return key, order, counts


def grouped_experts(
    x: jax.Array,  # [N, H] tokens
    experts: jax.Array,  # [N, k] int32 global expert ids
    gate: jax.Array,  # [E_local, H, I] this device's experts
    up: jax.Array,  # [E_local, H, I]
    down: jax.Array,  # [E_local, I, H]
    row_tile: int,
    first: int | jax.Array = 0,  # the global id of gate[0] (expert parallelism)
    act=jax.nn.silu,
) -> jax.Array:
    """Each slot's expert output [N, k, H] on fixed tiles (module docstring); slots routed to experts outside
    [first, first + E_local) give zeros. Slots are sorted by expert, each expert's run padded to whole tiles of
    `row_tile` rows, and a loop runs the tiles in use, each one expert's gated MLP on [row_tile, H] rows."""
    n, k = experts.shape
    num_local, h = gate.shape[0], x.shape[-1]
    slots = n * k
    key, order, counts = slots_by_expert(experts, num_local, first)  # foreign slots are never computed
    tiles = -(-counts // row_tile)  # [E_local] tiles per expert
    tile_end = jnp.cumsum(tiles)  # [E_local]
    run_start = jnp.cumsum(counts) - counts  # [E_local] the first sorted position of each expert
    # every tile holds at least one slot, and each expert wastes less than one tile: a static bound on the tiles
    max_tiles = min(slots, -(-slots // row_tile) + min(num_local, slots))
    sorted_key = key[order]  # [S]
    expert_of = jnp.minimum(sorted_key, num_local - 1)
    rank = jnp.arange(slots) - run_start[expert_of]  # position within its expert's run
    padded_row = (tile_end[expert_of] - tiles[expert_of]) * row_tile + rank  # [S] row in the tile buffer
    rows = max_tiles * row_tile
    row_of_slot = jnp.full((slots,), rows, jnp.int32).at[order].set(
        jnp.where(sorted_key < num_local, padded_row, rows).astype(jnp.int32))  # [S]; `rows`: not computed here
    slot_of_row = jnp.zeros((rows + 1,), jnp.int32).at[row_of_slot].set(jnp.arange(slots, dtype=jnp.int32))[:rows]
    tile_expert = jnp.searchsorted(tile_end, jnp.arange(max_tiles), side="right", method="compare_all")
    tile_expert = jnp.minimum(tile_expert, num_local - 1)  # [max_tiles] the expert of each tile

    def body(i, out):  # out [rows, H]
        token = jax.lax.dynamic_slice_in_dim(slot_of_row, i * row_tile, row_tile) // k  # [row_tile]
        e = tile_expert[i]
        y = gated_mlp(x[token], gate[e], up[e], down[e], _tile_dot, act)  # [row_tile, H]
        return jax.lax.dynamic_update_slice_in_dim(out, y, i * row_tile, 0)

    out = jax.lax.fori_loop(0, tile_end[-1], body, jnp.zeros((rows + 1, h), x.dtype))  # row `rows` stays zero
    return out[row_of_slot].reshape(n, k, h)


def ragged_experts(
    x: jax.Array, experts: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array, first: int | jax.Array = 0,
    act=jax.nn.silu,
) -> jax.Array:
    """`grouped_experts` with plain XLA numerics: each projection one `jax.lax.ragged_dot` over the slots sorted by
    expert (foreign slots last, past the groups: zeros)."""
    n, k = experts.shape
    _, order, sizes = slots_by_expert(experts, gate.shape[0], first)
    xs = x[order // k]  # [S, H]
    wide = held_dtype(x.dtype)
    dot = lambda a, w: jax.lax.ragged_dot(a.astype(wide), w.astype(wide), sizes).astype(x.dtype)  # noqa: E731
    ys = gated_mlp(xs, gate, up, down, dot, act)  # [S, H]
    return jnp.zeros_like(ys).at[order].set(ys).reshape(n, k, -1)


def expert_outputs(
    x: jax.Array, experts: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array, row_tile: int | None,
    act=jax.nn.silu,
) -> jax.Array:
    """Every slot's expert output [N, k, H] for tokens x [N, H] and their experts [N, k]: on fixed tiles of
    `row_tile` rows (invariant numerics) or by ragged_dot (None). Under a mesh whose model axis divides the experts,
    expert-parallel (module docstring; rows split over the data axis); otherwise XLA partitions whatever split the
    weights have."""
    fn = functools.partial(ragged_experts, act=act) if row_tile is None else functools.partial(
        grouped_experts, row_tile=row_tile, act=act)
    model = jax.sharding.get_abstract_mesh().shape[MODEL] if on_mesh() else 0
    if not model or gate.shape[0] % model:
        return fn(x, experts, gate, up, down)
    per_device = gate.shape[0] // model

    def local(x, experts, gate, up, down):
        first = jax.lax.axis_index(MODEL) * per_device
        return jax.lax.psum(fn(x, experts, gate, up, down, first=first), MODEL)

    stacked = P(MODEL, None, None)
    return jax.shard_map(local, in_specs=(P(DATA), P(DATA), stacked, stacked, stacked), out_specs=P(DATA),
                         check_vma=False)(x, experts, gate, up, down)
