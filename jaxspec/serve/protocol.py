"""The OpenAI request bodies the server accepts (pydantic), checked into what the engine runs.

Unknown fields are refused (`extra="forbid"`), so a misspelled parameter is a 400 naming it, never silently ignored.
Fields OpenAI defines that this server cannot honour yet (best_of, suffix) are refused with a message saying so.
A completions request may carry several prompts (strings or token-id lists), and any request `n` choices per
prompt: each choice is its own engine request. Structured output comes as OpenAI's `response_format` (json_schema,
json_object) or vLLM's `structured_outputs` (regex, choice, json), on both routes. Sampling settings and seeds are
per request; what a request leaves out is the server's default (`python -m jaxspec.serve --temperature/--top-p/
--top-k`).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from jaxspec.errors import JaxspecError
from jaxspec.grammar import Grammar
from jaxspec.processors import LogitProcessors
from jaxspec.sampling import SamplingConfig

MAX_STOP_STRINGS = 4  # as OpenAI
MAX_CHOICES = 128  # OpenAI's limit on n


class _Common(BaseModel):
    """Fields completions and chat share."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # vLLM/SGLang's extension
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0)  # vLLM/SGLang's extension
    logit_bias: dict[str, float] | None = None
    n: int = Field(1, ge=1, le=MAX_CHOICES)  # choices per prompt
    stream: bool = False
    stream_options: dict | None = None  # {"include_usage": true}
    user: str | None = None
    response_format: dict | None = None  # OpenAI's: {"type": "text" | "json_object" | "json_schema", ...}
    structured_outputs: dict | None = None  # vLLM's: {"regex": ...} | {"choice": [...]} | {"json": schema}

    def check_unsupported(self) -> None:
        """A one-line error for a field this server cannot honour yet (the routes' own)."""

    def grammar(self) -> Grammar | None:
        """The request's structured output, or None for free text."""
        kind = (self.response_format or {}).get("type", "text")
        if self.structured_outputs and kind != "text":
            raise JaxspecError("give response_format or structured_outputs, not both")
        if kind == "json_object":
            return Grammar.json_schema({"type": "object"})
        if kind == "json_schema":
            spec = (self.response_format or {}).get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
                raise JaxspecError('response_format json_schema needs {"json_schema": {"name": ..., "schema": {...}}}')
            return Grammar.json_schema(spec["schema"])
        if kind != "text":
            raise JaxspecError(f"response_format type {kind!r} is not one of text, json_object, json_schema")
        if not self.structured_outputs:
            return None
        if len(self.structured_outputs) != 1:
            raise JaxspecError("structured_outputs takes one of regex, choice, json, got "
                               f"{sorted(self.structured_outputs)}")
        (key, value), = self.structured_outputs.items()
        if key == "regex" and isinstance(value, str):
            return Grammar("regex", value)
        if key == "choice" and isinstance(value, list):
            return Grammar.choice(value)
        if key == "json" and isinstance(value, (dict, str)):
            return Grammar.json_schema(value)
        raise JaxspecError(f"structured_outputs: {key!r} is not one of regex (a string), choice (a list of strings), "
                           "json (a schema)")

    def stop_strings(self) -> tuple[str, ...]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOP_STRINGS or not all(stops):
            raise JaxspecError(f"stop takes up to {MAX_STOP_STRINGS} non-empty strings, got {stops!r}")
        return tuple(stops)

    def processors(self, vocab: int) -> LogitProcessors:
        bias = []
        for token, value in (self.logit_bias or {}).items():
            if not token.lstrip("-").isdigit() or not 0 <= int(token) < vocab:
                raise JaxspecError(f"logit_bias keys are token ids in [0, {vocab}), got {token!r}")
            if not -100 <= value <= 100:
                raise JaxspecError(f"logit_bias values are in [-100, 100], got {value} for token {token}")
            bias.append((int(token), float(value)))
        return LogitProcessors(
            repetition_penalty=self.repetition_penalty, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, min_p=self.min_p, logit_bias=tuple(sorted(bias)),
        )

    def sampling(self, default: SamplingConfig) -> SamplingConfig:
        """The request's settings, each one it leaves out taken from the server's `default`; top_k -1 is off, as
        in vLLM. Out-of-range values are a one-line error (a 400)."""
        if self.top_k is not None and self.top_k < -1:
            raise JaxspecError(f"top_k must be >= 1, or 0 or -1 for off; got {self.top_k}")
        return SamplingConfig(
            default.temperature if self.temperature is None else self.temperature,
            default.top_k if self.top_k is None else max(self.top_k, 0),
            default.top_p if self.top_p is None else self.top_p,
        )

    @property
    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


class CompletionRequest(_Common):
    """POST /v1/completions: a prompt as text or token ids, or a list of either (one choice each, `n` with n > 1),
    fed as is (no chat template). `echo` with `logprobs` gives the prompt's own tokens' logprobs before the
    completion's (the first token has none), as lm-evaluation-harness's loglikelihood tasks read them; with
    `max_tokens: 0` the prompt is scored only."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)  # OpenAI's default for completions; 0: score the prompt (echo)
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    def check_unsupported(self) -> None:
        if self.best_of not in (None, 1):
            raise JaxspecError("best_of is not supported by this server yet")
        if self.suffix:
            raise JaxspecError("suffix is not supported by this server yet")
        if self.max_tokens == 0 and not (self.echo and self.logprobs is not None):
            raise JaxspecError("max_tokens 0 scores the prompt alone: give echo: true and logprobs too, or ask for "
                               "at least one token")

    @property
    def budget(self) -> int:
        return 16 if self.max_tokens is None else self.max_tokens

    def prompts(self, tokenizer) -> tuple[list[str | None], list[list[int]]]:
        """(each prompt's text, None for token ids; each prompt's token ids): one prompt or a list of them."""
        prompt = self.prompt
        many = isinstance(prompt, list) and bool(prompt) and not isinstance(prompt[0], int)
        items = list(prompt) if many else [prompt]  # [] is one empty prompt: refused as empty
        texts = [p if isinstance(p, str) else None for p in items]
        return texts, [tokenizer(p).input_ids if isinstance(p, str) else list(p) for p in items]

    def logprob_count(self) -> int | None:
        """Alternatives per token the request wants with each token's log-probability; None: no logprobs."""
        if self.logprobs is not None and self.logprobs < 0:
            raise JaxspecError(f"logprobs must be >= 0, got {self.logprobs}")
        return self.logprobs


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[TextPart]  # a string, or text parts (joined); images and audio are not read
    name: str | None = None

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatCompletionRequest(_Common):
    """POST /v1/chat/completions: messages rendered with the tokenizer's chat template, the assistant turn open."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = None

    def logprob_count(self) -> int | None:
        """Alternatives per token the request wants with each token's log-probability; None: no logprobs."""
        if self.top_logprobs is not None and not self.logprobs:
            raise JaxspecError("top_logprobs needs logprobs: true")
        if self.top_logprobs is not None and self.top_logprobs < 0:
            raise JaxspecError(f"top_logprobs must be >= 0, got {self.top_logprobs}")
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def budget(self) -> int | None:
        """max_completion_tokens, else max_tokens, else None (the server's default, within the room left)."""
        return self.max_completion_tokens or self.max_tokens
