"""Continuous batching: a fixed set of rows ("slots") that requests join and leave between steps.

Why: a server cannot hold a short request until the long ones beside it finish, nor compile for every arrival.
What: `SlotBatcher` keeps one generation state of `Generator.batch_size` rows on the device at one cache capacity,
so its step compiles once. A request joins a free slot between steps: its prompt is prefilled in a batch of just
the joining rows (the requests joining at the same time, padded: `join_rows`), and those rows are
written into the running state (`_join_rows`, a scatter in place); it leaves when its EOS or its budget ends it, and
its slot is free for the next. The prefill and the step are `Generator`'s own programs, and rows never interact
under the engine's batch-invariant numerics, so a request's greedy output is the one `Generator.generate` gives it
alone, whoever shares the batch and however many rows its prefill had (tests/test_slots.py, tests/test_serve.py).
With `--numerics plain` that promise does not hold: XLA's own kernels may change a row's bits with the batch.

Why a prefill of the joining rows only: a lone request joining 16 slots once prefilled 16 rows (15 of padding),
16 times the compute while every running row waited. Each (rows, prompt bucket) pair is one compiled prefill,
compiled when a first join needs it (`warm_up` compiles the commonest).

Chunked prefill (`prefill_chunk`): a prompt longer than a chunk that joins while other requests run would stall
them for its whole prefill; instead its slot is held and its prompt runs a chunk before each `step`
(`engine.core.prefill_chunk`), the last chunk being the prefill proper that puts it in its slot. Each chunk runs on
the prefill's tiles and reads the chunks before it from the cache, so the request's cache, first token and
drafter state are those of a whole prefill, bit for bit. A join into an idle state prefills whole: nobody waits.

Steps on the live rows (`step_buckets`): a step computes every row of its batch, finished or not, so a lone
request on a 16-slot server would pay for 16 rows (on a CPU, 16 times the compute; on a GPU, the idle rows' cache
reads). Each chunk of steps runs on the live slots alone, gathered into the smallest compiled batch that holds them
(the mesh's data axis times a power of two, as joins are: `join_rows`) and written back
(`engine.core.steps_on_rows`); all slots live run the full step. Rows never interact, so the tokens are the same.

Costs: a join's prefill holds its fresh state beside the running one until its rows are copied over; a bucketed
chunk of steps copies its rows' state (caches included) in and out.

Each request has its own sampling settings and seed (`SlotRequest`): they are per-row arrays of the state
(`jaxspec.sampling`), so greedy and sampled requests share one compiled step, and a seeded request draws from its
own key (`row_keys(seed, [0])`, what `Generator.generate` gives a lone prompt with that seed), so it samples the same
tokens whoever shares the batch.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Collection, Hashable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec import processors as procs
from jaxspec import sharding
from jaxspec.engine.core import GenState, PartialPrefill, constrain_state
from jaxspec.engine.generation import Completion, Generator, TokenLogprob, prompt_bucket, row_logprobs
from jaxspec.errors import JaxspecError
from jaxspec.sampling import SamplingConfig, row_keys, row_sampling
from pallas_kernels.mesh_axes import DATA


_WARM_UP, _WARM_UP_2 = object(), object()  # the handles of `SlotBatcher.warm_up`'s requests


@dataclasses.dataclass(frozen=True)
class SlotRequest:
    """One request: its tokenized prompt, its budget of new tokens, its logit processors, its sampling settings and
    seed (None: one drawn by the batcher), whether its updates bring its tokens' log-probabilities (the
    generator must keep them: `Generator.keep_logprobs`), and how many alternatives the prompt's own tokens'
    log-probabilities bring (None: not asked for; the server's scheduler scores the prompt before it joins, and a
    request that asks for them may have a budget of 0: scored only, it never takes a slot)."""

    prompt: tuple[int, ...]
    max_new_tokens: int
    processors: procs.LogitProcessors = procs.LogitProcessors()
    sampling: SamplingConfig = SamplingConfig()
    seed: int | None = None
    logprobs: bool = False
    prompt_logprobs: int | None = None


@dataclasses.dataclass(frozen=True)
class SlotUpdate:
    """What one request produced since the last update: its new tokens, and its completion once it has ended."""

    handle: Hashable  # the caller's name for the request (`SlotBatcher.join`)
    new_tokens: list[int]
    completion: Completion | None  # None while the request runs
    logprobs: list[TokenLogprob] | None = None  # one per new token, for a request that asked for them
    prompt_logprobs: list[TokenLogprob] | None = None  # the first update of a request that asked for them: one per
    # prompt token after the first (`Generator.prompt_logprobs`)


class SlotBatcher:
    """Requests joining and leaving the rows of one running generation state (module docstring).

    capacity: cache slots per row, the same for every request (prompt + budget + the slots a verify writes ahead
    must fit); stop_ids: tokens that end a request; seed: where the seeds of requests that bring none come from;
    grammar_shape: (automaton states, token classes) every request's grammar tables are held at, so that any grammar
    up to that size joins the same compiled step (None: requests cannot bring grammars); prefill_chunk: the chunk
    of a long prompt's prefill when it joins running requests (None: whole prefills); step_buckets: steps run on the
    live slots alone (False: every step runs all slots); drafting_rows: the step buckets (`step_bucket`) whose steps
    draft, the others drafting nothing on the same state (None: every step drafts)."""

    def __init__(
        self, generator: Generator, *, capacity: int, stop_ids: Sequence[int] = (), seed: int = 0,
        max_tokens: int | None = None, grammar_shape: tuple[int, int] | None = None,
        prefill_chunk: int | None = None, step_buckets: bool = True, drafting_rows: Collection[int] | None = None,
    ):
        limit = generator.config.context_length + generator.extra_capacity
        if not generator.extra_capacity < capacity <= limit:
            raise JaxspecError(f"a slot's cache capacity must be in ({generator.extra_capacity}, {limit}], got "
                               f"{capacity}")
        if prefill_chunk is not None and prefill_chunk < 1:
            raise JaxspecError(f"the prefill chunk must be at least 1 token, got {prefill_chunk} (0 or none: whole "
                               "prefills)")
        self.prefill_chunk = prefill_chunk
        self.step_buckets = step_buckets
        # the buckets of rows whose steps draft (None: all, with a proposer); the others run the proposer's keep-up
        # and the target alone (speculation off at high load: the server's auto, `engine.auto`)
        self.drafting_rows = None if drafting_rows is None else frozenset(drafting_rows)
        if self.drafting_rows is not None and generator.proposer is None:
            raise JaxspecError("drafting_rows needs a speculative generator (a target-only one never drafts)")
        self.step_rows: collections.Counter = collections.Counter()  # chunks of steps by the rows they ran on
        self.step_programs: dict[int, object] = {}  # rows → its compiled step, held (no cache lookup per chunk)
        self.pending: collections.deque[_PendingJoin] = collections.deque()  # chunked joins, the first advancing
        self.prefill_chunks = 0  # chunks run by chunked joins (their last chunk, the prefill proper, not counted)
        self.generator = generator
        self.capacity = capacity
        # prompt + new tokens of one request: what the cache holds, or less (a server's --max-model-len)
        self.room = min(capacity - generator.extra_capacity, max_tokens or capacity)
        self.grammar_shape = grammar_shape
        self.eos = jnp.asarray(list(stop_ids) or [-1], jnp.int32)
        self.stop_ids = frozenset(int(s) for s in stop_ids)
        self.seeds = np.random.default_rng(seed)  # for requests without a seed of their own
        self.state: GenState | None = None  # after the first join
        rows = generator.batch_size
        self.held: list[tuple[Hashable, SlotRequest] | None] = [None] * rows  # each slot's request, None: free
        self.emitted = np.zeros((rows,), np.int64)  # tokens of each slot's request reported so far
        self.joined_at = np.zeros((rows,), np.float64)
        self.prefill_seconds = np.zeros((rows,), np.float64)
        self.join_program = jax.jit(_join_rows, donate_argnums=(0,))
        self.prefill_rows: collections.Counter = collections.Counter()  # joins by the rows their prefill had
        self.end_program = jax.jit(_end_row, donate_argnums=(0,))

    @property
    def free_slots(self) -> list[int]:
        reserved = {p.slot for p in self.pending}
        return [i for i, held in enumerate(self.held) if held is None and i not in reserved]

    @property
    def running(self) -> int:
        return len(self.held) - len(self.free_slots)

    def check(self, request: SlotRequest) -> None:
        """A one-line error for a request no slot can take (empty, or prompt + budget past the capacity)."""
        if not request.prompt:
            raise JaxspecError("the prompt is empty after tokenization")
        if request.max_new_tokens < (0 if request.prompt_logprobs is not None else 1):
            raise JaxspecError(f"max_new_tokens must be >= 1 (0 only to score the prompt), got "
                               f"{request.max_new_tokens}")
        if len(request.prompt) + request.max_new_tokens > self.room:
            raise JaxspecError(
                f"the prompt has {len(request.prompt)} tokens; with {request.max_new_tokens} new tokens that exceeds "
                f"the {self.room} tokens a request may hold (shorten the prompt or lower the budget)"
            )
        if request.prompt_logprobs is not None:
            self.generator.check_prompt_scoring(len(request.prompt))
        procs.check_vocab([request.processors], self.generator.config.vocab_size)
        if request.logprobs and self.generator.logprobs is None:
            raise JaxspecError("this engine keeps no logprobs (Generator.keep_logprobs; the server's --max-logprobs)")
        grammar = request.processors.grammar
        if grammar is not None:
            if self.grammar_shape is None:
                raise JaxspecError("this engine was started without room for grammars (structured output)")
            procs.check_grammar_fits(grammar, self.grammar_shape,
                                     "start the server with higher --max-grammar-states/--max-grammar-classes")

    def join(self, requests: Sequence[tuple[Hashable, SlotRequest]]) -> list[int]:
        """Prefill `requests` (handle, request) into free slots; returns their slots. Their first tokens come with
        the next `collect`. The requests prefill together in one program, except, with `prefill_chunk`, a prompt
        longer than a chunk joining while other requests run: it joins over the next steps, one chunk before each
        (`step`), so that the running requests keep going."""
        free = self.free_slots
        if len(requests) > len(free):
            raise JaxspecError(f"{len(requests)} requests for {len(free)} free slots")
        for _, request in requests:
            self.check(request)
        slots = free[: len(requests)]
        whole, chunked = [], []
        for slot, held in zip(slots, requests):
            long = self.prefill_chunk is not None and len(held[1].prompt) > self.prefill_chunk
            (chunked if long and (self.pending or self.busy.any()) else whole).append((slot, held))
        now = time.perf_counter()
        for slot, (handle, request) in chunked:
            args = self._prefill_args([request], self.join_rows(1), [0])
            self.pending.append(_PendingJoin(handle, request, slot, args, joined_at=now))
        if whole:
            self._prefill_whole([s for s, _ in whole], [held for _, held in whole])
        return slots

    def _prefill_args(self, requests: Sequence[SlotRequest], n: int, at: Sequence[int]) -> tuple:
        """The prefill's arguments for `requests` in rows `at` of n (the others padding rows)."""
        # below the capacity: every state array then has the shapes the running one has (an n-gram history is
        # max(capacity, T + 1) wide); `check` keeps every prompt shorter than the capacity
        t = min(prompt_bucket(max(len(r.prompt) for r in requests)), self.capacity - 1)
        prompt = np.zeros((n, t), np.int32)
        lens, max_new = np.zeros((n,), np.int32), np.zeros((n,), np.int32)
        processors = [procs.LogitProcessors()] * n
        settings = [SamplingConfig()] * n
        keys = [row_keys(0, [0])[0]] * n
        for row, request in zip(at, requests):
            prompt[row, : len(request.prompt)] = request.prompt
            lens[row], max_new[row] = len(request.prompt), request.max_new_tokens
            processors[row], settings[row] = request.processors, request.sampling
            seed = request.seed if request.seed is not None else int(self.seeds.integers(2**31))
            keys[row] = row_keys(seed, [0])[0]
        # processor and sampling arrays always (neutral rows change no bit): one program whoever joins
        values = procs.batch_values(processors, n, self.generator.config.vocab_size, always=True,
                                    grammar_shape=self.grammar_shape)
        sampling = row_sampling(settings, n, always=True)
        return (jnp.asarray(prompt), jnp.asarray(lens), jnp.asarray(max_new), self.eos, jnp.stack(keys), values,
                sampling)

    def _prefill_whole(self, slots: list[int], requests: list[tuple[Hashable, SlotRequest]]) -> None:
        """One prefill of `requests` into `slots`: the first join builds the running state (every row, the requests
        at their slots); later ones prefill the joining rows alone, request j in row j, and scatter them in."""
        gen = self.generator
        n = len(self.held) if self.state is None else self.join_rows(len(requests))
        at = slots if self.state is None else range(len(requests))
        args = self._prefill_args([r for _, r in requests], n, at)
        if self.state is None:
            prefill, _ = gen.programs(args, self.capacity)  # the step of every slot compiled with it
        else:
            prefill = gen.prefill_program(args, self.capacity)
        start = time.perf_counter()
        self._place(prefill(*gen.program_params, *args), slots, requests, start, start)

    def _place(self, fresh: GenState, slots: list[int], requests: list[tuple[Hashable, SlotRequest]],
               joined_at: float, prefill_start: float) -> None:
        """A prefill's rows into the running state (rows j → slots[j]; the first prefill is the state), held."""
        n = fresh.num_generated.shape[0]
        if self.state is None:
            self.state = fresh
        else:
            where = np.full((n,), len(self.held), np.int32)  # row j of the prefill → its slot; padding: dropped
            where[: len(slots)] = slots
            with sharding.mesh_context(self.generator.mesh):
                self.state = self.join_program(self.state, fresh, jnp.asarray(where))
        jax.block_until_ready(self.state.num_generated)
        self.prefill_rows[n] += 1
        now = time.perf_counter()
        for slot, held in zip(slots, requests):
            self.held[slot] = held
            self.emitted[slot] = 0
            self.joined_at[slot], self.prefill_seconds[slot] = joined_at, now - prefill_start

    def _advance_chunked_join(self) -> None:
        """One chunk of the first chunked join; its last chunk is the prefill proper, which puts it in its slot."""
        p, gen, chunk = self.pending[0], self.generator, self.prefill_chunk
        if p.start == 0:
            p.began = time.perf_counter()
        if len(p.request.prompt) - p.start <= chunk:
            args = (*p.args, p.partial, jnp.int32(p.start))
            fresh = gen.prefill_program(args, self.capacity, chunk)(*gen.program_params, *args)
            self.pending.popleft()
            self._place(fresh, [p.slot], [(p.handle, p.request)], p.joined_at, p.began)
            return
        args = (p.args[0], p.partial, jnp.int32(p.start))
        p.partial = gen.chunk_program(args, self.capacity, chunk)(*gen.program_params, *args)
        p.start += chunk
        self.prefill_chunks += 1

    def join_rows(self, joining: int) -> int:
        """Rows of the prefill for `joining` requests joining a running state: the mesh's data axis (a batch splits
        over it; 1 without a mesh) times the next power of two that holds them, at most the slots, so that few
        programs serve every count."""
        data = self.generator.mesh.shape[DATA] if self.generator.mesh is not None else 1
        return bucket_rows(joining, len(self.held), data)

    def step_bucket(self, live: int) -> int:
        """Rows of the step that runs `live` running slots: `join_rows`'s buckets with `step_buckets`, else all."""
        return self.join_rows(live) if self.step_buckets else len(self.held)

    def warm_up(self, token: int = 0) -> float:
        """Compile the step at every bucket of rows (`step_bucket`), the shortest prompt bucket's prefill of every
        slot (the first join's) and of a lone request (the commonest join: requests arriving one at a time), its join
        into a running state and a cancel before any request comes (one-token prompts; nothing of them stays). Other
        row counts (`join_rows`) and longer prompt buckets compile their prefill when a first join needs them.
        Returns the seconds it took."""
        start = time.perf_counter()
        self.join([(_WARM_UP, SlotRequest((token,), 2))])
        if len(self.held) > 1:
            self.join([(_WARM_UP_2, SlotRequest((token,), 2))])
            self.cancel(_WARM_UP_2)
        for rows in sorted({self.step_bucket(n) for n in range(1, len(self.held) + 1)}):
            self._step_program(rows)  # compiled, not run
        while self.running:
            self.step()
        return time.perf_counter() - start

    def cancel(self, handle: Hashable) -> bool:
        """End a running request now (its client went away): its row is marked done, so the next steps skip it,
        and its slot is free (a chunked join not yet in its slot is dropped). False if no slot holds it."""
        for p in self.pending:
            if p.handle == handle:
                self.pending.remove(p)
                return True
        for slot, held in enumerate(self.held):
            if held is not None and held[0] == handle:
                with sharding.mesh_context(self.generator.mesh):
                    self.state = self.end_program(self.state, jnp.int32(slot))
                self.held[slot] = None
                return True
        return False

    def step(self) -> list[SlotUpdate]:
        """One chunk of a chunked join if one is under way, one compiled chunk of steps (`Generator.chunk_steps`)
        over the running slots (on their bucket of rows, `step_bucket`), then `collect`."""
        if self.pending:
            self._advance_chunked_join()
        busy = self.busy
        if self.state is not None and busy.any():
            live = np.flatnonzero(busy)
            rows = self.step_bucket(len(live))
            self.step_rows[rows] += 1
            program, params = self._step_program(rows), self.generator.program_params
            if rows == len(self.held):
                self.state = program(*params, self.state, self.eos)
            else:  # the live slots, then idle ones (finished rows: the steps leave them as they are) up to the bucket
                at = np.concatenate([live, np.flatnonzero(~busy)[: rows - len(live)]]).astype(np.int32)
                with sharding.mesh_context(self.generator.mesh):
                    self.state = program(*params, self.state, self.eos, jnp.asarray(at))
        return self.collect()

    def drafts_at(self, rows: int) -> bool:
        """Whether a step of `rows` rows drafts (`drafting_rows`)."""
        if self.generator.proposer is None:
            return False
        return self.drafting_rows is None or rows in self.drafting_rows

    def _step_program(self, rows: int):
        """The compiled step of a bucket of rows, drafting or not per `drafting_rows`: compiled once and held, so
        that a chunk of steps does not rebuild the program cache's key over the whole state."""
        if rows not in self.step_programs:
            gen = self.generator
            drafting = gen.proposer is None or self.drafts_at(rows)  # a target-only step has no drafting switch
            self.step_programs[rows] = gen.step_program(self.state, self.eos, None if rows == len(self.held) else rows,
                                                        drafting)
        return self.step_programs[rows]

    def collect(self) -> list[SlotUpdate]:
        """The tokens each request produced since the last collect, and the completions of the requests that have
        ended (their slots are free again)."""
        if self.state is None or not self.busy.any():
            return []
        st = self.state
        counts, done = sharding.to_host(st.num_generated), sharding.to_host(st.done)
        ending = done & self.busy
        fresh = counts > self.emitted
        tokens = sharding.to_host(st.tokens) if np.any(fresh) or np.any(ending) else None
        # [B, C, K] arrays: fetched only when a request that asked for them has new tokens
        wanted = np.asarray([held is not None and held[1].logprobs for held in self.held])
        logprobs = [sharding.to_host(x) for x in st.logprobs] if np.any(fresh & wanted) else None
        stats = self.generator.row_stats(st, len(self.held)) if np.any(ending) else None
        now = time.perf_counter()
        updates = []
        for slot, held in enumerate(self.held):
            if held is None:
                continue
            handle, request = held
            n, seen = int(counts[slot]), int(self.emitted[slot])
            new = tokens[slot, seen:n].tolist() if n > seen else []
            self.emitted[slot] = n
            completion = None
            if done[slot]:
                ids = tokens[slot, :n].tolist()
                completion = Completion(
                    ids, bool(ids) and ids[-1] in self.stop_ids, len(request.prompt), now - self.joined_at[slot],
                    float(self.prefill_seconds[slot]), len(self.held), stats[slot],
                )
                self.held[slot] = None
            if new or completion is not None:
                lps = row_logprobs(logprobs, slot, seen, new) if request.logprobs and logprobs is not None else None
                updates.append(SlotUpdate(handle, new, completion, lps))
        return updates

    @property
    def busy(self) -> np.ndarray:
        """[rows] bool: which slots hold a request."""
        return np.asarray([held is not None for held in self.held])


