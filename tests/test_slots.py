"""Continuous batching (jaxspec/engine/slots.py): requests that join and leave slots between steps each get the
output `Generator.generate` gives them alone, streamed as they go; a prompt prefilled in chunks gets the bits of its
whole prefill."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from spec_fixtures import PROMPTS, fitted_head, in_dtype, random_head, tiny_target

from jaxspec.engine.generation import Generator
from jaxspec.engine.generator import SpeculativeGenerator
from jaxspec.engine.slots import SlotBatcher, SlotRequest
from jaxspec.errors import JaxspecError
from jaxspec.processors import LogitProcessors

# (prompt, budget): more requests than slots, other lengths and budgets, one with a processor
REQUESTS = [
    (PROMPTS[0], 12, LogitProcessors()), (PROMPTS[1], 5, LogitProcessors()), (PROMPTS[2], 20, LogitProcessors()),
    (PROMPTS[3], 9, LogitProcessors(repetition_penalty=1.3, logit_bias=((7, 2.0),))), (PROMPTS[1][:3], 16, LogitProcessors()),
]


def alone(make, stop_ids, requests=REQUESTS) -> list[list[int]]:
    gen = make(1)
    return [gen.generate([p], max_new_tokens=n, stop_ids=stop_ids, processors=proc)[0].token_ids
            for p, n, proc in requests]


def served(batcher: SlotBatcher) -> tuple[dict, dict, int]:
    """Each request joins when a slot is free (one per chunk of steps, so that they overlap at other points):
    (completions, streamed tokens, the most requests running at once)."""
    pending = list(enumerate(REQUESTS))
    completions, streamed, most = {}, {i: [] for i in range(len(REQUESTS))}, 0
    while pending or batcher.running:
        if pending and batcher.free_slots:
            i, (prompt, budget, proc) = pending.pop(0)
            batcher.join([(i, SlotRequest(tuple(prompt), budget, proc))])
        most = max(most, batcher.running)
        for update in batcher.step():
            streamed[update.handle] += update.new_tokens
            if update.completion is not None:
                completions[update.handle] = update.completion
    return completions, streamed, most


@pytest.mark.parametrize("drafter", [  # CI: tests/test_serve.py (joins with a head) and the n-gram join below
    pytest.param("none", marks=pytest.mark.slow),
    pytest.param("eagle3", marks=pytest.mark.slow),
])
def test_requests_joining_between_steps_get_their_own_output(drafter):
    model = tiny_target()

    def make(rows, chunk_steps=None):  # the batcher's: chunks of 2 steps, so that requests join mid-way
        if drafter == "none":
            return Generator(model, batch_size=rows, chunk_steps=chunk_steps)
        return SpeculativeGenerator(model, fitted_head(), num_draft=3, batch_size=rows, chunk_steps=chunk_steps)

    stop = alone(make, (), REQUESTS[2:3])[0][6]  # a token request 2 produces: a stop id ends it (maybe others) early
    want = alone(make, (stop,))
    batcher = SlotBatcher(make(2, chunk_steps=2), capacity=64, stop_ids=(stop,))
    completions, streamed, most = served(batcher)
    assert most == 2 and batcher.running == 0
    for i, ids in enumerate(want):
        assert completions[i].token_ids == ids, i
        assert streamed[i] == ids, i  # streamed as produced, nothing lost or repeated
        assert completions[i].finished_by_eos == (ids[-1] == stop)
    assert any(c.finished_by_eos for c in completions.values())
    if drafter == "eagle3":
        assert all(c.stats["verify_calls"] > 0 for c in completions.values() if c.num_generated > 1)


@pytest.mark.slow  # CI: the server's joins (tests/test_serve.py)
def test_a_prompt_whose_bucket_reaches_the_capacity_joins_an_ngram_state():
    """The n-gram proposer's history is max(capacity, T + 1) wide: a prefill bucket at the capacity would make it
    wider than the running state's (the join keeps buckets below the capacity). The joining row brings its own
    logit processors."""
    from jaxspec.engine.proposers.ngram import NgramProposer

    model = tiny_target()
    long = (PROMPTS[1] * 2)[:20]  # bucket 32 = the capacity
    biased = LogitProcessors(repetition_penalty=1.3, logit_bias=((7, 2.0),))  # per-row processors join too
    requests = [(PROMPTS[0], 8, LogitProcessors()), (long, 6, biased)]

    def make(rows, chunk_steps=None):
        return Generator(model, proposer=NgramProposer(3), batch_size=rows, chunk_steps=chunk_steps)

    want = alone(make, (), requests)
    batcher = SlotBatcher(make(2, chunk_steps=1), capacity=32)
    batcher.join([(0, SlotRequest(tuple(requests[0][0]), requests[0][1]))])
    batcher.step()
    batcher.join([(1, SlotRequest(tuple(long), 6, biased))])  # into the running state of the first prefill
    done = {}
    while batcher.running:
        done |= {u.handle: u.completion for u in batcher.step() if u.completion is not None}
    assert [done[0].token_ids, done[1].token_ids] == want


def test_joins_prefill_only_the_joining_rows_and_each_request_gets_its_own_output():
    """A join into a running state prefills the joining rows alone, padded to a power of two (3 → 4, the padding
    row dropped; 1 → 1), and scatters them into their slots; the steps run on the live slots alone, gathered into
    a bucket of rows (engine.core.steps_on_rows): each request's output is still what it gets alone."""
    model = tiny_target()
    requests = [(PROMPTS[0], 6), (PROMPTS[1], 5), (PROMPTS[2], 7), (PROMPTS[3], 4), (PROMPTS[1][:3], 6)]
    want = [Generator(model, batch_size=1).generate([p], max_new_tokens=n)[0].token_ids for p, n in requests]
    batcher = SlotBatcher(Generator(model, batch_size=4, chunk_steps=1), capacity=32)
    assert [batcher.join_rows(k) for k in (1, 2, 3, 4)] == [1, 2, 4, 4]
    done = {}

    def run(steps: int | None = None):
        for _ in range(steps or 10**6):
            if not batcher.running:
                return
            done.update({u.handle: u.completion for u in batcher.step() if u.completion is not None})

    batcher.join([(0, SlotRequest(tuple(requests[0][0]), requests[0][1]))])  # the first: every slot's prefill
    run(2)
    batcher.join([(i, SlotRequest(tuple(p), n)) for i, (p, n) in enumerate(requests[1:4], 1)])  # 3 rows → 4
    run()
    batcher.join([(4, SlotRequest(tuple(requests[4][0]), requests[4][1]))])  # a lone join into an idle state
    run()
    assert [done[i].token_ids for i in range(len(requests))] == want
    assert batcher.prefill_rows == {4: 2, 1: 1}
    # the steps ran on the live slots alone: 1 (the first, the last), 4 (four running), 2 (as they left)
    assert set(batcher.step_rows) == {1, 2, 4}, batcher.step_rows


