"""Greedy speculative decoding equals target-only greedy decoding token for token."""

import numpy as np
import pytest
from flax import nnx
from spec_fixtures import PROMPTS, fitted_head, random_head, tiny_target

from jaxspec.errors import JaxspecError
from jaxspec.engine.generation import Generator
from jaxspec.engine.generator import SpeculativeGenerator
from jaxspec.engine.tree import TreeConfig


@pytest.fixture(scope="module")
def reference():
    return [c.token_ids for c in Generator(tiny_target(), batch_size=1).generate(PROMPTS, max_new_tokens=30)]


# CI: a random head (drafts mostly rejected) at K=1 alone, a fitted one (mostly accepted) at K=5 in a batch of 4
# with other rows; every other combination under -m slow.
GREEDY_CI = {("random", 1, 1), ("fitted", 5, 4)}


@pytest.mark.parametrize("head_kind,k,batch", [
    pytest.param(h, k, b, marks=() if (h, k, b) in GREEDY_CI else pytest.mark.slow)
    for b in (1, 4) for k in (1, 3, 5) for h in ("random", "fitted")
])
def test_equals_target_only(head_kind, k, batch, reference):
    head = random_head() if head_kind == "random" else fitted_head()
    got = SpeculativeGenerator(tiny_target(), head, num_draft=k, batch_size=batch).generate(PROMPTS, max_new_tokens=30)
    assert [c.token_ids for c in got] == reference
    mean_len = np.mean([c.stats["mean_accepted_length"] for c in got])
    if head_kind == "random":
        assert mean_len < 1.2  # acceptance near zero
    elif k == 5:
        assert mean_len > 2  # multi-token acceptance and bonus tokens really happen
    for c in got:
        assert c.stats["target_calls"] - 1 <= len(c.token_ids) - 1
        assert len(c.stats["acceptance_per_position"]) == k


@pytest.mark.slow  # ~18 s; CI: stops inside a verify window in test_grammar (its rows end at EOS) and test_serve
def test_eos_and_budget_inside_a_window(reference):
    """Every token of the reference as EOS, and every budget: speculative output is the reference, cut there."""
    gen = SpeculativeGenerator(tiny_target(), fitted_head(), num_draft=5, batch_size=4)
    # EOS at the 2nd, 5th, 8th and 12th token of each reference: inside the first window, at and past its end
    for eos in sorted({ref[i] for ref in reference for i in (1, 4, 7, 11)}):
        got = gen.generate(PROMPTS, max_new_tokens=30, stop_ids=[eos])
        for ref, c in zip(reference, got):
            want = ref[: ref.index(eos) + 1] if eos in ref else ref
            assert c.token_ids == want
    for budget in (1, 2, 3, 5, 6, 7, 11, 13):  # around the K + 1 = 6 tokens a step can emit
        got = gen.generate(PROMPTS, max_new_tokens=budget)
        assert [c.token_ids for c in got] == [ref[:budget] for ref in reference]


@pytest.mark.parametrize("tree", [pytest.param(None, marks=pytest.mark.slow), TreeConfig(8, 3, 2)], ids=["chain", "tree"])
def test_a_prompt_that_fills_the_context_speculates_to_its_last_token(tree):
    """Prompt + new tokens = the context length: target-only runs it, so speculation must too, and equal it (the
    verify window's slots past the context are scratch, never committed)."""
    model = tiny_target(context=40)
    prompts = [[(7 * i + j) % 101 for i in range(40 - 9)] for j in range(2)]
    want = [c.token_ids for c in Generator(model, batch_size=2).generate(prompts, max_new_tokens=9)]
    spec = SpeculativeGenerator(model, fitted_head(), num_draft=5, tree=tree, batch_size=2)
    got = spec.generate(prompts, max_new_tokens=9)
    assert [c.token_ids for c in got] == want
    assert all(len(w) == 9 for w in want)
    with pytest.raises(JaxspecError, match="exceeds the model's context length of 40"):
        spec.generate(prompts, max_new_tokens=10)


