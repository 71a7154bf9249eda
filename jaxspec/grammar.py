"""Structured output: a regular expression, a JSON schema or a list of choices compiled to a token automaton that
masks the logits, exactly as the other logit processors do, so that it stays exact under speculation.

Why an automaton on the device: a grammar constrains each position by the state it has after the tokens before it.
A verify step scores K+1 (or a tree's N) positions at once, so each position needs the state its own path leads to
(`processors.process` walks the path through the table), and the head must draft under the same mask. A host-side
matcher (a callback per token) could do neither inside the one jitted step.

How: outlines-core (a well-kept Rust library, the one vLLM and SGLang also use) builds the token-level index of the
regular expression over the tokenizer's vocabulary; a JSON schema becomes a regular expression first (its
`build_regex_from_schema`). The index's transitions are then stored densely but compactly: tokens that behave
alike in every state share a class, so the table is `token_class` [V] plus `transitions` [S, C] (next state, or -1
where the token is not allowed), with the initial state at 0. In final states the stop tokens are allowed (the
index allows its EOS there), so a constrained answer ends only where the grammar may.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Sequence

import numpy as np

from jaxspec.errors import JaxspecError

KINDS = ("regex", "json_schema", "choice")


@dataclasses.dataclass(frozen=True)
class Grammar:
    """One request's constraint (host side): `spec` is a regular expression, a JSON schema (as JSON text) or the
    choices (as a JSON list of strings)."""

    kind: str
    spec: str

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise JaxspecError(f"a grammar is one of {', '.join(KINDS)}, got {self.kind!r}")

    @classmethod
    def choice(cls, options: Sequence[str]) -> Grammar:
        if not options or not all(isinstance(o, str) and o for o in options):
            raise JaxspecError(f"choices must be a non-empty list of non-empty strings, got {options!r}")
        return cls("choice", json.dumps(list(options)))

    @classmethod
    def json_schema(cls, schema: dict | str) -> Grammar:
        text = schema if isinstance(schema, str) else json.dumps(schema)
        try:
            json.loads(text)
        except json.JSONDecodeError as e:
            raise JaxspecError(f"the JSON schema is not valid JSON ({e.msg})") from None
        return cls("json_schema", text)

    def regex(self) -> str:
        """The regular expression the automaton matches."""
        if self.kind == "regex":
            return self.spec
        if self.kind == "choice":
            import re

            return "(" + "|".join(re.escape(o) for o in json.loads(self.spec)) + ")"
        from outlines_core.json_schema import build_regex_from_schema

        try:
            return build_regex_from_schema(self.spec)
        except Exception as e:  # the library's own error types: a schema it cannot express
            raise JaxspecError(f"the JSON schema cannot be compiled: {e}") from None


def grammar_of(regex: str | None = None, json_schema: str | None = None,
               choice: Sequence[str] | None = None) -> Grammar | None:
    """The CLIs' --regex / --json-schema (inline JSON, or a file holding it) / --choice (at most one given)."""
    if regex is not None:
        return Grammar("regex", regex)
    if json_schema is not None:
        if json_schema.lstrip().startswith("{"):
            return Grammar.json_schema(json_schema)
        from pathlib import Path

        from jaxspec.files import read_text

        return Grammar.json_schema(read_text(Path(json_schema), "--json-schema file"))
    if choice:
        return Grammar.choice(choice)
    return None


@dataclasses.dataclass(frozen=True, eq=False)
class TokenAutomaton:
    """A grammar over one vocabulary (module docstring). Compared by identity (it holds arrays)."""

    token_class: np.ndarray  # [V] int32, each token's class
    transitions: np.ndarray  # [S, C] int32, the next state (-1: not allowed); state 0 is the initial one
    final: np.ndarray | None = None  # [S] bool, where the answer may end (None: everywhere)

    @property
    def num_states(self) -> int:
        return self.transitions.shape[0]

    @property
    def num_classes(self) -> int:
        return self.transitions.shape[1]

    def allowed(self, state: int) -> np.ndarray:
        """[V] bool: the tokens allowed in `state`."""
        return self.transitions[state][self.token_class] >= 0

    def advance(self, state: int, token: int) -> int:
        """The state after `token` (-1: the token was not allowed)."""
        return int(self.transitions[state, self.token_class[token]])

    def matches(self, tokens: Sequence[int]) -> bool:
        """Whether `tokens` is a whole answer of the grammar (a stop token at the end or not): every token allowed,
        ending where the grammar may end."""
        state = 0
        for t in tokens:
            state = self.advance(state, t)
            if state < 0:
                return False
        return self.final is None or bool(self.final[state])


