"""Prompt lookup beside a drafter (`jaxspec.engine.proposers.lookup`): which rows look up and how their scores move,
greedy output equal to target-only, sampling lossless with the drafter's and the lookup's draft distributions in one
batch, and the flag's errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from spec_fixtures import PROMPTS, fitted_drafter, fitted_head, in_dtype, random_head, tiny_target
from test_ngram_proposer import REPEATING, target_joint
from test_spec_sampling import SHAPE, VOCAB, chi_square_p, first_two, plain_target

from jaxspec.cli.args import prompt_lookup
from jaxspec.errors import JaxspecError
from jaxspec.engine.generation import Generator
from jaxspec.engine.generator import SpeculativeGenerator
from jaxspec.engine.proposers.base import PrefillView, Proposal, StepView, Verified
from jaxspec.engine.proposers.dflash import DFlashProposer
from jaxspec.engine.proposers.lookup import PromptLookup, WithPromptLookup, chain_run
from jaxspec.engine.tree import TreeConfig
from jaxspec.sampling import SamplingConfig, filtered_logits


class Constant:
    """A chain drafter that always drafts token 9 (no parameters, no state): lookup's rival in the unit tests."""

    tree = None
    name = "constant"
    needs_aux = needs_hidden = False
    forwards_per_step = 0

    def __init__(self, k: int):
        self.depth = k
        self.verify_width = k + 1

    def extra_capacity(self):
        return self.depth + 1

    def kv_cache(self, state):
        return None

    def init(self, params, target, view, capacity):
        return ()

    def propose(self, params, target, state, view, keys):
        b = view.last_token.shape[0]
        tokens = jnp.full((b, self.depth + 1), 9, jnp.int32)
        return Proposal(tokens, None, None, jnp.full((b, self.depth + 1, 2), 9, jnp.int32)), state

    def commit(self, params, state, verified):
        return state


class Roomy(Constant):
    """`Constant` whose commit takes longer accepted runs than it drafts (`accepting`, as `base.LongerRuns`)."""

    accept_depth = 0

    def accepting(self, depth: int):
        wider = Roomy(self.depth)
        wider.accept_depth = depth
        return wider


class TreeDrafter(Constant):
    tree = TreeConfig(8, 3, 2)

    def __init__(self):
        super().__init__(3)


def started(rows: list[list[int]], k: int = 2, lookup: PromptLookup = PromptLookup(), drafter=Constant):
    """(proposer, state after prompts `rows`, whose last token is each row's first emitted token)."""
    proposer = WithPromptLookup(drafter(k), lookup)
    b, t = len(rows), max(len(r) for r in rows) - 1
    prompt = jnp.asarray([r[:-1] + [0] * (t - len(r) + 1) for r in rows], jnp.int32)
    view = PrefillView(prompt, jnp.asarray([len(r) - 1 for r in rows]), jnp.asarray([r[-1] for r in rows]), None, None)
    return proposer, proposer.init(None, None, view, capacity=32)


def step_view(b: int) -> StepView:
    return StepView(jnp.zeros((b,), jnp.int32), jnp.zeros((b,), jnp.int32), jnp.ones((b,), jnp.int32), None)


def test_chain_run_counts_within_the_emitted_tokens():
    emitted = jnp.asarray([[4, 5, 6], [4, 5, 6], [4, 5, 6]])
    drafts = jnp.asarray([[4, 5], [4, 7], [4, 5]])
    # a = 0: only the first emitted token is known, so a chain right at both drafts counts 1
    assert chain_run(drafts, emitted, jnp.asarray([2, 2, 0])).tolist() == [2, 1, 1]