def test_forced_rejection_never_changes_output(reference):
    """A head whose every draft is off by one token: all drafts are rejected (their K/V written, never committed)."""
    head = nnx.clone(fitted_head())
    vocab = tiny_target().config.vocab_size
    head.d2t.set_value(np.where(np.arange(vocab) + 1 < vocab, 1, 1 - vocab))  # target id = draft id + 1 (mod V)
    got = SpeculativeGenerator(tiny_target(), head, num_draft=4, batch_size=4).generate(PROMPTS, max_new_tokens=30)
    assert [c.token_ids for c in got] == reference
    assert max(max(c.stats["acceptance_per_position"]) for c in got) < 0.15


def test_step_compiles_once_per_bucket():
    gen = SpeculativeGenerator(tiny_target(), fitted_head(), num_draft=3, batch_size=2)
    gen.generate(PROMPTS[:2], max_new_tokens=16)
    messages = []
    gen.on_compile = messages.append
    gen.generate([[1, 2, 3], [9] * 12, [4] * 7, [8] * 9], max_new_tokens=16)  # new prompts, same buckets
    gen.generate([[1, 2, 3], [9] * 12], max_new_tokens=9)  # another budget in the same cache bucket
    assert messages == []
    gen.generate([[5] * 40], max_new_tokens=16)  # a longer prompt bucket compiles a prefill and a step
    assert [m.split(" (")[0] for m in messages if m.startswith("compiling")] == [
        "compiling the prefill", "compiling the step"
    ]


@pytest.mark.parametrize(
    "variant",
    [
        pytest.param(dict(norm_before_residual=True), marks=pytest.mark.slow),
        pytest.param(dict(norm_before_fc=True), marks=pytest.mark.slow),
        pytest.param(dict(fc_norm=True), marks=pytest.mark.slow),
        # A narrower head with its own embeddings and a reduced draft vocabulary mapped by d2t.
        dict(hidden_size=48, head_dim=12, intermediate_size=96, has_embed_tokens=True, draft_vocab_size=40),
    ],
    ids=["norm_before_residual", "norm_before_fc", "fc_norm", "narrow_own_embed_reduced_vocab"],
)  # CI: the narrow head (its own embeddings, a reduced vocabulary); the norm variants: -m slow (and test_heads)
def test_head_variants_keep_output_exact(variant, reference):
    from fit_head import head_config_for

    from jaxspec.models.eagle3 import Eagle3Head

    target = tiny_target()
    head = Eagle3Head(head_config_for(target, **variant), rngs=nnx.Rngs(3))
    if "draft_vocab_size" in variant:
        selected = np.sort(np.random.default_rng(0).choice(target.config.vocab_size, 40, replace=False))
        head.d2t.set_value(selected - np.arange(40))
    got = SpeculativeGenerator(target, head, num_draft=3, batch_size=4).generate(PROMPTS, max_new_tokens=30)
    assert [c.token_ids for c in got] == reference


# CI: forced acceptance through the bench suite (tests/test_cli.py, [forced])
@pytest.mark.parametrize("prob, k", [pytest.param(0.6, 4, marks=pytest.mark.slow), pytest.param(1.0, 4, marks=pytest.mark.slow),
                                     pytest.param(0.0, 3, marks=pytest.mark.slow)])
