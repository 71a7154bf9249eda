"""`--proposer ngram` (prompt lookup) through the engine: greedy output equals target-only output, ragged batches,
lossless sampling with deterministic drafts, raw statistics, and the CLI's flags and errors."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hf_tiny import ByteTokenizer, make_tiny
from spec_fixtures import PROMPTS, tiny_target
from test_spec_sampling import VOCAB, chi_square_p, first_two, plain_target

from jaxspec.errors import JaxspecError
from jaxspec.engine.generation import Generator, tokens_per_verify
from jaxspec.processors import LogitProcessors
from jaxspec.sampling import SamplingConfig, filtered_logits
from jaxspec.engine.proposers.ngram import NgramProposer

# The tiny target falls into short cycles (e.g. 16 9 16 9 ...), which prompt lookup picks up; a prompt that
# repeats itself gives it matches from the first step.
REPEATING = [PROMPTS[1] * 3, [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_ngram")
    make_tiny("smollm2_tied", path, seed=5)
    return path


def target_joint(prompt: list[int], sampling: SamplingConfig) -> np.ndarray:
    """P(x1, x2) [V, V] of the target alone after `prompt`, computed directly."""
    target, n = plain_target(), len(prompt)
    seqs = jnp.asarray([prompt + [x1] for x1 in range(VOCAB)], jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(n + 1, dtype=jnp.int32), seqs.shape)
    out = target(seqs, pos, target.init_cache(VOCAB, n + 1))
    probs = np.asarray(jax.nn.softmax(filtered_logits(out.logits, sampling), axis=-1), np.float64)
    return probs[0, n - 1][:, None] * probs[:, n]


# both slow (~30 s): in CI prompt lookup's greedy output equals target-only in bfloat16 on test_moe's mesh test
@pytest.mark.parametrize("k, batch, min_n, max_n", [pytest.param(3, 1, 1, 3, marks=pytest.mark.slow),
                                                    pytest.param(5, 4, 2, 4, marks=pytest.mark.slow)])
def test_greedy_equals_target_only(k, batch, min_n, max_n):
    prompts = PROMPTS + REPEATING
    want = [c.token_ids for c in Generator(tiny_target(), batch_size=1).generate(prompts, max_new_tokens=40)]
    gen = Generator(tiny_target(), proposer=NgramProposer(k, min_n, max_n), batch_size=batch)
    got = gen.generate(prompts, max_new_tokens=40)
    assert [c.token_ids for c in got] == want
    assert tokens_per_verify(got) > 2  # the cycles are drafted and accepted
    for c in got:
        s = c.stats
        assert s["proposer"] == "ngram" and s["draft_calls"] == 0 and len(s["accepted_per_position"]) == k
        assert all(isinstance(x, int) for x in s["accepted_per_position"])
        assert s["target_calls"] == s["verify_calls"] + 1
        # accepted runs are prefixes: position j accepted at most as often as position j - 1
        assert s["accepted_per_position"] == sorted(s["accepted_per_position"], reverse=True)
        assert sum(s["accepted_per_position"]) + s["verify_calls"] >= c.num_generated - 1  # EOS/budget may cut


@pytest.mark.slow  # processors with speculation stay in CI: test_processors
def test_with_logit_processors_equals_target_only():
    penalties = LogitProcessors(repetition_penalty=1.2, frequency_penalty=0.2)
    prompts = PROMPTS + REPEATING
    want = Generator(tiny_target(), batch_size=2).generate(prompts, max_new_tokens=30, processors=penalties)
    got = Generator(tiny_target(), proposer=NgramProposer(4), batch_size=2).generate(
        prompts, max_new_tokens=30, processors=penalties
    )
    assert [c.token_ids for c in got] == [c.token_ids for c in want]


@pytest.mark.slow  # CI: the walk for deterministic drafts (q None) under sampling in test_dflash's sampling test
def test_sampling_is_lossless():
    """Deterministic drafts are verified with the walk that needs no q: the first two tokens follow the target."""
    n = 20000
    prompt = [3, 7, 1, 12, 3, 7]  # "3 7" recurs: drafts from the first step
    sampling = SamplingConfig(1.0)
    joint = target_joint(prompt, sampling)
    gen = Generator(plain_target(), proposer=NgramProposer(3, 1, 2), batch_size=n)
    out = gen.generate([prompt] * n, max_new_tokens=2, sampling=sampling, seed=5)
    assert chi_square_p(first_two(out), joint) > 0.01
    accepted = np.mean([c.stats["accepted_per_position"][0] for c in out])
    assert 0.02 < accepted < 0.98  # both branches of the walk (a draft accepted, a draw without it) are exercised


def test_bad_settings_are_errors():
    with pytest.raises(JaxspecError, match="need 1 <= min <= max"):
        NgramProposer(5, 3, 2)
    with pytest.raises(JaxspecError, match="applies to chains"):
        Generator(tiny_target(), proposer=None, forced_accept_prob=0.5)


def test_cli_generate_with_ngram_equals_no_draft(tiny_dir, capsys, monkeypatch):
    from jaxspec import generate
    from jaxspec import prompts as prompts_mod

    monkeypatch.setattr(prompts_mod, "load_tokenizer", lambda _: ByteTokenizer())
    runs = {}
    for extra in (["--no-draft"], ["--proposer", "ngram", "--ngram-max", "2", "--num-speculative-tokens", "4"]):
        assert generate.main(["--target", str(tiny_dir), "--prompt", "a b a b a b", "--raw", "--max-new-tokens", "24",
                              "--json", *extra]) == 0
        runs[extra[0]] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert runs["--proposer"]["token_ids"] == runs["--no-draft"]["token_ids"]
    stats = runs["--proposer"]["stats"]
    assert stats["proposer"] == "ngram" and len(stats["accepted_per_position"]) == 4


@pytest.mark.parametrize("extra, message", [
    (["--proposer", "ngram", "--tree", "8,3,2"], "--proposer ngram drafts chains; drop --tree"),
    (["--proposer", "ngram", "--no-draft"], "drop --no-draft"),
    (["--proposer", "ngram", "--ngram-min", "0"], "--ngram-min and --ngram-max need 1 <= min <= max"),
])
def test_cli_errors(extra, message, tiny_dir, capsys):
    from jaxspec import generate

    with pytest.raises(SystemExit) as exit_info:
        generate.main(["--target", str(tiny_dir), "--prompt", "hi", *extra])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and message in err and err.count("\n") == 1, err



@pytest.mark.slow
def test_sampling_is_lossless_when_no_row_matches():
    """No 3-token suffix recurs in these rows, so the step runs the root alone (a one-token decode) and samples the
    target's token itself: the first two tokens still follow the target."""
    n = 20000
    prompt = [3, 7, 1, 12, 5]
    sampling = SamplingConfig(1.0)
    joint = target_joint(prompt, sampling)
    gen = Generator(plain_target(), proposer=NgramProposer(3, 3, 3), batch_size=n)
    out = gen.generate([prompt] * n, max_new_tokens=2, sampling=sampling, seed=7)
    assert chi_square_p(first_two(out), joint) > 0.01
    assert all(c.stats["rejections"]["no_draft"] == 1 for c in out if c.num_generated == 2)
