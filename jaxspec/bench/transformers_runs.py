"""transformers on the bench's prompts: plain greedy `generate`, its assisted generation with a draft model
(`assistant_model=`), and that assisted generation's verify steps one by one, so that a draft model's acceptance in
jaxspec can be checked step for step against transformers' on the same pair.

Why the steps line up only from the second token: jaxspec's prefill emits the target's first token alone and its
first verify step drafts after it, where transformers' first step verifies the assistant's drafts together with the
prompt. Started from the prompt and that first token, transformers' assisted generation walks the same steps as
jaxspec's chain: each drafts K tokens greedily after the same committed text and accepts the same prefix.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

from jaxspec.errors import JaxspecError

NEEDS_TORCH = "--compare-hf needs torch and transformers (pip install 'jaxspec[test]')"


def _libraries():
    try:
        import torch
        import transformers
    except ImportError:
        raise JaxspecError(NEEDS_TORCH) from None
    return torch, transformers


def _load(model_dir: Path):
    torch, transformers = _libraries()
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _assistant(draft_dir: Path, num_drafts: int | None):
    """The draft model as transformers' assistant: K drafts every step (`num_drafts`; None keeps transformers'
    own schedule, which grows and shrinks K and stops drafting below a confidence threshold)."""
    assistant = _load(draft_dir)
    if num_drafts is not None:
        config = assistant.generation_config
        config.num_assistant_tokens = num_drafts
        config.num_assistant_tokens_schedule = "constant"
        config.assistant_confidence_threshold = 0.0  # falsy: no early stop, every step drafts K
    return assistant


def _cut_at_stop(ids: list[int], stops: Sequence[int]) -> list[int]:
    return ids[: next((i + 1 for i, t in enumerate(ids) if t in stops), len(ids))]


def time_hf(target_dir: Path, prompts: Sequence[Sequence[int]], max_new_tokens: int, stops: Sequence[int],
            assistant_dir: Path | None = None, num_drafts: int | None = None) -> tuple[float, int, list[list[int]]]:
    """Greedy transformers `generate` on the same prompts, batch 1, float32: (seconds, tokens, outputs). With
    `assistant_dir`, its assisted generation (`assistant_model=`, the draft model's speculative decoding), K drafts
    a step when `num_drafts` is given."""
    torch, _ = _libraries()
    model = _load(target_dir)
    assisted = {} if assistant_dir is None else {"assistant_model": _assistant(assistant_dir, num_drafts)}
    outputs, seconds = [], 0.0
    with torch.inference_mode():
        model.generate(torch.tensor([prompts[0]]), max_new_tokens=4, do_sample=False, pad_token_id=stops[0],
                       **assisted)  # warm-up
        for p in prompts:
            start = time.perf_counter()
            out = model.generate(
                torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=list(stops), pad_token_id=stops[0],
                **assisted,
            )
            seconds += time.perf_counter() - start
            outputs.append(_cut_at_stop(out[0, len(p):].tolist(), stops))
    return seconds, sum(len(o) for o in outputs), outputs


def assisted_steps(target_dir: Path, draft_dir: Path, prompts: Sequence[Sequence[int]],
                   first_tokens: Sequence[int | None], num_drafts: int, max_new_tokens: int,
                   stops: Sequence[int]) -> list[tuple[list[int], int]]:
    """Per prompt: (the tokens each verify step of transformers' assisted generation committed, its accepted drafts
    plus the target's own token; the tokens those steps gave the output after the first, cut at a stop token and
    the budget as jaxspec's output is). K drafts a step, from the prompt and the target's first token (jaxspec's
    prefill gives it; None: the output was empty and there is no step) until `max_new_tokens` in all or a stop
    token.

    transformers is given K + 1 tokens of room past the budget so that no step near the end drafts fewer than K (as
    jaxspec's last step does not); steps past the budget are not taken."""
    torch, transformers = _libraries()

    class Lengths(transformers.StoppingCriteria):
        """Called once after each step of the main loop (the assistant's own generate gets none): the lengths."""

        def __init__(self):
            self.lengths: list[int] = []

        def __call__(self, input_ids, scores, **kwargs):
            self.lengths.append(input_ids.shape[1])
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    model, assistant = _load(target_dir), _assistant(draft_dir, num_drafts)
    steps = []
    with torch.inference_mode():
        for prompt, first in zip(prompts, first_tokens):
            if first is None or first in stops or max_new_tokens <= 1:
                steps.append(([], 0))
                continue
            ids = [*prompt, first]
            trace = Lengths()
            out = model.generate(
                torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=max_new_tokens - 1 + num_drafts + 1, do_sample=False, eos_token_id=list(stops),
                pad_token_id=stops[0], assistant_model=assistant, stopping_criteria=[trace],
            )
            committed, done = [], 1
            for before, after in zip([len(ids), *trace.lengths], trace.lengths):
                if done >= max_new_tokens:
                    break
                committed.append(after - before)
                done += after - before
            tokens = len(_cut_at_stop(out[0, len(ids):].tolist(), stops)[: max_new_tokens - 1])
            steps.append((committed, tokens))
    return steps


def steps_agree(steps: Sequence[int], stats: dict, depth: int) -> bool:
    """Whether one prompt's transformers steps (tokens committed each) are jaxspec's: as many verify steps, and
    the same count of steps accepting at least j drafts for every position j (its `accepted_per_position`)."""
    at_least = [sum(c - 1 > j for c in steps) for j in range(depth)]
    accepted = list(stats.get("accepted_per_position", [0] * depth))
    return stats.get("verify_calls", 0) == len(steps) and accepted == at_least


def assisted_acceptance(runs: Sequence[tuple[Sequence[int], int]], completions, depth: int) -> dict:
    """transformers' acceptance over all prompts (`assisted_steps`), beside jaxspec's chain on the same prompts
    (`completions`, their stats): mean accepted length (tokens per verify, as `suite.speculative_stats` counts it),
    the histogram of accepted drafts per step, and on how many prompts the steps were the same."""
    flat = [c for s, _ in runs for c in s]
    histogram = [sum(c - 1 == a for c in flat) for a in range(depth + 1)]
    same = sum(steps_agree(s, c.stats, depth) for (s, _), c in zip(runs, completions))
    return {
        "num_assistant_tokens": depth,
        "verify_steps": len(flat),
        "mean_accepted_length": round(sum(t for _, t in runs) / max(len(flat), 1), 3),
        "accepted_drafts_histogram": histogram,
        "same_steps_as_jaxspec": f"{same}/{len(runs)}",
    }