LONG = [int(x) for x in np.random.default_rng(0).integers(1, 100, 150)]  # five chunks of 32, the last short


def _chunk_generator(kind: str, dtype, tmp_path, target_as=lambda target: target) -> Generator:
    """llama: the tiny target with an EAGLE-3 head; gemma2: a Gemma 2 target (a window of 8 and soft caps, so
    chunks cross windows) alone, gemma3 likewise without soft caps; dflash: the tiny target with a DFlash drafter
    (its context from the features); moe: test_moe's mixture-of-experts target alone. target_as: applied to the
    target first (`one_pass`)."""
    if kind == "llama":
        target = target_as(in_dtype(tiny_target(), dtype))
        return SpeculativeGenerator(target, in_dtype(random_head(), dtype), num_draft=3)
    if kind == "moe":  # a mixture-of-experts target alone (its experts' matmuls in the loop's chunks)
        from test_moe import moe_target

        return Generator(target_as(in_dtype(moe_target(), dtype)))
    if kind == "dflash":
        from spec_fixtures import random_drafter

        from jaxspec.engine.proposers.dflash import DFlashProposer

        proposer, params = DFlashProposer.of(random_drafter(), 3)
        return Generator(target_as(in_dtype(tiny_target(), dtype)), proposer=proposer, proposer_params=params)
    from test_gemma2_3 import make_gemma

    from jaxspec.checkpoints.hf import load_target

    if not (tmp_path / "config.json").exists():
        make_gemma(kind, tmp_path)
    return Generator(target_as(in_dtype(load_target(tmp_path), dtype)))


def one_pass(target):
    """The target with its whole prompts prefilled in one pass over the bucket (`Numerics.prefill_loop_chunk` off)."""
    target.numerics = dataclasses.replace(target.numerics, prefill_loop_chunk=None)
    return target


