"""Host side of generation, target-only or with a draft proposer: batching, shape buckets, compilation, streaming,
timing and statistics."""

from __future__ import annotations

import dataclasses
import functools
import time
import weakref
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from jaxspec import processors as procs
from jaxspec import sharding
from jaxspec.compiled_programs import ProgramCache
from jaxspec.errors import JaxspecError
from jaxspec.memory import MemoryReport, compiled_peak_bytes, device_bytes
from jaxspec.models.llama import LlamaModel
from jaxspec.sampling import SamplingConfig, row_keys, row_sampling
from jaxspec.engine import core as engine
from jaxspec.engine.proposers.base import Proposer
from jaxspec.engine.telemetry import OUTCOMES
from pallas_kernels.dispatch import IMPLEMENTATIONS, resolve_kernels
from pallas_kernels.mesh_axes import DATA, MODEL

CAPACITY_QUANTUM = 256  # cache capacities are multiples of this: one compile serves many lengths
MIN_PROMPT_BUCKET = 16


def prompt_bucket(length: int) -> int:
    """Power of two ≥ length (≥ 16): prompts of similar length share one prefill compile."""
    return max(MIN_PROMPT_BUCKET, 1 << (max(length, 1) - 1).bit_length())


def capacity_bucket(needed: int, limit: int) -> int:
    """Cache slots: a power of two up to 256 (≥ 16), then multiples of 256, at most `limit` (the context length plus
    the slots a verify step writes ahead)."""
    if needed <= CAPACITY_QUANTUM:
        return min(prompt_bucket(needed), limit)
    return min(-(-needed // CAPACITY_QUANTUM) * CAPACITY_QUANTUM, limit)


@dataclasses.dataclass
class Completion:
    token_ids: list[int]
    finished_by_eos: bool
    prompt_tokens: int
    seconds: float  # wall time of the batch it ran in (prefill + decode)
    prefill_seconds: float
    batch_size: int
    stats: dict = dataclasses.field(default_factory=dict)  # engine-specific (speculative: acceptance, calls)
    logprobs: list[TokenLogprob] | None = None  # one per token, where the generator keeps them (`keep_logprobs`)

    @property
    def num_generated(self) -> int:
        return len(self.token_ids)


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability under the target, and the likeliest tokens at its position."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token, log-probability), likeliest first


def row_logprobs(logprobs: Sequence[np.ndarray], row: int, start: int, tokens: Sequence[int]) -> list[TokenLogprob]:
    """`TokenLogprob`s of a row's tokens start.. from the state's `TokenLogprobs` arrays, on the host."""
    lp, ids, top = (x[row, start : start + len(tokens)] for x in logprobs)
    return [TokenLogprob(int(t), float(lp[j]), tuple(zip(ids[j].tolist(), top[j].tolist())))
            for j, t in enumerate(tokens)]


def tokens_per_verify(completions: Sequence[Completion]) -> float | None:
    """Pooled over rows: tokens the verify steps produced (bonus included; the prefill's first token excluded) per
    verify step, from the raw counts in `stats` — what says whether speculation paid (1.0: every draft rejected).
    None without speculative statistics or verify steps."""
    speculated = [c for c in completions if "verify_calls" in c.stats]  # automatic: batches that ran target-only
    calls = sum(c.stats["verify_calls"] for c in speculated)  # have no verify steps and are left out
    if not calls:
        return None
    return sum(c.num_generated - 1 for c in speculated if c.num_generated) / calls


_prefill = jax.jit(engine.prefill, static_argnames=("target_graphdef", "proposer", "capacity", "chunk", "logprobs"))
_prefill_chunk = jax.jit(
    engine.prefill_chunk, static_argnames=("target_graphdef", "proposer", "capacity", "chunk"), donate_argnums=(5,),
)
_prompt_logprobs = jax.jit(engine.prompt_logprobs, static_argnames=("target_graphdef", "proposer", "top"))
_steps = jax.jit(
    engine.steps,
    static_argnames=("target_graphdef", "proposer", "num_steps", "forced_accept_prob", "kernels", "drafting"),
    donate_argnums=(4,),
)
_steps_on_rows = jax.jit(
    engine.steps_on_rows,
    static_argnames=("target_graphdef", "proposer", "num_steps", "forced_accept_prob", "kernels", "drafting"),
    donate_argnums=(4,),
)


MAX_TOP_LOGPROBS = 20  # OpenAI's limit on top_logprobs
MAX_SCORING_BYTES = 4 << 30  # a prompt's scoring pass holds its logits at every position (and their log-softmax)


def check_prompt_lengths(prompt_lengths: Sequence[int], max_new_tokens: int, context_length: int) -> None:
    """Prompt + new tokens must fit the context: a function of the config alone, so that the CLIs check it before
    any weights load. The slots a verify step writes ahead of the committed length are scratch past it (the cache
    gets `extra_capacity` more), so speculation accepts every prompt target-only does: a token there is never
    committed, and causal attention keeps it out of every committed token's logits."""
    for i, n in enumerate(prompt_lengths):
        if n == 0:
            raise JaxspecError(f"prompt {i} is empty after tokenization")
        if n + max_new_tokens > context_length:
            raise JaxspecError(
                f"prompt {i} has {n} tokens; with --max-new-tokens {max_new_tokens} that exceeds the "
                f"model's context length of {context_length} tokens (shorten the prompt or lower "
                "--max-new-tokens)"
            )


class Generator:
    """Generates continuations of tokenized prompts, `batch_size` rows at a time: with the target alone, or with a
    draft `proposer` (`jaxspec.engine.proposers.base`; its parameters in `proposer_params`) whose drafts the target verifies.
    Greedy output is the target's token for token either way; sampled output follows the target's distribution.

    kernels: the draft verifier's implementation ("reference", "pallas" or "interpret", `pallas_kernels.dispatch`);
    None follows the target's numerics (whose attention the same choice set), or `auto` for plain numerics.
    forced_accept_prob: benchmarks only (chains): accept each draft with this probability whatever the target says
    — the output is then not the target's."""

    def __init__(
        self,
        model: LlamaModel,
        *,
        proposer: Proposer | None = None,
        proposer_params=None,
        batch_size: int = 1,
        chunk_steps: int | None = None,
        mesh: jax.sharding.Mesh | None = None,
        forced_accept_prob: float | None = None,
        kernels: str | None = None,
        logprobs: int | None = None,
    ):
        if batch_size < 1:
            raise JaxspecError(f"batch size must be >= 1, got {batch_size}")
        if forced_accept_prob is not None:
            if proposer is None or proposer.tree is not None:
                raise JaxspecError("--accept-prob (forced acceptance, benchmarks only) applies to chains, not --tree")
            if not 0.0 <= forced_accept_prob <= 1.0:
                raise JaxspecError(f"--accept-prob must be in [0, 1], got {forced_accept_prob}")
        if kernels is None:
            kernels = model.numerics.kernels if model.numerics is not None else resolve_kernels()
        if kernels not in IMPLEMENTATIONS:
            raise JaxspecError(f"kernels must be one of {', '.join(IMPLEMENTATIONS)}, got {kernels!r}")
        self.config = model.config
        self.mesh = mesh  # None: one device; else params, caches and batch rows are split over its (data, model) axes
        if mesh is None or mesh.shape[MODEL] == 1:  # on the model, so every generator of it shares one copy
            model.hold_step_weights()
        else:  # split dots there: kernels held for one device would only take memory on every device
            model = model.without_held_weights()
        self.graphdef, self.params = nnx.split(model)
        self.proposer, self.proposer_params = proposer, proposer_params
        if mesh is not None:
            sharding.check_fits(mesh, {"target": model.config}, batch_size)
            self.params = sharding.shard_params(self.params, mesh)
            if proposer_params is not None:
                self.proposer_params = sharding.shard_params(proposer_params, mesh)
        self.batch_size = batch_size
        self.chunk_steps = chunk_steps or (16 if proposer is None else 4)
        self.kernels = kernels
        # XLA options of every program compiled here (numerics.Numerics.compiler_options: no split-K GEMMs on GPU)
        self.compiler_options = model.numerics.compiler_options() if model.numerics is not None else {}
        self.forced_accept_prob = forced_accept_prob
        self.logprobs: int | None = None
        self.keep_logprobs(logprobs)
        self.compile_seconds = 0.0
        self._compiled = ProgramCache()  # bounded process-wide on memory maps (compiled_programs.py)
        self.on_compile: Callable[[str], None] | None = None  # told what compiles and how long it took (CLIs: stderr)
        self.memory: MemoryReport | None = None  # of the last batch generated (`--memory-report`)
        self._step_peaks = weakref.WeakKeyDictionary()  # compiled step program → its peak bytes (`_step_peak`)

    def keep_logprobs(self, top: int | None) -> None:
        """Keep each generated token's log-probability and its `top` likeliest alternatives in the state
        (`engine.core.TokenLogprobs`: read by `row_logprobs`); None: keep none (the programs compute none)."""
        if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
            raise JaxspecError(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}] alternatives, got {top}")
        self.logprobs = top

    @property
    def num_draft(self) -> int:
        """The longest acceptable run of drafts: a chain's K, a tree's depth (0 without a proposer)."""
        return 0 if self.proposer is None else self.proposer.depth

    @property
    def extra_capacity(self) -> int:
        """Cache slots needed beyond prompt + max-new-tokens (a verify block writes ahead)."""
        return 0 if self.proposer is None else self.proposer.extra_capacity()

    def row_stats(self, st, n_rows: int) -> list[dict]:
        """Speculative statistics per row from the state's raw counters, read once per batch: integer counts
        (`verify_calls`, `accepted_per_position`, `draft_calls`) and the rates derived from them."""
        if self.proposer is None:
            return [{} for _ in range(n_rows)]
        calls, generated, accepted, outcomes, siblings = (
            sharding.to_host(x) for x in (
                st.stats.verify_calls, st.num_generated, st.stats.accepted, st.stats.outcomes,
                st.stats.sibling_accepts,
            )
        )
        forwards = self.proposer.forwards_per_step
        # a proposer's own counters (prompt lookup beside a drafter: the steps it drafted), [B] each
        own = {name: sharding.to_host(x) for name, x in
               (self.proposer.row_counts(st.proposer) if hasattr(self.proposer, "row_counts") else {}).items()}
        stats = []
        for row in range(n_rows):
            c = int(calls[row])
            stats.append({
                "proposer": self.proposer.name,
                # tokens per target verify call, bonus included (the first token comes from the prefill)
                "mean_accepted_length": round((int(generated[row]) - 1) / c, 4) if c else 0.0,
                "acceptance_per_position": [round(float(x) / c, 4) if c else 0.0 for x in accepted[row]],
                "accepted_per_position": [int(x) for x in accepted[row]],
                "verify_calls": c,
                "target_calls": c + 1,
                "draft_calls": c * forwards + (1 if forwards else 0),  # the head also reads the prompt
                # why each verify step stopped accepting (`jaxspec.engine.telemetry`): counts summing to verify_calls
                "rejections": {name: int(n) for name, n in zip(OUTCOMES, outcomes[row])},
                "accepted_via_sibling": int(siblings[row]),
                **{name: int(x[row]) for name, x in own.items()},
            })
        return stats

    def _step_peak(self, step) -> int | None:
        """`compiled_peak_bytes` of a step program, read once per program: XLA's memory analysis takes ~0.1 s on
        CPU, which every batch paid (at batch 1, 5% of a 128-token answer's time, and inside the timed prefill)."""
        if step not in self._step_peaks:
            self._step_peaks[step] = compiled_peak_bytes(step)
        return self._step_peaks[step]

    def _memory_parts(self, st) -> dict:
        """Bytes per device of the parameters and caches of a batch: the target's (with the q/k/v kernels held
        side by side on CPU, `llama.hold_step_weights`) and the proposer's."""
        own_cache = None if self.proposer is None else self.proposer.kv_cache(st.proposer)
        return {
            "target_parameters": device_bytes(self.params), "target_kv_cache": device_bytes(st.cache),
            "head_parameters": device_bytes(self.proposer_params), "head_kv_cache": device_bytes(own_cache),
        }

    def check_lengths(self, prompt_lengths: Sequence[int], max_new_tokens: int) -> None:
        """Prompt + new tokens must fit the context (`check_prompt_lengths`)."""
        check_prompt_lengths(prompt_lengths, max_new_tokens, self.config.context_length)

    def compiled_programs(self, name: str) -> list[Callable]:
        """The ahead-of-time compiled "prefill" or "step" programs held now, one per shape bucket (for inspecting
        their shardings or memory; on a process near its memory-map limit older ones are released and compile
        again when used: compiled_programs.py). They take (target params, proposer params, *arguments)."""
        return [fn for key, fn in self._compiled.items() if key[0] == name]

    def _compiled_fn(self, name: str, fn, *args, **static):
        """AOT-compile once per static shape (while the program is held); compile time is kept apart from
        generation time."""
        # the arguments' structure too: a batch that samples (per-row settings) is another program than a greedy one
        key = (name, jax.tree.structure(args), *(getattr(a, "shape", None) for a in jax.tree.leaves(args)),
               *sorted(static.items()))

        def compile_program():
            if self.on_compile is not None:
                cache = f", cache {static['capacity']}" if "capacity" in static else ""
                # a prefill, or a step of some rows (their indices last), may be smaller than the batch
                rows = args[0].shape[0] if name.startswith(("prefill", "prompt")) else args[-1].shape[0] \
                    if name == "rows step" \
                    else self.batch_size
                self.on_compile(f"compiling the {name} (batch {rows}{cache})...")
            start = time.perf_counter()
            with sharding.mesh_context(self.mesh):
                models = (self.graphdef, self.params, self.proposer, self.proposer_params)
                program = fn.lower(*models, *args, **static).compile(compiler_options=self.compiler_options or None)
            seconds = time.perf_counter() - start
            self.compile_seconds += seconds
            if self.on_compile is not None:
                self.on_compile(f"compiled the {name} in {seconds:.1f}s")
            return program

        return self._compiled.get(key, compile_program)

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        max_new_tokens: int,
        sampling: SamplingConfig | Sequence[SamplingConfig] = SamplingConfig(),
        stop_ids: Sequence[int] = (),
        seed: int = 0,
        on_tokens: Callable[[int, list[int]], None] | None = None,
        progress: str | None = None,
        processors: procs.LogitProcessors | Sequence[procs.LogitProcessors] | None = None,
    ) -> list[Completion]:
        """Continuations in input order. on_tokens(prompt_index, new_ids) streams tokens as chunks finish;
        `progress` names a progress bar over prompts on stderr (none by default). sampling and processors: one
        setting for every prompt, or one per prompt (`jaxspec.sampling`, `jaxspec.processors`); their values are
        arrays, so new values reuse the compiled programs. Prompt i draws from the key `row_keys(seed, [i])`: its
        sampled output depends on the seed and i, not on the batch size or what shares its batch."""
        if max_new_tokens < 1:
            raise JaxspecError(f"max-new-tokens must be >= 1, got {max_new_tokens}")
        self.check_lengths([len(p) for p in prompts], max_new_tokens)
        if not isinstance(processors, (list, tuple)):
            requests = [procs.check_replayable(processors)] * len(prompts)
        else:
            requests = [procs.check_replayable(p) for p in processors]
            if len(requests) != len(prompts):
                raise JaxspecError(f"{len(requests)} logit processor settings for {len(prompts)} prompts")
        procs.check_vocab(requests, self.config.vocab_size)
        settings = [sampling] * len(prompts) if isinstance(sampling, SamplingConfig) else list(sampling)
        if len(settings) != len(prompts):
            raise JaxspecError(f"{len(settings)} sampling settings for {len(prompts)} prompts")
        results: list[Completion] = []
        bar = tqdm(total=len(prompts), desc=progress, unit="prompt", disable=progress is None, leave=False)
        for start in range(0, len(prompts), self.batch_size):
            batch = prompts[start : start + self.batch_size]
            rows = slice(start, start + self.batch_size)
            values = procs.batch_values(requests[rows], self.batch_size, self.config.vocab_size)
            row_settings = row_sampling(settings[rows], self.batch_size)
            keys = row_keys(seed, np.arange(start, start + self.batch_size))
            results += self.generate_batch(
                batch, start, max_new_tokens, stop_ids, keys, on_tokens, values, row_settings
            )
            bar.update(len(batch))
        bar.close()
        return results

    @property
    def program_params(self) -> tuple:
        """(target params, proposer params): the first arguments of the compiled programs (`programs`)."""
        return self.params, self.proposer_params

    def programs(self, prefill_args: tuple, capacity: int) -> tuple[Callable, Callable]:
        """(prefill, step) compiled for one batch shape, each once per shape while held: prefill(*program_params,
        prompt [B, T], prompt_lens [B], max_new [B], eos_ids [n], keys [B], processor values or None, row sampling
        settings or None) → GenState; step(*program_params, state, eos_ids) → the state after up to `chunk_steps`
        steps (the state donated). Budgets, sampling settings and processor values are data: no compile per value."""
        prefill = self.prefill_program(prefill_args, capacity)
        return prefill, self.step_program(prefill.out_info, prefill_args[3])

    def step_program(self, state, eos_ids: jax.Array, rows: int | None = None, drafting: bool = True) -> Callable:
        """The step for a running state (`state` gives the shapes), compiled once per (rows, drafting):
        program(*program_params, state, eos_ids[, row indices [rows]]) → the state after up to `chunk_steps` steps
        (the state donated). rows: those rows alone (`engine.core.steps_on_rows`; the indices are then the last
        argument), None all; drafting: False, a speculative state's steps draft nothing (`engine.core.spec_step`)."""
        if not drafting and self.proposer is None:
            raise ValueError("drafting=False needs a proposer: a target-only step drafts nothing anyway")
        static = dict(num_steps=self.chunk_steps, forced_accept_prob=self.forced_accept_prob, kernels=self.kernels)
        if not drafting:
            static["drafting"] = False
        if rows is None:
            return self._compiled_fn("step", _steps, state, eos_ids, **static)
        # the row indices replicated on a mesh (each device gathers its share of the rows from all of them)
        where = None if self.mesh is None else jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())
        return self._compiled_fn("rows step", _steps_on_rows, state, eos_ids,
                                 jax.ShapeDtypeStruct((rows,), jnp.int32, sharding=where), **static)

    def prefill_program(self, prefill_args: tuple, capacity: int, chunk: int | None = None) -> Callable:
        """The prefill alone, compiled for these arguments' shapes (`programs`). Its batch may be smaller than
        `batch_size`: rows never interact under the batch-invariant numerics, so a continuous batcher prefills only
        the rows that join (`engine.slots`) and copies them into the running state. With `chunk`, the last chunk of
        a chunked prefill, whose arguments end with the PartialPrefill and the chunk's start (`chunk_program`)."""
        static = {} if chunk is None else {"chunk": chunk}
        if self.logprobs is not None:
            static["logprobs"] = self.logprobs
        return self._compiled_fn("prefill", _prefill, *prefill_args, capacity=capacity, **static)

    def prompt_logprobs(self, prompt: Sequence[int], top: int) -> list[TokenLogprob]:
        """Each token of `prompt` after the first with its log-probability under the target and its `top` likeliest
        alternatives (`engine.core.prompt_logprobs`): the prompt's own logprobs, as OpenAI's completions return them
        for `echo` with `logprobs`. Compiled once per prompt bucket and `top`; a batch of one prompt (on a mesh, as
        many rows as the data axis has devices, the others padding)."""
        self.check_prompt_scoring(len(prompt))
        if not 0 <= top <= MAX_TOP_LOGPROBS:
            raise JaxspecError(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}] alternatives, got {top}")
        rows = 1 if self.mesh is None else self.mesh.shape[DATA]
        tokens = np.zeros((rows, prompt_bucket(len(prompt))), np.int32)
        tokens[0, : len(prompt)] = prompt
        tokens = jnp.asarray(tokens)
        program = self._compiled_fn("prompt scoring", _prompt_logprobs, tokens, top=top)
        got = [sharding.to_host(x) for x in program(*self.program_params, tokens)]
        return row_logprobs(got, 0, 0, list(prompt[1:]))

    def check_prompt_scoring(self, length: int) -> None:
        """A one-line error for a prompt `prompt_logprobs` cannot score: empty, or whose logits at every position
        (float32, twice: the logits and their log-softmax) would pass MAX_SCORING_BYTES."""
        if length < 1:
            raise JaxspecError("the prompt is empty after tokenization")
        rows = 1 if self.mesh is None else self.mesh.shape[DATA]
        need = 2 * 4 * rows * prompt_bucket(length) * self.config.vocab_size
        if need > MAX_SCORING_BYTES:
            longest = MAX_SCORING_BYTES // (2 * 4 * rows * self.config.vocab_size)
            raise JaxspecError(f"the prompt has {length} tokens; scoring its own logprobs (echo with logprobs) "
                               f"takes up to {longest} here (the logits of every position are held at once)")

    def chunk_program(self, chunk_args: tuple, capacity: int, chunk: int) -> Callable:
        """One chunk of a chunked prefill (`engine.core.prefill_chunk`), compiled for chunk_args = (prompt [B, Tp],
        PartialPrefill or None for the first chunk, start): program(*program_params, *chunk_args) → PartialPrefill,
        the partial prefill donated. Two programs per (rows, prompt bucket): the first chunk and any later one."""
        return self._compiled_fn("prefill chunk", _prefill_chunk, *chunk_args, capacity=capacity, chunk=chunk)

    def batch_capacity(self, batch: Sequence[Sequence[int]], max_new_tokens: int) -> int:
        """Cache slots for one batch of prompts: its longest prompt, the new tokens and the verify block's slots,
        bucketed (`capacity_bucket`)."""
        longest = max(len(p) for p in batch)
        return capacity_bucket(
            longest + max_new_tokens + self.extra_capacity, self.config.context_length + self.extra_capacity
        )

    def generate_batch(
        self, batch, offset, max_new_tokens, stop_ids, keys, on_tokens, processor_values, sampling=None
    ) -> list[Completion]:
        """One batch of at most `batch_size` prompts (`generate` splits the prompts, their keys [B] and settings):
        prefill, then compiled chunks of steps until every row is done. offset: the first prompt's index, for
        `on_tokens`; sampling: the rows' settings (`row_sampling`; None: greedy)."""
        b = self.batch_size
        longest = max(len(p) for p in batch)
        capacity = self.batch_capacity(batch, max_new_tokens)
        t = min(prompt_bucket(longest), capacity)
        prompt = np.zeros((b, t), np.int32)
        lens = np.zeros((b,), np.int32)
        for i, p in enumerate(batch):
            prompt[i, : len(p)] = p
            lens[i] = len(p)
        max_new = np.where(lens > 0, max_new_tokens, 0).astype(np.int32)
        eos = np.asarray(list(stop_ids) or [-1], np.int32)
        args = (jnp.asarray(prompt), jnp.asarray(lens), jnp.asarray(max_new), jnp.asarray(eos), keys,
                processor_values, sampling)
        prefill, step = self.programs(args, capacity)
        params = self.program_params

        start = time.perf_counter()
        st = prefill(*params, *args)
        emitted = np.zeros((b,), np.int64)
        emitted = self._stream(st, emitted, len(batch), offset, on_tokens)
        jax.block_until_ready(st.num_generated)
        prefill_seconds = time.perf_counter() - start
        while not bool(np.all(sharding.to_host(st.done))):
            st = step(*params, st, args[3])
            emitted = self._stream(st, emitted, len(batch), offset, on_tokens)
        seconds = time.perf_counter() - start
        self.memory = MemoryReport(
            devices=self.mesh.size if self.mesh is not None else 1, batch_size=b, cache_capacity=capacity,
            step_peak=self._step_peak(step), **self._memory_parts(st),
        )

        tokens, counts = sharding.to_host(st.tokens), sharding.to_host(st.num_generated)
        logprobs = None if st.logprobs is None else [sharding.to_host(x) for x in st.logprobs]
        stop = set(int(s) for s in stop_ids)
        out = []
        for i, (p, stats) in enumerate(zip(batch, self.row_stats(st, len(batch)))):
            ids = tokens[i, : counts[i]].tolist()
            finished = bool(ids) and ids[-1] in stop
            lps = None if logprobs is None else row_logprobs(logprobs, i, 0, ids)
            out.append(Completion(ids, finished, len(p), seconds, prefill_seconds, len(batch), stats, lps))
        return out

    @staticmethod
    def _stream(st, emitted, n_rows, offset, on_tokens):
        if on_tokens is None:
            return emitted
        counts = sharding.to_host(st.num_generated)
        if np.any(counts[:n_rows] > emitted[:n_rows]):
            tokens = sharding.to_host(st.tokens)
            for i in range(n_rows):
                if counts[i] > emitted[i]:
                    on_tokens(offset + i, tokens[i, emitted[i] : counts[i]].tolist())
        return np.maximum(emitted, counts)


@functools.cache
def default_dtype() -> str:
    """float32 on CPU (where bfloat16 matmuls are slow), bfloat16 on GPU and TPU."""
    return "float32" if jax.default_backend() == "cpu" else "bfloat16"
