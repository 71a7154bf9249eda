"""Prompts written by the target itself (train/self_prompts.py, `python -m train.data prompts`)."""

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from hf_tiny import write_char_tokenizer

from jaxspec.errors import JaxspecError
from jaxspec.prompts import read_prompts_file
from train.self_prompts import read_written, round_seed, sample_prompts, user_turn_prefix

ROOT = Path(__file__).resolve().parents[1]


def test_the_prefix_is_the_template_up_to_the_users_message(tmp_path):
    import transformers

    write_char_tokenizer(tmp_path)
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
    tok.chat_template = (
        "{% if messages[0]['role'] != 'system' %}[sys]be kind[/sys]{% endif %}"
        "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}[end]{% endfor %}"
        "{% if add_generation_prompt %}[assistant]{% endif %}"
    )
    prefix = user_turn_prefix(tok)
    assert tok.decode(prefix) == "[sys]be kind[/sys][user]"
    tok.chat_template = None
    with pytest.raises(JaxspecError, match="no chat template"):
        user_turn_prefix(tok)


@dataclass
class Done:
    token_ids: list[int]
    finished_by_eos: bool


ROUND_OF = {round_seed(10, r): r for r in range(3)}  # the scripted rounds by their sampling seed


class Scripted:
    """Stands in for the target's Generator: each round (seed) returns the scripted turns, as token ids."""

    batch_size = 4

    def __init__(self, rounds):
        self.rounds, self.seeds = rounds, []

    def generate(self, prompts, *, max_new_tokens, sampling, stop_ids, seed):
        assert len(prompts) == self.batch_size and sampling.temperature > 0
        self.seeds.append(seed)
        return [Done([ord(c) for c in text], finished) for text, finished in self.rounds[ROUND_OF[seed]]]


def decode(ids):
    return "".join(map(chr, ids))


def test_sampling_keeps_distinct_finished_turns_and_resumes():
    from jaxspec.sampling import SamplingConfig

    rounds = [
        [("What is rain?", True), ("  ", True), ("Cut mid-sent", False), ("Banned one", True)],
        [("What is rain?", True), ("Write a poem.", True), ("Plan a trip.", True), ("Sort a list.", True)],
        [("Name a bird.", True), ("Name a fish.", True), ("x", True), ("y", True)],
    ]
    kw = {"seed": 10, "sampling": SamplingConfig(temperature=1.0), "max_tokens": 8, "exclude": {"Banned one"}}
    written, drops = [], []
    gen = Scripted(rounds)

    def on_round(new, dropped):
        written.extend(new)
        drops.append(dropped)

    rows = sample_prompts(gen, [1, 2], decode, [0], count=3, on_round=on_round, **kw)
    # round 0 keeps one (empty, unfinished, excluded dropped); round 1 adds two, its repeat of round 0 dropped
    assert [r["prompt"] for r in rows] == ["What is rain?", "Write a poem.", "Plan a trip."]
    assert [r["round"] for r in rows] == [0, 1, 1] and gen.seeds == [round_seed(10, 0), round_seed(10, 1)]
    assert drops == [{"unfinished": 1, "empty": 1, "repeated": 0, "excluded": 1},
                     {"unfinished": 0, "empty": 0, "repeated": 1, "excluded": 0}]  # round 1 stops at count
    assert written == rows and len({r["id"] for r in rows}) == 3
    # a rerun with a larger count continues after the last round written, keeping what exists
    gen = Scripted(rounds)
    more = sample_prompts(gen, [1, 2], decode, [0], count=5, written=rows, **kw)
    assert more[:3] == rows and [r["prompt"] for r in more[3:]] == ["Name a bird.", "Name a fish."]
    assert gen.seeds == [round_seed(10, 2)]
    with pytest.raises(JaxspecError, match="only 1 of 5 distinct prompts after 1 rounds"):
        sample_prompts(Scripted(rounds), [1, 2], decode, [0], count=5, max_rounds=1, **kw)


def test_runs_with_other_seeds_sample_other_rounds():
    """--seed 1 once replayed --seed 0's rounds 1, 2, ... (seed + round): a second file excluding the first kept
    nothing. Round seeds are hashed from (seed, round): no two of these runs' rounds share one."""
    seeds = [round_seed(s, r) for s in range(4) for r in range(256)]
    assert len(set(seeds)) == len(seeds) and all(0 <= x < 2**31 for x in seeds)


def test_a_run_replaying_an_excluded_file_is_refused():
    """The same --seed as the run that wrote an excluded file samples its rounds again: every turn of the first
    round is excluded, and the command says to change the seed instead of sampling nothing for hours."""
    from jaxspec.sampling import SamplingConfig

    rounds = [[("Write a poem.", True), ("Cut mid-sent", False), ("Sort a list.", True), ("Name a bird.", True)]]
    kw = {"seed": 10, "sampling": SamplingConfig(temperature=1.0), "max_tokens": 8}
    earlier = {"Write a poem.", "Sort a list.", "Name a bird."}  # the excluded file's first round
    with pytest.raises(JaxspecError, match="round 0 sampled only excluded turns: --seed 10 replays"):
        sample_prompts(Scripted(rounds), [1, 2], decode, [0], count=3, exclude=earlier, **kw)
    # one finished turn excluded, or a round of this run's own repeats, is no evidence of a replay
    rounds = [[("Write a poem.", True), ("Cut", False), ("Cut", False), ("Cut", False)],
              [("A.", True), ("B.", True), ("C.", True), ("D.", True)],
              [("A.", True), ("B.", True), ("C.", True), ("D.", True)]]
    with pytest.raises(JaxspecError, match="only 4 of 5 distinct prompts after 3 rounds"):
        sample_prompts(Scripted(rounds), [1, 2], decode, [0], count=5, exclude=earlier, max_rounds=3, **kw)


def test_a_foreign_file_is_refused(tmp_path):
    bad = tmp_path / "p.jsonl"
    bad.write_text(json.dumps({"id": "a", "prompt": "hi"}) + "\n")
    with pytest.raises(JaxspecError, match="is not a row of `train.data prompts`"):
        read_written(bad)


@pytest.mark.smollm2
@pytest.mark.slow  # ~100 s on SmolLM2; the tiny-target tests above cover the writer
def test_the_builtin_target_writes_prompts_that_generate_reads(tmp_path):
    """End to end on SmolLM2-135M-Instruct: the CLI writes distinct chat prompts, generate's reader takes the file,
    and a rerun with a larger count continues it."""
    out = tmp_path / "self.jsonl"

    def run(count):
        cmd = [sys.executable, "-m", "train.data", "prompts", "--out", str(out), "--count", str(count),
               "--batch-size", "4", "--max-tokens", "48", "--exclude", "mt_bench"]
        proc = subprocess.run(cmd, check=False, cwd=ROOT, capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stderr

    run(2)
    first = read_prompts_file(out)
    assert len(first) == 2 and len({text for _, text in first}) == 2
    assert all(text.strip() and "<|im_" not in text for _, text in first)
    run(3)
    again = read_prompts_file(out)
    assert again[:2] == first and len(again) == 3 and len({text for _, text in again}) == 3