@pytest.mark.parametrize("kind,dtype", [
    pytest.param("llama", jnp.float32, marks=pytest.mark.slow), ("llama", jnp.bfloat16),
    pytest.param("gemma3", jnp.bfloat16, marks=pytest.mark.slow),
    pytest.param("dflash", jnp.float32, marks=pytest.mark.slow),
    pytest.param("moe", jnp.bfloat16, marks=pytest.mark.slow),
])
def test_a_prefill_looped_up_to_the_longest_prompt_gets_the_bits_of_one_pass(kind, dtype, tmp_path):
    """On the CPU row kernel a whole prompt's prefill loops over chunks of 32 positions and stops after the chunk
    holding the longest prompt's last token (engine.core._prefill_in_chunks): a ragged batch in a 256-wide bucket,
    one prompt ending in the fifth chunk and one in the first (its rows run garbage chunks after it), gets one
    pass's bits: each row's cache over its prompt, its first token, the drafter's cache built from the features.
    Buckets of two chunks and Gemma 2's soft-capped layers (block-fold attention) keep one pass."""
    from jaxspec.engine.core import looped_prefill_chunk

    looped = _chunk_generator(kind, dtype, tmp_path)
    target = nnx.merge(looped.graphdef, looped.params)
    if looped_prefill_chunk(target, 256) != 32:
        pytest.skip("no looped prefill here (the CPU kernels do not build)")
    assert looped_prefill_chunk(target, 64) is None
    if kind == "gemma3":
        from test_gemma2_3 import make_gemma

        from jaxspec.checkpoints.hf import load_target

        make_gemma("gemma2", tmp_path / "gemma2")
        assert looped_prefill_chunk(load_target(tmp_path / "gemma2"), 256) is None
    whole = _chunk_generator(kind, dtype, tmp_path, target_as=one_pass)
    _assert_same_prefills(looped, whole, [LONG, LONG[::-1][:20]], width=256, capacity=512, max_new=8)


def test_a_looped_prefill_past_the_bucket_and_the_capacity_with_a_padding_row(tmp_path):
    """The loop's last chunk may reach past the prompt width and the cache's capacity (`generate`'s width is the
    capacity where that is the smaller: here a 245-token prompt in 250 slots runs its last chunk over [224, 256));
    a batch's padding row (no prompt) runs with the others: the same bits as one pass, nothing written out of
    bounds that a row reads."""
    from jaxspec.engine.core import looped_prefill_chunk

    looped = _chunk_generator("llama", jnp.bfloat16, tmp_path)
    if looped_prefill_chunk(nnx.merge(looped.graphdef, looped.params), 250) != 32:
        pytest.skip("no looped prefill here (the CPU kernels do not build)")
    whole = _chunk_generator("llama", jnp.bfloat16, tmp_path, target_as=one_pass)
    long = (LONG * 2)[:245]
    _assert_same_prefills(looped, whole, [long, LONG[:40], []], width=250, capacity=250, max_new=4)


def _assert_same_prefills(looped: Generator, whole: Generator, prompts: list[list[int]], width: int, capacity: int,
                          max_new: int) -> None:
    """`prompts` prefilled in one batch [len(prompts), width] by both generators: the same first tokens, each row's
    cache over its prompt, and the drafter's cache, bit for bit."""
    lens = [len(p) for p in prompts]
    prompt = np.zeros((len(prompts), width), np.int32)
    for row, p in enumerate(prompts):
        prompt[row, : len(p)] = p
    args = (jnp.asarray(prompt), jnp.asarray(lens, jnp.int32), jnp.asarray([max_new if n else 0 for n in lens],
            jnp.int32), jnp.asarray([-1], jnp.int32), jax.random.split(jax.random.key(0), len(prompts)), None, None)
    a = looped.prefill_program(args, capacity)(*looped.program_params, *args)
    b = whole.prefill_program(args, capacity)(*whole.program_params, *args)
    np.testing.assert_array_equal(np.asarray(a.last_token), np.asarray(b.last_token))
    np.testing.assert_array_equal(np.asarray(a.cache.lengths), lens)
    np.testing.assert_array_equal(np.asarray(b.cache.lengths), lens)
    for row, n in enumerate(lens):
        for x, y in zip(a.cache.k + a.cache.v, b.cache.k + b.cache.v):
            np.testing.assert_array_equal(np.asarray(x[row, :, :n], np.float32), np.asarray(y[row, :, :n], np.float32))
    if looped.proposer is None:
        return
    own_a, own_b = looped.proposer.kv_cache(a.proposer), whole.proposer.kv_cache(b.proposer)
    np.testing.assert_array_equal(np.asarray(own_a.lengths), np.asarray(own_b.lengths))
    for row, length in enumerate(lens):
        n = int(own_a.lengths[row])
        assert n > 0 or length == 0
        for x, y in zip(own_a.k + own_a.v, own_b.k + own_b.v):
            np.testing.assert_array_equal(np.asarray(x[row, :, :n], np.float32), np.asarray(y[row, :, :n], np.float32))