def test_rows_look_up_where_their_match_length_scores_above_zero():
    # row 0: "1 2" recurs (a 2-token match; prior +0.1): lookup drafts what followed, 3 then 1 (periodic);
    # row 1: only its last token recurs (a 1-token match; prior -0.1): the drafter's 9s; row 2: no match at all
    proposer, st = started([[1, 2, 3, 1, 2], [4, 5, 6, 5], [7, 8]])
    proposal, st = proposer.propose(None, None, st, step_view(3), None)
    assert proposal.tokens[:, 1:].tolist() == [[3, 1], [9, 9], [9, 9]]
    assert st.match.tolist() == [2, 1, 0]
    assert proposal.any_vocab.tolist() == [True, False, False]  # the telemetry's: lookup drafts any token
    assert proposal.candidates[0, :, 0].tolist() == [3, 1, -1] and proposal.candidates[1, :, 0].tolist() == [9, 9, 9]


def test_scores_follow_which_chain_the_target_took():
    proposer, st = started([[1, 2, 3, 1, 2], [4, 5, 6, 5]])
    proposal, st = proposer.propose(None, None, st, step_view(2), None)
    # row 0 accepted both lookup drafts (3 1) and emitted 2: lookup +2 over the drafter (9 9: none);
    # row 1 drafted 9 9 and the target emitted 9 then 4: the drafter's run is 1, lookup's (6 5) none: -1
    emitted = jnp.asarray([[3, 1, 2], [9, 4, 0]])
    st = proposer.commit(None, st, Verified(emitted, jnp.asarray([2, 1]), jnp.asarray([1, 1]), None, None))
    np.testing.assert_allclose(st.score, [[-0.1, 0.8 * 0.1 + 0.2 * 2, 0.1], [0.8 * -0.1 + 0.2 * -1, 0.1, 0.1]],
                               rtol=1e-6)
    assert st.history.length.tolist() == [8, 6]  # the 3 and 2 emitted tokens appended
    assert st.history.history[0, 5:8].tolist() == [3, 1, 2]


def test_a_row_whose_lookups_keep_losing_drafts_from_the_drafter():
    proposer, st = started([[1, 2, 3, 1, 2]], k=2)
    for _ in range(3):  # lookup drafts 3 1, the target emits 9 9 9 (the drafter's chain): scores go negative
        proposal, st = proposer.propose(None, None, st, step_view(1), None)
        st = proposer.commit(None, st, Verified(jnp.asarray([[9, 9, 9]]), jnp.asarray([0]), jnp.asarray([1]),
                                                None, None))
        st = st._replace(history=st.history._replace(length=jnp.asarray([5])))  # keep the same match
    assert float(st.score[0, 1]) < 0
    proposal, _ = proposer.propose(None, None, st, step_view(1), None)
    assert proposal.tokens[0, 1:].tolist() == [9, 9]


def test_lookup_chains_run_longer_than_the_drafters_where_its_state_takes_them():
    # the same rows as above, beside a drafter whose pending buffers take runs of 4: lookup drafts 4, the drafter 2
    proposer, st = started([[1, 2, 3, 1, 2], [4, 5, 6, 5], [7, 8]], drafter=Roomy, lookup=PromptLookup(num_draft=4))
    assert (proposer.depth, proposer.verify_width) == (4, 5)
    assert proposer.inner.accept_depth == 4 and proposer.extra_capacity() == 5
    proposal, st = proposer.propose(None, None, st, step_view(3), None)
    # row 0 looks up (3 1 2 3: the periodic copy); rows 1 and 2 draft 9 9, then lookup's drafts past 2 (row 1's
    # 1-token match copies 6 5; row 2 has none and repeats its last token), verified like any draft
    assert proposal.tokens[:, 1:].tolist() == [[3, 1, 2, 3], [9, 9, 6, 5], [9, 9, 8, 8]]
    assert proposal.candidates[0, :, 0].tolist() == [3, 1, 2, 3, -1]
    assert proposal.candidates[1, :, 0].tolist() == [9, 9, 6, 5, -1]
    # row 0's four drafts and the target's token: lookup's run 4 against the drafter's 0
    emitted = jnp.asarray([[3, 1, 2, 3, 7], [9, 4, 0, 0, 0], [5, 0, 0, 0, 0]])
    st = proposer.commit(None, st, Verified(emitted, jnp.asarray([4, 1, 0]), jnp.ones((3,), jnp.int32), None, None))
    assert float(st.score[0, 1]) == pytest.approx(0.8 * 0.1 + 0.2 * 4)
    assert st.history.length.tolist() == [10, 6, 3]
    # by default, and beside a drafter without `accepting`, lookup drafts the drafter's K
    assert WithPromptLookup(Roomy(2)).depth == 2 and WithPromptLookup(Constant(2), PromptLookup(num_draft=4)).depth == 2
    assert WithPromptLookup(Roomy(5), PromptLookup(num_draft=4)).depth == 5  # at least the drafter's K


