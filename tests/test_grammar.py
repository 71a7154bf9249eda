"""Structured output (jaxspec/grammar.py): grammars compiled to token automata over a real tokenizer, applied as a
logit processor that speculation replays along every drafted path. Constrained greedy speculation equals constrained
target-only decoding (chain and tree, beside unconstrained rows) and matches the pattern; sampling under a grammar
stays lossless."""

import functools
import re
import tempfile

import jax.numpy as jnp
import numpy as np
import pytest
from hf_tiny import write_char_tokenizer
from spec_fixtures import PROMPTS, fitted_head, tiny_target
from test_spec_sampling import SHAPE, VOCAB, chi_square_p, first_two, plain_target

from jaxspec.engine.generation import Generator
from jaxspec.engine.generator import SpeculativeGenerator
from jaxspec.engine.tree import TreeConfig
from jaxspec.errors import JaxspecError
from jaxspec.grammar import Grammar, GrammarCompiler, TokenAutomaton
from jaxspec.processors import LogitProcessors
from jaxspec.sampling import SamplingConfig, filtered_logits

EOS = 96  # the char tokenizer's <eos>: ids 0..94 are the printable characters chr(32 + id)


@functools.cache
def compiler() -> GrammarCompiler:
    from transformers import AutoTokenizer

    path = tempfile.mkdtemp(prefix="grammar-tokenizer-")
    write_char_tokenizer(path)
    return GrammarCompiler(AutoTokenizer.from_pretrained(path), vocab_size=101, stop_ids=[EOS])


def ids(text: str) -> list[int]:
    return [ord(c) - 32 for c in text]


def text(tokens) -> str:
    return "".join(chr(t + 32) for t in tokens if t < 95)


def test_automata_accept_exactly_their_language():
    a = compiler()(Grammar("regex", r"(yes|no)-[0-9]{2}"))
    assert a.matches(ids("yes-42") + [EOS]) and a.matches(ids("no-07"))
    assert not a.matches(ids("yes-4x")) and not a.matches(ids("maybe")) and not a.matches(ids("yes-4"))
    state = 0
    for t in ids("yes-4"):
        state = a.advance(state, t)
    assert not a.allowed(state)[EOS]  # not finished: no stop
    assert a.allowed(a.advance(state, ids("2")[0]))[EOS] and a.allowed(state)[ids("2")[0]]
    assert not a.allowed(0)[97:].any()  # ids past the tokenizer's are never allowed
    choice = compiler()(Grammar.choice(["red", "green"]))
    assert choice.matches(ids("green") + [EOS]) and not choice.matches(ids("gree") + [EOS])
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    js = compiler()(Grammar.json_schema(schema))
    assert js.matches(ids('{"n":12}') + [EOS]) and not js.matches(ids('{"n":"12"}'))
    assert compiler()(Grammar.json_schema(schema)) is js  # compiled once per grammar
    with pytest.raises(JaxspecError, match="cannot be compiled to a token automaton"):
        compiler()(Grammar("regex", "(unclosed"))
    with pytest.raises(JaxspecError, match="not valid JSON"):
        Grammar.json_schema("{nope")


PATTERN = r"[a-z]{2,4}( [a-z]{2,3}){1,2}\."


@functools.cache
def constrained_reference() -> tuple[list[LogitProcessors], list[list[int]], list[list[int]]]:
    """Two prompts target-only in one batch: the first under PATTERN, the second free; and both free."""
    automaton = compiler()(Grammar("regex", PATTERN))
    requests = [LogitProcessors(grammar=automaton), LogitProcessors()]
    gen = Generator(tiny_target(), batch_size=2)
    want = [c.token_ids for c in gen.generate(PROMPTS[:2], max_new_tokens=24, processors=requests, stop_ids=[EOS])]
    free = [c.token_ids for c in gen.generate(PROMPTS[:2], max_new_tokens=24, stop_ids=[EOS])]
    return requests, want, free


@pytest.mark.parametrize("tree", [None, pytest.param(TreeConfig(10, 4, 3), marks=pytest.mark.slow)],
                         ids=["chain", "tree"])  # CI: the chain; the tree's replay is process()'s, tested with paths
