"""The built-in SmolLM2-135M-Instruct target: conversion, logit parity and greedy generation vs transformers."""

from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from jaxspec.checkpoints import builtin
from jaxspec.checkpoints.hf import load_target
from jaxspec.generation import TargetGenerator
from jaxspec.prompts import encode_prompt, load_tokenizer, read_prompts_file, stop_token_ids

pytestmark = pytest.mark.smollm2
SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"


@pytest.fixture(scope="module")
def target_dir():
    return builtin.ensure_default_target()


@pytest.fixture(scope="module")
def hf_model(target_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def model(target_dir):
    return load_target(target_dir)


def test_conversion_equals_transformers_gguf_loader(tmp_path, hf_model):
    gguf = builtin.fetch_gguf(tmp_path, log=lambda *_: None)
    ref = transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    ours, theirs = hf_model.state_dict(), ref.state_dict()
    assert set(ours) == set(theirs)
    for key in ours:
        assert torch.equal(ours[key], theirs[key]), key


def test_tokenizer_and_template(target_dir):
    tok = load_tokenizer(target_dir)
    ids = encode_prompt(tok, "Hi 2024", raw=False)
    text = tok.decode(ids)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    assert tok.convert_ids_to_tokens(tok("2024").input_ids) == ["2", "0", "2", "4"]  # SmolLM2 splits digits
    assert tok.convert_tokens_to_ids("<|im_end|>") in stop_token_ids(tok, target_dir)


def test_logits_match_transformers(model, hf_model):
    tokens = np.random.default_rng(0).integers(0, 49152, (1, 64))
    with torch.no_grad():
        ref = hf_model(torch.tensor(tokens), output_hidden_states=True)
    out = model(jnp.asarray(tokens, jnp.int32), jnp.arange(64, dtype=jnp.int32)[None], model.init_cache(1, 64), return_aux=True)
    assert np.abs(np.asarray(out.logits) - ref.logits.numpy()).max() <= 1e-3
    want = np.concatenate([ref.hidden_states[i].numpy() for i in model.config.aux_layer_ids], axis=-1)
    assert model.config.aux_layer_ids == (2, 15, 27)
    np.testing.assert_allclose(np.asarray(out.aux), want, atol=1e-3, rtol=1e-3)


@pytest.mark.skipif(not SHARED.is_dir(), reason="needs ../shared/data")
def test_greedy_mt_bench_equals_transformers(target_dir, model, hf_model):
    tok = load_tokenizer(target_dir)
    stops = stop_token_ids(tok, target_dir, model.config.eos_token_ids)
    prompts = [encode_prompt(tok, text, raw=False) for _, text in read_prompts_file(SHARED / "mt_bench_questions.jsonl")[:10]]
    got = TargetGenerator(model, batch_size=4).generate(prompts, max_new_tokens=64, stop_ids=stops)
    for prompt, c in zip(prompts, got):
        with torch.no_grad():
            out = hf_model.generate(
                torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=64, do_sample=False, eos_token_id=stops, pad_token_id=stops[0],
            )
        assert c.token_ids == out[0, len(prompt) :].tolist()


@pytest.mark.skipif(not SHARED.is_dir(), reason="needs ../shared/data")
def test_speculative_greedy_with_random_head_equals_target_only(target_dir, model):
    from fit_head import head_config_for
    from flax import nnx

    from jaxspec.models.eagle3 import Eagle3Head
    from jaxspec.spec.generator import SpeculativeGenerator

    tok = load_tokenizer(target_dir)
    stops = stop_token_ids(tok, target_dir, model.config.eos_token_ids)
    prompts = [encode_prompt(tok, text, raw=False) for _, text in read_prompts_file(SHARED / "mt_bench_questions.jsonl")[:4]]
    head = Eagle3Head(head_config_for(model, draft_vocab_size=8192), rngs=nnx.Rngs(0))
    ref = TargetGenerator(model, batch_size=4).generate(prompts, max_new_tokens=24, stop_ids=stops)
    got = SpeculativeGenerator(model, head, num_draft=3, batch_size=4).generate(prompts, max_new_tokens=24, stop_ids=stops)
    assert [c.token_ids for c in got] == [c.token_ids for c in ref]
