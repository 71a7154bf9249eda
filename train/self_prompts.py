"""User prompts written by the target itself, for self-distilled training data in the target's own chat domain.

Why: a head drafts only as well as its training data resembles what it will be asked to draft. The shipped prompt
mix is mostly GSM8K, T0 templates and CodeAlpaca, and the SmolLM2 heads draft half as well on MT-Bench's open
chat as on held-out prompts of that mix (BENCHMARKS.md, "where the MT-Bench gap comes from"). An instruct model
asked to continue its chat template right after the user-turn header writes a user's message — the method of
Magpie (Xu et al., 2024, "Magpie: Alignment Data Synthesis from Scratch by Prompting Aligned LLMs with Nothing").
Sampling that turn many times gives prompts from the distribution the target was tuned on, with no dataset and
no download; `python -m train.data generate --prompts FILE` then writes the target's greedy responses to them.

  python -m train.data prompts --out self.jsonl --count 4096 [--exclude mt_bench gsm8k] [--seed S]

A second file that excludes a first needs another --seed: with the same one it samples the same rounds.
"""

from __future__ import annotations

import json
import os
import sys
from collections import Counter
from pathlib import Path

from jaxspec.errors import JaxspecError
from jaxspec.files import read_text

_SENTINEL = "\x00JAXSPEC_USER_TURN\x00"


def user_turn_prefix(tokenizer) -> list[int]:
    """Token ids of the chat template up to where a user's message starts (the system turn the template adds by
    default, then the user header): what the target continues to write a prompt."""
    if not getattr(tokenizer, "chat_template", None):
        raise JaxspecError("this tokenizer has no chat template: the target cannot be asked for a user's turn")
    text = tokenizer.apply_chat_template([{"role": "user", "content": _SENTINEL}], tokenize=False)
    if _SENTINEL not in text:
        raise JaxspecError("the chat template does not place the user's message verbatim; cannot find its start")
    return tokenizer(text[: text.index(_SENTINEL)], add_special_tokens=False).input_ids


def read_written(path: Path) -> list[dict]:
    """Rows already in a prompts file this module wrote ({id, prompt, round}), so that a rerun continues it."""
    if not path.is_file():
        return []
    rows = []
    for lineno, line in enumerate(read_text(path, "prompts file").splitlines(), 1):
        if line.strip():
            try:
                row = json.loads(line)
                rows.append({"id": str(row["id"]), "prompt": str(row["prompt"]), "round": int(row["round"])})
            except (json.JSONDecodeError, KeyError, TypeError, ValueError):
                raise JaxspecError(
                    f"{path.name}:{lineno} is not a row of `train.data prompts` (id, prompt, round); use a new --out"
                ) from None
    return rows


def round_seed(seed: int, rnd: int) -> int:
    """The sampling seed of round `rnd` of a run started with `seed` (>= 0): a 31-bit hash of the pair, so that
    runs with other --seed values do not replay each other's rounds (with seed + round, --seed 1 repeated --seed
    0's rounds 1, 2, ... and kept nothing while a file of --seed 0 was excluded)."""
    import numpy as np

    return int(np.random.SeedSequence((seed, rnd)).generate_state(1, np.uint32)[0] >> 1)  # fits an int32


