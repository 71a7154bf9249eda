"""Training-time test (TTT) for EAGLE-3 heads (DESIGN_NOTES §3): K draft steps unrolled in training, each feeding the
head's own state forward, so that the head learns to draft from its own outputs as it will at inference.

Row t of step k reads the embedding of x_{t+1+k} and the state of step k-1 (step 0: fc of the target features
g_t), sits at rope position p_t+k (p_t: t's position in its own sequence), and attends to block-0 keys j ≤ t of
its sequence plus, for each step 1 ≤ i ≤ k, only its own key of that step (row t): exactly the cache an
inference-time draft chain anchored at t would hold. The efficient form runs causal attention over block 0 once
per step and merges the k diagonal terms in closed form (log-sum-exp); `ttt_logits_reference` builds the explicit
[T, (k+1)·T] masks instead and exists to test it.

Packed rows (`train.packing`): several sequences share a row, told apart by `segments` and each with its own
`positions`; attention stays within a sequence. `trained` [B, C] names the positions that carry a loss: step 0
computes keys and values for every position (they are attended to), but the queries, MLP and logits of step 0 and
every later step run at those C positions only — a prompt position costs a key, not K head forwards.

Multi-layer heads (`HeadConfig.num_layers`): every layer keeps its own step-0 keys and diagonal keys, as its own
cache would at inference; step 0 runs the layers before the last at every position (the next layer's keys need
their outputs) and the last one at the trained positions. With EAGLE 3.1's `norm_output` the state fed to the next
step is the normed output (`Eagle3Head.next_state`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxspec.config import rope_inv_freq
from jaxspec.models.eagle3 import Eagle3Head
from jaxspec.models.layers import NEG_INF, attention, group_queries, rope_cos_sin, ungroup_queries


def _layers(head: Eagle3Head) -> list:
    """The head's decoder layers in order: the first (2H input) and, in multi-layer heads, plain ones after it."""
    return [head.midlayer, *head.later_layers]


def _project_step(head: Eagle3Head, index: int, layer_input, positions):
    """q, k, v [B, N, heads, D] and the residual of layer `index` for one step's rows [B, N, ...] (N: all T
    positions or the C trained ones): the head layers' own code (`Eagle3Layer.attention_input`, an input norm for
    the later layers, `Attention.project`), as drafting runs it. layer_input: (token embeddings, state) for the
    first layer, the previous layer's output for the others."""
    layer = _layers(head)[index]
    if index == 0:
        u, residual = layer.attention_input(*layer_input)
    else:
        u, residual = layer.input_layernorm(layer_input), layer_input
    cos, sin = rope_cos_sin(positions, jnp.asarray(rope_inv_freq(head.config)))
    q, k, v = layer.self_attn.project(u, cos, sin)
    return q, k, v, residual


def _finish_layer(head: Eagle3Head, index: int, residual, attn):
    """o_proj and the MLP of layer `index` (`Eagle3Layer.finish`, `DecoderLayer.finish`) → its output [B, N, H]."""
    layer = _layers(head)[index]
    b, t = attn.shape[:2]
    return layer.finish(residual, layer.self_attn.o_proj(attn.reshape(b, t, -1)))


def _draft_outputs(head: Eagle3Head, out):
    """(draft logits [B, N, V_d] float32, the next step's state [B, N, H]) of the last layer's output."""
    return head.logits(out), head.next_state(out)


def _attend_with_lse(q, k, v, mask):
    """GQA attention of queries q [B, C, Hq, D] over keys k, v [B, T, Hkv, D] where mask [B, C, T] allows:
    (out [B, C, Hq, D] float32, lse [B, C, Hq])."""
    b, c, hq, d = q.shape
    hkv = k.shape[2]
    g = hq // hkv
    qg = group_queries(q, hkv)  # [B, Hkv, G·C, D]
    k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [B, Hkv, T, D]
    s = jnp.einsum("bkqd,bksd->bkqs", qg, k, preferred_element_type=jnp.float32).reshape(b, hkv, g, c, -1) * d**-0.5
    s = jnp.where(mask[:, None, None, :, :], s, NEG_INF)  # [B, Hkv, G, C, T]
    lse = jax.nn.logsumexp(s, axis=-1)  # [B, Hkv, G, C]
    probs = jnp.exp(s - lse[..., None]).reshape(b, hkv, g * c, -1)
    out = jnp.einsum("bkqs,bksd->bkqd", probs, v.astype(jnp.float32))  # [B, Hkv, G·C, D]
    return ungroup_queries(out, hq), ungroup_queries(lse.reshape(b, hkv, g * c), hq)


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


