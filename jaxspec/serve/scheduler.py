"""The server's engine thread: requests in, token updates out, over one `SlotBatcher`.

Why a thread: the engine's steps block (compiled programs), and the HTTP side is asyncio; one thread owns the device
state, so nothing in it is shared. Requests wait in a queue until a slot is free; each step's updates go back to
each request's own callback (the HTTP side's asyncio queue, `loop.call_soon_threadsafe`). A cancelled request (its
client went away, or a stop string ended it) leaves its queue or its slot before the next step.

A request that asks for its prompt's own log-probabilities (`SlotRequest.prompt_logprobs`: OpenAI's `echo` with
`logprobs`) is scored by one pass over its prompt when it leaves the queue, before it joins; one with a budget of 0
is scored only and never waits for a slot.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import queue
import threading
import time
import traceback
from collections.abc import Callable

from jaxspec.engine.generation import Completion
from jaxspec.engine.slots import SlotBatcher, SlotRequest, SlotUpdate

Sink = Callable[[SlotUpdate | BaseException], None]


@dataclasses.dataclass
class SchedulerStats:
    """Counters the /metrics endpoint reads (written by the engine thread only)."""

    steps: int = 0
    step_seconds: float = 0.0
    joins: int = 0
    completed: int = 0
    cancelled: int = 0
    generated_tokens: int = 0
    scored_prompts: int = 0  # prompts whose own log-probabilities were computed
    verify_calls: int = 0  # of completed speculative requests
    rejections: collections.Counter = dataclasses.field(default_factory=collections.Counter)


class Scheduler:
    """Owns a SlotBatcher in a daemon thread (module docstring). `submit` and `cancel` may be called from any
    thread."""

    def __init__(self, batcher: SlotBatcher):
        self.batcher = batcher
        self.stats = SchedulerStats()
        self._inbox: queue.Queue = queue.Queue()  # ("submit", handle, request, sink) | ("cancel", handle)
        self._waiting: collections.OrderedDict = collections.OrderedDict()  # handle → (request, sink)
        self._sinks: dict = {}  # handle → sink, of requests in slots
        self._ids = itertools.count()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="jaxspec-engine", daemon=True)
        self.error: BaseException | None = None  # what stopped the engine thread, if anything did

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._inbox.put(("wake",))
        self._thread.join(timeout=60)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def running(self) -> int:
        return self.batcher.running

    def submit(self, request: SlotRequest, sink: Sink) -> int:
        """Queue a request (checked first: a JaxspecError for one no slot can hold; EngineStopped once the engine
        thread has failed); returns its handle."""
        if self.error is not None:
            raise EngineStopped(f"the engine stopped: {self.error!r}")
        self.batcher.check(request)
        handle = next(self._ids)
        self._inbox.put(("submit", handle, request, sink))
        return handle

    def cancel(self, handle: int, stopped: bool = False) -> None:
        """End a request before its EOS or budget: its client went away, or (stopped) a stop string ended it."""
        self._inbox.put(("cancel", handle, stopped))

    def _drain(self, block: bool) -> None:
        while True:
            try:
                message = self._inbox.get(block=block, timeout=0.5 if block else None)
            except queue.Empty:
                return
            block = False
            if message[0] == "submit":
                _, handle, request, sink = message
                self._waiting[handle] = (request, sink)
                if request.max_new_tokens == 0:  # scored only: ahead of the requests that wait for a slot
                    self._waiting.move_to_end(handle, last=False)
            elif message[0] == "cancel":
                _, handle, stopped = message
                if self._waiting.pop(handle, None) is not None or self.batcher.cancel(handle):
                    if stopped:
                        self.stats.completed += 1
                    else:
                        self.stats.cancelled += 1
                self._sinks.pop(handle, None)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._drain(block=not self.batcher.running and not self._waiting)
                joining = []
                while self._waiting and (len(joining) < len(self.batcher.free_slots)
                                         or next(iter(self._waiting.values()))[0].max_new_tokens == 0):
                    handle, (request, sink) = self._waiting.popitem(last=False)
                    if request.prompt_logprobs is not None and not self._score(handle, request, sink):
                        continue  # scored only
                    self._sinks[handle] = sink
                    joining.append((handle, request))
                if joining:
                    self.batcher.join(joining)
                    self.stats.joins += len(joining)
                    self._deliver(self.batcher.collect())
                if self.batcher.running:
                    start = time.perf_counter()
                    updates = self.batcher.step()
                    self.stats.steps += 1
                    self.stats.step_seconds += time.perf_counter() - start
                    self._deliver(updates)
        except BaseException as e:  # noqa: BLE001 (every request is told, later ones are refused, /health says so)
            self.error = e
            traceback.print_exc()
            sinks = [*self._sinks.values(), *(s for _, s in self._waiting.values())]
            while True:  # requests queued but not yet seen
                try:
                    message = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if message[0] == "submit":
                    sinks.append(message[3])
            for sink in sinks:
                _tell(sink, e)

    def _score(self, handle: int, request: SlotRequest, sink: Sink) -> bool:
        """The prompt's own log-probabilities, as the request's first update; returns whether it goes on to join
        (False: a budget of 0, and this update ends it; or the scoring failed, and the request is told so)."""
        start = time.perf_counter()
        try:
            # at the server's most alternatives (the formatter keeps the request's): one compile per prompt bucket
            generator = self.batcher.generator
            top = request.prompt_logprobs if generator.logprobs is None else generator.logprobs
            scored = generator.prompt_logprobs(request.prompt, top)
        except Exception as e:  # noqa: BLE001 (this request's failure, told to it alone; the engine goes on)
            traceback.print_exc()
            _tell(sink, e)
            return False
        self.stats.scored_prompts += 1
        completion = None
        if request.max_new_tokens == 0:
            seconds = time.perf_counter() - start
            completion = Completion([], False, len(request.prompt), seconds, seconds, 1)
            self.stats.completed += 1
        _tell(sink, SlotUpdate(handle, [], completion, prompt_logprobs=scored))
        return completion is None

    def _deliver(self, updates: list[SlotUpdate]) -> None:
        for update in updates:
            self.stats.generated_tokens += len(update.new_tokens)
            if update.completion is not None:
                self.stats.completed += 1
                stats = update.completion.stats
                self.stats.verify_calls += stats.get("verify_calls", 0)
                self.stats.rejections.update(stats.get("rejections", {}))
                sink = self._sinks.pop(update.handle, None)
            else:
                sink = self._sinks.get(update.handle)
            if sink is not None:
                _tell(sink, update)


def _tell(sink: Sink, what) -> None:
    """Hand an update to a request's sink; a sink that fails (its event loop closed at shutdown) fails alone."""
    try:
        sink(what)
    except Exception:  # noqa: BLE001
        pass


class EngineStopped(Exception):
    """The engine thread has failed: new requests are refused (503)."""
