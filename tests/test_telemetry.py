"""Why drafts are rejected (`jaxspec.engine.telemetry`): each outcome on hand-made steps, and through the engine the
counters partition the verify steps and agree with what the proposers can and cannot draft."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from spec_fixtures import PROMPTS, fitted_head, tiny_target

from jaxspec.engine.generation import Generator
from jaxspec.engine.proposers.eagle3 import Eagle3Proposer
from jaxspec.engine.generator import SpeculativeGenerator
from jaxspec.engine.proposers.ngram import NgramProposer
from jaxspec.engine.proposers.base import PrefillView, StepView
from jaxspec.engine.telemetry import OUTCOMES, sibling_accepts, step_outcome
from jaxspec.engine.tree import TreeConfig

CHAIN = jnp.asarray([[-1, 0, 1, 2]] * 6, jnp.int32)  # a chain of 3 drafts, six rows


def test_each_outcome_on_hand_made_chain_steps():
    tokens = jnp.asarray([[0, 10, 11, 12]] * 6, jnp.int32)
    a = jnp.asarray([3, 1, 1, 0, 2, 1], jnp.int32)
    target_token = jnp.asarray([50, 7, 20, 30, 40, 13], jnp.int32)
    # per node: its top-2 candidates (the drafted child first); row 4's node 2 has none
    cands = np.tile(np.asarray([[10, 30], [11, 20], [12, 60], [-1, -1]], np.int32), (6, 1, 1))
    cands[4, 2] = -1
    vocab = jnp.ones((64,), bool).at[7].set(False)
    cut = jnp.asarray([False, False, False, False, False, True])
    got = step_outcome(a, 3, a, target_token, tokens, CHAIN, jnp.asarray(cands), vocab, cut)
    names = [OUTCOMES[i] for i in np.asarray(got)]
    assert names == ["all_accepted", "outside_draft_vocab", "in_draft_topk", "in_draft_topk", "no_draft",
                     "cut_by_stop"]
    # row 1's drafts were not the head's (prompt lookup's, `Proposal.any_vocab`): 7 is no longer out of reach
    looked = step_outcome(a, 3, a, target_token, tokens, CHAIN, jnp.asarray(cands), vocab, cut, None,
                          jnp.arange(6) == 1)
    assert OUTCOMES[int(looked[1])] == "miss" and np.array_equal(np.asarray(looked)[2:], np.asarray(got)[2:])
    # row 3: 30 is node 0's second candidate; without candidates (only the drafted child) it is a plain miss
    plain = step_outcome(a, 3, a, target_token, tokens, CHAIN, None, None, jnp.zeros(6, bool))
    assert [OUTCOMES[i] for i in np.asarray(plain)] == ["all_accepted"] + ["miss"] * 5


def test_sibling_accepts_counts_accepted_nodes_that_were_not_a_first_child():
    #            0   1  2  3  4  5  6      node 2 is node 0's second child, node 4 node 1's second, node 6 node 2's first
    parents = jnp.asarray([[-1, 0, 0, 1, 1, 4, 2]] * 3, jnp.int32)
    path = jnp.asarray([[0, 1, 4, 5], [0, 2, 6, -1], [0, 1, 3, -1]], jnp.int32)
    a = jnp.asarray([3, 2, 2], jnp.int32)
    assert np.asarray(sibling_accepts(parents, path, a)).tolist() == [1, 1, 0]
    assert np.asarray(sibling_accepts(parents, path, jnp.asarray([1, 0, 2]))).tolist() == [0, 0, 0]


def check_partition(out, depth):
    for c in out:
        s = c.stats
        rej = s["rejections"]
        assert list(rej) == list(OUTCOMES) and all(isinstance(v, int) and v >= 0 for v in rej.values())
        assert sum(rej.values()) == s["verify_calls"]
        assert rej["cut_by_stop"] <= 1  # a cut ends the row
        # all_accepted steps accepted the last position, and only a cut step can hide one more
        full = s["accepted_per_position"][depth - 1]
        assert rej["all_accepted"] <= full <= rej["all_accepted"] + rej["cut_by_stop"]


def test_chain_counters_partition_the_steps_and_see_a_reduced_draft_vocabulary():
    from fit_head import head_config_for

    from jaxspec.models.eagle3 import Eagle3Head

    target = tiny_target()
    out = SpeculativeGenerator(target, fitted_head(), num_draft=4, batch_size=4).generate(PROMPTS, max_new_tokens=40)
    check_partition(out, 4)
    total = {k: sum(c.stats["rejections"][k] for c in out) for k in OUTCOMES}
    assert total["outside_draft_vocab"] == 0  # the fitted head drafts from the whole vocabulary
    assert total["all_accepted"] > 0 and total["miss"] + total["in_draft_topk"] > 0

    # A head that can draft only 8 tokens: every step whose target token is outside them says so.
    head = Eagle3Head(head_config_for(target, draft_vocab_size=8), rngs=nnx.Rngs(3))
    allowed = np.arange(0, 80, 10)
    head.d2t.set_value(allowed - np.arange(8))
    want = [c.token_ids for c in Generator(target, batch_size=4).generate(PROMPTS, max_new_tokens=30)]
    out = SpeculativeGenerator(target, head, num_draft=2, batch_size=4).generate(PROMPTS, max_new_tokens=30)
    assert [c.token_ids for c in out] == want
    check_partition(out, 2)
    for c, ref in zip(out, want):
        # Drafts come from the 8 tokens, so every other token after the prefill's is a step's own token: a rejection
        # outside the vocabulary, unless it was the bonus of a full step or cut by the budget.
        outside = sum(t not in allowed for t in ref[1:])
        rej = c.stats["rejections"]
        assert outside - rej["all_accepted"] - rej["cut_by_stop"] <= rej["outside_draft_vocab"] <= outside
    assert sum(c.stats["rejections"]["outside_draft_vocab"] for c in out) > 0


@pytest.mark.slow  # ~23 s; CI checks the chain's counters (above), a tree's: -m slow
@pytest.mark.parametrize("tree", [TreeConfig(12, 4, 3), TreeConfig(6, 5, 1)], ids=str)
def test_tree_counters(tree):
    out = SpeculativeGenerator(tiny_target(), fitted_head(), tree=tree, batch_size=4).generate(
        PROMPTS, max_new_tokens=40
    )
    check_partition(out, tree.depth)
    siblings = sum(c.stats["accepted_via_sibling"] for c in out)
    if tree.top_k == 1:  # a single path: nothing has a sibling, and the top-1 is the drafted child
        assert siblings == 0 and all(c.stats["rejections"]["in_draft_topk"] == 0 for c in out)
    else:
        assert siblings > 0  # the fitted head's second choices are accepted now and then


def test_ngram_counters_say_no_draft_without_a_match():
    gen = Generator(tiny_target(), proposer=NgramProposer(3, 4, 4), batch_size=4)  # 4-grams: rare in short prompts
    out = gen.generate(PROMPTS, max_new_tokens=12)
    check_partition(out, 3)
    for c in out:
        rej = c.stats["rejections"]
        assert rej["outside_draft_vocab"] == rej["in_draft_topk"] == 0  # one candidate per node: the draft
    assert sum(c.stats["rejections"]["no_draft"] for c in out) > 0


@pytest.mark.slow  # CI: the chain counters above read the same candidates
def test_eagle3_chain_candidates_start_with_the_draft():
    """Greedy: a chain node's first candidate is the next draft (its top-1)."""
    target, head = tiny_target(), fitted_head()
    graphdef, params = nnx.split(head)
    proposer = Eagle3Proposer(graphdef, num_draft=4)
    b, t = 2, 6
    prompt = jnp.asarray(np.random.default_rng(0).integers(0, 101, (b, t)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    aux = target(prompt, positions, target.init_cache(b, 64), return_aux=True).aux
    lens = jnp.full((b,), t, jnp.int32)
    st = proposer.init(params, target, PrefillView(prompt, lens, prompt[:, -1], aux, None), 64)
    view = StepView(prompt[:, -1], lens, jnp.ones((b,), jnp.int32), None)
    propose = jax.jit(lambda params, st, view: proposer.propose(params, target, st, view,
                                                                jax.random.split(jax.random.key(0), b))[0])  # one compile, not op by op
    proposal = propose(params, st, view)
    cands = np.asarray(proposal.candidates)
    assert cands.shape == (b, 5, 8)
    np.testing.assert_array_equal(cands[:, :4, 0], np.asarray(proposal.tokens)[:, 1:])
    assert (cands[:, 4] == -1).all() and bool(np.asarray(proposal.draft_vocab).all())