def _take(x: jax.Array, at: jax.Array) -> jax.Array:
    """x [B, T, ...] at positions at [B, C] → [B, C, ...]; every `at` here is within [0, T). mode="clip" clamps the
    indices instead of masking the result: the default ("fill") adds a select over the whole [B, C, V_d] gather of
    the teacher's probabilities, which XLA:CPU ran as its own pass (~50 ms per TTT step)."""
    return jnp.take_along_axis(x, at.reshape(*at.shape, *([1] * (x.ndim - 2))), axis=1, mode="clip")


def _packing(next_ids, positions, segments, trained):
    """Defaults for an unpacked batch: one sequence per row, positions 0..T-1, every position trained."""
    b, t = next_ids.shape
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    if segments is None:
        segments = jnp.zeros((b, t), jnp.int32)
    if trained is None:
        trained = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    return positions, segments, trained


def _step_ids(next_ids, at, num_steps):
    """Token ids of step k at positions `at` [B, C]: x_{t+1+k}, i.e. next_ids shifted left by k (padding past the
    end; such positions, and those whose shift crosses into the next packed sequence, are masked in the loss)."""
    b, _ = next_ids.shape
    padded = jnp.concatenate([next_ids, jnp.zeros((b, num_steps), next_ids.dtype)], axis=1)
    return [jnp.take_along_axis(padded, at + k, axis=1) for k in range(num_steps)]  # K × [B, C]


def ttt_logits(
    head: Eagle3Head,
    embed_table,  # [V, H] the target's embeddings (used when the head has none)
    features,  # [B, T, n_aux·Ht] target features g_t
    next_ids,  # [B, T] the token after each position (x_{t+1})
    num_steps: int,
    positions=None,  # [B, T] each token's position in its own sequence (packed rows); None: 0..T-1
    segments=None,  # [B, T] which packed sequence each token belongs to; None: one per row
    trained=None,  # [B, C] the positions to compute draft logits for, ascending; None: all T
) -> list[jax.Array]:
    """Draft logits of each TTT step, efficient form: num_steps arrays [B, C, V_d]; step k at trained[i] = t
    predicts x_{t+2+k}."""
    positions, segments, trained = _packing(next_ids, positions, segments, trained)
    table = head.embed_tokens[...] if head.embed_tokens is not None else embed_table
    step_ids = _step_ids(next_ids, trained, num_steps)
    t = next_ids.shape[1]
    last = head.config.num_layers - 1
    row_pos, row_seg = _take(positions, trained), _take(segments, trained)  # [B, C]
    mask = (jnp.arange(t)[None, None, :] <= trained[:, :, None]) & (segments[:, None, :] == row_seg[:, :, None])
    # Step 0 over every position: all of them are keys, of every layer. Layers before the last run every row
    # (a later layer's keys need them); the last runs its queries, MLP and logits at the trained rows only.
    causal = (jnp.arange(t)[None, None, :] <= jnp.arange(t)[None, :, None]) & (
        segments[:, None, :] == segments[:, :, None])  # [B, T, T]
    x = (jnp.take(table, next_ids, axis=0).astype(head.dtype), head.project(features))
    block_k, block_v = [], []  # per layer: step 0's keys and values at every position [B, T, Hkv, D]
    for layer in range(last + 1):
        q, k0, v0, residual = _project_step(head, layer, x, positions)
        block_k.append(k0)
        block_v.append(v0)
        if layer == last:
            q, residual = _take(q, trained), _take(residual, trained)
        out, _ = _attend_with_lse(q, k0, v0, mask if layer == last else causal)
        x = _finish_layer(head, layer, residual, out.astype(head.dtype))
    logits, state = _draft_outputs(head, x)
    logits_per_step = [logits]
    diag_k, diag_v = [[] for _ in block_k], [[] for _ in block_k]  # per layer: each later step's keys at its row
    for k in range(1, num_steps):
        x = (jnp.take(table, step_ids[k], axis=0).astype(head.dtype), state)
        for layer in range(last + 1):
            q, key, value, residual = _project_step(head, layer, x, row_pos + k)
            diag_k[layer].append(key)
            diag_v[layer].append(value)
            out, lse = _attend_with_lse(q, block_k[layer], block_v[layer], mask)
            attn = _merge_diagonal(out, lse, q, diag_k[layer], diag_v[layer])
            x = _finish_layer(head, layer, residual, attn.astype(head.dtype))
        logits, state = _draft_outputs(head, x)
        logits_per_step.append(logits)
    return logits_per_step


