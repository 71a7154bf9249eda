"""Gemma 3 and Gemma 2 targets: the Gemma 4 decoder (jaxspec/models/gemma.py) by configuration alone. Tiny random
Gemma3ForCausalLM / Gemma2ForCausalLM checkpoints built with transformers' own config classes and weight names load
by name (Gemma 3 also from the multimodal checkpoint's layouts), give transformers' logits, features and greedy text
past the sliding window, and greedy speculation in bfloat16 equals target-only (Gemma 2: soft-capped scores in the
invariant attention). The soft cap in the attention itself (kernel and reference): tests/test_invariant_attention.py."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from hf_tiny import as_multimodal, assert_greedy_text_equals_transformers
from spec_fixtures import PROMPTS, in_dtype

from jaxspec.checkpoints.hf import load_target
from jaxspec.config import target_config_from_hf
from jaxspec.engine.generation import Generator
from jaxspec.errors import JaxspecError
from jaxspec.models.gemma import GemmaModel

SLIDING, FULL = "sliding_attention", "full_attention"
SHAPE = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, sliding_window=8, layer_types=[SLIDING, FULL, SLIDING, SLIDING],
             query_pre_attn_scalar=24)
# Gemma 3: q/k norms, full layers with linearly scaled RoPE at another base, a window of 8 (generation runs past it)
GEMMA3 = dict(SHAPE, rope_parameters={SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
                                      FULL: {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0}})
# Gemma 2: no q/k norms, scores and logits soft-capped low enough that the caps bite
GEMMA2 = dict(SHAPE, attn_logit_softcapping=3.0, final_logit_softcapping=5.0)
FAMILIES = {"gemma3": GEMMA3, "gemma2": GEMMA2}


def make_gemma(family: str, out_dir, seed: int = 0):
    """A random Gemma3ForCausalLM or Gemma2ForCausalLM saved to out_dir: weights N(0, 0.15²), norm weights (applied as
    1 + w) N(0, 0.2²), so that every part changes the output."""
    import transformers

    config_cls, model_cls = {"gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
                             "gemma2": ("Gemma2Config", "Gemma2ForCausalLM")}[family]
    torch.manual_seed(seed)
    config = getattr(transformers, config_cls)(**FAMILIES[family])
    config._attn_implementation = "eager"  # Gemma 2's soft cap: transformers' eager attention only
    hf = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.normal_(0.0, 0.2 if "norm" in name else 0.15)
    hf.save_pretrained(out_dir)
    hf.generation_config.eos_token_id = None  # 32 tokens whatever they are, as jaxspec without stop ids
    return hf


@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_features_and_greedy_text_equal_transformers(family, tmp_path):
    hf = make_gemma(family, tmp_path / "text")
    model = load_target(tmp_path / "text", aux_layer_ids=(1, 2, 3))
    assert isinstance(model, GemmaModel) and model.config.model_type == hf.config.model_type
    forward = nnx.jit(lambda m, ids, positions: m(ids, positions, m.init_cache(2, 24), empty_cache=True,
                                                  return_aux=True))
    ids = np.random.RandomState(0).randint(0, 128, (2, 20))
    with torch.no_grad():
        ref = hf(torch.tensor(ids), output_hidden_states=True)
    positions = jnp.broadcast_to(jnp.arange(20), (2, 20))
    out = forward(model, jnp.asarray(ids), positions)
    scale = np.abs(ref.logits.numpy()).max()
    np.testing.assert_allclose(np.asarray(out.logits), ref.logits.numpy(), atol=1e-4 * scale)
    features = np.concatenate([ref.hidden_states[i].numpy() for i in (1, 2, 3)], axis=-1)
    np.testing.assert_allclose(np.asarray(out.aux), features, atol=1e-4 * np.abs(features).max())
    if family == "gemma3":  # the same decoder in the published multimodal layout: the same logits
        # as Google published it: the decoder under language_model.model., a vision tower and projector beside it
        multimodal = as_multimodal(tmp_path / "text", tmp_path / "multimodal", "gemma3", "language_model.model.", {
            "vision_tower.vision_model.embeddings.patch_embedding.weight": (4, 4),
            "multi_modal_projector.mm_input_projection_weight": (4, 64)})
        mm_out = forward(load_target(multimodal, aux_layer_ids=(1, 2, 3)), jnp.asarray(ids), positions)
        np.testing.assert_array_equal(np.asarray(mm_out.logits), np.asarray(out.logits))
    assert_greedy_text_equals_transformers(load_target(tmp_path / "text"), hf)  # invariant numerics, the default


def test_greedy_speculation_on_a_soft_capped_target_equals_target_only(tmp_path):
    """Gemma 2 in bfloat16 (soft-capped scores, a window of 8, 32 tokens after prompts of up to 33): prompt lookup
    at batch 4, steps that verify a match and steps that run the root alone, gives target-only's tokens one row at a
    time."""
    from jaxspec.engine.proposers.ngram import NgramProposer

    make_gemma("gemma2", tmp_path)
    target = in_dtype(load_target(tmp_path), jnp.bfloat16)
    prompts = [PROMPTS[0], PROMPTS[1] * 3, PROMPTS[2], PROMPTS[3]]  # one repeats itself: prompt lookup finds matches
    want = [c.token_ids for c in Generator(target, batch_size=1).generate(prompts, max_new_tokens=32)]
    got = Generator(target, proposer=NgramProposer(4, 2, 3), batch_size=4).generate(prompts, max_new_tokens=32)
    assert [c.token_ids for c in got] == want
    outcomes = {k: sum(c.stats["rejections"][k] for c in got) for k in ("no_draft", "miss", "all_accepted")}
    assert outcomes["no_draft"] > 0 and outcomes["miss"] + outcomes["all_accepted"] > 0


def test_configs_as_transformers_reads_them_and_refusals():
    from transformers import Gemma2Config, Gemma3TextConfig

    # Gemma 3 as its published config.json reads (before transformers 5): rope_theta for full layers with
    # rope_scaling, rope_local_base_freq for sliding ones, a full layer every sliding_window_pattern
    legacy = dict(SHAPE, model_type="gemma3_text", layer_types=None, num_hidden_layers=6, sliding_window_pattern=3,
                  rope_theta=1_000_000.0, rope_local_base_freq=10_000.0,
                  rope_scaling={"rope_type": "linear", "factor": 8.0})
    cfg = target_config_from_hf(legacy)
    g = cfg.gemma
    assert g.layer_types == (SLIDING, SLIDING, FULL) * 2
    assert g.full_rope == (1e6, 1.0, 8.0) and g.sliding_rope == (1e4, 1.0, 1.0)
    assert (g.norm_offset, g.qk_norm, g.v_norm, g.layer_scalar, g.attn_softcapping) == (True, True, False, False,
                                                                                          None)
    assert g.query_scale == 24**-0.5 and g.kv_source == tuple(range(6)) and g.per_layer_dim == 0
    written = Gemma3TextConfig(**GEMMA3).to_dict()  # transformers 5: rope_parameters per layer type
    assert target_config_from_hf(written).gemma.full_rope == (1e6, 1.0, 8.0)
    # Gemma 2's defaults: alternating layers (sliding first), scores capped at 50, logits at 30, one RoPE
    g2 = target_config_from_hf(Gemma2Config(**dict(SHAPE, layer_types=None)).to_dict()).gemma
    assert g2.layer_types == (SLIDING, FULL) * 2 and (g2.attn_softcapping, g2.final_logit_softcapping) == (50.0, 30.0)
    assert not g2.qk_norm and g2.full_rope == g2.sliding_rope == (1e4, 1.0, 1.0)
    assert target_config_from_hf({"model_type": "gemma3", "text_config": written}).model_type == "gemma3_text"
    for bad, message in ((dict(use_bidirectional_attention=True), "bidirectional"),
                         (dict(attention_bias=True), "attention_bias is not supported"),
                         (dict(hidden_activation="silu"), "hidden_activation"),
                         (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope_type 'yarn' is not supported"),
                         (dict(sliding_window_pattern=0), "sliding_window_pattern must be >= 1"),
                         (dict(query_pre_attn_scalar=0), "must be positive"),
                         (dict(num_key_value_heads=3), "not a multiple of 3 KV heads")):
        with pytest.raises(JaxspecError, match=message):
            target_config_from_hf({**legacy, **bad})
    with pytest.raises(JaxspecError, match="a gemma3 config without a text_config"):
        target_config_from_hf({"model_type": "gemma3"})


GEMMA_CHAT_TEMPLATE = (  # Gemma 2/3's template, as their tokenizer_config.json carries it (system turns left out)
    "{{ bos_token }}{% for message in messages %}{% set role = 'model' if message['role'] == 'assistant' "
    "else message['role'] %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}")


def test_generate_applies_the_chat_template_and_stops_at_the_end_of_turn(tmp_path, capsys):
    """`jaxspec.generate --prompt` on a Gemma 3 target: the prompt wrapped in Gemma's chat template, and the greedy
    text transformers generates from the same ids, <end_of_turn> a stop token (by name, as for every target)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from jaxspec import generate
    from jaxspec.prompts import stop_token_ids

    hf = make_gemma("gemma3", tmp_path)
    chars = [chr(c) for c in range(32, 127)]
    specials = ["<unk>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"]
    backend = Tokenizer(models.WordLevel({t: i for i, t in enumerate([*chars, "\n", *specials])}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="<eos>",
                                        bos_token="<bos>", additional_special_tokens=specials[3:])
    tokenizer.chat_template = GEMMA_CHAT_TEMPLATE
    tokenizer.save_pretrained(str(tmp_path))
    end_of_turn = tokenizer.convert_tokens_to_ids("<end_of_turn>")
    assert end_of_turn in stop_token_ids(tokenizer, tmp_path)
    assert generate.main(["--target", str(tmp_path), "--prompt", "Hi", "--json", "--max-new-tokens", "24"]) == 0
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids  # transformers 5 returns an encoding
    assert tokenizer.decode(ids, skip_special_tokens=False).endswith("<start_of_turn>model\n")
    with torch.no_grad():
        want = hf.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False, pad_token_id=0,
                           eos_token_id=[tokenizer.eos_token_id, end_of_turn])[0, len(ids):].tolist()
    assert record["token_ids"] == want
