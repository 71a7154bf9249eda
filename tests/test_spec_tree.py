"""EAGLE-2 dynamic trees: construction, KV compaction, and greedy output equal to target-only output."""

import jax.numpy as jnp
import numpy as np
import pytest
from spec_fixtures import PROMPTS, fitted_head, random_head, tiny_target

from jaxspec.errors import JaxspecError
from jaxspec.engine.generation import Generator
from jaxspec.models import kv_cache as kvc
from jaxspec.engine.generator import SpeculativeGenerator
from jaxspec.engine.tree import TreeConfig, draft_tree, tree_from_parents


@pytest.fixture(scope="module")
def reference():
    return [c.token_ids for c in Generator(tiny_target(), batch_size=1).generate(PROMPTS, max_new_tokens=30)]


def mean_accepted(completions) -> float:
    return float(np.mean([c.stats["mean_accepted_length"] for c in completions]))


# CI: the widest tree with a fitted head in a batch of 4, the one-draft tree with a random head alone; the rest
# under -m slow.
TREE_CI = {("fitted", "16,4,4", 4), ("random", "2,1,1", 1)}


@pytest.mark.parametrize("head_kind,tree,batch", [
    pytest.param(h, t, b, id=f"{b}-{t.spec}-{h}", marks=() if (h, t.spec, b) in TREE_CI else pytest.mark.slow)
    for b in (1, 4) for t in (TreeConfig(16, 4, 4), TreeConfig(8, 3, 2), TreeConfig(2, 1, 1))
    for h in ("random", "fitted")
])
def test_tree_greedy_equals_target_only(head_kind, tree, batch, reference):
    head = random_head() if head_kind == "random" else fitted_head()
    got = SpeculativeGenerator(tiny_target(), head, tree=tree, batch_size=batch).generate(PROMPTS, max_new_tokens=30)
    assert [c.token_ids for c in got] == reference
    assert all(len(c.stats["acceptance_per_position"]) == tree.depth for c in got)
    if head_kind == "fitted" and tree.depth >= 3:
        assert mean_accepted(got) > 3


@pytest.mark.slow  # a quality check of tree drafting (CI: the fitted head's tree accepts > 3 tokens per verify)
def test_a_tree_accepts_more_than_a_chain_of_the_same_depth(reference):
    chain = SpeculativeGenerator(tiny_target(), fitted_head(), num_draft=5, batch_size=4)
    tree = SpeculativeGenerator(tiny_target(), fitted_head(), tree=TreeConfig(24, 5, 4), batch_size=4)
    got_chain, got_tree = (g.generate(PROMPTS, max_new_tokens=30) for g in (chain, tree))
    assert [c.token_ids for c in got_tree] == [c.token_ids for c in got_chain] == reference
    assert mean_accepted(got_tree) > mean_accepted(got_chain) + 0.2


@pytest.mark.slow  # CI: test_spec_greedy's chain case; chains and trees stop through the same engine.core.emit
def test_eos_and_budget_inside_a_tree_step(reference):
    gen = SpeculativeGenerator(tiny_target(), fitted_head(), tree=TreeConfig(12, 4, 3), batch_size=4)
    for eos in sorted({ref[i] for ref in reference for i in (1, 3, 4, 7)}):  # inside, at and past a step's end
        got = gen.generate(PROMPTS, max_new_tokens=30, stop_ids=[eos])
        for ref, c in zip(reference, got):
            assert c.token_ids == (ref[: ref.index(eos) + 1] if eos in ref else ref)
    for budget in (1, 2, 3, 5, 7):
        got = gen.generate(PROMPTS, max_new_tokens=budget)
        assert [c.token_ids for c in got] == [ref[:budget] for ref in reference]


def test_draft_tree_is_a_valid_tree_with_best_first_nodes():
    target, head = tiny_target(), fitted_head()
    cfg = TreeConfig(10, 3, 3)
    b = 2
    logits0 = jnp.asarray(np.random.default_rng(0).normal(size=(b, head.config.draft_vocab_size)), jnp.float32)
    state0 = jnp.asarray(np.random.default_rng(1).normal(size=(b, head.config.hidden_size)), jnp.float32)
    cache = kvc.advance(head.init_cache(b, 64), jnp.asarray([5, 9]))
    dt = draft_tree(head, target.embed_tokens[...], logits0, state0, cache, cfg)
    parents, depths, mask = (np.asarray(x) for x in (dt.parents, dt.depths, dt.mask))
    assert parents.shape == (b, cfg.total_tokens) and (parents[:, 0] == -1).all()
    for row in range(b):
        for i in range(1, cfg.total_tokens):
            assert 0 <= parents[row, i] < i and depths[row, i] == depths[row, parents[row, i]] + 1
            assert 1 <= depths[row, i] <= cfg.depth
            want = {i}
            j = parents[row, i]
            while j >= 0:
                want.add(j)
                j = parents[row, j]
            assert set(np.flatnonzero(mask[row, i]).tolist()) == want
        # siblings carry distinct tokens (top-k of one distribution)
        tok = np.asarray(dt.tokens[row])
        for p in set(parents[row, 1:].tolist()):
            kids = tok[1:][parents[row, 1:] == p]
            assert len(set(kids.tolist())) == len(kids)
    # Telemetry candidates: each expanded node's top_k children as ranked; the tree's children of a node are among
    # them, best first (a node's first child is its top-1 whenever it has children).
    cands = np.asarray(dt.candidates)
    assert cands.shape == (b, cfg.total_tokens, cfg.top_k)
    for row in range(b):
        tok = np.asarray(dt.tokens[row])
        for i in range(cfg.total_tokens):
            kids = tok[parents[row] == i]
            assert set(kids.tolist()) <= set(cands[row, i].tolist())
            if len(kids):
                assert kids[0] == cands[row, i, 0]
    # the first level holds the head's top tokens after the root
    top = np.argsort(-np.asarray(logits0), axis=1)[:, :1]
    first = np.asarray(head.to_target_ids(jnp.asarray(top)))
    for row in range(b):
        assert first[row, 0] in np.asarray(dt.tokens[row])[depths[row] == 1]