@pytest.mark.parametrize("kind,dtype", [
    pytest.param("llama", jnp.float32, marks=pytest.mark.slow), ("llama", jnp.bfloat16),
    pytest.param("gemma2", jnp.bfloat16, marks=pytest.mark.slow),
    pytest.param("dflash", jnp.float32, marks=pytest.mark.slow),
])
def test_a_prompt_in_chunks_gets_the_bits_of_its_whole_prefill(kind, dtype, tmp_path):
    """Chunked prefill (engine.core.prefill_chunk, then prefill with the partial): the target's cache over the
    prompt, the first token and the drafter's cache (an EAGLE-3 head's, from the features; a DFlash drafter's
    context) are the whole prompt's pass bit for bit, each chunk on the prefill's tiles reading the ones before
    from the cache; a Gemma 2 target's windows and soft caps too."""
    gen = _chunk_generator(kind, dtype, tmp_path)
    n, capacity, chunk = len(LONG), 256, 32
    prompt = jnp.asarray([LONG + [0] * (256 - 1 - n)], jnp.int32)[:, :160]  # the bucket (160: a whole chunk past)
    args = (prompt, jnp.asarray([n], jnp.int32), jnp.asarray([8], jnp.int32), jnp.asarray([-1], jnp.int32),
            jax.random.split(jax.random.key(0), 1), None, None)
    whole = gen.prefill_program(args, capacity)(*gen.program_params, *args)
    partial = None
    for start in range(0, n - 1, chunk)[:-1]:  # 0, 32, 64, 96: the last chunk (128..149) is the prefill's
        chunk_args = (prompt, partial, jnp.int32(start))
        partial = gen.chunk_program(chunk_args, capacity, chunk)(*gen.program_params, *chunk_args)
        assert int(partial.cache.lengths[0]) == start + chunk
    last = (*args, partial, jnp.int32(128))
    chunked = gen.prefill_program(last, capacity, chunk)(*gen.program_params, *last)
    assert int(chunked.last_token[0]) == int(whole.last_token[0])
    assert int(chunked.cache.lengths[0]) == n
    for a, b in zip(whole.cache.k + whole.cache.v, chunked.cache.k + chunked.cache.v):
        np.testing.assert_array_equal(np.asarray(a[:, :, :n], np.float32), np.asarray(b[:, :, :n], np.float32))
    if gen.proposer is None:
        return
    own, own_chunked = gen.proposer.kv_cache(whole.proposer), gen.proposer.kv_cache(chunked.proposer)
    assert int(own.lengths[0]) == int(own_chunked.lengths[0]) > 0
    for a, b in zip(own.k + own.v, own_chunked.k + own_chunked.v):  # from the features
        np.testing.assert_array_equal(np.asarray(a[:, :, :n], np.float32), np.asarray(b[:, :, :n], np.float32))


