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
import json
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from jaxspec.engine.slots import SlotRequest
from jaxspec.errors import JaxspecError
from jaxspec.serve.protocol import ChatCompletionRequest, CompletionRequest
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


class LogprobFormatter:
    """A request's token log-probabilities in OpenAI's two shapes: completions' `{tokens, token_logprobs,
    top_logprobs, text_offset}` and chat's `{content: [{token, logprob, bytes, top_logprobs}]}`. A token's text
    is its own decode (a piece of a character split across tokens reads as U+FFFD, as in vLLM)."""

    def __init__(self, tokenizer, top: int, chat: bool):
        self.tokenizer, self.top, self.chat = tokenizer, top, chat
        self.offset = 0  # completions: the next token's character offset in the completion
        self.texts: dict[int, str] = {}  # each token's text, decoded once (alternatives repeat)

    def _text(self, token: int) -> str:
        if token not in self.texts:
            self.texts[token] = self.tokenizer.decode([token], skip_special_tokens=False,
                                                      clean_up_tokenization_spaces=False)
        return self.texts[token]

    def format(self, logprobs: list) -> dict:
        """The OpenAI `logprobs` object of these tokens (`jaxspec.engine.slots.TokenLogprob`s), in order."""
        if self.chat:
            def entry(token, lp):
                text = self._text(token)
                return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}
            return {"content": [{**entry(t.token, t.logprob),
                                 "top_logprobs": [entry(i, lp) for i, lp in t.top[: self.top]]} for t in logprobs]}
        texts = [self._text(t.token) for t in logprobs]
        offsets = []
        for text in texts:
            offsets.append(self.offset)
            self.offset += len(text)
        return {"tokens": texts, "token_logprobs": [t.logprob for t in logprobs],
                "top_logprobs": [{self._text(i): lp for i, lp in t.top[: self.top]} for t in logprobs]
                if self.top else None, "text_offset": offsets}


def error_body(message: str, status: int, param: str | None = None) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    code = {404: "not_found", 503: "engine_stopped"}.get(status)
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}},
                        status_code=status)