def free_automaton(vocab_size: int) -> TokenAutomaton:
    """No constraint: one state, one class, every token allowed (the rows of a batch without a grammar)."""
    return TokenAutomaton(np.zeros((vocab_size,), np.int32), np.zeros((1, 1), np.int32))


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet (also Llama 3's and SmolLM2's): the printable character standing for each byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def _decoder_types(tokenizer) -> set[str]:
    spec = json.loads(tokenizer.backend_tokenizer.to_str()).get("decoder") or {}
    found, todo = set(), [spec]
    while todo:
        d = todo.pop()
        if isinstance(d, dict):
            found.add(d.get("type"))
            todo += d.get("decoders", [])
    return found


def token_bytes(tokenizer) -> dict[bytes, list[int]]:
    """Each ordinary token's bytes (what it adds to the text) → its ids; special tokens are left out (a grammar's
    text never holds them). Byte-level tokenizers (GPT-2, Llama 3, SmolLM2) map characters back to bytes;
    SentencePiece ones (Llama 2, Mistral) turn '▁' into a space and `<0xNN>` into that byte."""
    types = _decoder_types(tokenizer)
    special = set(tokenizer.all_special_ids)
    byte_level = "ByteLevel" in types
    decoder = _byte_decoder() if byte_level else {}
    out: dict[bytes, list[int]] = {}
    for text, i in tokenizer.get_vocab().items():
        if i in special:
            continue
        if byte_level:
            if any(c not in decoder for c in text):
                continue  # an added token outside the byte alphabet
            data = bytes(decoder[c] for c in text)
        elif "ByteFallback" in types and len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
            data = bytes([int(text[3:5], 16)])
        else:
            data = text.replace("▁", " ").encode("utf-8") if ("Metaspace" in types or "Replace" in types) \
                else text.encode("utf-8")
        if data:
            out.setdefault(data, []).append(i)
    return out


class GrammarCompiler:
    """Compiles grammars for one tokenizer and vocabulary (its token bytes read once; automata cached per
    grammar). vocab_size: the model's (it may exceed the tokenizer's: those ids are never allowed); stop_ids:
    allowed in final states."""

    def __init__(self, tokenizer, vocab_size: int, stop_ids: Sequence[int]):
        from outlines_core import Vocabulary

        if not stop_ids:
            raise JaxspecError("structured output needs a stop token (the tokenizer names no EOS)")
        self.vocab_size, self.stop_ids = vocab_size, sorted(set(int(s) for s in stop_ids))
        # a stop token ends the answer, so it is never a piece of its text (even where it is an ordinary token)
        mapping = {b: [i for i in ids if i < vocab_size and i not in self.stop_ids]
                   for b, ids in token_bytes(tokenizer).items()}
        self.vocabulary = Vocabulary(self.stop_ids[0], {b: ids for b, ids in mapping.items() if ids})
        self.compile = functools.lru_cache(maxsize=64)(self._compile)

    def _compile(self, grammar: Grammar) -> TokenAutomaton:
        from outlines_core import Index

        try:
            index = Index(grammar.regex(), self.vocabulary)
        except JaxspecError:
            raise
        except Exception as e:  # outlines-core's errors: a pattern it cannot parse, or one no token sequence can match
            raise JaxspecError(f"the {grammar.kind.replace('_', ' ')} cannot be compiled to a token automaton: "
                               f"{e}") from None
        transitions = index.get_transitions()  # {state: {token: next state}}
        first = index.get_initial_state()
        order = [first] + sorted(s for s in transitions if s != first)
        order += sorted({n for moves in transitions.values() for n in moves.values()} - set(order))
        number = {s: i for i, s in enumerate(order)}
        dense = np.full((len(order), self.vocab_size), -1, np.int32)
        eos = self.stop_ids[0]
        for s, moves in transitions.items():
            row = dense[number[s]]
            tokens = np.fromiter(moves.keys(), np.int64, len(moves))
            row[tokens] = [number[n] for n in moves.values()]
        for state in index.get_final_states():  # every stop token ends a finished answer (the index allows its EOS)
            dense[number[state], self.stop_ids] = dense[number[state], eos]
        # tokens alike in every state share one class: [V, S] columns, deduplicated
        columns, token_class = np.unique(dense.T, axis=0, return_inverse=True)
        final = np.zeros((len(order),), bool)
        final[[number[s] for s in index.get_final_states()]] = True
        return TokenAutomaton(token_class.astype(np.int32).reshape(-1), np.ascontiguousarray(columns.T, np.int32),
                              final)

    def __call__(self, grammar: Grammar) -> TokenAutomaton:
        return self.compile(grammar)