@pytest.mark.slow  # CI: the server's concurrent clients join in chunks (tests/test_serve.py), and the bits above
def test_a_long_prompt_joins_in_chunks_while_the_running_request_keeps_going():
    """With prefill_chunk, a long prompt joining a running state runs a chunk before each step: the running
    request gets tokens between its chunks, and both get the output they get alone (an EAGLE-3 head, whose state
    the chunks' features build). A join into an idle state, or of a short prompt, prefills whole."""
    model = tiny_target()

    def make(rows, chunk_steps=None):
        return SpeculativeGenerator(model, random_head(), num_draft=3, batch_size=rows, chunk_steps=chunk_steps)

    requests = [(PROMPTS[1], 30), (LONG, 12), (PROMPTS[0], 6)]
    want = [make(1).generate([p], max_new_tokens=k)[0].token_ids for p, k in requests]
    batcher = SlotBatcher(make(2, chunk_steps=1), capacity=256, prefill_chunk=32)
    batcher.join([(0, SlotRequest(tuple(requests[0][0]), requests[0][1]))])
    batcher.step()
    batcher.join([(1, SlotRequest(tuple(requests[1][0]), requests[1][1]))])
    assert batcher.free_slots == [] and batcher.running == 2  # its slot is held while it joins
    done, during = {}, 0
    while batcher.running:
        chunking = bool(batcher.pending)
        for update in batcher.step():
            during += len(update.new_tokens) if chunking and update.handle == 0 else 0
            if update.completion is not None:
                done[update.handle] = update.completion.token_ids
    assert batcher.prefill_chunks == 4 and during >= 4  # a step after each of its chunks
    batcher.join([(2, SlotRequest(tuple(requests[2][0]), requests[2][1]))])  # idle: whole
    batcher.join([(3, SlotRequest(tuple(LONG), 4))])  # running, long: chunked, then cancelled while it joins
    assert batcher.cancel(3) and not batcher.pending and len(batcher.free_slots) == 1
    while batcher.running:
        done |= {u.handle: u.completion.token_ids for u in batcher.step() if u.completion is not None}
    assert [done[i] for i in range(3)] == want
    assert batcher.prefill_chunks == 4 and batcher.prefill_rows == {2: 1, 1: 2}
    with pytest.raises(JaxspecError, match="prefill chunk must be at least 1 token"):
        SlotBatcher(make(2), capacity=64, prefill_chunk=0)


def test_a_request_no_slot_can_hold_is_refused_in_one_line():
    batcher = SlotBatcher(Generator(tiny_target(), batch_size=2), capacity=32)
    with pytest.raises(JaxspecError, match="exceeds the 32 tokens a request may hold"):
        batcher.check(SlotRequest(tuple(PROMPTS[1]), 30))
    with pytest.raises(JaxspecError, match="prompt is empty"):
        batcher.check(SlotRequest((), 4))
    with pytest.raises(JaxspecError, match="3 requests for 2 free slots"):
        batcher.join([(i, SlotRequest((1, 2), 4)) for i in range(3)])
    with pytest.raises(JaxspecError, match="capacity must be in"):
        SlotBatcher(Generator(tiny_target(), batch_size=2), capacity=4096)


@pytest.mark.parametrize("drafter", ["eagle3", pytest.param("draft-model", marks=pytest.mark.slow)])
def test_speculation_off_above_a_bucket_keeps_each_requests_output(drafter):
    """`drafting_rows`: steps of one live row draft, steps of more rows draft nothing on the same state (the
    proposer keeps up, the target runs the root alone), switching as requests join and leave: each request still
    gets its output alone, and the drafting steps after a stretch without drafts draft as well as ever (the target
    as its own draft model accepts every draft)."""
    from jaxspec.engine.proposers.draft_model import DraftModelProposer

    model = tiny_target()

    def make(rows, chunk_steps=None):
        if drafter == "eagle3":
            return SpeculativeGenerator(model, fitted_head(), num_draft=3, batch_size=rows, chunk_steps=chunk_steps)
        proposer, params = DraftModelProposer.of(model, 3)
        return Generator(model, proposer=proposer, proposer_params=params, batch_size=rows, chunk_steps=chunk_steps)

    want = alone(make, ())
    batcher = SlotBatcher(make(4, chunk_steps=2), capacity=64, drafting_rows={1})
    completions, streamed, most = served(batcher)
    assert most > 1 and set(batcher.step_rows) == {1, 2, 4}, batcher.step_rows
    for i, ids in enumerate(want):
        assert completions[i].token_ids == ids and streamed[i] == ids, i
    outcomes = [c.stats["rejections"] for c in completions.values()]
    assert sum(o["no_draft"] for o in outcomes) > 0  # steps that drafted nothing (more than one row live)
    drafted = sum(c.stats["verify_calls"] - o["no_draft"] for c, o in zip(completions.values(), outcomes))
    assert drafted > 0
    if drafter == "draft-model":  # every drafting step accepted all its drafts (or stopped inside them)
        assert all(o["miss"] == o["in_draft_topk"] == o["outside_draft_vocab"] == 0 for o in outcomes), outcomes
    with pytest.raises(JaxspecError, match="drafting_rows needs a speculative generator"):
        SlotBatcher(Generator(model, batch_size=2), capacity=64, drafting_rows={1})
