"""Parsing Hugging Face config.json into TargetConfig, and refusing what jaxspec cannot run exactly."""

import numpy as np
import pytest
import torch
import transformers

from jaxspec.config import RopeConfig, TargetConfig, rope_inv_freq, target_config_from_hf
from jaxspec.errors import JaxspecError

BASE = dict(
    model_type="llama", hidden_size=64, intermediate_size=96, num_hidden_layers=32, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=100,
)


def test_llama_defaults():
    cfg = target_config_from_hf(BASE)
    assert (cfg.head_dim, cfg.num_groups, cfg.aux_layer_ids) == (16, 2, (2, 16, 29))
    assert not cfg.attention_bias and not cfg.qk_norm and cfg.context_length == 2048


def test_family_flags():
    assert target_config_from_hf({**BASE, "model_type": "qwen2"}).attention_bias
    assert not target_config_from_hf({**BASE, "model_type": "qwen2"}).o_proj_bias
    assert target_config_from_hf({**BASE, "model_type": "qwen3", "head_dim": 32}).qk_norm
    assert target_config_from_hf({**BASE, "attention_bias": True}).o_proj_bias


def test_rope_parameters_new_and_old_style():
    new = target_config_from_hf({**BASE, "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}})
    old = target_config_from_hf({**BASE, "rope_theta": 5e5, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}})
    assert new.rope == old.rope and new.rope.rope_type == "llama3" and new.rope.theta == 5e5


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "default", "rope_theta": 10000.0},
        {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
        {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    ],
)
def test_inv_freq_matches_transformers(rope):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_config = transformers.LlamaConfig(**{k: v for k, v in BASE.items() if k != "model_type"}, rope_parameters=rope)
    if rope["rope_type"] == "default":
        fn = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding.compute_default_rope_parameters
    else:
        fn = ROPE_INIT_FUNCTIONS[rope["rope_type"]]
    want, _ = fn(config=hf_config, device=torch.device("cpu"))
    got = rope_inv_freq(target_config_from_hf({**BASE, "rope_parameters": rope}))
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-6)


@pytest.mark.parametrize(
    "raw, message",
    [
        ({**BASE, "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}, "unsupported architecture GPT2LMHeadModel"),
        ({**BASE, "rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope scaling type 'yarn'"),
        ({**BASE, "hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({k: v for k, v in BASE.items() if k != "hidden_size"}, "lacks the field 'hidden_size'"),
        ({**BASE, "num_key_value_heads": 3}, "not a multiple"),
    ],
)
def test_refusals_name_the_problem(raw, message):
    with pytest.raises(JaxspecError, match=message):
        target_config_from_hf(raw)


def test_sliding_window_limits_the_usable_context():
    mistral = target_config_from_hf({**BASE, "model_type": "mistral", "sliding_window": 1024, "max_position_embeddings": 32768})
    assert mistral.context_length == 1024  # attention is exact up to the window; longer inputs are refused
    assert target_config_from_hf({**BASE, "model_type": "mistral", "sliding_window": None}).context_length == 2048
    qwen = {**BASE, "model_type": "qwen2", "sliding_window": 512, "max_position_embeddings": 4096}
    assert target_config_from_hf({**qwen, "use_sliding_window": False}).context_length == 4096
    assert target_config_from_hf({**qwen, "use_sliding_window": True}).context_length == 512


def test_aux_layer_ids_are_validated():
    with pytest.raises(JaxspecError, match="aux layer id 4"):
        TargetConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=4, num_heads=2, num_kv_heads=1,
                      head_dim=4, aux_layer_ids=(1, 2, 4))
    assert RopeConfig().rope_type == "default"