def ttt_logits_reference(
    head: Eagle3Head, embed_table, features, next_ids, num_steps: int, positions=None, segments=None, trained=None
) -> list[jax.Array]:
    """The same, every step over all T positions with an explicit mask over all keys of all steps so far (slow;
    for tests), then read at `trained`."""
    positions, segments, trained = _packing(next_ids, positions, segments, trained)
    table = head.embed_tokens[...] if head.embed_tokens is not None else embed_table
    b, t = next_ids.shape
    all_rows = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    step_ids = _step_ids(next_ids, all_rows, num_steps)
    state = head.project(features)
    layers = head.config.num_layers
    keys, values, out_logits = [[] for _ in range(layers)], [[] for _ in range(layers)], []
    idx = jnp.arange(t)
    same = segments[:, :, None] == segments[:, None, :]  # [B, T, T]
    for k in range(num_steps):
        x = (jnp.take(table, step_ids[k], axis=0).astype(head.dtype), state)
        blocks = [(idx[None, :] <= idx[:, None])[None] & same]  # step 0: causal within the sequence
        blocks += [jnp.broadcast_to(idx[None, :] == idx[:, None], (b, t, t))] * k  # steps 1..k: the diagonal
        for layer in range(layers):
            q, key, value, residual = _project_step(head, layer, x, positions + k)
            keys[layer].append(key)
            values[layer].append(value)
            all_k = jnp.concatenate(keys[layer], axis=1).transpose(0, 2, 1, 3)  # [B, Hkv, (k+1)·T, D]
            all_v = jnp.concatenate(values[layer], axis=1).transpose(0, 2, 1, 3)
            attn = attention(q, all_k, all_v, jnp.concatenate(blocks, axis=2))
            x = _finish_layer(head, layer, residual, attn)
        logits, state = _draft_outputs(head, x)
        out_logits.append(_take(logits, trained))
    return out_logits


def _taught_at(k: int, trained, loss_mask, segments, row_seg):
    """Where step k of the rows `trained` [B, C] is taught: (the teacher's position t+1+k, clamped into the row,
    [B, C]; whether it counts [B, C] bool — the token t+2+k is a response token of the row's own sequence)."""
    t = loss_mask.shape[1]
    at = trained + 1 + k  # the teacher's position; the trained token is at + 1
    nxt = jnp.minimum(at + 1, t - 1)
    counted = (at + 1 < t) & (_take(loss_mask, nxt) > 0) & (_take(segments, nxt) == row_seg)
    return jnp.minimum(at, t - 1), counted


def _drafts(logits, token, top):
    """Whether the greedy draft of logits [B, C, V_d] is `token` [B, C], given the row maxima `top` [B, C]: the token
    holds the maximum (a tie counts as right; a vocabulary-wide argmax costs ~70 ms a training step on CPU)."""
    return jnp.take_along_axis(logits, token[..., None], axis=-1, mode="clip")[..., 0] >= top