class TextTracker:
    """A request's text so far from its tokens, cut at the first stop string; `advance` returns the part of the
    text that can be sent now.

    Decoded incrementally, as vLLM does: the text of ids[:read] is kept, and new tokens are decoded in a window that
    starts a few tokens back (at `prefix`), minus that window's own text, so each update costs the window, not the
    whole answer (re-decoding everything made a long stream O(n^2)). A piece is taken in only once it ends on a
    whole character; what follows is decoded on demand. The concatenation is `decode(ids)` for the tokenizers
    served (byte-level BPE, SentencePiece: a window's leading-space rule applies to both of its decodes alike)."""

    def __init__(self, tokenizer, stops: tuple[str, ...]):
        self.tokenizer, self.stops = tokenizer, stops
        self.ids: list[int] = []
        self.decoded = ""  # the text of ids[:read]
        self.prefix = self.read = 0  # ids[prefix:read]: the context the next tokens are decoded after
        self.sent = 0  # characters of the text sent so far
        self.stopped = False  # a stop string was found

    def _decode(self, ids: list[int]) -> str:
        # no clean-up of spaces before punctuation: it could rewrite text already streamed
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def _pending(self) -> str:
        """The text of ids[read:], decoded after its context."""
        if self.read == len(self.ids):
            return ""
        before = self._decode(self.ids[self.prefix : self.read])
        return self._decode(self.ids[self.prefix :])[len(before) :]

    def text(self) -> str:
        text = self.decoded + self._pending()
        cuts = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if cuts:
            self.stopped = True
            return text[: min(cuts)]
        return text

    def tokens_used(self) -> int:
        """The answer's completion tokens: all of them, or, where a stop string cut the text, those up to the one
        that completed it (as vLLM counts; the engine may have produced a few more in the same chunk of steps)."""
        if not self.stopped:
            return len(self.ids)
        low, high = 1, len(self.ids)  # the shortest prefix whose text holds a stop string: a prefix's text grows
        while low < high:
            mid = (low + high) // 2
            text = self._decode(self.ids[:mid])
            if any(stop in text for stop in self.stops):
                high = mid
            else:
                low = mid + 1
        return low

    def advance(self, new_ids: list[int], final: bool) -> str:
        self.ids += new_ids
        piece = self._pending()
        if piece and not piece.endswith("\ufffd"):  # whole characters: the window moves on
            self.decoded += piece
            self.prefix, self.read = self.read, len(self.ids)
        text = self.text()
        end = len(text)
        if not final and not self.stopped:
            if text.endswith("\ufffd"):  # a character split across tokens: wait for the rest
                end = text.rstrip("\ufffd").__len__()
            for s in self.stops:  # a suffix that could grow into a stop string stays back
                for k in range(min(len(s) - 1, end), 0, -1):
                    if text[:end].endswith(s[:k]):
                        end -= k
                        break
        out = text[self.sent : max(end, self.sent)]
        self.sent = max(end, self.sent)
        return out


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

    async def answer(http: Request, route: str, body, prompt_ids: list[int], budget: int | None, chat: bool,
                     echo: str = ""):
        if body.model is not None and body.model != served.name:
            requests_total.labels(route, "404").inc()
            return error_body(f"the model {body.model!r} does not exist; this server serves {served.name!r}", 404,
                              "model")
        try:
            body.check_unsupported()
            sampling = body.sampling(served.sampling)
            stops = body.stop_strings()
            if not all(0 <= i < served.vocab for i in prompt_ids):
                raise JaxspecError(f"prompt token ids must be in [0, {served.vocab})")
            if budget is None:  # the server's default, within the room the prompt leaves (as vLLM)
                budget = max(1, min(served.default_max_tokens, scheduler.batcher.room - len(prompt_ids)))
            processors = body.processors(served.vocab)
            wanted = body.logprob_count()
            served.check_logprobs(wanted)
            grammar = body.grammar()
            if grammar is not None:
                if served.grammars is None:
                    raise JaxspecError("structured output is off on this server (--max-grammar-states 0)")
                # compiled off the event loop (seconds for a JSON schema; cached per grammar)
                automaton = await asyncio.get_running_loop().run_in_executor(None, served.grammars, grammar)
                processors = dataclasses.replace(processors, grammar=automaton)
            request = SlotRequest(tuple(prompt_ids), budget, processors, sampling, body.seed, wanted is not None)
            loop = asyncio.get_running_loop()
            updates: asyncio.Queue = asyncio.Queue()
            handle = scheduler.submit(request, lambda u: loop.call_soon_threadsafe(updates.put_nowait, u))
        except EngineStopped as e:
            requests_total.labels(route, "503").inc()
            return error_body(str(e), 503)
        except JaxspecError as e:
            requests_total.labels(route, "400").inc()
            return error_body(str(e), 400)
        prompt_tokens.inc(len(prompt_ids))
        requests_total.labels(route, "200").inc()
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        tracker = TextTracker(served.tokenizer, stops)
        logprobs = None if wanted is None else LogprobFormatter(served.tokenizer, wanted, chat)
        if body.stream:
            events = _stream(served, scheduler, handle, updates, tracker, rid, chat, body.include_usage,
                             len(prompt_ids), in_flight, logprobs, echo)
            # after the response, whichever way it ended: a client that left before the stream's first chunk never
            # ran the stream's own clean-up (a generator that never started); a request already ended is no-op
            return StreamingResponse(events, media_type="text/event-stream",
                                     background=BackgroundTask(scheduler.cancel, handle))
        in_flight.inc()
        try:
            completion, kept = None, []
            while completion is None:
                try:  # a client that goes away cancels its request (the server does not notice that by itself)
                    update = await asyncio.wait_for(updates.get(), timeout=DISCONNECT_POLL_SECONDS)
                except TimeoutError:
                    if await http.is_disconnected():
                        scheduler.cancel(handle)
                        return Response(status_code=499)
                    continue
                if isinstance(update, BaseException):
                    return error_body(f"the engine failed: {update!r}", 500)
                kept += update.logprobs or []
                tracker.advance(update.new_tokens, final=False)
                if tracker.stopped:
                    scheduler.cancel(handle, stopped=True)
                    break
                completion = update.completion
            text = tracker.text()
            reason = _finish_reason(completion, tracker)
            n = tracker.tokens_used()
            lps = None if logprobs is None else logprobs.format(kept[:n])
            return _response(rid, served.name, chat, echo + text, reason, len(prompt_ids), n, lps)
        except asyncio.CancelledError:
            scheduler.cancel(handle)
            raise
        finally:
            in_flight.dec()

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http: Request):
        ids = body.prompt if isinstance(body.prompt, list) else served.tokenizer(body.prompt).input_ids
        # echo: the completion's text begins with the prompt (token ids: their decoded text)
        echo = "" if not body.echo else body.prompt if isinstance(body.prompt, str) else served.tokenizer.decode(ids)
        return await answer(http, "/v1/completions", body, list(ids), body.max_tokens or 16, chat=False, echo=echo)

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
        return await answer(http, "/v1/chat/completions", body, ids, body.budget, chat=True)

    return app


