"""Training-time test (TTT) for EAGLE-3 heads (DESIGN_NOTES §3): K draft steps unrolled in training, each feeding the
head's own state forward, so that the head learns to draft from its own outputs as it will at inference.

Row t of step k reads the embedding of x_{t+1+k} and the state of step k-1 (step 0: fc of the target features
g_t), sits at rope position t+k, and attends to block-0 keys j ≤ t plus, for each step 1 ≤ i ≤ k, only its own
key of that step (row t): exactly the cache an inference-time draft chain anchored at t would hold. The efficient
form runs causal attention over block 0 once per step and merges the k diagonal terms in closed form (log-sum-exp);
`ttt_logits_reference` builds the explicit [T, (k+1)·T] masks instead and exists to test it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxspec.config import rope_inv_freq
from jaxspec.models.eagle3 import Eagle3Head
from jaxspec.models.layers import NEG_INF, attention, rope_cos_sin


def _project_step(head: Eagle3Head, emb, state, positions):
    """q, k, v [B, T, heads, D] and the residual for one step's inputs: the head layer's own code
    (`Eagle3Layer.attention_input`, `Attention.project`), as drafting runs it."""
    layer = head.midlayer
    u, residual = layer.attention_input(emb, state)
    cos, sin = rope_cos_sin(positions, jnp.asarray(rope_inv_freq(head.config)))
    q, k, v = layer.self_attn.project(u, cos, sin)
    return q, k, v, residual


def _finish_step(head: Eagle3Head, residual, attn):
    """o_proj, MLP and the draft logits (`Eagle3Layer.finish`, `Eagle3Head.logits`); returns (logits [B, T, V_d]
    float32, next state [B, T, H])."""
    layer = head.midlayer
    b, t = attn.shape[:2]
    out = layer.finish(residual, layer.self_attn.o_proj(attn.reshape(b, t, -1)))
    return head.logits(out), out


def _causal_with_lse(q, k, v):
    """Causal GQA attention over one block: (out [B, T, Hq, D] float32, lse [B, T, Hq])."""
    b, t, hq, d = q.shape
    hkv = k.shape[2]
    qg = q.reshape(b, t, hkv, hq // hkv, d)
    s = jnp.einsum("btkgd,bskd->btkgs", qg, k, preferred_element_type=jnp.float32) * d**-0.5
    causal = jnp.tril(jnp.ones((t, t), bool))[None, :, None, None, :]
    s = jnp.where(causal, s, NEG_INF)
    lse = jax.nn.logsumexp(s, axis=-1)  # [B, T, Hkv, G]
    out = jnp.einsum("btkgs,bskd->btkgd", jnp.exp(s - lse[..., None]), v.astype(jnp.float32))
    return out.reshape(b, t, hq, d), lse.reshape(b, t, hq)


def _merge_diagonal(out_b, lse_b, q, diag_k, diag_v):
    """Add keys that each row t sees only at row t (one per earlier step) to a block result, exactly."""
    b, t, hq, d = q.shape
    hkv = diag_k[0].shape[2]
    g = hq // hkv
    qg = q.reshape(b, t, hkv, g, d)
    scores = [jnp.einsum("btkgd,btkd->btkg", qg, k, preferred_element_type=jnp.float32).reshape(b, t, hq) * d**-0.5
              for k in diag_k]
    m = jnp.max(jnp.stack([lse_b, *scores]), axis=0)  # [B, T, Hq]
    total = jnp.exp(lse_b - m)[..., None] * out_b
    weight = jnp.exp(lse_b - m)
    for s, v in zip(scores, diag_v):
        v_full = jnp.repeat(v.astype(jnp.float32), g, axis=2)  # [B, T, Hq, D]
        total = total + jnp.exp(s - m)[..., None] * v_full
        weight = weight + jnp.exp(s - m)
    return total / weight[..., None]


def _step_inputs(head, embed_table, features, next_ids, num_steps):
    table = head.embed_tokens[...] if head.embed_tokens is not None else embed_table
    b, t = next_ids.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    # Step k reads x_{t+1+k}: shift the ids left by k (rows past the end read padding and are masked in the loss).
    padded = jnp.concatenate([next_ids, jnp.zeros((b, num_steps), next_ids.dtype)], axis=1)
    embs = [jnp.take(table, padded[:, k : k + t], axis=0).astype(head.dtype) for k in range(num_steps)]
    return head.project(features), embs, positions


def ttt_logits(head: Eagle3Head, embed_table, features, next_ids, num_steps: int) -> list[jax.Array]:
    """Draft logits of each TTT step, efficient form.

    features: [B, T, n_aux·Ht] target features g_t; next_ids: [B, T] the token after each position (x_{t+1}).
    Returns num_steps arrays [B, T, V_d]: step k, row t predicts x_{t+2+k}.
    """
    state, embs, positions = _step_inputs(head, embed_table, features, next_ids, num_steps)
    logits_per_step, diag_k, diag_v = [], [], []
    k0 = v0 = None
    for k in range(num_steps):
        q, key, value, residual = _project_step(head, embs[k], state, positions + k)
        if k == 0:
            k0, v0 = key, value
            out, lse = _causal_with_lse(q, k0, v0)
            attn = out
        else:
            diag_k.append(key)
            diag_v.append(value)
            out, lse = _causal_with_lse(q, k0, v0)
            attn = _merge_diagonal(out, lse, q, diag_k, diag_v)
        logits, state = _finish_step(head, residual, attn.astype(head.dtype))
        logits_per_step.append(logits)
    return logits_per_step


def ttt_logits_reference(head: Eagle3Head, embed_table, features, next_ids, num_steps: int) -> list[jax.Array]:
    """The same, with an explicit mask over all keys of all steps so far (slow; for tests)."""
    state, embs, positions = _step_inputs(head, embed_table, features, next_ids, num_steps)
    b, t = next_ids.shape
    keys, values, out_logits = [], [], []
    rows = jnp.arange(t)
    for k in range(num_steps):
        q, key, value, residual = _project_step(head, embs[k], state, positions + k)
        keys.append(key)
        values.append(value)
        all_k = jnp.concatenate(keys, axis=1).transpose(0, 2, 1, 3)  # [B, Hkv, (k+1)·T, D]
        all_v = jnp.concatenate(values, axis=1).transpose(0, 2, 1, 3)
        blocks = [rows[None, :] <= rows[:, None]]  # step 0: causal
        blocks += [rows[None, :] == rows[:, None]] * k  # steps 1..k: the diagonal
        mask = jnp.broadcast_to(jnp.concatenate(blocks, axis=1)[None], (b, t, (k + 1) * t))
        attn = attention(q, all_k, all_v, mask)
        logits, state = _finish_step(head, residual, attn)
        out_logits.append(logits)
    return out_logits


def ttt_loss(
    step_logits: list[jax.Array],  # K × [B, T, V_d]
    teacher_logits: jax.Array,  # [B, T, V_d] the target's logits at each position, draft-vocabulary columns only
    loss_mask: jax.Array,  # [B, T] 1 where the token at that position is trained on (assistant tokens)
    decay: float = 0.8,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Σ_k decay^k · soft cross-entropy(target restricted to the draft vocabulary, draft), with accuracies.

    Step k, row t is taught by the target's distribution at position t+1+k (which predicts x_{t+2+k}) and counts
    where loss_mask[t+2+k] is set.
    """
    b, t, _ = teacher_logits.shape
    teacher = jax.nn.softmax(teacher_logits.astype(jnp.float32), axis=-1)  # [B, T, V_d] renormalized on the draft vocab
    teacher_best = jnp.argmax(teacher, axis=-1)
    total = 0.0
    metrics = {}
    still_right = jnp.ones((b, t), bool)
    cond = []
    for k, logits in enumerate(step_logits):
        shift = 1 + k
        p = jnp.concatenate([teacher[:, shift:], jnp.zeros_like(teacher[:, :shift])], axis=1)
        best = jnp.concatenate([teacher_best[:, shift:], jnp.zeros_like(teacher_best[:, :shift])], axis=1)
        m = jnp.concatenate([loss_mask[:, shift + 1 :], jnp.zeros((b, shift + 1), loss_mask.dtype)], axis=1)
        m = m.astype(jnp.float32)
        count = jnp.maximum(m.sum(), 1.0)
        ce = -jnp.sum(p * jax.nn.log_softmax(logits, axis=-1), axis=-1)  # [B, T]
        loss_k = jnp.sum(ce * m) / count
        total = total + decay**k * loss_k
        right = jnp.argmax(logits, axis=-1) == best
        metrics[f"loss_{k}"] = loss_k
        metrics[f"acc_{k}"] = jnp.sum(right * m) / count
        reached = still_right & (m > 0)
        cond_k = jnp.sum(right & reached) / jnp.maximum(jnp.sum(reached), 1)
        metrics[f"cond_acc_{k}"] = cond_k
        cond.append(cond_k)
        still_right = still_right & right
    # Simulated mean accepted length of a chain: 1 + Σ_k Π_{i≤k} cond_acc_i.
    metrics["tau"] = 1.0 + sum(jnp.prod(jnp.stack(cond[: k + 1])) for k in range(len(cond)))
    return total, metrics
