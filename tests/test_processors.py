"""Logit processors (repetition / presence / frequency penalties, min-p, logit bias) stay exact under speculation:
the rule against an independent numpy reference, a drafted path counted as output, greedy speculative output equal
to target-only output, per-request values without recompiling, and lossless sampling."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from spec_fixtures import PROMPTS, fitted_head, tiny_target
from test_spec_sampling import SHAPE, VOCAB, chi_square_p, first_two, plain_target

from jaxspec.errors import JaxspecError
from jaxspec.engine.generation import Generator
from jaxspec.processors import LogitProcessors, ProcessorValues, batch_values, chain_paths, init_state, process, record
from jaxspec.sampling import SamplingConfig, filtered_logits
from jaxspec.engine.generator import SpeculativeGenerator
from jaxspec.engine.tree import TreeConfig

PENALTIES = LogitProcessors(
    repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.3, logit_bias=((5, 2.0), (16, -1.5))
)


def numpy_process(logits, prompt_tokens, output_tokens, path, v: LogitProcessors):
    """The module docstring's rule, written out per position in float32 numpy."""
    x = logits.astype(np.float32).copy()
    counts = np.bincount([t for t in list(output_tokens) + list(path) if t >= 0], minlength=x.shape[-1])
    seen = np.isin(np.arange(x.shape[-1]), prompt_tokens) | (counts > 0)
    bias = np.zeros(x.shape[-1], np.float32)
    for t, b in v.logit_bias:
        bias[t] = b
    x = x + bias
    rep = np.float32(v.repetition_penalty)
    x = np.where(seen, np.where(x < 0, x * rep, x / rep), x)
    x = x - np.float32(v.frequency_penalty) * counts.astype(np.float32)
    return x - np.float32(v.presence_penalty) * (counts > 0).astype(np.float32)


def random_case(seed: int, b=3, n=5, d=4, vocab=37):
    rng = np.random.default_rng(seed)
    requests = [
        LogitProcessors(
            repetition_penalty=float(rng.uniform(0.5, 2)), presence_penalty=float(rng.normal()),
            frequency_penalty=float(rng.normal()), logit_bias=((int(rng.integers(vocab)), float(rng.normal() * 3)),),
        )
        for _ in range(b)
    ]
    prompts = rng.integers(0, vocab, (b, 6))
    lens = np.array([6, 1, 3][:b])
    outputs = [rng.integers(0, vocab, rng.integers(0, 8)) for _ in range(b)]
    path = rng.integers(0, 6, (b, n, d))  # small ids: duplicates on a path and with the output
    path[rng.random((b, n, d)) < 0.3] = -1
    logits = rng.normal(size=(b, n, vocab)).astype(np.float32) * 4
    st = init_state(batch_values(requests, b, vocab), jnp.asarray(prompts, jnp.int32), jnp.asarray(lens, jnp.int32))
    for i, out in enumerate(outputs):  # output tokens counted one emission at a time, as the engines do
        for t in out:
            st = record(st, jnp.full((b, 1), int(t), jnp.int32), jnp.asarray(np.arange(b) == i, jnp.int32))
    return requests, prompts, lens, outputs, path, logits, st


@pytest.mark.parametrize("seed", range(4))
def test_process_follows_the_rule_bit_for_bit(seed):
    requests, prompts, lens, outputs, path, logits, st = random_case(seed)
    got = np.asarray(jax.jit(process)(jnp.asarray(logits), st, jnp.asarray(path, jnp.int32)))
    for i in range(len(requests)):
        for j in range(path.shape[1]):
            want = numpy_process(logits[i, j], prompts[i, : lens[i]], outputs[i], path[i, j], requests[i])
            np.testing.assert_array_equal(got[i, j], want)


