"""DFlash's training objective (BLOCK_DRAFTERS.md §1.5): many blocks per sequence in one forward.

For a sequence of S tokens with target features at every position, each anchor a (a position whose next tokens are
trained, `loss_mask[a] = loss_mask[a + 1] = 1`) gets the block [x_a, MASK x (B - 1)] at positions a .. a + B - 1.
A block's tokens see the context strictly before a (the features of positions < a: what the drafter's cache holds
when x_a is the root) and every token of their own block, nothing of other blocks. Slot k >= 1 is trained to
predict x_{a+k} with weight exp(-(k - 1) / gamma) (gamma 7 for B = 16 in SpecForge, 4 for B = 7-8 in DeepSpec),
times the loss mask there; the loss is sum(w * CE) / sum(w). The target is frozen and its embedding table and LM
head are shared, so only the drafter learns.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from jaxspec.models import kv_cache as kvc
from jaxspec.models.dflash import DFlashDrafter


def block_inputs(tokens: jax.Array, anchors: jax.Array, block_size: int, mask_token_id: int):
    """(block tokens [N, A·B], their positions [N, A·B], labels [N, A, B]) for anchors [N, A] into tokens [N, S];
    labels past the sequence are clipped to its last token (their weight is zero: `slot_weights`)."""
    n, s = tokens.shape
    a = anchors.shape[1]
    k = jnp.arange(block_size, dtype=jnp.int32)
    positions = anchors[:, :, None] + k  # [N, A, B]
    block = jnp.full((n, a, block_size), mask_token_id, jnp.int32).at[:, :, 0].set(
        jnp.take_along_axis(tokens, anchors, axis=1)
    )
    labels = jnp.take_along_axis(tokens, jnp.minimum(positions, s - 1).reshape(n, -1), axis=1).reshape(n, a, block_size)
    return block.reshape(n, -1), positions.reshape(n, -1), labels


def block_masks(anchors: jax.Array, seq_len: int, block_size: int) -> tuple[jax.Array, jax.Array]:
    """(context mask [N, A·B, S]: slot < the query's anchor; block mask [N, A·B, A·B]: the query's own block)."""
    n, a = anchors.shape
    anchor_of = jnp.repeat(anchors, block_size, axis=1)  # [N, A·B]
    ctx = jnp.arange(seq_len)[None, None, :] < anchor_of[:, :, None]
    block_of = jnp.repeat(jnp.arange(a), block_size)  # [A·B]
    own = jnp.broadcast_to(block_of[:, None] == block_of[None, :], (n, a * block_size, a * block_size))
    return ctx, own


def slot_weights(anchors, loss_mask, block_size: int, gamma: float) -> jax.Array:
    """[N, A, B] weights: 0 at slot 0, exp(-(k - 1) / gamma) at slot k, times loss_mask at a + k (0 past the end)."""
    n, s = loss_mask.shape
    k = jnp.arange(block_size)
    decay = jnp.where(k >= 1, jnp.exp(-(k - 1.0) / gamma), 0.0)  # [B]
    at = anchors[:, :, None] + k  # [N, A, B]
    inside = at < s
    mask = jnp.take_along_axis(loss_mask, jnp.minimum(at, s - 1).reshape(n, -1), axis=1).reshape(at.shape)
    return decay * (inside & (mask > 0))


def block_logits(drafter: DFlashDrafter, target, features, tokens, anchors) -> tuple[jax.Array, jax.Array]:
    """(logits [N, A, B, V] float32, labels [N, A, B]) of every anchor's block: features [N, S, n_aux·Ht] (the
    target's, at the drafter's layers), tokens [N, S], anchors [N, A] int32 (< S). target: the frozen target
    module (its embedding table and LM head)."""
    cfg = drafter.config
    n, s = tokens.shape
    block, positions, labels = block_inputs(tokens, anchors, cfg.block_size, cfg.mask_token_id)
    ctx_mask, own = block_masks(anchors, s, cfg.block_size)
    cache = drafter.init_cache(n, s)
    cache = drafter.write_context(features, jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (n, s)), cache)
    states = drafter(target.embed(block), positions, kvc.advance(cache, s), ctx_mask, own)  # [N, A·B, H]
    return target.vocab_logits(states).reshape(n, anchors.shape[1], cfg.block_size, -1), labels


def block_loss(
    drafter: DFlashDrafter, target, features, tokens, loss_mask, anchors, gamma: float,
    anchor_valid: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """(the weighted cross-entropy of every anchor's block, metrics): `block_logits`' inputs, loss_mask [N, S] (1
    on trained tokens), anchor_valid [N, A] bool (False: a padding anchor, weightless; None: all valid).

    Metrics, over valid anchors whose first slot is trained: `acc_1`, the first draft's top-1 accuracy, and
    `accepted_length`, 1 + the drafts in a row whose argmax is the label (inside the trained tokens). A block's
    drafts depend on its context and its anchor token only, never on each other, so on the target's own greedy
    text this is the tokens per verify the engine would accept at that anchor with chains of B - 1."""
    logits, labels = block_logits(drafter, target, features, tokens, anchors)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels)  # [N, A, B]
    w = slot_weights(anchors, loss_mask, drafter.config.block_size, gamma)  # [N, A, B]
    if anchor_valid is not None:
        w = w * anchor_valid[:, :, None]
    loss = jnp.sum(w * ce) / jnp.maximum(jnp.sum(w), 1e-9)
    hit = (jnp.argmax(logits, axis=-1) == labels) & (w > 0)  # [N, A, B]; slot 0 (the anchor itself) has w = 0
    scored = w[:, :, 1] > 0  # [N, A]
    run = jnp.cumprod(hit[:, :, 1:], axis=-1).sum(-1)  # [N, A] drafts accepted in a row
    count = jnp.maximum(scored.sum(), 1)
    metrics = {"acc_1": jnp.sum(hit[:, :, 1] & scored) / count, "accepted_length": jnp.sum((1 + run) * scored) / count}
    return loss, jax.lax.stop_gradient(metrics)
