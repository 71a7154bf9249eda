"""The generation engine on device: one state, one prefill and one jitted step for target-only and speculative
decoding, repeated in `lax.while_loop`.

Invariants between steps, per row (m = tokens committed in the target cache): the cache holds x_0 .. x_{m-1};
x_m (`last_token`) is emitted but not yet run through the target. Without a proposer a step runs x_m through the
target and samples x_{m+1}. With one (`jaxspec.engine.proposers.base`), a step is

    propose  the proposer drafts nodes under the root x_m (a chain of K, or a tree), from its own state;
    verify   the target runs all nodes in one forward (a tree with its ancestor mask), and the logit processors are
             replayed per node (the committed tokens plus the node's own path);
    accept   greedy / rejection sampling (`pallas_kernels.rejection`): a drafts accepted, then one target token;
    commit   the target cache keeps x_m and the accepted nodes (a tree's path moved to contiguous slots), the
             tokens are emitted (cut at EOS and the budget), the proposer is told what was accepted.

Rows finish independently: a finished row stops writing output and stops advancing its cache. Everything is a pure
function of (graphdefs, parameters, state), so it jits once per static shape (batch, prompt bucket, cache
capacity, chunk length, proposer config), never per prompt or step.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxspec import processors as procs
from jaxspec.models import kv_cache as kvc
from jaxspec.models.llama import TargetOutput
from jaxspec.models.numerics import model_sharded
from jaxspec.sampling import (
    RowSampling, exponential_rows, filtered_logits, sample, split_rows, uniform_rows,
)
from jaxspec.engine import telemetry
from jaxspec.engine.accept import forced_accept
from jaxspec.engine.proposers.base import PrefillView, Proposal, Proposer, StepView, Verified
from pallas_kernels import row_attention
from pallas_kernels.dispatch import on_mesh
from pallas_kernels.mesh_axes import DATA
from pallas_kernels.rejection import chain_parents, verify_draft


def constrain_state(state):
    """Inside jit: a decode state (a NamedTuple of per-row arrays and caches) with its caches split as (data,
    model) and every other per-row array split over data. Applied where a state is returned, so that a step's
    output has the shardings its compiled input has (the step runs again on its own output)."""
    if not on_mesh():
        return state

    def one(x):
        if isinstance(x, kvc.KVCache):
            return kvc.constrain(x)
        if x.ndim == 0 or jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            return x
        return jax.lax.with_sharding_constraint(x, P(DATA))

    return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, kvc.KVCache))


class Stats(NamedTuple):
    """Raw per-row counters, read once per batch (the CLIs, the bench suite and the trainer derive rates)."""

    verify_calls: jax.Array  # [B] speculative steps while the row was running (target forwards after the prefill)
    accepted: jax.Array  # [B, D] how often draft position j was accepted (D = the proposer's depth; 0 without one)
    outcomes: jax.Array  # [B, len(telemetry.OUTCOMES)] why each verify step stopped accepting (sum: verify_calls)
    sibling_accepts: jax.Array  # [B] accepted tree nodes that were not their parent's first child


class GenState(NamedTuple):
    cache: kvc.KVCache  # the target's
    last_token: jax.Array  # [B] x_m, emitted, not yet in the cache
    tokens: jax.Array  # [B, C] generated tokens, C the cache capacity >= any row's budget (padding past num_generated)
    num_generated: jax.Array  # [B]
    done: jax.Array  # [B] bool
    max_new: jax.Array  # [B] per-row budget (0 for padding rows)
    keys: jax.Array  # [B] PRNG keys, one per row (`jaxspec.sampling.row_keys`)
    processors: procs.ProcessorState | None  # logit processors' values and output counts (None: none requested)
    sampling: RowSampling | None  # per-row temperature, top-k, top-p (None: every row greedy)
    stats: Stats
    proposer: Any  # the proposer's own state (None: target-only)
    logprobs: TokenLogprobs | None = None  # each generated token's log-probability (None: not asked for)


class TokenLogprobs(NamedTuple):
    """Each generated token's log-probability under the target and the `top` likeliest tokens at its position, as
    the OpenAI API returns them. From the target's raw logits (before logit processors and temperature: vLLM's
    default, `raw_logprobs`), so they say what the model thinks whatever a request's sampling settings."""

    token: jax.Array  # [B, C] float32, beside `GenState.tokens`
    top_ids: jax.Array  # [B, C, K] int32, likeliest first
    top: jax.Array  # [B, C, K] float32