def test_a_drafted_path_counts_as_output_on_a_draft_vocabulary():
    """A position's path gives the bits of committing the path first; on a draft vocabulary's columns too (tokens
    outside it are simply absent)."""
    *_, path, logits, st = random_case(7)
    n = path.shape[1]
    columns = jnp.asarray(np.random.default_rng(1).permutation(logits.shape[-1])[:20], jnp.int32)
    with_path = process(jnp.asarray(logits), st, jnp.asarray(path, jnp.int32))
    drafted = process(jnp.asarray(logits)[..., columns], st, jnp.asarray(path, jnp.int32), columns)
    for j in range(n):
        # record counts tokens[:, :count]; put a path's valid entries first
        order = np.argsort(path[:, j] < 0, axis=1, kind="stable")
        packed = np.take_along_axis(path[:, j], order, axis=1)
        committed = record(st, jnp.asarray(packed, jnp.int32), jnp.asarray((packed >= 0).sum(1), jnp.int32))
        alone = process(jnp.asarray(logits[:, j : j + 1]), committed)[:, 0]
        np.testing.assert_array_equal(np.asarray(with_path[:, j]), np.asarray(alone))
        np.testing.assert_array_equal(np.asarray(drafted[:, j]), np.asarray(alone)[:, np.asarray(columns)])


def test_chain_paths():
    paths = np.asarray(chain_paths(jnp.asarray([[7, 8, 9]])))
    assert paths.tolist() == [[[-1, -1, -1], [7, -1, -1], [7, 8, -1], [7, 8, 9]]]


@functools.cache
def reference(processors: LogitProcessors) -> list[list[int]]:
    gen = Generator(tiny_target(), batch_size=1)
    return [c.token_ids for c in gen.generate(PROMPTS, max_new_tokens=30, processors=processors)]


@pytest.mark.parametrize(
    "tree, k, batch",
    [
        pytest.param(None, 3, 1, marks=pytest.mark.slow), (None, 5, 4),
        pytest.param(TreeConfig(10, 4, 3), None, 1, marks=pytest.mark.slow),
        # a tree's processors in CI: test_sampling_with_processors_is_lossless[tree]
        pytest.param(TreeConfig(10, 4, 3), None, 4, marks=pytest.mark.slow),
    ],
    ids=["chain3-b1", "chain5-b4", "tree-b1", "tree-b4"],
)
def test_greedy_speculation_with_penalties_equals_target_only(tree, k, batch):
    want = reference(PENALTIES)
    assert want != reference(LogitProcessors())  # the penalties do change the text
    gen = SpeculativeGenerator(tiny_target(), fitted_head(), num_draft=k or 5, tree=tree, batch_size=batch)
    got = gen.generate(PROMPTS, max_new_tokens=30, processors=PENALTIES)
    assert [c.token_ids for c in got] == want
    assert np.mean([c.stats["mean_accepted_length"] for c in got]) > 1.5  # drafting follows the penalties too


def test_per_request_values_need_no_recompile_and_min_p_leaves_greedy_alone():
    """One batch, a different processor per row: each row is what it is alone. New values reuse the programs."""
    mixed = [PENALTIES, LogitProcessors(), LogitProcessors(presence_penalty=1.0, min_p=0.3), PENALTIES]
    want = [reference(p)[i] for i, p in enumerate(mixed)]
    compiles = []
    gen = SpeculativeGenerator(tiny_target(), fitted_head(), num_draft=4, batch_size=4)
    gen.on_compile = compiles.append
    assert [c.token_ids for c in gen.generate(PROMPTS, max_new_tokens=30, processors=mixed)] == want
    n = len(compiles)
    other = LogitProcessors(repetition_penalty=1.1, frequency_penalty=0.7, logit_bias=((3, 1.0),))
    got = gen.generate(PROMPTS, max_new_tokens=30, processors=other)
    assert len(compiles) == n  # same shapes, new values: nothing compiled
    assert [c.token_ids for c in got] == reference(other)
    assert reference(LogitProcessors(min_p=0.5)) == reference(LogitProcessors())  # min-p keeps the argmax


