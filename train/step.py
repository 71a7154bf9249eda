"""The jitted TTT train step: the frozen target computes features and teacher logits online, the head runs K
draft steps, optax updates the head. Pure in (params, opt_state, batch), so the same code runs on one device or
sharded over a `jax.sharding.Mesh` with data and fsdp axes (GSPMD partitions it from the input shardings)."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxspec.models.eagle3 import Eagle3Head
from jaxspec.models.llama import LlamaModel
from pallas_kernels.mesh_axes import DATA, FSDP
from train.config import OptimConfig  # the `optim:` section of the training config
from train.precision import cast_floats
from train.ttt import ttt_logits, ttt_loss


def make_optimizer(cfg: OptimConfig) -> optax.GradientTransformation:
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, cfg.learning_rate, max(cfg.warmup_steps, 1), max(cfg.total_steps, cfg.warmup_steps + 1)
    )
    return optax.chain(
        optax.clip_by_global_norm(cfg.grad_clip),
        optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay),
    )


class Batch(NamedTuple):
    """One step's arrays (`train.packing.PackedBatch` on device). Packing fields None: one sequence per row,
    every position trained."""

    ids: jax.Array  # [B, T] int32 token ids (prompt + response), packed sequences back to back
    loss_mask: jax.Array  # [B, T] int32, 1 on assistant tokens
    # Offline training: the target's cached features and final hidden states; None = computed online.
    aux: jax.Array | None = None  # [B, T, n_aux * H]
    hidden: jax.Array | None = None  # [B, T, H]
    positions: jax.Array | None = None  # [B, T] int32 position within each packed sequence
    segments: jax.Array | None = None  # [B, T] int32 packed sequence id (0: padding)
    trained: jax.Array | None = None  # [B, C] int32 positions that carry a loss (run the draft steps)


def split_head(head: Eagle3Head, freeze_lm_head: bool = False):
    """(graphdef, trainable params, frozen rest): embeddings are never trained; lm_head optionally frozen."""
    trainable = nnx.All(nnx.Param, nnx.Not(nnx.PathContains("embed_tokens")))
    if freeze_lm_head:
        trainable = nnx.All(trainable, nnx.Not(nnx.PathContains("lm_head")))
    return nnx.split(head, trainable, ...)


def target_features(
    target: LlamaModel, ids: jax.Array, positions: jax.Array | None = None, segments: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
    """The frozen target's EAGLE-3 features [B, T, 3H] and final pre-norm hidden states [B, T, H]; on packed rows
    each sequence sees only itself (causal within its segment, its own positions)."""
    b, t = ids.shape
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    mask = None
    if segments is not None:
        causal = jnp.tril(jnp.ones((t, t), bool))[None]
        mask = causal & (segments[:, :, None] == segments[:, None, :])  # [B, T, T]
    out = target(ids, positions, target.init_cache(b, t), block_mask=mask, return_aux=True, return_hidden=True,
                 empty_cache=True)
    return out.aux, out.hidden  # the full-vocabulary logits are unused and compiled away


def teacher_logits(target: LlamaModel, hidden: jax.Array, draft_ids: jax.Array) -> jax.Array:
    """The target's logits [B, T, V_d] on the draft vocabulary's columns only: the loss renormalizes over them,
    so the other (V − V_d) columns, most of the LM head's cost, are never computed."""
    h = target.norm(hidden.astype(target.dtype))
    table = target.embed_tokens[...] if target.lm_head is None else target.lm_head.kernel[...].T  # [V, H]
    rows = jnp.take(table, draft_ids, axis=0)  # [V_d, H]
    return jnp.einsum("bth,vh->btv", h, rows, preferred_element_type=jnp.float32)


def train_step(
    target_graphdef, target_params, head_graphdef, params, frozen, opt_state, batch: Batch, *, tx, num_steps: int,
    compute_dtype=None, teacher_temperature: float = 1.0,
):
    """One optimizer step; returns (params, opt_state, loss, metrics). compute_dtype: mixed precision
    (train/precision.py): the head computes with params and frozen cast to it — head_graphdef is then a head of that
    dtype (`computing_in`) — while the optimizer updates params in their own dtype; None: the params' dtype. The
    target computes in the dtype of target_graphdef and target_params. teacher_temperature: `ttt_loss`'s."""
    target = nnx.merge(target_graphdef, target_params)
    if batch.aux is None:
        features, hidden = target_features(target, batch.ids, batch.positions, batch.segments)
    else:  # offline: only the target's final norm and the draft columns of its lm_head run
        features, hidden = batch.aux, batch.hidden
    features, hidden = jax.lax.stop_gradient(features.astype(target.dtype)), jax.lax.stop_gradient(hidden)
    head0 = nnx.merge(head_graphdef, params, frozen)
    draft_ids = head0.to_target_ids(jnp.arange(head0.config.draft_vocab_size, dtype=jnp.int32))  # [V_d]
    teacher = teacher_logits(target, hidden, draft_ids)
    next_ids = jnp.concatenate([batch.ids[:, 1:], jnp.zeros_like(batch.ids[:, :1])], axis=1)

    fixed = frozen if compute_dtype is None else cast_floats(frozen, compute_dtype)

    def loss_fn(params):
        if compute_dtype is not None:
            params = cast_floats(params, compute_dtype)  # the gradient flows back through the cast to the master
        head = nnx.merge(head_graphdef, params, fixed)
        logits = ttt_logits(head, target.embed_tokens[...], features, next_ids, num_steps,
                            batch.positions, batch.segments, batch.trained)
        return ttt_loss(logits, teacher, batch.loss_mask, segments=batch.segments, trained=batch.trained,
                        teacher_temperature=teacher_temperature)

    (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss, metrics


def make_mesh(data: int, fsdp: int, devices=None) -> Mesh:
    devices = devices if devices is not None else jax.devices()[: data * fsdp]
    return jax.make_mesh((data, fsdp), (DATA, FSDP), axis_types=(jax.sharding.AxisType.Auto,) * 2, devices=devices)


def param_sharding(mesh: Mesh, tree):
    """FSDP: each array split over 'fsdp' along its first axis that divides evenly; small ones replicated."""
    fsdp = mesh.shape[FSDP]

    def spec(x):
        for axis, size in enumerate(x.shape):
            if size % fsdp == 0 and size >= fsdp:
                parts = [None] * x.ndim
                parts[axis] = FSDP
                return NamedSharding(mesh, P(*parts))
        return NamedSharding(mesh, P())

    return jax.tree.map(spec, tree)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Batch rows over both axes (FSDP shards data too), sequence whole."""
    return NamedSharding(mesh, P((DATA, FSDP), None))
