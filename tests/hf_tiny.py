"""Tiny random Hugging Face checkpoints of each supported family, written with transformers (torch, CPU)."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

COMMON = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
)

FAMILIES = {
    # name: (config class, model class, extra config)
    "llama3_scaled": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        dict(
            rope_theta=500000.0,
            rope_scaling=dict(
                rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                original_max_position_embeddings=32,
            ),
        ),
    ),
    "smollm2_tied": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        dict(tie_word_embeddings=True, num_key_value_heads=1, rope_theta=100000.0),
    ),
    "qwen2_bias": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, dict(tie_word_embeddings=False)),
    "qwen3_qknorm": (
        transformers.Qwen3Config,
        transformers.Qwen3ForCausalLM,
        dict(head_dim=32, tie_word_embeddings=True),
    ),
    "llama_biases": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        dict(attention_bias=True, mlp_bias=True, head_dim=32),
    ),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, dict(sliding_window=None)),
    # mixtures of experts (jaxspec/models/moe.py): top-2 of 8 with a dense layer between, top-2 of 4 in every layer,
    # top-2 of 4 with a shared expert; top-1 and top-8 in tests/test_moe.py
    "qwen3_moe": (
        transformers.Qwen3MoeConfig,
        transformers.Qwen3MoeForCausalLM,
        dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, mlp_only_layers=[1], norm_topk_prob=True,
             head_dim=16),
    ),
    "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM,
                dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=None)),
    "qwen2_moe_shared": (
        transformers.Qwen2MoeConfig,
        transformers.Qwen2MoeForCausalLM,
        dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
             tie_word_embeddings=False),
    ),
}


def make_tiny(family: str, out_dir: Path, seed: int = 0, **overrides):
    """Save a random tiny model of `family` to out_dir and return the torch model (eval mode, float32); `overrides`
    replace config fields."""
    config_cls, model_cls, extra = FAMILIES[family]
    torch.manual_seed(seed)
    config = config_cls(**{**COMMON, **extra, **overrides})
    model = model_cls(config).eval()
    with torch.no_grad():  # non-trivial norms and biases, so that a missed weight shows up in the logits
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                param.add_(0.1 * torch.randn_like(param))
    model.save_pretrained(out_dir)
    return model


class ByteTokenizer:
    """Stands in for a tokenizer: the tiny random checkpoints ship none."""

    eos_token_id = None
    chat_template = None

    def __call__(self, text, add_special_tokens=True):
        return type("Encoding", (), {"input_ids": [ord(ch) % 97 for ch in text]})

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))

    def get_vocab(self):
        return {}


def write_char_tokenizer(out_dir: str | Path) -> None:
    """A real (saved, loadable with AutoTokenizer) one-token-per-character tokenizer for the tiny checkpoints, so
    that subprocess tests run the CLIs unpatched: printable ASCII, <unk> and <eos> — 97 ids, the tiny vocabulary."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    chars = [chr(c) for c in range(32, 127)]
    vocab = {ch: i for i, ch in enumerate([*chars, "<unk>", "<eos>"])}
    assert len(vocab) == COMMON["vocab_size"]
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="<eos>")
    tokenizer.save_pretrained(str(out_dir))


def make_training_setup(base: Path, target_seed: int = 1) -> Path:
    """A tiny SmolLM2-shaped target at base/target and one training shard at base/data: 24 random sequences of
    12-29 tokens, the first 5 the prompt (what `train.launch` tests train on); returns base."""
    import numpy as np

    from train.data import write_shard

    make_tiny("smollm2_tied", base / "target", seed=target_seed)
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, 97, rng.integers(12, 30)).tolist() for _ in range(24)]
    (base / "data").mkdir()
    write_shard(base / "data" / "shard-00000.npz", seqs, [5] * len(seqs), [str(i) for i in range(len(seqs))],
                [True] * len(seqs))
    return base


def train_head_on_own_text(target_dir: Path, out: Path, prompts: list[list[int]], batch_size: int = 8,
                           seq_len: int = 32, **head) -> tuple[Path, list[list[int]]]:
    """train.launch on a tiny target's own greedy text: its 24-token continuations of `prompts` (5 tokens each) as
    one shard under out/data, 60 steps of a head (`head`: the config's head section) → (the run directory, the
    training sequences)."""
    import yaml

    from jaxspec.checkpoints.hf import load_target
    from jaxspec.engine.generation import Generator
    from train.config import load_config
    from train.data import write_shard
    from train.launch import run

    continuations = Generator(load_target(target_dir), batch_size=batch_size).generate(prompts, max_new_tokens=24)
    seqs = [p + c.token_ids for p, c in zip(prompts, continuations)]
    (out / "data").mkdir(parents=True)
    write_shard(out / "data" / "shard-00000.npz", seqs, [5] * len(seqs), [str(i) for i in range(len(seqs))],
                [True] * len(seqs))
    cfg = {"target": str(target_dir), "data": str(out / "data"), "out": str(out / "run"),
           "head": {"intermediate_size": 96, **head},
           "train": {"num_draft_steps": 3, "batch_size": 4, "seq_len": seq_len, "steps": 60, "seed": 0,
                     "checkpoint_every": 60, "keep_checkpoints": 1, "log_every": 10, "eval_every": 0,
                     "compute_dtype": "float32"},
           "optim": {"learning_rate": 0.003, "warmup_steps": 2}}
    (out / "run.yaml").write_text(yaml.safe_dump(cfg))
    run(load_config(out / "run.yaml"))
    return out / "run", seqs


def as_multimodal(text_dir: Path, out_dir: Path, model_type: str, prefix: str, extra: dict) -> Path:
    """A multimodal-layout copy of a text checkpoint (Gemma3/Gemma4ForConditionalGeneration): config.json's
    text_config, the decoder's `model.*` tensors under `prefix`, the tied LM head dropped, and `extra` tensors (towers
    the loader must ignore) beside them."""
    import json

    import numpy as np
    from safetensors.numpy import load_file, save_file

    tensors = load_file(Path(text_dir) / "model.safetensors")
    renamed = {k.replace("model.", prefix, 1): v for k, v in tensors.items() if k != "lm_head.weight"}
    renamed.update({k: np.zeros(shape, np.float32) for k, shape in extra.items()})
    out_dir.mkdir()
    save_file(renamed, out_dir / "model.safetensors")
    text_config = json.loads((Path(text_dir) / "config.json").read_text())
    arch = {"gemma3": "Gemma3ForConditionalGeneration", "gemma4": "Gemma4ForConditionalGeneration"}[model_type]
    (out_dir / "config.json").write_text(json.dumps({"model_type": model_type, "architectures": [arch],
                                                     "text_config": text_config, "vision_config": {}}))
    return out_dir


def assert_greedy_text_equals_transformers(model, hf, max_new_tokens: int = 32) -> None:
    """Greedy generation of a jaxspec target (its default numerics) equals transformers' generate on two prompts
    of 5 and 11 tokens, batched together in jaxspec and one at a time in transformers."""
    from jaxspec.engine.generation import Generator

    prompts = [[5, 17, 3, 9, 60], [44, 2, 61, 8, 19, 23, 7, 1, 90, 12, 4]]
    got = Generator(model, batch_size=2).generate(prompts, max_new_tokens=max_new_tokens)
    for prompt, completion in zip(prompts, got):
        with torch.no_grad():
            want = hf.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
        assert completion.token_ids == want[0, len(prompt):].tolist()
