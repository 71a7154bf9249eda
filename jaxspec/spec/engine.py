"""The speculative engine on device: prefill, then a jitted, fixed-shape chain step repeated in `lax.while_loop`.

Invariants between steps, per row (m = tokens committed in the target cache):
- the target cache holds x_0 .. x_{m-1}; x_m (`last_token`) is emitted but not yet run through the target;
- the head has consumed the pairs (g_t, x_{t+1}) for t < h; pairs h .. m-1 are pending (1 ≤ m - h ≤ K + 1):
  `pending_feat` holds their target features g_t, `pending_tok` their next tokens x_{t+1}.
One step: the head catches up on the pending pairs in one forward and proposes draft 1; K - 1 more head steps
propose drafts 2..K; the target verifies [x_m, d_1..d_K] in one forward; a drafts are accepted and one target
token follows; the target cache commits x_m, d_1..d_a (their K/V were written by the verify); the verify's
features become the next pending pairs, so no extra target call is needed. Draft entries in the head cache are
rolled back by resetting its length: the next catch-up overwrites them.

Logit processors (`jaxspec.processors`) are replayed per position: verify position j is processed with the
committed prompt and output plus d_1..d_j (a tree node: its ancestors), exactly what a target-only decode step
would see there, and each draft with the drafts before it, on the head's vocabulary.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jaxspec import processors as procs
from jaxspec.models import kv_cache as kvc
from jaxspec.sampling import SamplingConfig, filtered_logits, sample
from jaxspec.sharding import constrain_cache, constrain_state
from jaxspec.spec.accept import forced_accept, greedy_accept, sampling_accept
from jaxspec.spec.tree import TreeConfig, draft_tree
from pallas_kernels.rejection import verify_draft


class SpecState(NamedTuple):
    target_cache: kvc.KVCache
    head_cache: kvc.KVCache
    last_token: jax.Array  # [B] x_m
    pending_feat: jax.Array  # [B, K+1, n_aux * Ht]
    pending_tok: jax.Array  # [B, K+1]
    num_pending: jax.Array  # [B] in 1..K+1
    tokens: jax.Array  # [B, max_new] generated tokens
    num_generated: jax.Array  # [B]
    done: jax.Array  # [B] bool
    max_new: jax.Array  # [B]
    key: jax.Array
    verify_calls: jax.Array  # [B] steps while the row was running
    accepted: jax.Array  # [B, K] how often draft j was accepted
    processors: procs.ProcessorState | None  # logit processors' values and output counts (None: none requested)


def _embed_table(target, head):
    return None if head.embed_tokens is not None else target.embed_tokens[...]


def _emit(st: SpecState, emitted: jax.Array, count: jax.Array, eos_ids: jax.Array) -> SpecState:
    """Append emitted[:, :count] to each running row, cut at the first EOS and at the row's budget."""
    b, width = emitted.shape
    j = jnp.arange(width)[None, :]
    is_eos = jnp.any(emitted[..., None] == eos_ids, axis=-1) & (j < count[:, None])
    first_eos = jnp.min(jnp.where(is_eos, j, width), axis=-1)
    n = jnp.minimum(jnp.minimum(count, first_eos + 1), st.max_new - st.num_generated)
    n = jnp.where(st.done, 0, n)
    slots = jnp.where(j < n[:, None], st.num_generated[:, None] + j, st.tokens.shape[1])  # out of range: dropped
    tokens = st.tokens.at[jnp.arange(b)[:, None], slots].set(emitted, mode="drop")
    num_generated = st.num_generated + n
    done = st.done | (first_eos < n) | (num_generated >= st.max_new)
    processors = procs.record(st.processors, emitted, n)
    return st._replace(tokens=tokens, num_generated=num_generated, done=done, processors=processors)


