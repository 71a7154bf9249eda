"""Token log-probabilities (`Generator.keep_logprobs`, engine.core.TokenLogprobs): each generated token's
log-probability under the target's raw logits and its likeliest alternatives, kept beside the tokens. Under the
batch-invariant numerics a verify's logits are a decode's bits, so speculative generation, whatever it accepts,
returns target-only's floats exactly; and they are the log-softmax a plain forward over the text gives."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from spec_fixtures import PROMPTS, in_dtype, tiny_target

from jaxspec.config import TreeConfig
from jaxspec.engine.generation import Generator
from jaxspec.engine.proposers.draft_model import DraftModelProposer
from jaxspec.errors import JaxspecError
from jaxspec.models.llama import LlamaModel
from jaxspec.sampling import SamplingConfig


TREE = TreeConfig.parse("8,3,2")


@pytest.mark.parametrize("dtype,trees", [(jnp.float32, (None,)),  # CI: chains; trees and bfloat16 under -m slow
                                         pytest.param(jnp.float32, (TREE,), marks=pytest.mark.slow),
                                         pytest.param(jnp.bfloat16, (None, TREE), marks=pytest.mark.slow)])
def test_speculative_logprobs_are_target_onlys_bit_for_bit(dtype, trees):
    """The target as its own draft model, so that whole chains and tree branches are accepted (several tokens of
    one verify each get their own position's logits): chain K=3 or a tree, three prompts of other lengths."""
    model = in_dtype(tiny_target(), dtype)
    want = Generator(model, batch_size=4, logprobs=3).generate(PROMPTS[:3], max_new_tokens=12)
    for tree in trees:
        proposer, params = DraftModelProposer.of(model, 3, tree)
        got = Generator(model, proposer=proposer, proposer_params=params, batch_size=4, logprobs=3).generate(
            PROMPTS[:3], max_new_tokens=12)
        assert np.mean([c.stats["mean_accepted_length"] for c in got]) > 2
        for g, w in zip(got, want):
            assert g.token_ids == w.token_ids
            assert g.logprobs == w.logprobs  # token, log-probability and the top 3, as floats
    for c in want:
        assert [t.token for t in c.logprobs] == c.token_ids
        assert all(t.top[0][0] == t.token and t.top[0][1] == t.logprob for t in c.logprobs)  # greedy: the argmax
        assert all(a[1] >= b[1] for t in c.logprobs for a, b in zip(t.top, t.top[1:]))
    if dtype == jnp.float32:  # against one plain forward over each prompt + answer (right-padded: causal)
        texts = [list(p) + c.token_ids for p, c in zip(PROMPTS[:3], want)]
        ids = jnp.asarray([t + [0] * (32 - len(t)) for t in texts], jnp.int32)
        plain = LlamaModel(model.config, rngs=None, numerics=None)  # XLA's own numerics, the same weights
        nnx.update(plain, nnx.state(model, nnx.Param))
        out = plain(ids, jnp.broadcast_to(jnp.arange(32), (3, 32)), plain.init_cache(3, 64), empty_cache=True)
        lsm = jax.nn.log_softmax(out.logits, axis=-1)
        for row, (prompt, c) in enumerate(zip(PROMPTS[:3], want)):
            expected = [float(lsm[row, len(prompt) - 1 + j, t]) for j, t in enumerate(c.token_ids)]
            np.testing.assert_allclose([t.logprob for t in c.logprobs], expected, atol=2e-5)


def test_sampled_tokens_get_their_logprobs_and_none_are_kept_by_default():
    """A sampled token's log-probability is the raw distribution's (before temperature), whatever was drawn; the
    default keeps none, and the programs compute none."""
    model = tiny_target()
    sampled = Generator(model, batch_size=4, logprobs=0).generate(
        PROMPTS[:2], max_new_tokens=8, sampling=SamplingConfig(temperature=1.5), seed=4)
    kept = Generator(model, batch_size=4, logprobs=2).generate(
        PROMPTS[:2], max_new_tokens=8, sampling=SamplingConfig(temperature=1.5), seed=4)
    for a, b in zip(sampled, kept):
        assert a.token_ids == b.token_ids  # keeping logprobs changes no token
        assert [t.logprob for t in a.logprobs] == [t.logprob for t in b.logprobs]
        assert all(t.top == () for t in a.logprobs) and all(len(t.top) == 2 for t in b.logprobs)
    assert any(t.top[0][0] != t.token for c in kept for t in c.logprobs)  # some draws are not the argmax
    assert Generator(model, batch_size=4).generate(PROMPTS[:1], max_new_tokens=3)[0].logprobs is None
    with pytest.raises(JaxspecError, match=r"logprobs must be in \[0, 20\]"):
        Generator(model, logprobs=21)
