"""What the routes send back: OpenAI's response bodies, stream chunks and errors, text detokenized as it streams,
and token log-probabilities in OpenAI's shapes."""

from __future__ import annotations

import json
import time

from fastapi.responses import JSONResponse


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

    def format_prompt(self, prompt: list[int], scored: list) -> dict:
        """Completions' `logprobs` object of an echoed prompt: every prompt token, the first with no log-probability
        (nothing comes before it), the others with theirs (`scored`: `Generator.prompt_logprobs`). The completion's
        tokens follow it (`format`, `joined`)."""
        return self._completions_object([self._text(t) for t in prompt], [None, *scored])

    def format(self, logprobs: list) -> dict:
        """The OpenAI `logprobs` object of these tokens (`jaxspec.engine.slots.TokenLogprob`s), in order."""
        if self.chat:
            def entry(token, lp):
                text = self._text(token)
                return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}
            return {"content": [{**entry(t.token, t.logprob),
                                 "top_logprobs": [entry(i, lp) for i, lp in t.top[: self.top]]} for t in logprobs]}
        return self._completions_object([self._text(t.token) for t in logprobs], list(logprobs))

    def _completions_object(self, texts: list[str], logprobs: list) -> dict:
        """`{tokens, token_logprobs, top_logprobs, text_offset}` of tokens whose texts are `texts`; a None in
        `logprobs` is a token without one (a prompt's first). The offsets go on from the last call's."""
        offsets = []
        for text in texts:
            offsets.append(self.offset)
            self.offset += len(text)
        tops = [None if t is None else {self._text(i): lp for i, lp in t.top[: self.top]} for t in logprobs]
        return {"tokens": texts, "token_logprobs": [None if t is None else t.logprob for t in logprobs],
                "top_logprobs": tops if self.top else None, "text_offset": offsets}


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


def joined(first: dict | None, second: dict | None) -> dict | None:
    """Two completions `logprobs` objects one after the other (an echoed prompt's, then the completion's)."""
    if first is None or second is None:
        return first or second
    return {key: None if first[key] is None or second[key] is None else first[key] + second[key] for key in first}


def finish_reason(completion, tracker: TextTracker) -> str:
    if tracker.stopped or (completion is not None and completion.finished_by_eos):
        return "stop"
    return "length"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def response_body(rid: str, model: str, chat: bool, choices: list[dict], used: dict) -> dict:
    """A whole (not streamed) response; `choices` from `choice_body`, in index order."""
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": choices, "usage": used}


def choice_body(chat: bool, index: int, text: str, reason: str, logprobs: dict | None) -> dict:
    if chat:
        return {"index": index, "message": {"role": "assistant", "content": text}, "finish_reason": reason,
                "logprobs": logprobs}
    return {"index": index, "text": text, "finish_reason": reason, "logprobs": logprobs}


class ChunkWriter:
    """Server-sent events of one streamed response: each chunk names its choice (`index`)."""

    def __init__(self, rid: str, model: str, chat: bool):
        self.rid, self.model, self.chat = rid, model, chat
        self.created = int(time.time())
        self.obj = "chat.completion.chunk" if chat else "text_completion"

    def _event(self, choices: list[dict], **extra) -> str:
        body = {"id": self.rid, "object": self.obj, "created": self.created, "model": self.model,
                "choices": choices, **extra}
        return f"data: {json.dumps(body)}\n\n"

    def chunk(self, index: int, text: str | None, reason: str | None, first: bool = False,
              logprobs: dict | None = None) -> str:
        if self.chat:
            delta = {"role": "assistant", "content": text or ""} if first else ({"content": text} if text else {})
            choice = {"index": index, "delta": delta, "finish_reason": reason, "logprobs": logprobs}
        else:
            choice = {"index": index, "text": text or "", "finish_reason": reason, "logprobs": logprobs}
        return self._event([choice])

    def usage(self, used: dict) -> str:
        return self._event([], usage=used)

    @staticmethod
    def error(message: str) -> str:
        error = {"message": message, "type": "server_error", "param": None, "code": 500}
        return f"data: {json.dumps({'error': error})}\n\n"

    DONE = "data: [DONE]\n\n"
