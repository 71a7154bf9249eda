"""Target-only generation: equal to transformers' greedy generate, batch-invariant, compiled once per bucket."""

import pytest
import torch
from hf_tiny import make_tiny

from jaxspec import generation
from jaxspec.checkpoints.hf import load_target
from jaxspec.errors import JaxspecError
from jaxspec.engine.generation import Generator
from jaxspec.sampling import SamplingConfig

PROMPTS = [[5, 17, 3, 9], [44, 2, 61, 8, 19, 23, 7, 1, 90, 12, 4], [33], [70, 71, 72, 73, 74, 75]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    hf = make_tiny("smollm2_tied", path, seed=3)
    return hf, load_target(path)


def hf_greedy(hf, prompt, max_new, eos):
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False, eos_token_id=eos, pad_token_id=0,
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        )
    return out[0, len(prompt) :].tolist()


def test_greedy_equals_transformers_generate(tiny):
    hf, model = tiny
    got = Generator(model, batch_size=1).generate(PROMPTS, max_new_tokens=20)
    for prompt, c in zip(PROMPTS, got):
        assert c.token_ids == hf_greedy(hf, prompt, 20, eos=None)


def test_eos_stops_each_row_on_its_own(tiny):
    hf, model = tiny
    free = Generator(model, batch_size=1).generate(PROMPTS, max_new_tokens=20)
    eos = free[1].token_ids[5]  # a token that really appears mid-generation
    got = Generator(model, batch_size=4).generate(PROMPTS, max_new_tokens=20, stop_ids=[eos])
    for prompt, f, c in zip(PROMPTS, free, got):
        want = f.token_ids[: f.token_ids.index(eos) + 1] if eos in f.token_ids else f.token_ids
        assert c.token_ids == want
        assert c.token_ids == hf_greedy(hf, prompt, 20, eos=eos)[: len(c.token_ids)]
        assert c.finished_by_eos == (eos in f.token_ids)


@pytest.mark.slow  # ~19 s; CI: test_invariance (a prompt's prefill beside others), test_serve (batch 4 = alone)
def test_batching_does_not_change_greedy_output(tiny):
    _, model = tiny
    one = Generator(model, batch_size=1).generate(PROMPTS, max_new_tokens=12)
    for b in (2, 3, 4):
        many = Generator(model, batch_size=b).generate(PROMPTS, max_new_tokens=12)
        assert [c.token_ids for c in many] == [c.token_ids for c in one]


@pytest.mark.slow  # ~45 s; in CI seeds are per request in the server (test_serve's own-settings-and-seed test)
def test_sampling_is_seeded(tiny):
    _, model = tiny
    gen = Generator(model, batch_size=2)
    cfg = SamplingConfig(temperature=1.0, top_k=20, top_p=0.9)
    a = gen.generate(PROMPTS, max_new_tokens=10, sampling=cfg, seed=1)
    # each prompt draws from its own key (the seed folded with its index): another batch size, the same text
    b = Generator(model, batch_size=1).generate(PROMPTS, max_new_tokens=10, sampling=cfg, seed=1)
    c = gen.generate(PROMPTS, max_new_tokens=10, sampling=cfg, seed=2)
    assert [x.token_ids for x in a] == [x.token_ids for x in b]
    assert [x.token_ids for x in a] != [x.token_ids for x in c]


def test_compiles_once_per_bucket(tiny):
    _, model = tiny
    gen = Generator(model, batch_size=2)
    gen.generate(PROMPTS[:2], max_new_tokens=8)
    messages = []
    gen.on_compile = messages.append
    # Different prompts, lengths within the same bucket, and many decode steps: nothing new to compile.
    gen.generate([[1, 2, 3], [9] * 13, [4] * 12, [8] * 10], max_new_tokens=8)  # capacity 32, prompt bucket 16
    gen.generate([[1, 2, 3], [9] * 13], max_new_tokens=5)  # another budget, capacity 32 still: budgets are data
    assert messages == []
    gen.generate([[5] * 40], max_new_tokens=8)  # a longer prompt bucket compiles a new prefill
    assert any(m.startswith("compiling the prefill") for m in messages)
    assert len(gen.compiled_programs("prefill")) == 2


def test_prompt_longer_than_context_is_refused(tiny):
    _, model = tiny
    with pytest.raises(JaxspecError, match="exceeds the model's context length of 256"):
        Generator(model).generate([[1] * 250], max_new_tokens=10)


def test_buckets():
    assert [generation.prompt_bucket(n) for n in (1, 16, 17, 100)] == [16, 16, 32, 128]
    assert [generation.capacity_bucket(n, 8192) for n in (10, 17, 256, 257, 300)] == [16, 32, 256, 512, 512]
    assert generation.capacity_bucket(300, 400) == 400