def test_forced_acceptance_sets_the_mean_accepted_length(prob, k):
    """Benchmark-only forced acceptance: a chain accepts 1 + p + ... + p^K tokens per verify on average, whatever the
    head (here a random one, which accepts ~nothing on its own)."""
    gen = SpeculativeGenerator(tiny_target(), random_head(), num_draft=k, batch_size=4, forced_accept_prob=prob)
    max_new = 1 + 40 * (k + 1)  # with p = 1, exactly 40 full steps after the prefill token
    out = gen.generate(PROMPTS, max_new_tokens=max_new)
    tokens = sum(c.num_generated - 1 for c in out)
    calls = sum(c.stats["target_calls"] - 1 for c in out)
    expected = sum(prob**j for j in range(k + 1))
    if prob in (0.0, 1.0):
        assert tokens / calls == expected
    else:  # ~40 steps per row at p = 0.6: the mean of ~100+ draws of a bounded count, well within 0.25
        assert abs(tokens / calls - expected) < 0.25
    assert all(c.num_generated == max_new for c in out)


def test_forced_acceptance_is_for_chains_only():
    with pytest.raises(JaxspecError, match="applies to chains"):
        SpeculativeGenerator(tiny_target(), random_head(), tree=TreeConfig(6, 3, 2), forced_accept_prob=0.5)
    with pytest.raises(JaxspecError, match=r"must be in \[0, 1\]"):
        SpeculativeGenerator(tiny_target(), random_head(), forced_accept_prob=1.5)


def test_a_head_held_on_the_cpu_kernels_keeps_output_exact(reference):
    """`hold_draft_weights`, as the CLIs load a head on CPU: its matmuls on the row kernel (int8 values and a scale
    per column) and its causal attention (catch-up and chain steps) on the row attention. Drafts only change speed,
    so the text is target-only's; the head's logits are those of its plain forward with the int8-quantized weights
    to rounding, and the row attention is really what its forward calls."""
    import jax
    import jax.numpy as jnp

    from jaxspec.models import kv_cache as kvc
    from jaxspec.models.llama import Attention, Linear, hold_draft_weights
    from jaxspec.models.quantize import quantize_weight
    from pallas_kernels import cpu_library

    if not cpu_library.available():
        pytest.skip(f"the CPU kernels do not build here: {cpu_library.unavailable_reason()}")
    target, plain = tiny_target(), fitted_head()
    held = nnx.merge(*nnx.split(plain))  # a copy: the cached head stays plain
    hold_draft_weights(held, target)
    assert all(a.draft_row_attention for _, a in nnx.iter_graph(held) if isinstance(a, Attention))

    embed = target.embed_tokens[...] if plain.embed_tokens is None else None
    rng = np.random.default_rng(3)
    feats = jnp.asarray(rng.standard_normal((1, 9, plain.config.num_aux * 64), dtype=np.float32))
    tokens = jnp.asarray(rng.integers(0, 101, (1, 9)), jnp.int32)

    def forward(head):  # a prompt of 6 into an empty cache, then a catch-up of 3 behind it
        cache = head.init_cache(1, 32)
        _, _, cache = head(tokens[:, :6], head.project(feats[:, :6]), jnp.arange(6)[None], cache, embed,
                           empty_cache=True)
        cache = kvc.advance(cache, jnp.array([6]))
        return head(tokens[:, 6:], head.project(feats[:, 6:]), 6 + jnp.arange(3)[None], cache, embed)[0]

    dequantized = nnx.merge(*nnx.split(plain))
    for linear in [n for _, n in nnx.iter_graph(dequantized) if isinstance(n, Linear)]:
        values, scale = quantize_weight(linear.kernel[...], "int8", jnp.float32)
        linear.kernel = nnx.Param((values * scale).astype(linear.kernel[...].dtype))
    np.testing.assert_allclose(np.asarray(forward(held)), np.asarray(forward(dequantized)), rtol=1e-4, atol=1e-4)
    assert "jaxspec_row_attention" in str(jax.make_jaxpr(lambda: forward(held))())
    assert "jaxspec_row_attention" not in str(jax.make_jaxpr(lambda: forward(plain))())

    got = SpeculativeGenerator(target, held, num_draft=5, batch_size=1).generate(PROMPTS, max_new_tokens=30)
    assert [c.token_ids for c in got] == reference
    assert np.mean([c.stats["mean_accepted_length"] for c in got]) > 2