def ttt_hits(
    step_logits: list[jax.Array],  # K × [B, C, V_d] draft logits at `trained`
    best: jax.Array,  # [B, T] the draft id each position's teacher picks (-1: a token no draft can be)
    loss_mask: jax.Array,  # [B, T]
    segments: jax.Array | None = None,  # [B, T]
    trained: jax.Array | None = None,  # [B, C]
) -> tuple[jax.Array, jax.Array]:
    """(right [K, B, C]: step k's greedy draft is the teacher's token, counted [K, B, C]: step k is taught there),
    counted as `ttt_loss` counts them: sums over many batches give exact held-out rates, where the loss's per-batch
    means would weigh batches equally. `best` is the teacher's choice at each position: `ttt_loss` takes the
    target's greedy token among the draft vocabulary; held-out scoring (train.heldout) takes the token the target
    really produced, -1 where it lies outside the draft vocabulary, since the engine can never accept a draft there."""
    _, segments, trained = _packing(loss_mask, None, segments, trained)
    row_seg = _take(segments, trained)
    right, counted = [], []
    for k, logits in enumerate(step_logits):
        at, m = _taught_at(k, trained, loss_mask, segments, row_seg)
        want = _take(best, at)  # [B, C]
        right.append((want >= 0) & _drafts(logits, jnp.maximum(want, 0), jnp.max(logits, axis=-1)))
        counted.append(m)
    return jnp.stack(right), jnp.stack(counted)


def ttt_loss(
    step_logits: list[jax.Array],  # K × [B, C, V_d] draft logits at `trained`
    teacher_logits: jax.Array,  # [B, T, V_d] the target's logits at each position, draft-vocabulary columns only
    loss_mask: jax.Array,  # [B, T] 1 where the token at that position is trained on (assistant tokens)
    decay: float = 0.8,
    segments: jax.Array | None = None,  # [B, T] packed sequence of each position; None: one per row
    trained: jax.Array | None = None,  # [B, C] the positions the logits are for; None: all T
    teacher_temperature: float = 1.0,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Σ_k decay^k · soft cross-entropy(target restricted to the draft vocabulary, draft), with accuracies.

    Step k, row t is taught by the target's distribution at position t+1+k (which predicts x_{t+2+k}) and counts
    where loss_mask[t+2+k] is set and t+2+k belongs to t's own packed sequence. teacher_temperature divides the
    teacher's logits (0: its greedy token alone, a hard label): greedy verification accepts only the target's top
    token, and a head too small to match the whole distribution may draft it more often when taught it alone.
    """
    _, segments, trained = _packing(loss_mask, None, segments, trained)
    teacher_logits = teacher_logits.astype(jnp.float32)
    # the teacher's greedy token [B, T]: top_k is argmax with the same tie rule (lowest index) and about 1.6x
    # faster than jnp.argmax's variadic reduce on XLA:CPU
    teacher_best = jax.lax.top_k(teacher_logits, 1)[1][..., 0]
    if teacher_temperature > 0:  # [B, T, V_d] renormalized on the draft vocab
        teacher = jax.nn.softmax(teacher_logits / teacher_temperature, axis=-1)
    else:
        teacher = jax.nn.one_hot(teacher_best, teacher_logits.shape[-1], dtype=jnp.float32)
    row_seg = _take(segments, trained)  # [B, C]
    total = 0.0
    metrics = {}
    still_right = jnp.ones(trained.shape, bool)
    cond = []
    for k, logits in enumerate(step_logits):
        at, m = _taught_at(k, trained, loss_mask, segments, row_seg)
        p = _take(teacher, at)  # [B, C, V_d]
        best = _take(teacher_best, at)
        m = m.astype(jnp.float32)
        count = jnp.maximum(m.sum(), 1.0)
        # −Σ p·log_softmax(z) = logsumexp(z) − Σ p·z since Σ p = 1: no [B, C, V_d] log-probabilities in the
        # forward, and the gradient softmax(z) − p in the backward (the vocabulary-wide passes are most of the
        # loss's cost on CPU). The row maximum is taken once, for the logsumexp and for the accuracy.
        top = jax.lax.stop_gradient(jnp.max(logits, axis=-1))  # [B, C]
        lse = top + jnp.log(jnp.sum(jnp.exp(logits - top[..., None]), axis=-1))
        ce = lse - jnp.sum(p * logits, axis=-1)  # [B, C]
        loss_k = jnp.sum(ce * m) / count
        total = total + decay**k * loss_k
        right = _drafts(logits, best, top)  # the row maximum taken once, for the logsumexp and this
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
