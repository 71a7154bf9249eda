"""P-EAGLE (parallel drafting): a chain of K drafts from ONE forward of an EAGLE-3 head, the K - 1 slots after the
pending pairs holding the mask token and fc(mask_hidden). The drafts equal that forward run on each row alone;
greedy output equals target-only; sampling with each slot's distribution as q is lossless (slow)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fit_head import head_config_for
from flax import nnx
from spec_fixtures import PROMPTS, fitted_head, tiny_target

from jaxspec.engine.generation import Generator
from jaxspec.engine.generator import SpeculativeGenerator
from jaxspec.engine.proposers.base import StepView
from jaxspec.engine.proposers.eagle3 import Eagle3State, PEagleProposer
from jaxspec.models import kv_cache as kvc
from jaxspec.models.eagle3 import Eagle3Head
from jaxspec.sampling import SamplingConfig

MASK = 7


def peagle_head(base: Eagle3Head | None = None, target=None, seed: int = 4) -> Eagle3Head:
    """A P-EAGLE head: `base`'s weights (a fitted EAGLE-3 head drafts d_1 well) or random ones, a random mask_hidden."""
    target = target or tiny_target()
    cfg = head_config_for(target, mask_token_id=MASK)
    head = Eagle3Head(cfg, rngs=nnx.Rngs(seed))
    if base is not None:
        nnx.update(head, nnx.state(base))
    return head


def test_the_parallel_drafts_are_one_forward_of_each_row():
    """Rows with 1..K+1 pending pairs: each row's drafts are the argmax of its own forward over [its pending pairs,
    K - 1 mask slots] at the next positions, from the same cache."""
    target, head = tiny_target(), peagle_head()
    k, b, rng = 3, 4, np.random.default_rng(0)
    width, feat = k + 1, 3 * target.config.hidden_size
    embed = target.embed_tokens[...]
    prefix = jnp.asarray(rng.integers(0, 101, (b, 5)), jnp.int32)
    _, _, cache = head(prefix, head.project(jnp.asarray(rng.normal(size=(b, 5, feat)), jnp.float32)),
                       jnp.broadcast_to(jnp.arange(5, dtype=jnp.int32), (b, 5)), head.init_cache(b, 32), embed)
    cache = kvc.advance(cache, 5)
    st = Eagle3State(cache, jnp.asarray(rng.normal(size=(b, width, feat)), jnp.float32),
                     jnp.asarray(rng.integers(0, 101, (b, width)), jnp.int32), jnp.asarray([1, 3, width, 2], jnp.int32))
    running = jnp.asarray([1, 1, 0, 1], jnp.int32)  # row 2 has finished: its head cache must not move
    view = StepView(jnp.zeros((b,), jnp.int32), jnp.full((b,), 9, jnp.int32), running, None)
    proposer = PEagleProposer(nnx.graphdef(head), num_draft=k)
    propose = jax.jit(lambda params, st, view: proposer.propose(params, target, st, view,
                                                                jax.random.split(jax.random.key(0), b)))
    proposal, after = propose(nnx.state(head), st, view)
    for row in range(b):
        n = int(st.num_pending[row])
        tokens = jnp.concatenate([st.pending_tok[row, :n], jnp.full((k - 1,), MASK, jnp.int32)])[None]
        states = jnp.concatenate([head.project(st.pending_feat[row : row + 1, :n])[0],
                                  jnp.repeat(head.project(head.mask_hidden[...]), k - 1, axis=0)])[None]
        row_cache = jax.tree.map(lambda x: x[row : row + 1], cache)
        logits, _, _ = head(tokens, states, 5 + jnp.arange(n + k - 1, dtype=jnp.int32)[None], row_cache, embed)
        want = head.to_target_ids(jnp.argmax(logits[0, n - 1 :], axis=-1).astype(jnp.int32))
        np.testing.assert_array_equal(np.asarray(proposal.tokens[row, 1:]), np.asarray(want))
    # only the pending pairs of running rows are committed; the mask slots never are
    np.testing.assert_array_equal(np.asarray(after.head_cache.lengths),
                                  5 + np.asarray(st.num_pending) * np.asarray(running))


