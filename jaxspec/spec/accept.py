"""Acceptance of a chain of K drafts against the target's K+1 distributions (DESIGN_NOTES §4), vectorized.

Both rules return (a, emitted): a [B] is the number of accepted drafts, emitted [B, K+1] holds the drafts with the
target's own token at index a (the correction after a rejection, or the bonus token after K acceptances); entries
past a are meaningless.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _first_false(ok: jax.Array) -> jax.Array:
    """Index of the first False along the last axis of ok [B, K], or K when all are True."""
    k = ok.shape[-1]
    return jnp.min(jnp.where(ok, k, jnp.arange(k)), axis=-1).astype(jnp.int32)


def greedy_accept(drafts: jax.Array, target_logits: jax.Array) -> tuple[jax.Array, jax.Array]:
    """drafts [B, K] target ids; target_logits [B, K+1, V]. Accept while draft == target argmax."""
    best = jnp.argmax(target_logits, axis=-1).astype(jnp.int32)  # [B, K+1]
    a = _first_false(drafts == best[:, :-1])
    return a, _place(drafts, a, jnp.take_along_axis(best, a[:, None], axis=1)[:, 0])


def sampling_accept(
    drafts: jax.Array,  # [B, K] target ids, sampled from q
    p: jax.Array,  # [B, K+1, V] target probabilities (after temperature / top-k / top-p)
    q: jax.Array,  # [B, K, V] draft probabilities over the target vocabulary (0 outside the draft vocabulary)
    uniforms: jax.Array,  # [B, K] in [0, 1)
    key: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """Leviathan / Chen rejection sampling: accept x with probability min(1, p(x)/q(x)); at the first rejection draw
    from norm(max(p - q, 0)), after K acceptances from p_K. The output is distributed exactly as p."""
    px = jnp.take_along_axis(p[:, :-1], drafts[..., None], axis=-1)[..., 0]  # [B, K]
    qx = jnp.take_along_axis(q, drafts[..., None], axis=-1)[..., 0]
    a = _first_false(uniforms * qx < px)
    q_pad = jnp.concatenate([q, jnp.zeros_like(q[:, :1])], axis=1)  # q_K = 0, so the residual at K is p_K
    p_a = jnp.take_along_axis(p, a[:, None, None], axis=1)[:, 0]  # [B, V]
    q_a = jnp.take_along_axis(q_pad, a[:, None, None], axis=1)[:, 0]
    residual = jnp.maximum(p_a - q_a, 0.0)
    residual = jnp.where(jnp.sum(residual, -1, keepdims=True) > 0, residual, p_a)  # p == q: any draw from p
    token = jax.random.categorical(key, jnp.log(residual), axis=-1).astype(jnp.int32)
    return a, _place(drafts, a, token)


def _place(drafts: jax.Array, a: jax.Array, token: jax.Array) -> jax.Array:
    b, k = drafts.shape
    emitted = jnp.concatenate([drafts, jnp.zeros((b, 1), drafts.dtype)], axis=1)
    return emitted.at[jnp.arange(b), a].set(token)