def no_logprobs(b: int, capacity: int, top: int) -> TokenLogprobs:
    """Room for the log-probabilities of `capacity` tokens per row with `top` alternatives each."""
    return TokenLogprobs(jnp.zeros((b, capacity), jnp.float32), jnp.zeros((b, capacity, top), jnp.int32),
                         jnp.zeros((b, capacity, top), jnp.float32))


def position_logprobs(logits: jax.Array, tokens: jax.Array, top: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(log p(tokens) [B, W], the top ids [B, W, K], their log-probabilities [B, W, K]) of raw logits [B, W, V]."""
    lsm = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    chosen = jnp.take_along_axis(lsm, jnp.maximum(tokens, 0)[..., None], axis=-1)[..., 0]
    if top == 0:
        return chosen, jnp.zeros(tokens.shape + (0,), jnp.int32), jnp.zeros(tokens.shape + (0,), jnp.float32)
    best, ids = jax.lax.top_k(lsm, top)
    return chosen, ids.astype(jnp.int32), best


def prompt_logprobs(
    target_graphdef: nnx.GraphDef,
    target_params: nnx.State,
    proposer: Proposer | None,
    proposer_params: Any,
    prompt: jax.Array,  # [B, T] int32, right-padded
    *,
    top: int,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Each prompt token's log-probability under the target after the tokens before it, and the `top` likeliest
    tokens at its position: (log p [B, T-1], top ids [B, T-1, K], their log-probabilities [B, T-1, K]), entry j
    for token j+1 (the first token has no context). What OpenAI's completions return for `echo` with `logprobs`,
    and what lm-evaluation-harness's loglikelihood tasks read. From the raw logits, as `TokenLogprobs`.

    One pass over the prompt on the prefill's tiles, every position's logits at once ([B, T, V] float32: the memory
    a long prompt needs). Padding after a prompt's end never reaches the positions before it (causal)."""
    del proposer, proposer_params
    target = nnx.merge(target_graphdef, target_params)
    b, t = prompt.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    out = target(prompt, positions, kvc.constrain(target.init_cache(b, t)), empty_cache=True)
    return position_logprobs(out.logits[:, :-1], prompt[:, 1:], top)


def emit(st: GenState, emitted: jax.Array, count: jax.Array, eos_ids: jax.Array,
         logits: jax.Array | None = None) -> GenState:
    """Append emitted[:, :count] ([B, W], count [B]) to each running row, cut at the first EOS and at the row's
    budget; the logit processors count what was appended. logits: [B, W, V] the target's raw logits each emitted
    token was chosen from (read when the state keeps log-probabilities)."""
    b, width = emitted.shape
    j = jnp.arange(width)[None, :]
    is_eos = jnp.any(emitted[..., None] == eos_ids, axis=-1) & (j < count[:, None])
    first_eos = jnp.min(jnp.where(is_eos, j, width), axis=-1)
    n = jnp.minimum(jnp.minimum(count, first_eos + 1), st.max_new - st.num_generated)
    n = jnp.where(st.done, 0, n)
    slots = jnp.where(j < n[:, None], st.num_generated[:, None] + j, st.tokens.shape[1])  # out of range: dropped
    rows = jnp.arange(b)[:, None]
    tokens = st.tokens.at[rows, slots].set(emitted, mode="drop")
    num_generated = st.num_generated + n
    done = st.done | (first_eos < n) | (num_generated >= st.max_new)
    processors = procs.record(st.processors, emitted, n)
    logprobs = st.logprobs
    if logprobs is not None:
        got = position_logprobs(logits, emitted, logprobs.top.shape[-1])
        logprobs = TokenLogprobs(*(old.at[rows, slots].set(new, mode="drop") for old, new in zip(logprobs, got)))
    return st._replace(tokens=tokens, num_generated=num_generated, done=done, processors=processors,
                       logprobs=logprobs)


def prefill(
    target_graphdef: nnx.GraphDef,
    target_params: nnx.State,
    proposer: Proposer | None,
    proposer_params: Any,
    prompt: jax.Array,  # [B, Tp] int32, right-padded
    prompt_lens: jax.Array,  # [B] int32 (0 for padding rows)
    max_new: jax.Array,  # [B] int32
    eos_ids: jax.Array,  # [n_eos] int32
    keys: jax.Array,  # [B] PRNG keys
    processor_values: procs.ProcessorValues | None,
    sampling: RowSampling | None,
    partial: PartialPrefill | None = None,
    start: jax.Array | None = None,  # int32 scalar: where the prompt's last chunk starts (with `partial`)
    *,
    capacity: int,
    chunk: int | None = None,
    logprobs: int | None = None,
) -> GenState:
    """The prompt through the target, the first token, and the proposer's initial state. The token buffer is as
    wide as the cache (`capacity`, a bucket above prompt + budget), not as the budget: budgets are data (`max_new`),
    so another --max-new-tokens in the same bucket runs the same compiled prefill and step. Where the target's
    numerics set a `prefill_loop_chunk` (the CPU row kernel), the prompt runs in chunks up to the longest prompt's
    last token rather than over the whole bucket (`_prefill_in_chunks`), with the same bits.

    With `partial` (chunked prefill: `prefill_chunk` ran the prompt's positions [0, start)), the target runs the
    last `chunk` positions from `start` on, which hold every row's last prompt token, on the prefill's tiles; under
    the batch-invariant numerics each position gets the bits the whole prompt's pass gives it.

    logprobs: keep each generated token's log-probability and this many alternatives (`TokenLogprobs`); None:
    not kept (no cost)."""
    target = nnx.merge(target_graphdef, target_params)
    b, t = prompt.shape
    last = jnp.maximum(prompt_lens - 1, 0)[:, None]  # [B, 1]
    wanted = dict(return_aux=proposer is not None and proposer.needs_aux,
                  return_hidden=proposer is not None and proposer.needs_hidden)
    looped = looped_prefill_chunk(target, t) if partial is None else None
    if looped is not None:  # on the CPU row kernel: chunks up to the longest prompt, not the whole bucket
        out = _prefill_in_chunks(target, prompt, prompt_lens, kvc.constrain(target.init_cache(b, capacity)), looped,
                                 **wanted)
        cache, aux = kvc.advance(out.cache, prompt_lens), out.aux
    elif partial is None:
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        out = target(prompt, positions, kvc.constrain(target.init_cache(b, capacity)), logit_indices=last,
                     empty_cache=True, **wanted)
        cache, aux = kvc.advance(out.cache, prompt_lens), out.aux
    else:
        out = _chunk_pass(target, prompt, partial.cache, start, chunk, jnp.maximum(last - start, 0), **wanted)
        cache = out.cache._replace(lengths=prompt_lens)
        aux = None if out.aux is None else _chunk_features(partial.aux, out.aux, start)[:, :t]
    processors = procs.init_state(processor_values, prompt, prompt_lens)
    keys, sub = split_rows(keys, 2)
    first = sample(procs.process(out.logits, processors)[:, 0], sampling, sub, procs.min_p_of(processors))
    own = None
    if proposer is not None:
        view = PrefillView(prompt, prompt_lens, first, aux, out.hidden)
        own = proposer.init(proposer_params, target, view, capacity)
    depth = proposer.depth if proposer is not None else 0
    st = GenState(
        cache=cache,
        last_token=first,
        tokens=jnp.zeros((b, capacity), jnp.int32),
        num_generated=jnp.zeros((b,), jnp.int32),
        done=max_new <= 0,
        max_new=max_new,
        keys=keys,
        processors=processors,
        sampling=sampling,
        stats=Stats(
            jnp.zeros((b,), jnp.int32), jnp.zeros((b, depth), jnp.int32),
            jnp.zeros((b, len(telemetry.OUTCOMES)), jnp.int32), jnp.zeros((b,), jnp.int32),
        ),
        proposer=own,
        logprobs=None if logprobs is None else no_logprobs(b, capacity, logprobs),
    )
    return constrain_state(emit(st, first[:, None], jnp.ones((b,), jnp.int32), eos_ids, out.logits))


class PartialPrefill(NamedTuple):
    """A long prompt part way through the target (chunked prefill): what `prefill_chunk` has run so far."""

    cache: kvc.KVCache  # the target's, the prompt's positions [0, lengths) written (lengths the same for every row)
    aux: jax.Array | None  # [B, Tc, F] those positions' EAGLE-3 features (proposers that read them), zeros past


def chunked_width(prompt_width: int, chunk: int) -> int:
    """The prompt's width rounded up to whole chunks (the chunks' windows never reach past it)."""
    return -(-prompt_width // chunk) * chunk


def prefill_chunk(
    target_graphdef: nnx.GraphDef,
    target_params: nnx.State,
    proposer: Proposer | None,
    proposer_params: Any,
    prompt: jax.Array,  # [B, Tp] int32, right-padded (the whole prompt, as `prefill` takes it)
    partial: PartialPrefill | None,  # None: the first chunk
    start: jax.Array,  # int32 scalar, a multiple of `chunk`: the chunk's first position
    *,
    capacity: int,
    chunk: int,
) -> PartialPrefill:
    """Prompt positions [start, start + chunk) through the target into its cache: one chunk of a chunked prefill,
    so that a continuous batcher can run the batch's steps between a long prompt's chunks (`engine.slots`); the
    last chunk is `prefill`'s (with `partial`). Every chunk runs on the prefill's tiles and reads the chunks before
    it from the cache, as the whole prompt's pass does."""
    del proposer_params
    target = nnx.merge(target_graphdef, target_params)
    b, _ = prompt.shape
    cache = kvc.constrain(target.init_cache(b, capacity)) if partial is None else partial.cache
    needs_aux = proposer is not None and proposer.needs_aux
    out = _chunk_pass(target, prompt, cache, start, chunk, jnp.zeros((b, 1), jnp.int32), return_aux=needs_aux)
    aux = None
    if needs_aux:
        buffer = partial.aux if partial is not None else jnp.zeros(
            (b, chunked_width(prompt.shape[1], chunk), out.aux.shape[-1]), out.aux.dtype)
        aux = _chunk_features(buffer, out.aux, start)
    return PartialPrefill(kvc.constrain(kvc.advance(out.cache, chunk)), aux)


def _chunk_pass(target, prompt: jax.Array, cache: kvc.KVCache, start: jax.Array, chunk: int,
                logit_indices: jax.Array, **wanted):
    """The target over prompt positions [start, start + chunk) of every row ([B, chunk], right-padded past the
    prompt), written at those slots of `cache` (those past its capacity dropped); logits at `logit_indices`."""
    b, t = prompt.shape
    padded = jnp.pad(prompt, ((0, 0), (0, chunked_width(t, chunk) - t)))
    tokens = jax.lax.dynamic_slice_in_dim(padded, start, chunk, axis=1)  # [B, chunk]
    positions = start + jnp.broadcast_to(jnp.arange(chunk, dtype=jnp.int32), (b, chunk))
    cache = cache._replace(lengths=jnp.full((b,), start, jnp.int32))
    return target(tokens, positions, cache, logit_indices=logit_indices, prompt_chunk=True, **wanted)


def looped_prefill_chunk(target, prompt_width: int) -> int | None:
    """The chunk a whole prompt's prefill loops over (`Numerics.prefill_loop_chunk`), or None for one pass over the
    bucket: plain numerics, a `model` mesh axis (whose matmuls run on 64-row tiles, not on the row kernel), a layer
    that does not attend on the row attention (Gemma 2's soft caps: the block fold reads every key block up to the
    cache's capacity, once per chunk), or a bucket of at most two chunks (its prompts, longer than half of it,
    would run every chunk: the loop saves no row there and costs ~8 ms, measured at 56 tokens in a bucket of 64)."""
    numerics = getattr(target, "numerics", None)
    if numerics is None or numerics.prefill_loop_chunk is None or model_sharded() or not numerics.row_attention:
        return None
    if prompt_width <= 2 * numerics.prefill_loop_chunk:
        return None
    cache_dtype = target.dtype  # the dtype its caches have (`init_cache`)
    if any(not row_attention.supports(cache_dtype, getattr(n, "softcap", None)) for _, n in nnx.iter_graph(target)):
        return None
    return numerics.prefill_loop_chunk


def _prefill_in_chunks(target, prompt: jax.Array, prompt_lens: jax.Array, cache: kvc.KVCache, chunk: int,
                       **wanted) -> TargetOutput:
    """The whole prompt's pass ([B, Tp], right-padded; `cache` empty) as a loop over chunks of `chunk` positions
    that stops after the chunk holding the longest prompt's last token, each chunk run as chunked prefill runs it
    (`_chunk_pass`: the prefill's numerics, the chunks before read from the cache) → its output as one pass gives
    it: the logits (and hidden state) at each row's last prompt token, the features of every position (zeros past
    the chunks run), the cache written (lengths 0).

    Why: on the CPU row kernel a prefill is compute-bound, so it costs the rows it runs, and a prompt's bucket is
    the next power of two (a GSM8K prompt of ~90 tokens prefilled 128 rows, one of 140 rows 256). The row kernel
    and the row attention give a row the same bits in any chunk, so the loop changes no bit (tests/test_slots.py)."""
    b, t = prompt.shape
    last = jnp.maximum(prompt_lens - 1, 0)  # [B]

    def run(start, cache):
        return _chunk_pass(target, prompt, cache, start, chunk, jnp.clip(last - start, 0, chunk - 1)[:, None],
                           **wanted)

    shapes = jax.eval_shape(run, jnp.int32(0), cache)
    zeros = functools.partial(jax.tree.map, lambda s: jnp.zeros(s.shape, s.dtype))
    aux = None if shapes.aux is None else jnp.zeros(
        (b, chunked_width(t, chunk), shapes.aux.shape[-1]), shapes.aux.dtype)

    def body(i, carry):
        cache, logits, hidden, aux = carry
        start = i * chunk
        out = run(start, cache)
        here = ((last >= start) & (last < start + chunk))[:, None, None]  # the rows whose last token is here
        logits = jnp.where(here, out.logits, logits)
        hidden = None if hidden is None else jnp.where(here, out.hidden, hidden)
        aux = None if aux is None else _chunk_features(aux, out.aux, start)
        return kvc.constrain(out.cache), logits, hidden, aux

    chunks = jnp.max(last) // chunk + 1
    cache, logits, hidden, aux = jax.lax.fori_loop(
        0, chunks, body, (cache, zeros(shapes.logits), zeros(shapes.hidden), aux))
    return TargetOutput(logits, None if aux is None else aux[:, :t], cache._replace(lengths=jnp.zeros_like(last)),
                        hidden)


def _chunk_features(buffer: jax.Array, features: jax.Array, start: jax.Array) -> jax.Array:
    """buffer [B, Tc, F] with a chunk's features [B, chunk, F] at positions start on."""
    return jax.lax.dynamic_update_slice_in_dim(buffer, features.astype(buffer.dtype), start, axis=1)


def decode_step(target, st: GenState, eos_ids: jax.Array) -> GenState:
    """Target-only: run x_m, sample x_{m+1}."""
    running = ~st.done
    keys, sub = split_rows(st.keys, 2)
    out, token = _run_root(target, st, sub)
    st = st._replace(cache=kvc.advance(out.cache, running.astype(jnp.int32)), keys=keys)
    st = emit(st, token[:, None], jnp.ones_like(token), eos_ids, out.logits)
    return st._replace(last_token=jnp.where(running, token, st.last_token))


def _run_root(target, st: GenState, keys: jax.Array, **wanted):
    """x_m alone through the target, and the processed target's token after it: (target output, token [B])."""
    out = target(st.last_token[:, None], st.cache.lengths[:, None], st.cache, **wanted)
    logits = procs.process(out.logits, st.processors)[:, 0]  # [B, V]
    return out, sample(logits, st.sampling, keys, procs.min_p_of(st.processors))


def spec_step(
    target, proposer: Proposer, params, st: GenState, eos_ids: jax.Array, *,
    forced_accept_prob: float | None = None, kernels: str = "reference", drafting: bool = True,
) -> GenState:
    """propose → verify → accept → commit (module docstring). `forced_accept_prob`: the benchmark-only acceptance
    override (`accept.forced_accept`, chains); `kernels`: the verifier's implementation (`pallas_kernels.dispatch`).

    When the proposal says no running row has a real draft (`Proposal.has_draft`: an n-gram without a match), the
    step runs the root alone, as target-only decoding does (`_root_only`), instead of verifying N nodes: the same
    token (the root's logits are the same bits under invariant numerics; sampling draws from the same distribution)
    for a one-token forward. `drafting=False` makes every step such a step without drafting at all: the proposer
    only keeps up (`keep_up`), and the step costs a target-only decode plus that (a continuous batcher's
    speculation off at high load, on the same state). The statistics count it as a verify step with no draft."""
    running = (~st.done).astype(jnp.int32)
    k_propose, k_uniform, k_noise, keys = split_rows(st.keys, 4)
    view = StepView(st.last_token, st.cache.lengths, running, st.processors, st.sampling, st.cache)
    if drafting:
        proposal, own = proposer.propose(params, target, st.proposer, view, k_propose)
    else:
        proposal, own = keep_up(proposer, params, target, st.proposer, view, k_propose)
    tokens = proposal.tokens.at[:, 0].set(st.last_token)  # [B, N]
    b, n = tokens.shape
    parents = chain_parents(b, n) if proposal.tree is None else proposal.tree.parents
    args = (target, proposer, st, proposal, tokens, parents, k_uniform, k_noise)
    opts = dict(forced_accept_prob=forced_accept_prob, kernels=kernels)
    if not drafting:
        a, emitted, path, target_cache, aux, hidden, logits = _root_only(*args, **opts)
    elif proposal.has_draft is None:
        a, emitted, path, target_cache, aux, hidden, logits = _verify(*args, **opts)
    else:
        a, emitted, path, target_cache, aux, hidden, logits = jax.lax.cond(
            jnp.any(proposal.has_draft & (running > 0)),
            lambda: _verify(*args, **opts),
            lambda: _root_only(*args, **opts),
        )

    count = a + 1
    emitted = jnp.maximum(emitted, 0)  # entries past a are -1: never feed those to an embedding
    before = st.num_generated
    st = emit(st, emitted, count, eos_ids, logits)
    verified = Verified(emitted, a, running, aux, hidden)
    own_token = jnp.take_along_axis(emitted, a[:, None], axis=1)[:, 0]  # [B] the target's token after the path
    return st._replace(
        cache=kvc.advance(target_cache, count * running),
        last_token=jnp.where(running > 0, own_token, st.last_token),
        keys=keys,
        stats=_count(st.stats, proposal, tokens, parents, path, a, own_token, st.num_generated - before < count,
                     proposer.depth, running),
        proposer=proposer.commit(params, own, verified),
    )


def keep_up(proposer: Proposer, params, target, state, view: StepView, keys: jax.Array) -> tuple[Proposal, Any]:
    """A step that drafts nothing: (a chain proposal of no real drafts, the proposer's state after keeping up).
    The proposer's own `keep_up` if it has one (a head's catch-up alone), else its `propose` with the drafts
    dropped (they would only cost the verify)."""
    b = view.last_token.shape[0]
    if hasattr(proposer, "keep_up"):
        state = proposer.keep_up(params, target, state, view)
    else:
        state = proposer.propose(params, target, state, view, keys)[1]
    tokens = jnp.zeros((b, proposer.depth + 1), jnp.int32)
    return Proposal(tokens, None, None, has_draft=jnp.zeros((b,), jnp.bool_)), state


def _verify(target, proposer: Proposer, st: GenState, proposal, tokens, parents, k_uniform, k_noise, *,
            forced_accept_prob, kernels):
    """All N nodes through the target, then acceptance: (a [B], emitted [B, D+1] (-1 past a), path [B, D+1] or None,
    the target cache with the root and accepted nodes at m .. m + a, aux and hidden [B, D+1, ...] on the path, and
    the raw logits [B, D+1, V] each emitted token was chosen from when the state keeps log-probabilities)."""
    b, n = tokens.shape
    depth, m = proposer.depth, st.cache.lengths
    wanted = dict(return_aux=proposer.needs_aux, return_hidden=proposer.needs_hidden)
    dt = proposal.tree
    if dt is None:  # a chain: node j at position m + j, causal
        verify = target(tokens, m[:, None] + jnp.arange(n, dtype=jnp.int32), st.cache, **wanted)
        paths = procs.chain_paths(tokens[:, 1:])
    else:
        verify = target(tokens, m[:, None] + dt.depths, st.cache, block_mask=dt.mask, ancestors=dt.ancestors, **wanted)
        paths = procs.tree_paths(tokens, dt.ancestors, dt.depths)
    logits = procs.process(verify.logits, st.processors, paths)  # [B, N, V]

    def greedy():
        return verify_draft(
            tokens, parents, logits, jnp.zeros((b, n)), jnp.ones((b, 1)), mode="greedy", max_depth=depth, impl=kernels
        )

    def sampled():  # lossless rejection sampling for the rows that sample
        p = jax.nn.softmax(filtered_logits(logits, st.sampling, procs.min_p_of(st.processors)), axis=-1)
        uniforms = uniform_rows(k_uniform, (n,))
        noise = exponential_rows(k_noise, (p.shape[-1],))
        if proposal.q is not None:  # Leviathan / Chen with the chain's draft probabilities
            q_nodes = jnp.concatenate([proposal.q, jnp.zeros_like(proposal.q[:, :1])], axis=1)  # node j's child's q
            return verify_draft(tokens, parents, p, uniforms, noise, q_nodes, mode="chain", max_depth=depth,
                                impl=kernels)
        # deterministic drafts or a tree: the walk that needs no q
        return verify_draft(tokens, parents, p, uniforms, noise, mode="tree", max_depth=depth, impl=kernels)

    if forced_accept_prob is not None:
        a, emitted = forced_accept(tokens[:, 1:], logits, uniform_rows(k_uniform, (n - 1,)), forced_accept_prob)
        path = None
    elif st.sampling is None:
        a, emitted, path = greedy()
    else:  # greedy rows keep the greedy walk's result (the argmax of the same logits: greedy's bits)
        chosen = greedy()
        drawn = jax.lax.cond(jnp.any(st.sampling.sampled), sampled, lambda: chosen)
        pick = lambda s, g: jnp.where(st.sampling.sampled.reshape((b,) + (1,) * (g.ndim - 1)), s, g)  # noqa: E731
        a, emitted, path = jax.tree.map(pick, drawn, chosen)

    raw = verify.logits if st.logprobs is not None else None
    if dt is None:  # a chain's accepted nodes already sit in order at m .. m + a
        first = lambda x: None if x is None else x[:, : depth + 1]  # noqa: E731
        return a, emitted, path, verify.cache, first(verify.aux), first(verify.hidden), first(raw)
    target_cache = kvc.compact(verify.cache, m, path)
    safe = jnp.maximum(path, 0)[:, :, None]
    on_path = lambda x: None if x is None else jnp.take_along_axis(x, safe, axis=1)  # noqa: E731
    return a, emitted, path, target_cache, on_path(verify.aux), on_path(verify.hidden), on_path(raw)


def _root_only(target, proposer: Proposer, st: GenState, proposal, tokens, parents, k_uniform, k_noise, *,
               forced_accept_prob, kernels):
    """The root alone through the target, as `decode_step` runs it: `_verify`'s outputs for a step that accepts no
    draft (a = 0; aux and hidden zero past the root). Same signature as `_verify`, for `lax.cond`."""
    del proposal, parents, k_noise, kernels
    b, width = tokens.shape[0], proposer.depth + 1
    out, token = _run_root(
        target, st, k_uniform, return_aux=proposer.needs_aux, return_hidden=proposer.needs_hidden
    )
    emitted = jnp.full((b, width), -1, jnp.int32).at[:, 0].set(token)  # [B, D+1]
    path = None if forced_accept_prob is not None else jnp.full((b, width), -1, jnp.int32).at[:, 0].set(0)
    pad = lambda x: None if x is None else jnp.pad(x, ((0, 0), (0, width - 1)) + ((0, 0),) * (x.ndim - 2))  # noqa: E731
    raw = pad(out.logits) if st.logprobs is not None else None
    return jnp.zeros((b,), jnp.int32), emitted, path, out.cache, pad(out.aux), pad(out.hidden), raw


def _count(stats: Stats, proposal, tokens, parents, path, a, own_token, cut, depth: int, running) -> Stats:
    """The step's counters for running rows: accepted positions, the outcome (`telemetry`), sibling acceptances."""
    node = a if proposal.tree is None else jnp.take_along_axis(path, a[:, None], axis=1)[:, 0]  # [B] last accepted
    outcome = telemetry.step_outcome(
        a, depth, node, own_token, tokens, parents, proposal.candidates, proposal.draft_vocab, cut, proposal.has_draft,
        proposal.any_vocab,
    )
    live = running[:, None] > 0
    accepted = (jnp.arange(depth)[None, :] < a[:, None]) & live
    outcomes = (outcome[:, None] == jnp.arange(len(telemetry.OUTCOMES))[None, :]) & live
    siblings = 0 if proposal.tree is None else telemetry.sibling_accepts(parents, path, a) * running
    return Stats(
        stats.verify_calls + running, stats.accepted + accepted.astype(jnp.int32),
        stats.outcomes + outcomes.astype(jnp.int32), stats.sibling_accepts + siblings,
    )


def steps(
    target_graphdef: nnx.GraphDef,
    target_params: nnx.State,
    proposer: Proposer | None,
    proposer_params: Any,
    st: GenState,
    eos_ids: jax.Array,
    *,
    num_steps: int,
    forced_accept_prob: float | None = None,
    kernels: str = "reference",
    drafting: bool = True,
) -> GenState:
    """Up to `num_steps` steps (target-only without a proposer), stopping once every row is done. kernels: the
    verifier's implementation (the target's attention follows its own Numerics); drafting: False, steps that draft
    nothing on a speculative state (`spec_step`)."""
    target = nnx.merge(target_graphdef, target_params).hold_step_weights()  # concatenated here, not in every step

    def cond(carry):
        i, st = carry
        return (i < num_steps) & ~jnp.all(st.done)

    def body(carry):
        i, st = carry
        if proposer is None:
            st = decode_step(target, st, eos_ids)
        else:
            st = spec_step(
                target, proposer, proposer_params, st, eos_ids,
                forced_accept_prob=forced_accept_prob, kernels=kernels, drafting=drafting,
            )
        return i + 1, constrain_state(st)

    return jax.lax.while_loop(cond, body, (jnp.int32(0), st))[1]


def steps_on_rows(target_graphdef: nnx.GraphDef, target_params: nnx.State, proposer: Proposer | None,
                  proposer_params: Any, st: GenState, eos_ids: jax.Array, rows: jax.Array, **options) -> GenState:
    """`steps` (same options) over rows `rows` ([b] distinct row indices) of the state only, the others untouched:
    the rows are gathered into a state of b rows, stepped, and written back (in place when `st` is donated).

    Why: a fixed-shape step computes every row, finished or not; a continuous batcher with few live requests among
    many slots runs them on a smaller compiled batch instead (`engine.slots`). Rows never interact under the
    batch-invariant numerics, so a row's tokens are the same bits whichever batch it steps in. Cost: a copy of the
    b rows' state (their caches included) in and out per call of `num_steps` steps."""
    n = st.num_generated.shape[0]
    per_row = lambda x: x.ndim > 0 and x.shape[0] == n  # noqa: E731  every state array is batch-first (or a scalar)
    sub = constrain_state(jax.tree.map(lambda x: x[rows] if per_row(x) else x, st))
    sub = steps(target_graphdef, target_params, proposer, proposer_params, sub, eos_ids, **options)
    merged = jax.tree.map(lambda old, new: old.at[rows].set(new) if per_row(old) else new, st, sub)
    return constrain_state(merged)