def test_tree_from_parents_masks():
    parents = jnp.asarray([[-1, 0, 0, 1, 3, 2]])
    dt = tree_from_parents(jnp.zeros((1, 6), jnp.int32), parents, 4)
    assert np.asarray(dt.depths)[0].tolist() == [0, 1, 1, 2, 3, 2]
    assert np.flatnonzero(np.asarray(dt.mask)[0, 4]).tolist() == [0, 1, 3, 4]


def test_compact_moves_the_accepted_path_to_contiguous_slots():
    rng = np.random.default_rng(3)
    layer = jnp.asarray(rng.normal(size=(2, 2, 16, 4)), jnp.float32)
    cache = kvc.KVCache((layer,), (layer * 2,), jnp.asarray([3, 5], jnp.int32))
    path = jnp.asarray([[0, 2, 5, -1], [0, 1, 3, 6]], jnp.int32)
    out = kvc.compact(cache, cache.lengths, path)
    k = np.asarray(out.k[0])
    for row, (m, p) in enumerate([(3, [0, 2, 5]), (5, [0, 1, 3, 6])]):
        for j, node in enumerate(p):
            np.testing.assert_array_equal(k[row, :, m + j], np.asarray(layer)[row, :, m + node])
        np.testing.assert_array_equal(k[row, :, : m], np.asarray(layer)[row, :, : m])  # committed prefix untouched
    np.testing.assert_array_equal(np.asarray(out.v[0]), 2 * k)


@pytest.mark.parametrize("spec,message", [("8,2", "TOTAL,DEPTH,TOPK"), ("40,2,3", "fewer than"), ("1,3,3", ">= 2")])
def test_tree_config_errors(spec, message):
    with pytest.raises(JaxspecError, match=message):
        TreeConfig.parse(spec)


EAGLE31_MULTI = dict(num_layers=3, norm_output=True, fc_norm=True)  # a multi-layer head with EAGLE 3.1's switches


# CI: the 3-layer head (its first layer is a one-layer head's)
@pytest.mark.parametrize("variant", [pytest.param({}, marks=pytest.mark.slow), EAGLE31_MULTI],
                         ids=["one-layer", "eagle31-3-layers"])
def test_a_top1_tree_drafts_the_greedy_chain(variant):
    """A tree of one child per node is a chain: its levels (each written at its offset in the window, seeing its
    ancestors through the mask, in every layer of the head) draft exactly the tokens the head's chain steps do."""
    from fit_head import head_config_for
    from flax import nnx

    from jaxspec.models.eagle3 import Eagle3Head

    target = tiny_target()
    head = Eagle3Head(head_config_for(target, **variant), rngs=nnx.Rngs(5))
    embed, depth, b = target.embed_tokens[...], 4, 2
    rng = np.random.default_rng(3)
    logits0 = jnp.asarray(rng.normal(size=(b, head.config.draft_vocab_size)), jnp.float32)
    state = jnp.asarray(rng.normal(size=(b, 1, head.config.hidden_size)), jnp.float32)
    cache = kvc.advance(head.init_cache(b, 64), jnp.asarray([5, 9]))
    dt = draft_tree(head, embed, logits0, state[:, 0], cache, TreeConfig(depth + 1, depth, 1))
    chain, logits = [], logits0
    for _ in range(depth):
        token = head.to_target_ids(jnp.argmax(logits, axis=-1).astype(jnp.int32))  # [B]
        chain.append(np.asarray(token))
        step, state, cache = head(token[:, None], state, cache.lengths[:, None], cache, embed)
        cache, logits = kvc.advance(cache, 1), step[:, 0]
    np.testing.assert_array_equal(np.asarray(dt.tokens)[:, 1:], np.stack(chain, axis=1))


@pytest.mark.slow  # CI: a multi-layer head's drafts are checked directly (top-1 tree = chain here, TTT = drafting)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_multi_layer_head_keeps_chains_and_trees_exact(dtype, reference):
    from fit_head import head_config_for
    from flax import nnx
    from spec_fixtures import in_dtype

    from jaxspec.models.eagle3 import Eagle3Head

    target = tiny_target()
    head = Eagle3Head(head_config_for(target, **EAGLE31_MULTI), rngs=nnx.Rngs(3))
    if dtype == "bfloat16":
        target, head = in_dtype(target, jnp.bfloat16), in_dtype(head, jnp.bfloat16)
        reference = [c.token_ids for c in Generator(target, batch_size=1).generate(PROMPTS, max_new_tokens=30)]
    for shape in (dict(num_draft=3), dict(tree=TreeConfig(8, 3, 2))):
        got = SpeculativeGenerator(target, head, batch_size=4, **shape).generate(PROMPTS, max_new_tokens=30)
        assert [c.token_ids for c in got] == reference