def prefill(
    target_graphdef: nnx.GraphDef,
    target_params: nnx.State,
    head_graphdef: nnx.GraphDef,
    head_params: nnx.State,
    prompt: jax.Array,  # [B, Tp] right-padded
    prompt_lens: jax.Array,  # [B] (0 for padding rows)
    max_new: jax.Array,  # [B]
    eos_ids: jax.Array,  # [n_eos]
    key: jax.Array,
    processor_values: procs.ProcessorValues | None,
    *,
    capacity: int,
    max_new_tokens: int,
    sampling: SamplingConfig,
    num_draft: int,
) -> SpecState:
    target = nnx.merge(target_graphdef, target_params)
    head = nnx.merge(head_graphdef, head_params)
    b, t = prompt.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    last = jnp.maximum(prompt_lens - 1, 0)
    target_cache = constrain_cache(target.init_cache(b, capacity))
    out = target(prompt, positions, target_cache, logit_indices=last[:, None], return_aux=True, empty_cache=True)
    key, sub = jax.random.split(key)
    processors = procs.init_state(processor_values, prompt, prompt_lens)
    first = sample(procs.process(out.logits, processors)[:, 0], sampling, sub, procs.min_p_of(processors))
    # The head consumes pairs (g_t, x_{t+1}) for t < n - 1; the pair (g_{n-1}, x_n) is left pending.
    next_tokens = jnp.concatenate([prompt[:, 1:], jnp.zeros((b, 1), prompt.dtype)], axis=1)
    _, _, head_cache = head(
        next_tokens, head.project(out.aux), positions, constrain_cache(head.init_cache(b, capacity)),
        _embed_table(target, head), logit_indices=jnp.zeros((b, 1), jnp.int32), empty_cache=True,
    )
    g_last = jnp.take_along_axis(out.aux, last[:, None, None], axis=1)  # [B, 1, F]
    width = num_draft + 1
    st = SpecState(
        target_cache=kvc.advance(out.cache, prompt_lens),
        head_cache=kvc.advance(head_cache, last),
        last_token=first,
        pending_feat=jnp.zeros((b, width, out.aux.shape[-1]), out.aux.dtype).at[:, :1].set(g_last),
        pending_tok=jnp.zeros((b, width), jnp.int32).at[:, 0].set(first),
        num_pending=jnp.ones((b,), jnp.int32),
        tokens=jnp.zeros((b, max_new_tokens), jnp.int32),
        num_generated=jnp.zeros((b,), jnp.int32),
        done=max_new <= 0,
        max_new=max_new,
        key=key,
        verify_calls=jnp.zeros((b,), jnp.int32),
        accepted=jnp.zeros((b, num_draft), jnp.int32),
        processors=processors,
    )
    return constrain_state(_emit(st, first[:, None], jnp.ones((b,), jnp.int32), eos_ids))


def draft_processor(head, processors: procs.ProcessorState | None):
    """The logit processors on the head's draft vocabulary: process(logits [B, N, V_d], path [B, N, D]) with the
    committed counts plus each position's path, as the target will apply them (drafts only change speed, but a
    draft the processed target would not pick is a wasted one)."""
    if processors is None:
        return None
    columns = head.to_target_ids(jnp.arange(head.config.draft_vocab_size, dtype=jnp.int32))
    return lambda logits, path: procs.process(logits, processors, path, columns)


def _propose(head, logits: jax.Array, sampling: SamplingConfig, key: jax.Array, vocab: int, processors, path):
    """Draft token (target id) from draft logits [B, V_d] (processed with the drafts so far, path [B, D]), and its
    distribution over the target vocab when sampling."""
    process = draft_processor(head, processors)
    if process is not None:
        logits = process(logits[:, None], path[:, None])[:, 0]
    if sampling.greedy:
        return head.to_target_ids(jnp.argmax(logits, axis=-1).astype(jnp.int32)), None
    filtered = filtered_logits(logits, sampling, procs.min_p_of(processors))
    draft = jax.random.categorical(key, filtered, axis=-1).astype(jnp.int32)
    ids = head.to_target_ids(jnp.arange(logits.shape[-1], dtype=jnp.int32))
    q = jnp.zeros((logits.shape[0], vocab), jnp.float32).at[:, ids].set(jax.nn.softmax(filtered, axis=-1))
    return head.to_target_ids(draft), q


def _catch_up(head, st: SpecState, embed):
    """The head consumes the pending pairs in one forward: (logits after the last one [B, V_d], its state [B, H],
    the head cache committed through them, the committed length before)."""
    h0 = st.head_cache.lengths
    width = st.pending_tok.shape[1]
    positions = h0[:, None] + jnp.arange(width, dtype=jnp.int32)
    last = (st.num_pending - 1)[:, None]
    logits, out, head_cache = head(
        st.pending_tok, head.project(st.pending_feat), positions, st.head_cache, embed, logit_indices=last
    )
    state = jnp.take_along_axis(out, last[:, :, None], axis=1)[:, 0]  # [B, H]
    return logits[:, 0], state, kvc.advance(head_cache, st.num_pending), h0