def test_unreplayable_processors_and_bad_biases_are_one_line_errors():
    gen = Generator(tiny_target(), batch_size=1)
    with pytest.raises(JaxspecError, match="cannot be replayed across speculative positions"):
        gen.generate(PROMPTS[:1], max_new_tokens=2, processors=lambda ids, logits: logits)
    with pytest.raises(JaxspecError, match="logit bias names token 500, but the vocabulary has 101 tokens"):
        gen.generate(PROMPTS[:1], max_new_tokens=2, processors=LogitProcessors(logit_bias=((500, 1.0),)))
    with pytest.raises(JaxspecError, match="2 logit processor settings for 1 prompts"):
        gen.generate(PROMPTS[:1], max_new_tokens=2, processors=[PENALTIES, PENALTIES])


# Sampling: the first two tokens' joint distribution with processors on (the second token sees the first as output).
SAMPLED = LogitProcessors(
    repetition_penalty=1.6, presence_penalty=0.5, frequency_penalty=0.5, min_p=0.02, logit_bias=((3, 1.5),)
)
PROMPT = [3, 7, 1, 12]
N = 20000


def processed_joint(sampling: SamplingConfig, v: LogitProcessors) -> np.ndarray:
    """P(x1, x2) [V, V] under the processors, from the target's raw logits and the numpy rule."""
    target = plain_target()
    n = len(PROMPT)
    seqs = jnp.asarray([PROMPT + [x1] for x1 in range(VOCAB)], jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(n + 1, dtype=jnp.int32), seqs.shape)
    raw = np.asarray(target(seqs, pos, target.init_cache(VOCAB, n + 1)).logits, np.float32)

    def probs(logits):  # [V] processed -> the distribution sampling draws from
        filtered = filtered_logits(jnp.asarray(logits)[None], sampling, jnp.asarray([v.min_p], jnp.float32))
        return np.asarray(jax.nn.softmax(filtered, axis=-1)[0], np.float64)

    p1 = probs(numpy_process(raw[0, n - 1], PROMPT, [], [], v))
    p2 = np.stack([probs(numpy_process(raw[x1, n], PROMPT, [x1], [], v)) for x1 in range(VOCAB)])
    return p1[:, None] * p2


@pytest.mark.slow  # CI: test_spec_sampling's lossless chains and trees, test_processors' greedy penalties and rules
@pytest.mark.parametrize("tree", [None, TreeConfig(8, 3, 3)], ids=["chain", "tree"])
def test_sampling_with_processors_is_lossless(tree):
    sampling = SamplingConfig(2.0)  # flat enough that min-p leaves ~80 outcomes of 10 000 draws or more
    joint = processed_joint(sampling, SAMPLED)
    gen = SpeculativeGenerator(plain_target(), fitted_head(**SHAPE), num_draft=3, tree=tree, batch_size=N)
    spec = gen.generate([PROMPT] * N, max_new_tokens=2, sampling=sampling, seed=21, processors=SAMPLED)
    assert chi_square_p(first_two(spec), joint) > 0.01
    accepted = np.mean([c.stats["acceptance_per_position"][0] for c in spec])
    assert 0.05 < accepted < 0.98  # both branches of the verifier are exercised
    if tree is not None:  # the CI case checks target-only sampling with the processors too
        plain = Generator(plain_target(), batch_size=N).generate(
            [PROMPT] * N, max_new_tokens=2, sampling=sampling, seed=22, processors=SAMPLED
        )
        assert chi_square_p(first_two(plain), joint) > 0.01
    # min-p really removed tokens the plain distribution would draw
    unfiltered = processed_joint(sampling, LogitProcessors(**{**SAMPLED.__dict__, "min_p": 0.0}))
    assert (joint == 0).sum() > (unfiltered == 0).sum()


def test_processor_values_are_neutral_when_off():
    values = batch_values([LogitProcessors(min_p=0.2), LogitProcessors()], 3, 11)
    assert isinstance(values, ProcessorValues)
    np.testing.assert_array_equal(np.asarray(values.repetition), [1, 1, 1])
    np.testing.assert_array_equal(np.asarray(values.min_p), np.float32([0.2, 0, 0]))
    assert batch_values([LogitProcessors()] * 2, 2, 11) is None  # nothing on: the plain programs
