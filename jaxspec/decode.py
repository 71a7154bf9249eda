"""Target-only decoding on device: a prefill, then chunks of single-token steps inside `lax.while_loop`.

Everything here is a pure function of (graphdef, params, state) so it jits once per static shape (batch, prompt
bucket, cache capacity, chunk length) and never per prompt or per step. Rows finish independently: a finished row
stops writing output and stops advancing its cache.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jaxspec import processors as procs
from jaxspec.models import kv_cache as kvc
from jaxspec.sampling import SamplingConfig, sample
from jaxspec.sharding import constrain_cache, constrain_state


class DecodeState(NamedTuple):
    cache: kvc.KVCache
    last_token: jax.Array  # [B] int32, the token the next step feeds
    tokens: jax.Array  # [B, max_new] int32, generated tokens (padding past num_generated)
    num_generated: jax.Array  # [B] int32
    done: jax.Array  # [B] bool
    max_new: jax.Array  # [B] int32, per-row budget (0 for padding rows)
    key: jax.Array  # PRNG key
    processors: procs.ProcessorState | None  # logit processors' values and counts (None: none requested)


def _next_token(logits: jax.Array, st: DecodeState, sampling: SamplingConfig, key: jax.Array) -> jax.Array:
    """The token after one position per row: logits [B, V] raw → processed → sampled (argmax when greedy)."""
    logits = procs.process(logits[:, None], st.processors)[:, 0]
    return sample(logits, sampling, key, procs.min_p_of(st.processors))


def _emit(st: DecodeState, token: jax.Array, eos_ids: jax.Array) -> DecodeState:
    """Record one sampled token per still-running row; mark rows that hit EOS or their budget."""
    active = ~st.done
    b = token.shape[0]
    idx = jnp.minimum(st.num_generated, st.tokens.shape[1] - 1)
    tokens = st.tokens.at[jnp.arange(b), idx].set(jnp.where(active, token, st.tokens[jnp.arange(b), idx]))
    num_generated = st.num_generated + active.astype(jnp.int32)
    hit_eos = jnp.any(token[:, None] == eos_ids[None, :], axis=-1)
    done = st.done | (active & hit_eos) | (num_generated >= st.max_new)
    last = jnp.where(active, token, st.last_token)
    processors = procs.record(st.processors, token[:, None], active.astype(jnp.int32))
    return st._replace(tokens=tokens, num_generated=num_generated, done=done, last_token=last, processors=processors)


def prefill(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    prompt: jax.Array,  # [B, Tp] int32, right-padded
    prompt_lens: jax.Array,  # [B] int32 (0 for padding rows)
    max_new: jax.Array,  # [B] int32
    eos_ids: jax.Array,  # [n_eos] int32
    key: jax.Array,
    processor_values: procs.ProcessorValues | None,
    *,
    capacity: int,
    max_new_tokens: int,
    sampling: SamplingConfig,
) -> DecodeState:
    model = nnx.merge(graphdef, params)
    b, t = prompt.shape
    cache = constrain_cache(model.init_cache(b, capacity))
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    last_index = jnp.maximum(prompt_lens - 1, 0)[:, None]  # [B, 1]
    out = model(prompt, positions, cache, logit_indices=last_index, empty_cache=True)
    cache = kvc.advance(out.cache, prompt_lens)
    key, sub = jax.random.split(key)
    st = DecodeState(
        cache=cache,
        last_token=jnp.zeros((b,), jnp.int32),
        tokens=jnp.zeros((b, max_new_tokens), jnp.int32),
        num_generated=jnp.zeros((b,), jnp.int32),
        done=max_new <= 0,
        max_new=max_new,
        key=key,
        processors=procs.init_state(processor_values, prompt, prompt_lens),
    )
    first = _next_token(out.logits[:, 0], st, sampling, sub)
    return constrain_state(_emit(st._replace(last_token=first), first, eos_ids))


def decode_steps(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    st: DecodeState,
    eos_ids: jax.Array,
    *,
    num_steps: int,
    sampling: SamplingConfig,
) -> DecodeState:
    """Up to `num_steps` single-token steps, stopping early once every row is done."""
    model = nnx.merge(graphdef, params)

    def step(carry):
        i, st = carry
        tokens = st.last_token[:, None]  # [B, 1]
        positions = st.cache.lengths[:, None]  # the new token's position = tokens committed so far
        out = model(tokens, positions, st.cache)
        cache = kvc.advance(out.cache, (~st.done).astype(jnp.int32))
        key, sub = jax.random.split(st.key)
        token = _next_token(out.logits[:, 0], st, sampling, sub)
        return i + 1, constrain_state(_emit(st._replace(cache=cache, key=key), token, eos_ids))

    def cond(carry):
        i, st = carry
        return (i < num_steps) & ~jnp.all(st.done)

    _, st = jax.lax.while_loop(cond, step, (jnp.int32(0), st))
    return st
