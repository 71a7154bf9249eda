"""Logit processors that speculation replays exactly: logit bias, repetition penalty, presence and frequency
penalties, min-p.

Why these and only these: a processor is safe under speculative decoding when the processed logits of a position
are a function of the raw logits there and of the tokens before it — then the verify step, which computes K+1 (or a
tree's N) positions at once, can give each position exactly the context it would have had in a target-only decode
step: the committed tokens (prompt and output) plus the drafted tokens on its own path (its ancestors in a tree).
All five are of that kind, and so is a grammar (`jaxspec.grammar`): its automaton's state at a position is a
function of the tokens before it, so each position's state is the committed one walked along its own path. A
processor that needs anything else (a host callback) cannot be replayed across drafted positions and is refused
(`check_replayable`).

Per entry v of a row's logits x (float32), in this order (vLLM's: bias and penalties on the raw logits, then the
sampling filters):
    x += bias[v]                                                    logit bias (OpenAI)
    x = x * r if x < 0 else x / r,   if v is in prompt or output    repetition penalty r (transformers)
    x -= frequency · count[v] + presence · (count[v] > 0)           over the output only (OpenAI)
    x = -inf,   if the row's grammar does not allow v in the position's state        structured output
then sampling divides by the temperature, applies top-k and top-p, and min-p (transformers' order, `sampling.py`):
tokens whose probability is below min_p × the top probability are dropped. Greedy takes the argmax of the processed
logits (min-p never removes the argmax, so it changes nothing there).

Per-request values are arrays in the device state ([batch] each, the bias [batch, vocab]), so a new value does not
recompile; only switching processors on (a `ProcessorState` instead of None) does. Products are rounded before any
add (`exact_mul`) so that the same entry gets the same bits in a decode step and in a verify block.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.errors import JaxspecError
from jaxspec.grammar import TokenAutomaton
from jaxspec.models.numerics import exact_mul


@dataclasses.dataclass(frozen=True)
class LogitProcessors:
    """One request's processors (host side). The defaults switch every processor off."""

    repetition_penalty: float = 1.0  # > 0; 1 is off; > 1 discourages tokens of the prompt and output
    presence_penalty: float = 0.0  # subtracted once from every token the output already holds
    frequency_penalty: float = 0.0  # subtracted per occurrence in the output
    min_p: float = 0.0  # in [0, 1]; sampling only
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit)
    grammar: TokenAutomaton | None = None  # structured output (`jaxspec.grammar`); None: unconstrained

    def __post_init__(self) -> None:
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise JaxspecError(
                f"repetition penalty must be a finite number > 0 (1 = off), got {self.repetition_penalty}"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not math.isfinite(value):
                raise JaxspecError(f"{name.replace('_', ' ')} must be a finite number (0 = off), got {value}")
        if not 0 <= self.min_p <= 1:  # also rejects NaN
            raise JaxspecError(f"min-p must be in [0, 1] (0 = off), got {self.min_p}")
        for token, bias in self.logit_bias:
            if not isinstance(token, int) or token < 0:
                raise JaxspecError(f"logit bias: token ids must be integers >= 0, got {token!r}")
            if not (isinstance(bias, (int, float)) and (math.isfinite(bias) or bias == -math.inf)):
                raise JaxspecError(
                    f"logit bias of token {token} must be a finite number (or -inf to ban it), got {bias!r}"
                )

    @property
    def active(self) -> bool:
        return self != LogitProcessors()

    @classmethod
    def parse_bias(cls, text: str) -> tuple[tuple[int, float], ...]:
        """`--logit-bias '{"42": -100, "7": 2.5}'` (OpenAI's format: token id → bias) → ((42, -100.0), (7, 2.5))."""
        try:
            raw = json.loads(text)
            if not isinstance(raw, dict):
                raise ValueError
            return tuple(sorted((int(k), float(v)) for k, v in raw.items()))
        except (ValueError, TypeError):
            raise JaxspecError(
                f'--logit-bias wants a JSON object of token id to bias, e.g. \'{{"42": -100, "7": 2.5}}\', got {text!r}'
            ) from None


def check_replayable(processors: object) -> LogitProcessors:
    """What the engine can replay across speculative positions is a LogitProcessors; anything else (e.g. a
    transformers LogitsProcessor, a callable) is refused in one line."""
    if processors is None:
        return LogitProcessors()
    if not isinstance(processors, LogitProcessors):
        raise JaxspecError(
            f"logit processor {type(processors).__name__} cannot be replayed across speculative positions; "
            "jaxspec supports repetition, presence and frequency penalties, min-p and logit bias (LogitProcessors)"
        )
    return processors


class ProcessorValues(NamedTuple):
    """Per-row values of a batch (rows without processors hold the neutral ones, which change no bit)."""

    repetition: jax.Array  # [B] float32
    presence: jax.Array  # [B] float32
    frequency: jax.Array  # [B] float32
    min_p: jax.Array  # [B] float32
    bias: jax.Array  # [B, V] float32
    token_class: jax.Array | None = None  # [B, V] int32: each row's grammar (`jaxspec.grammar`; a free one for rows
    transitions: jax.Array | None = None  # [B, S, C] int32  without), or None when no row has one


class ProcessorState(NamedTuple):
    """What the processors read, carried in the decode and speculative states."""

    values: ProcessorValues
    in_prompt: jax.Array  # [B, V] bool: the token occurs in the row's prompt
    counts: jax.Array  # [B, V] int32: occurrences in the row's output so far (emitted tokens)
    grammar_state: jax.Array | None = None  # [B] int32: each row's automaton state after its output (with grammars)


def check_vocab(requests: Sequence[LogitProcessors], vocab: int) -> None:
    """Logit biases must name tokens of the target's vocabulary (checked before anything compiles)."""
    for r in requests:
        for token, _ in r.logit_bias:
            if token >= vocab:
                raise JaxspecError(
                    f"logit bias names token {token}, but the vocabulary has {vocab} tokens (ids 0..{vocab - 1})"
                )


def batch_values(
    requests: Sequence[LogitProcessors], batch_size: int, vocab: int, always: bool = False,
    grammar_shape: tuple[int, int] | None = None,
) -> ProcessorValues | None:
    """Host arrays for one batch (padding rows neutral), or None when no request uses a processor (then the
    compiled programs are the plain ones) unless `always` (continuous batching: one program whoever joins).
    grammar_shape: (states, classes) of every batch's grammar tables, so that any grammar up to that size runs the
    same program (a larger one is refused); None: tables only when a request has a grammar, sized to fit."""
    if not always and not any(r.active for r in requests):
        return None
    rep = np.ones((batch_size,), np.float32)
    presence, frequency, min_p = (np.zeros((batch_size,), np.float32) for _ in range(3))
    bias = np.zeros((batch_size, vocab), np.float32)
    for i, r in enumerate(requests):
        rep[i], presence[i], frequency[i] = r.repetition_penalty, r.presence_penalty, r.frequency_penalty
        min_p[i] = r.min_p
        for token, b in r.logit_bias:
            bias[i, token] = b
    token_class, transitions = _grammar_tables([r.grammar for r in requests], batch_size, vocab, grammar_shape)
    return ProcessorValues(
        *(jnp.asarray(x) for x in (rep, presence, frequency, min_p, bias)),
        token_class=None if token_class is None else jnp.asarray(token_class),
        transitions=None if transitions is None else jnp.asarray(transitions),
    )


def check_grammar_fits(automaton: TokenAutomaton, shape: tuple[int, int], fix: str) -> None:
    """A one-line error for a grammar larger than the (states, classes) tables an engine holds; `fix` says how to
    raise them."""
    states, classes = shape
    if automaton.num_states > states or automaton.num_classes > classes:
        raise JaxspecError(
            f"the grammar needs {automaton.num_states} automaton states and {automaton.num_classes} token classes; "
            f"this engine holds at most {states} and {classes} per request (a simpler schema or pattern, or {fix})"
        )


def _grammar_tables(automata, batch_size: int, vocab: int, shape: tuple[int, int] | None):
    """[B, V] token classes and [B, S, C] transitions (rows without a grammar free: every token allowed), or
    (None, None) when no row has a grammar and no shape is fixed."""
    if shape is None and all(a is None for a in automata):
        return None, None
    real = [a for a in automata if a is not None]
    states, classes = shape or (max(a.num_states for a in real), max(a.num_classes for a in real))
    for a in real:
        check_grammar_fits(a, (states, classes), "raise the limits")
    token_class = np.zeros((batch_size, vocab), np.int32)
    transitions = np.full((batch_size, states, classes), -1, np.int32)
    transitions[:, 0, 0] = 0  # the free automaton: one state, one class, allowed
    for i, a in enumerate(automata):
        if a is not None:
            token_class[i] = a.token_class
            transitions[i] = -1
            transitions[i, : a.num_states, : a.num_classes] = a.transitions
    return token_class, transitions


def init_state(values: ProcessorValues | None, prompt: jax.Array, prompt_lens: jax.Array) -> ProcessorState | None:
    """From the prompt [B, Tp] (right-padded; prompt_lens [B]): which tokens it holds; no output yet."""
    if values is None:
        return None
    b, t = prompt.shape
    valid = jnp.arange(t)[None, :] < prompt_lens[:, None]  # [B, Tp]
    rows = jnp.broadcast_to(jnp.arange(b)[:, None], (b, t))
    in_prompt = jnp.zeros(values.bias.shape, bool).at[rows, prompt].max(valid)
    grammar_state = None if values.token_class is None else jnp.zeros((b,), jnp.int32)  # each automaton's start
    return ProcessorState(values, in_prompt, jnp.zeros(values.bias.shape, jnp.int32), grammar_state)


def record(st: ProcessorState | None, tokens: jax.Array, count: jax.Array) -> ProcessorState | None:
    """Count tokens[:, :count] ([B, W], count [B]) as output."""
    if st is None:
        return None
    b, w = tokens.shape
    take = (jnp.arange(w)[None, :] < count[:, None]).astype(jnp.int32)
    rows = jnp.broadcast_to(jnp.arange(b)[:, None], (b, w))
    st = st._replace(counts=st.counts.at[rows, jnp.maximum(tokens, 0)].add(take))
    if st.grammar_state is None:
        return st
    state = st.grammar_state
    for j in range(w):  # the automaton through the emitted tokens, in order
        state = jnp.where(take[:, j] > 0, _advance(st.values, state[:, None], tokens[:, j : j + 1])[:, 0], state)
    return st._replace(grammar_state=state)


def _advance(v: ProcessorValues, state: jax.Array, token: jax.Array) -> jax.Array:
    """Each row's automaton from state [B, N] through token [B, N]. A token the grammar does not allow leads back
    to the start: only positions that can never be accepted get there (their path holds a draft the processed
    target gives probability 0), and a start state keeps their logits from being all -inf."""
    rows = jnp.arange(state.shape[0])[:, None]
    nxt = v.transitions[rows, state, v.token_class[rows, jnp.maximum(token, 0)]]
    return jnp.maximum(nxt, 0)


def _grammar_mask(st: ProcessorState, n: int, path: jax.Array | None, columns: jax.Array | None) -> jax.Array:
    """[B, N, V'] bool: the tokens each position's automaton state allows, that state being the row's committed one
    walked along the position's path (path [B, N, D], -1: none)."""
    v = st.values
    b = st.grammar_state.shape[0]
    state = jnp.broadcast_to(st.grammar_state[:, None], (b, n))
    for j in range(0 if path is None else path.shape[-1]):
        token = path[..., j]
        state = jnp.where(token >= 0, _advance(v, state, token), state)
    classes = v.token_class if columns is None else v.token_class[:, columns]  # [B, V']
    table = v.transitions[jnp.arange(b)[:, None], state]  # [B, N, C]
    index = jnp.broadcast_to(classes[:, None, :], (b, n, classes.shape[-1]))
    return jnp.take_along_axis(table, index, axis=-1) >= 0


def _penalize(x, bias, seen, counts, v: ProcessorValues, expand):
    """The per-entry rule of the module docstring. x, bias, seen, counts: same shape; v's [B] values broadcast by
    `expand`. Every product is rounded before an add, so a gathered entry gets the bits of the whole-row one."""
    rep, presence, frequency = expand(v.repetition), expand(v.presence), expand(v.frequency)
    x = x + bias
    # A true division, as transformers computes it: XLA rewrites x / broadcast(r) into x * (1 / r), which rounds
    # differently; a divisor behind an optimization barrier is not a broadcast to the simplifier.
    divisor = jax.lax.optimization_barrier(jnp.broadcast_to(rep, x.shape))
    x = jnp.where(seen, jnp.where(x < 0, exact_mul(x, rep), x / divisor), x)
    c = counts.astype(jnp.float32)
    return x - exact_mul(frequency, c) - exact_mul(presence, (counts > 0).astype(jnp.float32))


def process(
    logits: jax.Array,  # [B, N, V'] raw logits of N positions (V' = V, or a draft vocabulary's columns)
    st: ProcessorState | None,
    path: jax.Array | None = None,  # [B, N, D] target ids drafted before each position (-1: none); None: D = 0
    columns: jax.Array | None = None,  # [V'] target id of each column (a draft vocabulary); None: all V
) -> jax.Array:
    """Processed float32 logits: position n sees the committed prompt and output plus its own path (the drafts
    between the last emitted token and it: a chain's earlier drafts, a tree node's ancestors), and nothing else."""
    logits = logits.astype(jnp.float32)
    if st is None:
        return logits
    b, n, width = logits.shape
    v = st.values
    bias, seen, counts = v.bias, st.in_prompt | (st.counts > 0), st.counts  # [B, V]
    if columns is not None:
        bias, seen, counts = bias[:, columns], seen[:, columns], counts[:, columns]  # [B, V']

    def per_row(a):  # [B] -> [B, 1, 1]
        return a[:, None, None]

    out = _penalize(logits, bias[:, None], seen[:, None], counts[:, None], v, per_row)
    if st.grammar_state is not None:  # last: a token the grammar forbids gets -inf whatever the penalties did
        allowed = _grammar_mask(st, n, path, columns)
        finish = lambda x: jnp.where(allowed, x, -jnp.inf)  # noqa: E731
    else:
        finish = lambda x: x  # noqa: E731
    if path is None or path.shape[-1] == 0:
        return finish(out)
    # Entries of tokens on the path: counts raised by their occurrences on it, seen by the repetition penalty.
    d = path.shape[-1]
    valid = path >= 0  # [B, N, D]
    token = jnp.maximum(path, 0)
    rows = jnp.arange(b)[:, None, None]
    extra = jnp.sum((path[..., :, None] == path[..., None, :]) & valid[..., None, :], axis=-1)  # [B, N, D]
    if columns is not None:  # target id -> column (-1 outside the draft vocabulary: nothing to redo)
        col_of = jnp.full((st.counts.shape[1],), -1, jnp.int32).at[columns].set(jnp.arange(width, dtype=jnp.int32))
        col = col_of[token]
        valid = valid & (col >= 0)
    else:
        col = token
    col = jnp.maximum(col, 0)
    raw = logits[rows, jnp.arange(n)[None, :, None], col]  # [B, N, D]
    redone = _penalize(
        raw, v.bias[rows, token], jnp.ones_like(valid), st.counts[rows, token] + extra, v, per_row
    )
    positions = jnp.broadcast_to(jnp.arange(n)[None, :, None], (b, n, d))
    col = jnp.where(valid, col, width)  # out of range: dropped
    return finish(out.at[jnp.broadcast_to(rows, (b, n, d)), positions, col].set(redone, mode="drop"))


def min_p_of(st: ProcessorState | None) -> jax.Array | None:
    """The rows' min-p values for `sampling.filtered_logits` ([B]), or None without processors."""
    return None if st is None else st.values.min_p


def min_p_filter(logits: jax.Array, min_p: jax.Array) -> jax.Array:
    """Drop tokens whose probability is below min_p × the most likely token's (logits [B, ..., V] after temperature
    and the other filters; min_p [B]). transformers' MinPLogitsWarper: the top token always stays."""
    probs = jax.nn.softmax(logits, axis=-1)
    top = jnp.max(probs, axis=-1, keepdims=True)
    threshold = min_p.reshape(min_p.shape + (1,) * (logits.ndim - 1)) * top
    return jnp.where(probs < threshold, -jnp.inf, logits)


def chain_paths(drafts: jax.Array) -> jax.Array:
    """drafts [B, K] → [B, K+1, K]: position j (after the last emitted token and d_1..d_j) has path d_1..d_j."""
    k = drafts.shape[1]
    before = jnp.arange(k)[None, :] < jnp.arange(k + 1)[:, None]  # [K+1, K]
    return jnp.where(before[None], drafts[:, None, :], -1)


def tree_paths(tokens: jax.Array, ancestors: jax.Array, depths: jax.Array) -> jax.Array:
    """A tree's per-node paths: tokens [B, N] (node 0 the root, already emitted), ancestors [B, N, D+1] (node index
    at each depth), depths [B, N] → [B, N, D]: the tokens of each node's ancestors at depths 1..its own depth."""
    anc = ancestors[:, :, 1:]  # [B, N, D]
    on_path = jnp.arange(1, anc.shape[-1] + 1)[None, None, :] <= depths[:, :, None]
    toks = tokens[jnp.arange(tokens.shape[0])[:, None, None], anc]  # [B, N, D]
    return jnp.where(on_path, toks, -1)
