"""Acceptance of a chain of K drafts against the target's K+1 distributions (DESIGN_NOTES §4): the chain case of
the batched verifier in `pallas_kernels.rejection` (node 0 is the last emitted token, node j the j-th draft).

Both rules return (a, emitted): a [B] is the number of accepted drafts, emitted [B, K+1] holds the drafts with the
target's own token at index a (the correction after a rejection, or the bonus token after K acceptances); entries
past a are -1.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.rejection import chain_parents, verify_draft


def _chain(drafts: jax.Array) -> tuple[jax.Array, jax.Array]:
    b, k = drafts.shape
    return jnp.concatenate([jnp.zeros((b, 1), drafts.dtype), drafts], axis=1), chain_parents(b, k + 1)


def greedy_accept(drafts: jax.Array, target_logits: jax.Array, kernels: str = "reference") -> tuple[jax.Array, jax.Array]:
    """drafts [B, K] target ids; target_logits [B, K+1, V]. Accept while draft == target argmax. kernels: the
    verifier's implementation (`pallas_kernels.dispatch`)."""
    tokens, parents = _chain(drafts)
    b, n = tokens.shape
    a, emitted, _ = verify_draft(
        tokens, parents, target_logits, jnp.zeros((b, n)), jnp.ones((b, 1)), mode="greedy", max_depth=n - 1,
        impl=kernels,
    )
    return a, emitted


def forced_accept(drafts: jax.Array, target_logits: jax.Array, uniforms: jax.Array, prob: float):
    """Benchmark-only: accept each draft with probability `prob` whatever the target says (the first failure stops
    the run), then the target's argmax. Lets throughput be measured at a chosen acceptance (a chain's mean accepted
    length is 1 + prob + ... + prob^K) with any head, e.g. random weights at real shapes. Output is NOT the
    target's. uniforms [B, K] in [0, 1)."""
    b, k = drafts.shape
    a = jnp.sum(jnp.cumprod(uniforms < prob, axis=1), axis=1).astype(jnp.int32)  # [B] leading successes
    j = jnp.arange(k + 1)[None, :]
    padded = jnp.concatenate([drafts, jnp.zeros((b, 1), drafts.dtype)], axis=1)  # [B, K+1]
    target = jnp.argmax(target_logits, axis=-1).astype(drafts.dtype)  # [B, K+1]
    emitted = jnp.where(j < a[:, None], padded, jnp.where(j == a[:, None], target, -1))
    return a, emitted


def sampling_accept(
    drafts: jax.Array,  # [B, K] target ids, sampled from q
    p: jax.Array,  # [B, K+1, V] target probabilities (after temperature / top-k / top-p)
    q: jax.Array,  # [B, K, V] draft probabilities over the target vocabulary (0 outside the draft vocabulary)
    uniforms: jax.Array,  # [B, K] in [0, 1)
    key: jax.Array,
    kernels: str = "reference",  # the verifier's implementation (pallas_kernels.dispatch)
) -> tuple[jax.Array, jax.Array]:
    """Leviathan / Chen rejection sampling: accept x with probability min(1, p(x)/q(x)); at the first rejection draw
    from norm(max(p - q, 0)), after K acceptances from p_K. The output is distributed exactly as p."""
    tokens, parents = _chain(drafts)
    b, n = tokens.shape
    u = jnp.concatenate([jnp.zeros((b, 1), uniforms.dtype), uniforms], axis=1)  # u of node j+1 = uniforms[j]
    q_nodes = jnp.concatenate([q, jnp.zeros_like(q[:, :1])], axis=1)  # node j's child drafted from q_j; none at K
    noise = jax.random.exponential(key, (b, p.shape[-1]), jnp.float32)
    a, emitted, _ = verify_draft(tokens, parents, p, u, noise, q_nodes, mode="chain", max_depth=n - 1, impl=kernels)
    return a, emitted