def test_rows_that_did_not_run_keep_their_scores():
    proposer, st = started([[1, 2, 3, 1, 2]])
    _, st2 = proposer.propose(None, None, st, step_view(1), None)
    st2 = proposer.commit(None, st2, Verified(jnp.asarray([[3, 1, 2]]), jnp.asarray([2]), jnp.asarray([0]), None, None))
    np.testing.assert_array_equal(st2.score, st.score)


@pytest.fixture(scope="module")
def reference():
    prompts = PROMPTS + REPEATING
    return prompts, [c.token_ids for c in Generator(tiny_target(), batch_size=1).generate(prompts, max_new_tokens=30)]


@pytest.mark.parametrize("head_kind,k,batch", [("random", 3, 6), pytest.param("fitted", 2, 1, marks=pytest.mark.slow)])
def test_greedy_equals_target_only(head_kind, k, batch, reference):
    """Lookup's chains of 4 beside the head's of K (a ragged batch; head rows' chains go on with lookup's drafts past
    K): target-only's tokens."""
    prompts, want = reference
    head = random_head() if head_kind == "random" else fitted_head()
    got = SpeculativeGenerator(tiny_target(), head, num_draft=k, batch_size=batch,
                               lookup=PromptLookup(num_draft=4)).generate(prompts, max_new_tokens=30)
    assert [c.token_ids for c in got] == want
    assert got[0].stats["proposer"] == "eagle3+lookup"
    if head_kind == "random":  # its drafts are rejected (tests/test_spec_greedy.py); lookup's catch the cycles
        alone = SpeculativeGenerator(tiny_target(), head, num_draft=k, batch_size=batch).generate(
            prompts, max_new_tokens=30)
        mean = lambda cs: np.mean([c.stats["mean_accepted_length"] for c in cs])  # noqa: E731
        assert mean(alone) < 1.2 < mean(got)
        looked = sum(c.stats["lookup_steps"] for c in got)
        assert 0 < looked < sum(c.stats["verify_calls"] for c in got)  # both kinds of step ran
        assert len(got[0].stats["accepted_per_position"]) == 4  # lookup's chains of 4 ran past the head's K
        assert sum(c.stats["accepted_per_position"][3] for c in got) > 0


@pytest.mark.parametrize("drafter", ["head", pytest.param("dflash", marks=pytest.mark.slow)])
def test_bfloat16_greedy_equals_target_only(drafter):
    """A bfloat16 target, lookup beside a random head (CI) or a fitted DFlash drafter, a batch of 3 with ragged
    acceptance: target-only's tokens."""
    target = in_dtype(tiny_target(), jnp.bfloat16)
    prompts = [PROMPTS[0], *REPEATING]
    want = [c.token_ids for c in Generator(target, batch_size=1).generate(prompts, max_new_tokens=30)]
    if drafter == "head":
        gen = SpeculativeGenerator(target, in_dtype(random_head(), jnp.bfloat16), num_draft=3, batch_size=3,
                                   lookup=PromptLookup())
    else:
        proposer, params = DFlashProposer.of(in_dtype(fitted_drafter(), jnp.bfloat16), 3)
        gen = Generator(target, proposer=WithPromptLookup(proposer), proposer_params=params, batch_size=3)
    got = gen.generate(prompts, max_new_tokens=30)
    assert [c.token_ids for c in got] == want
    assert sum(c.stats["lookup_steps"] for c in got) > 0