def test_greedy_constrained_speculation_equals_constrained_target_only(tree):
    requests, want, free = constrained_reference()
    for i, tokens in enumerate(want):
        if i % 2 == 0:  # the grammar's rows match it and end at its stop; the others are the free output
            assert tokens[-1] == EOS and re.fullmatch(PATTERN, text(tokens)), text(tokens)
        else:
            assert tokens == free[i]
    assert want[0] != free[0]  # the grammar changed the text
    gen = SpeculativeGenerator(tiny_target(), fitted_head(), num_draft=4, tree=tree, batch_size=2)
    got = gen.generate(PROMPTS[:2], max_new_tokens=24, processors=requests, stop_ids=[EOS])
    assert [c.token_ids for c in got] == want
    assert all(c.stats["verify_calls"] > 0 and c.stats["mean_accepted_length"] >= 1 for c in got)


def test_a_grammar_that_does_not_fit_the_engine_is_a_one_line_error():
    from jaxspec.processors import batch_values

    automaton = compiler()(Grammar("regex", PATTERN))
    with pytest.raises(JaxspecError, match=r"needs \d+ automaton states and \d+ token classes; this engine holds at "
                                           r"most 2 and 2"):
        batch_values([LogitProcessors(grammar=automaton)], 1, 101, grammar_shape=(2, 2))


# Sampling: the first two tokens' joint distribution under a grammar over token ids (built directly): the first
# token odd, the second one of 0, 2, 4, 6, 8, then anything.
ODD_THEN_SMALL_EVEN = TokenAutomaton(
    np.asarray([1 if t in (0, 2, 4, 6, 8) else 0 if t % 2 else 2 for t in range(VOCAB)], np.int32),
    np.asarray([[1, -1, -1], [-1, 2, -1], [2, 2, 2]], np.int32),
)
PROMPT, N = [3, 7, 1, 12], 20000


def constrained_joint(sampling: SamplingConfig) -> np.ndarray:
    """P(x1, x2) [V, V]: the target's distributions with the forbidden tokens removed."""
    target = plain_target()
    n = len(PROMPT)
    seqs = jnp.asarray([PROMPT + [x1] for x1 in range(VOCAB)], jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(n + 1, dtype=jnp.int32), seqs.shape)
    raw = np.asarray(target(seqs, pos, target.init_cache(VOCAB, n + 1)).logits, np.float32)

    def probs(logits, allowed):  # the grammar's mask first, then the sampling filters (the engine's order)
        masked = jnp.where(jnp.asarray(allowed), jnp.asarray(logits), -jnp.inf)
        x = np.asarray(filtered_logits(masked[None], sampling), np.float64)[0]
        p = np.exp(x - x.max())
        return p / p.sum()

    p1 = probs(raw[0, n - 1], np.arange(VOCAB) % 2 == 1)
    p2 = np.stack([probs(raw[x1, n], np.isin(np.arange(VOCAB), [0, 2, 4, 6, 8])) for x1 in range(VOCAB)])
    return p1[:, None] * p2


# both slow (~100 s each): CI checks sampling's losslessness with trees' chi-square (test_spec_sampling) and
# chains' at the verification kernel (test_rejection); a grammar's constraint with greedy speculation (above)
@pytest.mark.parametrize("tree", [pytest.param(None, marks=pytest.mark.slow),
                                  pytest.param(TreeConfig(8, 3, 3), marks=pytest.mark.slow)], ids=["chain", "tree"])
def test_sampling_under_a_grammar_is_lossless(tree):
    sampling = SamplingConfig(2.0, top_p=0.9)  # CI's chain chi-square: top-p too (test_spec_sampling's are slow)
    joint = constrained_joint(sampling)
    gen = SpeculativeGenerator(plain_target(), fitted_head(**SHAPE), num_draft=3, tree=tree, batch_size=N)
    spec = gen.generate([PROMPT] * N, max_new_tokens=2, sampling=sampling, seed=5,
                        processors=LogitProcessors(grammar=ODD_THEN_SMALL_EVEN))
    counts = first_two(spec)
    assert counts[np.arange(VOCAB) % 2 == 0].sum() == 0  # never outside the grammar
    assert chi_square_p(counts, joint) > 0.01