def _commit(st: SpecState, new: SpecState, target_cache, head_cache, a, emitted, features, running) -> SpecState:
    """Shared end of a step: commit a + 1 target entries, make the accepted pairs pending, count acceptances."""
    count = a + 1
    keep = running[:, None] > 0
    emitted = jnp.maximum(emitted, 0)  # entries past a are -1: never feed those to an embedding
    width = st.accepted.shape[1]
    return new._replace(
        target_cache=kvc.advance(target_cache, count * running),
        head_cache=head_cache,
        last_token=jnp.where(running > 0, jnp.take_along_axis(emitted, a[:, None], axis=1)[:, 0], st.last_token),
        pending_feat=jnp.where(keep[:, :, None], features, st.pending_feat),
        pending_tok=jnp.where(keep, emitted, st.pending_tok),
        num_pending=jnp.where(running > 0, count, st.num_pending),
        verify_calls=st.verify_calls + running,
        accepted=st.accepted + ((jnp.arange(width)[None, :] < a[:, None]) & keep).astype(jnp.int32),
    )


def spec_step(
    target, head, st: SpecState, eos_ids: jax.Array, *, num_draft: int, sampling: SamplingConfig,
    forced_accept_prob: float | None = None, kernels: str = "reference",
) -> SpecState:
    """One chain step: catch-up and K drafts, verify K+1 tokens, accept, commit. `forced_accept_prob` is the
    benchmark-only acceptance override (`accept.forced_accept`); `kernels` the verifier's implementation."""
    b = st.last_token.shape[0]
    k = num_draft
    vocab = target.config.vocab_size
    running = (~st.done).astype(jnp.int32)
    embed = _embed_table(target, head)
    keys = jax.random.split(st.key, k + 3)

    # Draft 1: the head catches up on the pending pairs in one forward.
    logits0, state, head_cache, h0 = _catch_up(head, st, embed)
    path = jnp.full((b, k), -1, jnp.int32)  # drafts so far, for the logit processors
    draft, q = _propose(head, logits0, sampling, keys[0], vocab, st.processors, path)

    # Drafts 2..K: the head feeds its own state back.
    def draft_step(carry, step):
        head_cache, state, token, path = carry
        j, step_key = step
        path = path.at[:, j].set(token)
        logits, out, head_cache = head(token[:, None], state[:, None], head_cache.lengths[:, None], head_cache, embed)
        nxt, q = _propose(head, logits[:, 0], sampling, step_key, vocab, st.processors, path)
        return (kvc.advance(head_cache, 1), out[:, 0], nxt, path), (nxt, q)

    (head_cache, _, _, _), (more, more_q) = jax.lax.scan(
        draft_step, (head_cache, state, draft, path), (jnp.arange(k - 1), keys[1:k])
    )
    drafts = jnp.concatenate([draft[:, None], jnp.moveaxis(more, 0, 1)], axis=1)  # [B, K]
    head_cache = head_cache._replace(lengths=h0 + st.num_pending * running)  # drop the draft entries

    # Verify [x_m, d_1..d_K] in one target forward.
    tokens = jnp.concatenate([st.last_token[:, None], drafts], axis=1)
    positions = st.target_cache.lengths[:, None] + jnp.arange(k + 1, dtype=jnp.int32)
    verify = target(tokens, positions, st.target_cache, return_aux=True)
    logits = procs.process(verify.logits, st.processors, procs.chain_paths(drafts))  # [B, K+1, V]

    if forced_accept_prob is not None:
        a, emitted = forced_accept(drafts, logits, jax.random.uniform(keys[k], (b, k)), forced_accept_prob)
    elif sampling.greedy:
        a, emitted = greedy_accept(drafts, logits, kernels)
    else:
        qs = jnp.concatenate([q[:, None], jnp.moveaxis(more_q, 0, 1)], axis=1)  # [B, K, V]
        p = jax.nn.softmax(filtered_logits(logits, sampling, procs.min_p_of(st.processors)), axis=-1)
        uniforms = jax.random.uniform(keys[k], (b, k))
        a, emitted = sampling_accept(drafts, p, qs, uniforms, keys[k + 1], kernels)

    new = _emit(st, emitted, a + 1, eos_ids)._replace(key=keys[k + 2])
    return _commit(st, new, verify.cache, head_cache, a, emitted, verify.aux, running)