def _finish_reason(completion, tracker: TextTracker) -> str:
    if tracker.stopped or (completion is not None and completion.finished_by_eos):
        return "stop"
    return "length"


def _response(rid, model, chat, text, reason, prompt_n, completion_n, logprobs=None) -> dict:
    usage = {"prompt_tokens": prompt_n, "completion_tokens": completion_n, "total_tokens": prompt_n + completion_n}
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": reason,
                  "logprobs": logprobs}
        return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
                "choices": [choice], "usage": usage}
    choice = {"index": 0, "text": text, "finish_reason": reason, "logprobs": logprobs}
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [choice], "usage": usage}


async def _stream(served, scheduler, handle, updates, tracker, rid, chat, include_usage, prompt_n, in_flight,
                  logprobs=None, echo: str = ""):
    """Server-sent events: one chunk per update with new text (or new tokens' logprobs), the last with the finish
    reason, then [DONE]; with `echo` (a completion's prompt) a first chunk carries it. A chunk's logprobs are its
    update's tokens' (up to a stop string's last token), whose text may come in a later chunk while it could still
    be part of a stop string. A client that goes away cancels the request (its slot is freed before the next
    step)."""
    created = int(time.time())
    obj = "chat.completion.chunk" if chat else "text_completion"
    sent_logprobs = 0  # tokens whose logprobs have been sent

    def chunk(text: str | None, reason: str | None, first: bool = False, lps: dict | None = None) -> str:
        if chat:
            delta = {"role": "assistant", "content": text or ""} if first else ({"content": text} if text else {})
            choice = {"index": 0, "delta": delta, "finish_reason": reason, "logprobs": lps}
        else:
            choice = {"index": 0, "text": text or "", "finish_reason": reason, "logprobs": lps}
        body = {"id": rid, "object": obj, "created": created, "model": served.name, "choices": [choice]}
        return f"data: {json.dumps(body)}\n\n"

    in_flight.inc()
    finished = False
    try:
        if chat:
            yield chunk("", None, first=True)
        if echo:
            yield chunk(echo, None)
        completion = None
        while completion is None:
            update = await updates.get()
            if isinstance(update, BaseException):
                error = {"error": {"message": f"the engine failed: {update!r}", "type": "server_error",
                                   "param": None, "code": 500}}
                yield f"data: {json.dumps(error)}\n\n"
                return
            completion = update.completion
            text = tracker.advance(update.new_tokens, final=completion is not None)
            if tracker.stopped:
                scheduler.cancel(handle, stopped=True)
                text += tracker.advance([], final=True)
            lps = None
            if logprobs is not None and update.logprobs:
                end = tracker.tokens_used() if tracker.stopped else len(tracker.ids)
                fresh = update.logprobs[: max(0, end - sent_logprobs)]
                sent_logprobs += len(fresh)
                lps = logprobs.format(fresh) if fresh else None
            if text or lps:
                yield chunk(text, None, lps=lps)
            if tracker.stopped:
                break
        finished = True
        yield chunk(None, _finish_reason(completion, tracker))
        if include_usage:
            n = tracker.tokens_used()
            usage = {"prompt_tokens": prompt_n, "completion_tokens": n, "total_tokens": prompt_n + n}
            yield f"data: {json.dumps({'id': rid, 'object': obj, 'created': created, 'model': served.name, 'choices': [], 'usage': usage})}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        in_flight.dec()
        if not finished:  # the client went away mid-stream
            scheduler.cancel(handle)


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