def test_greedy_equals_target_only():
    """A fitted EAGLE-3 head's weights as a P-EAGLE head (its untrained mask slots draft poorly, its d_1 well):
    accepted and rejected drafts in a ragged batch of 4, one head forward per step, the target's text."""
    reference = [c.token_ids for c in Generator(tiny_target(), batch_size=1).generate(PROMPTS, max_new_tokens=24)]
    gen = SpeculativeGenerator(tiny_target(), peagle_head(fitted_head()), num_draft=3, batch_size=4)
    assert isinstance(gen.proposer, PEagleProposer)
    got = gen.generate(PROMPTS, max_new_tokens=24)
    assert [c.token_ids for c in got] == reference
    assert np.mean([c.stats["acceptance_per_position"][0] for c in got]) > 0.5  # d_1: the fitted head's draft
    for c in got:
        assert c.stats["proposer"] == "peagle" and c.stats["draft_calls"] == c.stats["verify_calls"] + 1


@pytest.mark.slow  # ~25 s; pricing a one-forward draft runs under -m slow only (DFlash's test too), auto's
# machinery in CI (test_auto_generator)
def test_auto_prices_a_chain_as_one_head_forward():
    """`--num-speculative-tokens auto` with a P-EAGLE head: a chain of any K costs one timed head forward (the
    longest chain's, `StepCosts.block_draft`) and its verify; every choice gives the target's text."""
    from jaxspec.engine.auto.generator import AutoSpeculativeGenerator
    from jaxspec.engine.auto.step_costs import measure_step_costs

    target, head = tiny_target(), peagle_head(fitted_head())
    costs = measure_step_costs(target, head, 1, 64, 4, repeats=1)
    assert costs.block_draft and costs.draft > 0
    reference = [c.token_ids for c in Generator(target, batch_size=1).generate(PROMPTS[:2], max_new_tokens=16)]
    gen = AutoSpeculativeGenerator(target, head, prior=None, batch_size=1, max_draft=4)
    got = gen.generate(PROMPTS[:2], max_new_tokens=16)
    assert [c.token_ids for c in got] == reference
    assert got[0].stats["auto"]["basis"] == "first batch" and got[1].stats["auto"]["basis"] == "observed"


@pytest.mark.slow  # ~40 s; CI: the sampling walk and q of chains in test_spec_sampling and test_draft_model
def test_sampling_with_each_slots_distribution_is_lossless():
    from test_spec_sampling import chi_square_p, first_two, plain_target
    from test_ngram_proposer import target_joint

    n, prompt, sampling = 20000, [3, 7, 1, 12], SamplingConfig(1.0)
    joint = target_joint(prompt, sampling)
    target = plain_target()
    gen = SpeculativeGenerator(target, peagle_head(target=target, seed=2), num_draft=2, batch_size=n)
    out = gen.generate([prompt] * n, max_new_tokens=2, sampling=sampling, seed=5)
    assert chi_square_p(first_two(out), joint) > 0.01
    accepted = np.mean([c.stats["accepted_per_position"][0] for c in out])
    assert 0.02 < accepted < 0.98  # both branches of the rejection rule ran


def test_training_refuses_to_start_from_a_peagle_head(tmp_path):
    """train.launch trains EAGLE-3's step-by-step objective: a P-EAGLE head as head.init_from is one line, not a
    head whose mask_hidden silently never learns."""
    from jaxspec.checkpoints.heads import export_head
    from jaxspec.errors import JaxspecError
    from train.config import HeadSection
    from train.launch import build_head

    target = tiny_target()
    out = export_head(peagle_head(), tmp_path / "peagle", layout="speculators", target=target.config,
                      dtype="float32")
    with pytest.raises(JaxspecError, match="is a P-EAGLE head .* start from an EAGLE-3 head"):
        build_head(target, HeadSection(init_from=str(out)), np.ones(101), seed=0)