def bucket_rows(count: int, slots: int, data: int = 1) -> int:
    """The rows of a program for `count` rows among `slots`: the mesh's data axis times the next power of two that
    holds them, at most the slots (`SlotBatcher.join_rows`, `SlotBatcher.step_bucket`)."""
    n = data
    while n < count:
        n *= 2
    return min(n, slots)


def row_buckets(slots: int, data: int = 1) -> list[int]:
    """Every bucket of rows `bucket_rows` gives for 1..slots rows, smallest first."""
    return sorted({bucket_rows(n, slots, data) for n in range(1, slots + 1)})


@dataclasses.dataclass
class _PendingJoin:
    """A request whose long prompt joins chunk by chunk (`SlotBatcher.join`), its slot held for it."""

    handle: Hashable
    request: SlotRequest
    slot: int
    args: tuple  # its prefill's arguments (`SlotBatcher._prefill_args`: the request in row 0)
    partial: PartialPrefill | None = None  # the chunks run so far
    start: int = 0  # prompt positions run so far (whole chunks)
    joined_at: float = 0.0
    began: float = 0.0  # when its first chunk ran


def _join_rows(running: GenState, fresh: GenState, where: jax.Array) -> GenState:
    """The running state [B, ...] with row j of `fresh` (a prefill of n ≤ B rows) written into slot where[j] ([n];
    B or more: a padding row, dropped): every per-row array (batch first, the rows' PRNG keys included) scattered
    row by row, in place when `running` is donated."""
    rows, n = running.num_generated.shape[0], where.shape[0]

    def one(old, new):
        if old.ndim == 0:
            return old
        if old.shape[0] != rows or new.shape != (n, *old.shape[1:]):
            raise ValueError(f"a state array of shape {old.shape} cannot take rows of shape {new.shape}")
        return old.at[where].set(new, mode="drop")

    return constrain_state(jax.tree.map(one, running, fresh))


def _end_row(st: GenState, slot: jax.Array) -> GenState:
    """The state with row `slot` marked done (a cancelled request): the steps skip it from now on."""
    return constrain_state(st._replace(done=st.done.at[slot].set(True)))
