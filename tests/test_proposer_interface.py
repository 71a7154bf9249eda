"""The Proposer contract is enough for an MTP-style draft method: a proposer that drafts from the target's final
hidden state (as MTP heads read it) plugs into the engine and the verifier unchanged, and stays exact."""

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import pytest
from spec_fixtures import PROMPTS, tiny_target

from jaxspec.engine.generation import Generator
from jaxspec.sampling import SamplingConfig
from jaxspec.engine.proposers.base import ChainDrafts, PrefillView, Proposal, StepView, Verified


class HiddenState(NamedTuple):
    hidden: jax.Array  # [B, H] the target's final hidden state at the token before last_token


@dataclasses.dataclass(frozen=True)
class HiddenStateProposer(ChainDrafts):
    """A stand-in for an MTP head with no weights of its own: draft j+1 = argmax of the target's LM head on
    (hidden state + embedding of draft j), the hidden state being the target's at the position before the root."""

    num_draft: int = 3
    name: str = "mtp-test"
    needs_aux: bool = False
    needs_hidden: bool = True
    forwards_per_step: int = 0
    # declare drafts only at even positions (`Proposal.has_draft`): the other steps run the root alone
    skip_odd_positions: bool = False

    def init(self, params, target, view: PrefillView, capacity: int) -> HiddenState:
        return HiddenState(view.hidden[:, 0])

    def propose(self, params, target, st: HiddenState, view: StepView, keys):
        token, drafts = view.last_token, []
        for _ in range(self.num_draft):
            token = jnp.argmax(target.logits(st.hidden + target.embed(token)), axis=-1).astype(jnp.int32)
            drafts.append(token)
        tokens = jnp.stack([jnp.zeros_like(token), *drafts], axis=1)  # [B, K+1], root set by the engine
        has_draft = view.committed % 2 == 0 if self.skip_odd_positions else None  # [B]
        return Proposal(tokens, None, None, has_draft=has_draft), st

    def commit(self, params, st: HiddenState, verified: Verified) -> HiddenState:
        # the hidden state at the last accepted node: the position before the new root (the bonus token)
        at = jnp.take_along_axis(verified.hidden, verified.num_accepted[:, None, None], axis=1)[:, 0]
        return HiddenState(jnp.where(verified.running[:, None] > 0, at, st.hidden))


def test_a_hidden_state_proposer_plugs_in_and_stays_exact():
    want = Generator(tiny_target(), batch_size=1).generate(PROMPTS, max_new_tokens=24)
    gen = Generator(tiny_target(), proposer=HiddenStateProposer(), batch_size=4)
    got = gen.generate(PROMPTS, max_new_tokens=24)
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    assert all(c.stats["proposer"] == "mtp-test" and c.stats["verify_calls"] > 0 for c in got)
    sampled = gen.generate(PROMPTS, max_new_tokens=8, sampling=SamplingConfig(1.0), seed=3)
    assert all(len(c.token_ids) == 8 for c in sampled)  # sampling runs through the walk that needs no q


@pytest.mark.parametrize("batch", [1, pytest.param(4, marks=pytest.mark.slow)])  # CI: a row alone
def test_steps_without_a_draft_run_the_root_alone_and_stay_exact(batch):
    """A proposal with no real draft in any running row (`Proposal.has_draft`) makes the step a one-token decode;
    the hidden state the proposer reads at the root comes from that decode, and the output stays the target's."""
    want = Generator(tiny_target(), batch_size=1).generate(PROMPTS, max_new_tokens=24)
    gen = Generator(tiny_target(), proposer=HiddenStateProposer(skip_odd_positions=True), batch_size=batch)
    got = gen.generate(PROMPTS, max_new_tokens=24)
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    if batch == 1:  # a row alone: every step at an odd position is undrafted
        assert all(c.stats["rejections"]["no_draft"] > 0 for c in got)


@pytest.mark.parametrize("drafter", ["eagle3", "draft-model"])
def test_keep_up_leaves_the_proposer_where_propose_does_without_the_drafts(drafter):
    """A step that drafts nothing (`engine.core.keep_up`, the batcher's speculation off at high load) runs only the
    proposer's catch-up: its state is the one `propose` leaves, the same committed lengths and the same cache
    entries below them (propose's drafts sit above them, uncommitted), pending inputs untouched. A wrong catch-up
    would show as far more than rounding: entries at other positions, or none."""
    import numpy as np
    from flax import nnx
    from spec_fixtures import fitted_head

    from jaxspec.engine.generator import SpeculativeGenerator
    from jaxspec.engine.proposers.draft_model import DraftModelProposer
    from jaxspec.engine.slots import SlotBatcher, SlotRequest

    model = tiny_target()
    if drafter == "eagle3":
        gen = SpeculativeGenerator(model, fitted_head(), num_draft=3, batch_size=2, chunk_steps=1)
    else:
        proposer, params = DraftModelProposer.of(model, 3)
        gen = Generator(model, proposer=proposer, proposer_params=params, batch_size=2, chunk_steps=1)
    batcher = SlotBatcher(gen, capacity=64, step_buckets=False)
    batcher.join([(0, SlotRequest(tuple(PROMPTS[1]), 20)), (1, SlotRequest(tuple(PROMPTS[0]), 20))])
    for _ in range(2):  # a few verify steps: pending runs of several tokens
        batcher.step()
    st = batcher.state
    target = nnx.merge(gen.graphdef, gen.params)
    view = StepView(st.last_token, st.cache.lengths, (~st.done).astype(jnp.int32), st.processors, st.sampling, st.cache)
    kept = jax.jit(lambda s: gen.proposer.keep_up(gen.proposer_params, target, s, view))(st.proposer)
    proposed = jax.jit(lambda s: gen.proposer.propose(gen.proposer_params, target, s, view, st.keys)[1])(st.proposer)
    cache_kept, cache_proposed = gen.proposer.kv_cache(kept), gen.proposer.kv_cache(proposed)
    lengths = np.asarray(cache_kept.lengths)
    np.testing.assert_array_equal(lengths, np.asarray(cache_proposed.lengths))
    assert np.all(lengths > np.asarray(gen.proposer.kv_cache(st.proposer).lengths))  # it caught up
    # drafters compute with plain numerics, and the two programs fuse the same forward differently: equal up to
    # float32 rounding (seen: 2.4e-7), not bit for bit (the output's exactness never rests on a drafter's bits)
    for a, b in zip(cache_kept.k + cache_kept.v, cache_proposed.k + cache_proposed.v):
        for row, n in enumerate(lengths):
            np.testing.assert_allclose(np.asarray(a[row, :, :n]), np.asarray(b[row, :, :n]), rtol=1e-5, atol=1e-5)
    for field in kept._fields:  # everything but the cache: as it was
        if field not in ("head_cache", "cache"):
            np.testing.assert_array_equal(np.asarray(getattr(kept, field)), np.asarray(getattr(st.proposer, field)))
