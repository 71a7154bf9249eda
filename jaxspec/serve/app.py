"""The HTTP side: an OpenAI-compatible FastAPI app over the engine thread (`Scheduler`).

Routes: /v1/completions, /v1/chat/completions (streamed as server-sent events with `stream: true`), /v1/models,
/health, /metrics (Prometheus). Errors are OpenAI's JSON shape, `{"error": {"message", "type", "param", "code"}}`,
with 4xx codes for what the client sent; the server keeps serving after any of them.

Text: each update's tokens are detokenized as a whole sequence and the new suffix sent, held back while it ends in
an incomplete character or could be the start of a stop string, so streamed text concatenates to the final text.
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from jaxspec.engine.slots import SlotRequest, SlotUpdate
from jaxspec.errors import JaxspecError
from jaxspec.serve.protocol import ChatCompletionRequest, CompletionRequest
from jaxspec.serve.responses import (
    ChunkWriter,
    LogprobFormatter,
    TextTracker,
    choice_body,
    error_body,
    finish_reason,
    joined,
    response_body,
    usage,
)
from jaxspec.serve.scheduler import EngineStopped, Scheduler

DISCONNECT_POLL_SECONDS = 0.5  # how often a waiting non-streamed request checks that its client is still there


class ServedModel:
    """What the routes need: the engine thread, the tokenizer, the model's name, the default sampling settings
    (for what a request leaves out) and default budget."""

    def __init__(self, scheduler: Scheduler, tokenizer, name: str, sampling, default_max_tokens: int, vocab: int,
                 grammars=None, max_logprobs: int | None = None):
        self.scheduler, self.tokenizer, self.name = scheduler, tokenizer, name
        self.sampling, self.default_max_tokens = sampling, default_max_tokens
        self.vocab = vocab  # the target's (token ids and logit_bias keys are checked against it)
        self.grammars = grammars  # a jaxspec.grammar.GrammarCompiler; None: no structured output
        self.max_logprobs = max_logprobs  # alternatives per token the engine keeps (None: no logprobs)

    def check_logprobs(self, wanted: int | None) -> None:
        if wanted is None:
            return
        if self.max_logprobs is None:
            raise JaxspecError("logprobs are off on this server (start it with --max-logprobs N)")
        if wanted > self.max_logprobs:
            raise JaxspecError(f"this server returns at most {self.max_logprobs} top logprobs per token "
                               f"(--max-logprobs), got {wanted}")


def make_app(served: ServedModel) -> FastAPI:
    app = FastAPI(title="jaxspec", docs_url=None, redoc_url=None)
    scheduler = served.scheduler
    registry = CollectorRegistry()
    requests_total = Counter("jaxspec_requests", "HTTP requests by route and status", ["route", "status"],
                             registry=registry)
    prompt_tokens = Counter("jaxspec_prompt_tokens", "prompt tokens of accepted requests", registry=registry)
    in_flight = Gauge("jaxspec_requests_in_flight", "requests being answered", registry=registry)
    registry.register(_EngineCollector(scheduler))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        requests_total.labels(request.url.path, str(exc.status_code)).inc()
        return error_body(str(exc.detail), exc.status_code)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        kind = first.get("type", "")
        message = ("the body is not valid JSON" if kind == "json_invalid"
                   else f"unknown field {where!r}" if kind == "extra_forbidden"
                   else f"{where}: {first.get('msg', 'invalid')}")
        requests_total.labels(request.url.path, "400").inc()
        return error_body(message, 400, where or None)

    @app.get("/health")
    async def health():
        if not scheduler.alive:
            return error_body(f"the engine stopped: {scheduler.error!r}", 503)
        return {"status": "ok", "running": scheduler.running, "waiting": scheduler.waiting}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": served.name, "object": "model", "created": 0,
                                            "owned_by": "jaxspec"}]}

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    async def answer(http: Request, route: str, body, prompts: list[list[int]], budget: int | None, chat: bool,
                     echoes: list[str] | None = None):
        """One request's choices (`n` per prompt, in OpenAI's order: prompt by prompt), each its own engine
        request, answered whole or streamed."""
        if body.model is not None and body.model != served.name:
            requests_total.labels(route, "404").inc()
            return error_body(f"the model {body.model!r} does not exist; this server serves {served.name!r}", 404,
                              "model")
        handles: list[int] = []
        try:
            body.check_unsupported()
            sampling = body.sampling(served.sampling)
            stops = body.stop_strings()
            if not all(0 <= i < served.vocab for ids in prompts for i in ids):
                raise JaxspecError(f"prompt token ids must be in [0, {served.vocab})")
            if budget is None:  # the server's default, within the room the prompt leaves (as vLLM)
                budget = max(1, min(served.default_max_tokens, scheduler.batcher.room - max(map(len, prompts))))
            processors = body.processors(served.vocab)
            wanted = body.logprob_count()
            served.check_logprobs(wanted)
            scored = wanted if echoes is not None and wanted is not None else None  # the prompt's own logprobs
            grammar = body.grammar()
            if grammar is not None:
                if served.grammars is None:
                    raise JaxspecError("structured output is off on this server (--max-grammar-states 0)")
                # compiled off the event loop (seconds for a JSON schema; cached per grammar)
                automaton = await asyncio.get_running_loop().run_in_executor(None, served.grammars, grammar)
                processors = dataclasses.replace(processors, grammar=automaton)
            # choice i * n + j: prompt i's j-th sample (seed + j: a seeded request's samples differ and repeat)
            requests = [SlotRequest(tuple(ids), budget, processors, sampling,
                                    None if body.seed is None else body.seed + j, wanted is not None, scored)
                        for ids in prompts for j in range(body.n)]
            for request in requests:  # every choice fits before any is queued
                scheduler.batcher.check(request)
            loop = asyncio.get_running_loop()
            updates: asyncio.Queue = asyncio.Queue()
            for index, request in enumerate(requests):
                handles.append(scheduler.submit(
                    request, lambda u, index=index: loop.call_soon_threadsafe(updates.put_nowait, (index, u))))
        except EngineStopped as e:
            for handle in handles:
                scheduler.cancel(handle)
            requests_total.labels(route, "503").inc()
            return error_body(str(e), 503)
        except JaxspecError as e:
            requests_total.labels(route, "400").inc()
            return error_body(str(e), 400)
        prompt_tokens.inc(sum(map(len, prompts)))
        requests_total.labels(route, "200").inc()
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        choices = [
            Choice(index, handle, list(prompts[index // body.n]), TextTracker(served.tokenizer, stops),
                   None if wanted is None else LogprobFormatter(served.tokenizer, wanted, chat),
                   "" if echoes is None else echoes[index // body.n])
            for index, handle in enumerate(handles)
        ]
        used = lambda: usage(sum(map(len, prompts)), sum(c.tracker.tokens_used() for c in choices))  # noqa: E731
        if body.stream:
            events = _stream(served, scheduler, choices, updates, ChunkWriter(rid, served.name, chat),
                             body.include_usage, used, in_flight)
            # after the response, whichever way it ended: a client that left before the stream's first chunk never
            # ran the stream's own clean-up (a generator that never started); a request already ended is no-op
            return StreamingResponse(events, media_type="text/event-stream",
                                     background=BackgroundTask(_cancel_all, scheduler, choices))
        in_flight.inc()
        try:
            while not all(c.ended for c in choices):
                try:  # a client that goes away cancels its request (the server does not notice that by itself)
                    index, update = await asyncio.wait_for(updates.get(), timeout=DISCONNECT_POLL_SECONDS)
                except TimeoutError:
                    if await http.is_disconnected():
                        _cancel_all(scheduler, choices)
                        return Response(status_code=499)
                    continue
                if isinstance(update, BaseException):
                    _cancel_all(scheduler, choices)
                    return error_body(f"the engine failed: {update!r}", 500)
                if not choices[index].ended:  # (an update may cross the cancel of a choice a stop string ended)
                    choices[index].take(update, scheduler)
            return response_body(rid, served.name, chat, [c.body(chat) for c in choices], used())
        except asyncio.CancelledError:
            _cancel_all(scheduler, choices)
            raise
        finally:
            in_flight.dec()

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http: Request):
        try:
            texts, prompts = body.prompts(served.tokenizer)
        except JaxspecError as e:
            requests_total.labels("/v1/completions", "400").inc()
            return error_body(str(e), 400, "prompt")
        # echo: the completion's text begins with the prompt (token ids: their decoded text)
        echoes = [text if text is not None else served.tokenizer.decode(ids) for text, ids in zip(texts, prompts)] \
            if body.echo else None
        return await answer(http, "/v1/completions", body, prompts, body.budget, chat=False, echoes=echoes)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, http: Request):
        if not getattr(served.tokenizer, "chat_template", None):
            return error_body("this model's tokenizer has no chat template; use /v1/completions", 400)
        messages = [{"role": m.role, "content": m.text} for m in body.messages]
        try:
            text = served.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as e:  # noqa: BLE001 (a template's own raise_exception: e.g. roles out of order)
            return error_body(f"the chat template refused these messages: {e}", 400, "messages")
        ids = served.tokenizer(text, add_special_tokens=False).input_ids
        return await answer(http, "/v1/chat/completions", body, [ids], body.budget, chat=True)

    return app


@dataclasses.dataclass
class Choice:
    """One choice of a response: its engine request (`handle`), its text so far (`tracker`), its token
    log-probabilities (`logprobs`: None when not asked for) and, for completions' `echo`, the prompt's text and,
    with logprobs, the prompt's own (the request's first update)."""

    index: int
    handle: int
    prompt: list[int]
    tracker: TextTracker
    logprobs: LogprobFormatter | None
    echo: str = ""
    kept: list = dataclasses.field(default_factory=list)  # the completion's TokenLogprobs so far
    prompt_logprobs: dict | None = None  # the echoed prompt's logprobs object (`LogprobFormatter.format_prompt`)
    completion: object = None
    ended: bool = False
    sent_logprobs: int = 0  # streaming: tokens whose logprobs have been sent

    def take(self, update: SlotUpdate, scheduler: Scheduler) -> str:
        """Fold one update in; returns the text that can be sent now. A stop string ends the request (cancelled
        in the engine: its slot is freed before the next step)."""
        if update.prompt_logprobs is not None and self.logprobs is not None:
            self.prompt_logprobs = self.logprobs.format_prompt(self.prompt, update.prompt_logprobs)
        self.kept += update.logprobs or []
        self.completion = update.completion
        text = self.tracker.advance(update.new_tokens, final=update.completion is not None)
        if self.tracker.stopped and not self.ended:
            scheduler.cancel(self.handle, stopped=True)
            text += self.tracker.advance([], final=True)
        self.ended = self.ended or self.tracker.stopped or update.completion is not None
        return text

    def fresh_logprobs(self) -> dict | None:
        """Streaming: the logprobs of the tokens taken since the last call (up to a stop string's last token)."""
        if self.logprobs is None:
            return None
        end = self.tracker.tokens_used() if self.tracker.stopped else len(self.tracker.ids)
        fresh = self.kept[self.sent_logprobs : max(self.sent_logprobs, end)]
        self.sent_logprobs += len(fresh)
        return self.logprobs.format(fresh) if fresh else None

    @property
    def reason(self) -> str:
        return finish_reason(self.completion, self.tracker)

    def body(self, chat: bool) -> dict:
        lps = None
        if self.logprobs is not None:
            lps = joined(self.prompt_logprobs, self.logprobs.format(self.kept[: self.tracker.tokens_used()]))
        return choice_body(chat, self.index, self.echo + self.tracker.text(), self.reason, lps)


def _cancel_all(scheduler: Scheduler, choices: list[Choice]) -> None:
    for choice in choices:
        if not choice.ended:
            scheduler.cancel(choice.handle)


async def _stream(served, scheduler, choices: list[Choice], updates, writer: ChunkWriter, include_usage: bool, used,
                  in_flight):
    """Server-sent events: per choice, a first chunk (chat: the role; completions' echo: the prompt, with its
    logprobs when asked), one chunk per update with new text or new tokens' logprobs, and one with the finish
    reason; then the usage when asked, and [DONE]. A chunk's logprobs are its update's tokens' (up to a stop
    string's last token), whose text may come in a later chunk while it could still be part of a stop string. A
    client that goes away cancels the requests (their slots are freed before the next step)."""
    chat = writer.chat
    in_flight.inc()
    finished = False
    try:
        for c in choices:
            if chat:
                yield writer.chunk(c.index, "", None, first=True)
            elif c.echo and c.logprobs is None:
                yield writer.chunk(c.index, c.echo, None)
        while not all(c.ended for c in choices):
            index, update = await updates.get()
            if isinstance(update, BaseException):
                yield writer.error(f"the engine failed: {update!r}")
                return
            c = choices[index]
            if c.ended:  # an update that crossed the cancel of a stop string
                continue
            text = c.take(update, scheduler)
            if update.prompt_logprobs is not None and c.prompt_logprobs is not None:  # echo with logprobs
                yield writer.chunk(c.index, c.echo, None, logprobs=c.prompt_logprobs)
            lps = c.fresh_logprobs()
            if text or lps:
                yield writer.chunk(c.index, text, None, logprobs=lps)
            if c.ended:
                yield writer.chunk(c.index, None, c.reason)
        finished = True
        if include_usage:
            yield writer.usage(used())
        yield writer.DONE
    finally:
        in_flight.dec()
        if not finished:  # the client went away mid-stream
            _cancel_all(scheduler, choices)


class _EngineCollector:
    """The engine thread's counters as Prometheus metrics, read when scraped."""

    def __init__(self, scheduler: Scheduler):
        self.scheduler = scheduler

    def collect(self):
        s, st = self.scheduler, self.scheduler.stats
        yield GaugeMetricFamily("jaxspec_slots_running", "requests in engine slots", value=s.running)
        yield GaugeMetricFamily("jaxspec_requests_waiting", "requests waiting for a slot", value=s.waiting)
        yield CounterMetricFamily("jaxspec_engine_steps", "compiled step chunks run", value=st.steps)
        yield CounterMetricFamily("jaxspec_engine_step_seconds", "wall time in step chunks", value=st.step_seconds)
        yield CounterMetricFamily("jaxspec_generated_tokens", "tokens generated", value=st.generated_tokens)
        yield CounterMetricFamily("jaxspec_requests_completed", "requests that ended", value=st.completed)
        yield CounterMetricFamily("jaxspec_requests_cancelled", "requests cancelled", value=st.cancelled)
        yield CounterMetricFamily("jaxspec_verify_calls", "target verify steps of completed requests",
                                  value=st.verify_calls)
        rejections = CounterMetricFamily("jaxspec_verify_outcomes", "why verify steps stopped accepting",
                                         labels=["outcome"])
        for outcome, count in sorted(st.rejections.items()):
            rejections.add_metric([outcome], count)
        yield rejections
        batcher = s.batcher
        chunks = CounterMetricFamily("jaxspec_engine_step_chunks_by_rows", "step chunks by the rows they ran on (the "
                                     "live requests' bucket) and whether they drafted", labels=["rows", "drafting"])
        for rows, count in sorted(list(batcher.step_rows.items())):
            chunks.add_metric([str(rows), str(batcher.drafts_at(rows)).lower()], count)
        yield chunks