def tree_step(
    target, head, st: SpecState, eos_ids: jax.Array, *, tree: TreeConfig, sampling: SamplingConfig,
    kernels: str = "reference",
) -> SpecState:
    """One tree step: catch-up, expand and select a dynamic tree, verify all its nodes in one target forward with
    the ancestor mask, walk the accepted path, move its K/V entries to contiguous slots, commit."""
    b = st.last_token.shape[0]
    running = (~st.done).astype(jnp.int32)
    embed = _embed_table(target, head)
    key, k_uniform, k_noise = jax.random.split(st.key, 3)

    logits0, state0, head_cache, h0 = _catch_up(head, st, embed)
    dt = draft_tree(head, embed, logits0, state0, head_cache, tree, draft_processor(head, st.processors))
    head_cache = head_cache._replace(lengths=h0 + st.num_pending * running)  # drop the tree levels' entries
    tokens = dt.tokens.at[:, 0].set(st.last_token)  # [B, N]
    m = st.target_cache.lengths
    verify = target(
        tokens, m[:, None] + dt.depths, st.target_cache, block_mask=dt.mask, ancestors=dt.ancestors, return_aux=True
    )
    logits = procs.process(verify.logits, st.processors, procs.tree_paths(tokens, dt.ancestors, dt.depths))

    n, depth = tokens.shape[1], tree.depth
    if sampling.greedy:
        a, emitted, path = verify_draft(
            tokens, dt.parents, logits, jnp.zeros((b, n)), jnp.ones((b, 1)), mode="greedy", max_depth=depth,
            impl=kernels,
        )
    else:
        p = jax.nn.softmax(filtered_logits(logits, sampling, procs.min_p_of(st.processors)), axis=-1)
        uniforms = jax.random.uniform(k_uniform, (b, n))
        noise = jax.random.exponential(k_noise, (b, p.shape[-1]), jnp.float32)
        a, emitted, path = verify_draft(
            tokens, dt.parents, p, uniforms, noise, mode="tree", max_depth=depth, impl=kernels
        )

    target_cache = kvc.compact(verify.cache, m, path)
    features = jnp.take_along_axis(verify.aux, jnp.maximum(path, 0)[:, :, None], axis=1)  # [B, D+1, F]
    new = _emit(st, emitted, a + 1, eos_ids)._replace(key=key)
    return _commit(st, new, target_cache, head_cache, a, emitted, features, running)


def spec_steps(
    target_graphdef: nnx.GraphDef,
    target_params: nnx.State,
    head_graphdef: nnx.GraphDef,
    head_params: nnx.State,
    st: SpecState,
    eos_ids: jax.Array,
    *,
    num_steps: int,
    num_draft: int,
    sampling: SamplingConfig,
    tree: TreeConfig | None = None,
    forced_accept_prob: float | None = None,
    kernels: str = "reference",
) -> SpecState:
    """Up to `num_steps` speculative steps (chains of `num_draft`, or trees; then num_draft = tree.depth sizes the
    state), stopping once every row is done. kernels: the verifier's implementation (`pallas_kernels.dispatch`;
    the target's attention follows its own Numerics)."""
    target = nnx.merge(target_graphdef, target_params)
    head = nnx.merge(head_graphdef, head_params)

    def cond(carry):
        i, st = carry
        return (i < num_steps) & ~jnp.all(st.done)

    def body(carry):
        i, st = carry
        if tree is not None:
            st = tree_step(target, head, st, eos_ids, tree=tree, sampling=sampling, kernels=kernels)
        else:
            st = spec_step(
                target, head, st, eos_ids, num_draft=num_draft, sampling=sampling,
                forced_accept_prob=forced_accept_prob, kernels=kernels,
            )
        return i + 1, constrain_state(st)

    return jax.lax.while_loop(cond, body, (jnp.int32(0), st))[1]