N = 16000


def target_joint3(prompt: list[int], sampling: SamplingConfig) -> np.ndarray:
    """P(x1, x2, x3) [V, V, V] of the target alone after `prompt`, computed directly."""
    target, n = plain_target(), len(prompt)
    seqs = jnp.asarray([prompt + [x1, x2] for x1 in range(VOCAB) for x2 in range(VOCAB)], jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(n + 2, dtype=jnp.int32), seqs.shape)
    out = target(seqs, pos, target.init_cache(VOCAB * VOCAB, n + 2))
    probs = np.asarray(jax.nn.softmax(filtered_logits(out.logits, sampling), axis=-1), np.float64)
    probs = probs.reshape(VOCAB, VOCAB, n + 2, VOCAB)
    first = probs[0, 0, n - 1]  # [V] p(x1)
    second = probs[:, 0, n]  # [V, V] p(x2 | x1)
    return first[:, None, None] * second[:, :, None] * probs[:, :, n + 1]


def first_three(completions) -> np.ndarray:
    counts = np.zeros((VOCAB, VOCAB, VOCAB))
    for c in completions:
        counts[tuple(c.token_ids[:3])] += 1
    return counts


def test_sampling_is_lossless_with_lookup_and_head_rows_in_one_batch():
    """Rows that look up (one-hot q) beside rows the head drafts for (its sampled draft and q), in one batch: each
    kind's first three tokens follow the target's own distribution. The lookup prompt holds every token, so whatever
    first token is drawn has a match, and the prior makes it look up at once; the head's prompt is one token, so a
    match (the first token drawn equal to it) is rare. Lookup's chains are 3 to the head's 1, so a head row's chain
    goes on with lookup's drafts (one-hot q beside the head's) and its second and third tokens can come from them."""
    sampling = SamplingConfig(1.0)
    looked, headed = [*range(VOCAB), 3], [5]
    gen = SpeculativeGenerator(plain_target(), fitted_head(**SHAPE), num_draft=1, batch_size=N,
                               lookup=PromptLookup(prior=(1.0, 1.0, 1.0), num_draft=3))
    out = gen.generate([looked, headed] * (N // 2), max_new_tokens=3, sampling=sampling, seed=3)
    for prompt, rows in ((looked, out[0::2]), (headed, out[1::2])):
        assert chi_square_p(first_three(rows), target_joint3(prompt, sampling)) > 0.01
    looked_up = [c.stats["lookup_steps"] / c.stats["verify_calls"] for c in out[0::2]]
    assert np.mean(looked_up) == 1.0 and np.mean([c.stats["lookup_steps"] for c in out[1::2]]) < 0.2
    for rows in (out[0::2], out[1::2]):  # both branches of the rejection rule run, for each kind of draft
        accepted = np.mean([c.stats["accepted_per_position"][0] for c in rows])
        assert 0.02 < accepted < 0.98
    # head rows accepted lookup's drafts past the head's one
    assert sum(c.stats["accepted_per_position"][1] for c in out[1::2]) > 0


def test_settings_and_flags():
    with pytest.raises(JaxspecError, match="one score per match length"):
        PromptLookup(max_n=4)
    with pytest.raises(JaxspecError, match="drafts chains"):
        WithPromptLookup(TreeDrafter(), PromptLookup())
    args = lambda **kw: type("Args", (), {"prompt_lookup": None, "proposer": "eagle3", **kw})()  # noqa: E731
    assert prompt_lookup(args()) == PromptLookup()
    assert prompt_lookup(args(prompt_lookup="off")) is None
    assert prompt_lookup(args(prompt_lookup_tokens=6)) == PromptLookup(num_draft=6)
    with pytest.raises(JaxspecError, match="at least 1 token"):
        PromptLookup(num_draft=0)
    assert prompt_lookup(args(proposer="ngram")) is None