def sample_prompts(
    generator,  # jaxspec.engine.generation.Generator over the target (target-only)
    prefix: list[int],
    decode,  # token ids -> text
    stop_ids: list[int],
    *,
    count: int,
    seed: int,
    sampling,  # jaxspec.sampling.SamplingConfig (temperature > 0)
    max_tokens: int,
    exclude: set[str] = frozenset(),
    written: list[dict] = (),
    on_round=None,  # called with each round's new rows and its dropped turns by reason (the CLI appends the rows)
    max_rounds: int | None = None,
) -> list[dict]:
    """Rows {id, prompt, round} until `count` distinct prompts exist (those in `written` count): each round
    samples one batch of user turns from `prefix` with round_seed(seed, round). A turn that does not end with a
    stop token within max_tokens (cut mid-sentence), is empty, repeats an earlier prompt or is in `exclude` is
    dropped. A round that keeps nothing because every finished turn (two or more) is in `exclude` is an error: a
    run that replays the rounds of the run that wrote an excluded file (the same --seed and settings) would keep
    nothing for as long as it ran."""
    rows = list(written)
    seen = {r["prompt"] for r in rows}  # excluded turns are told apart first
    start = max((r["round"] for r in rows), default=-1) + 1
    rounds = max_rounds if max_rounds is not None else 64 + 8 * -(-count // generator.batch_size)
    for rnd in range(start, start + rounds):
        if len(rows) >= count:
            break
        done = generator.generate([prefix] * generator.batch_size, max_new_tokens=max_tokens, sampling=sampling,
                                  stop_ids=stop_ids, seed=round_seed(seed, rnd))
        new, dropped = [], {"unfinished": 0, "empty": 0, "repeated": 0, "excluded": 0}
        for c in done:
            text = decode(c.token_ids).strip()
            if not c.finished_by_eos:
                dropped["unfinished"] += 1
            elif not text:
                dropped["empty"] += 1
            elif text in exclude:
                dropped["excluded"] += 1
            elif text in seen:
                dropped["repeated"] += 1
            elif len(rows) + len(new) < count:
                seen.add(text)
                new.append({"id": f"self-{seed}-{len(rows) + len(new):06d}", "prompt": text, "round": rnd})
        rows += new
        if on_round is not None:
            on_round(new, dropped)
        finished = len(done) - dropped["unfinished"] - dropped["empty"]
        if not new and finished >= 2 and dropped["excluded"] == finished:
            raise JaxspecError(
                f"round {rnd} sampled only excluded turns: --seed {seed} replays the rounds of the run that wrote "
                "a file given to --exclude; pass another --seed"
            )
    if len(rows) < count:
        raise JaxspecError(
            f"only {len(rows)} of {count} distinct prompts after {rounds} rounds (the target rarely ends its user "
            "turn within --max-tokens): raise --max-tokens or --temperature"
        )
    return rows


def append_rows(path: Path, rows: list[dict]) -> None:
    """Append rows to the JSONL file and flush them to disk: a killed run keeps every finished round."""
    with path.open("a") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
        f.flush()
        os.fsync(f.fileno())


def write_prompts(args) -> None:
    """`python -m train.data prompts`."""
    from tqdm import tqdm

    from jaxspec.cli.loading import kernels_impl, load_target_and_tokenizer, resolve_target
    from jaxspec.config import load_target_config
    from jaxspec.engine.generation import Generator
    from jaxspec.prompts import excluded_prompts, stop_token_ids
    from jaxspec.sampling import SamplingConfig

    out = Path(args.out)
    if out.exists() and not out.is_file():
        raise JaxspecError(f"--out {str(out)!r} exists and is not a file")
    exclude = excluded_prompts(args.exclude)
    written = read_written(out)
    if len(written) >= args.count:
        print(f"{out} already holds {len(written)} prompts", file=sys.stderr)
        return
    sampling = SamplingConfig(temperature=args.temperature, top_p=args.top_p)
    target_dir = resolve_target(args.target)
    load_target_config(target_dir)
    model, tokenizer = load_target_and_tokenizer(
        target_dir, args.dtype, numerics=args.numerics, kernels=kernels_impl(args), quantize=args.quantize
    )
    prefix = user_turn_prefix(tokenizer)
    stops = stop_token_ids(tokenizer, target_dir, model.config.eos_token_ids)
    gen = Generator(model, batch_size=args.batch_size)
    out.parent.mkdir(parents=True, exist_ok=True)
    bar = tqdm(total=args.count, initial=len(written), desc="prompts", unit="prompt")

    dropped_total = Counter()

    def on_round(rows, dropped):
        append_rows(out, rows)
        dropped_total.update(dropped)
        bar.update(len(rows))
        bar.set_postfix({f"dropped {why}": n for why, n in dropped_total.items()})  # redrawn each round

    sample_prompts(
        gen, prefix, lambda ids: tokenizer.decode(ids, skip_special_tokens=True), stops, count=args.count,
        seed=args.seed, sampling=sampling, max_tokens=args.max_tokens, exclude=exclude, written=written,
        on_round=on_round,
    )
    bar.close()
