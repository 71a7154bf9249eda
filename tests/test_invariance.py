"""Batch-invariant target numerics: after the same prompt, a token's logits and hidden states are the same bits
whether it is decoded alone, verified in a chain of K+1 or in a tree, next to other batch rows, at another cache
capacity, in float32 and bfloat16, for several model families; and a prompt's rows are the same bits whatever the
batch and padding of its prefill. (A prefill may have its own tiles, so on CPU a prompt row need not get a decode's
bits: jaxspec/models/numerics.py says why that is enough.) The hidden states of every layer are compared (aux
features at all layers), so a failure names the first layer — and so the op — that breaks invariance.

The models are tiny by default. `JAXSPEC_TEST_SHAPE=llama3.1-8b` (a key of jaxspec.reference_shapes.SHAPES) runs the
same tests on random weights of that real shape (its heads and tying; each family's biases and norms kept; 16 GB in
bfloat16: an accelerator's job). On a GPU or TPU, `attention="pallas"` cases also run the compiled kernel."""

from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxspec import sharding
from jaxspec.config import TargetConfig
from jaxspec.models import kv_cache as kvc
from jaxspec.models.llama import LlamaModel
from jaxspec.models.numerics import hold
from jaxspec.reference_shapes import reference_config
from jaxspec.engine.tree import tree_from_parents

FAMILIES = {
    # GQA 4/2, untied (Llama)
    "llama": dict(num_heads=4, num_kv_heads=2, tie_word_embeddings=False),
    # q/k/v biases (Qwen2), tied embeddings, GQA 6/2
    "qwen2": dict(num_heads=6, num_kv_heads=2, attention_bias=True, tie_word_embeddings=True, model_type="qwen2"),
    # per-head q/k norms (Qwen3), MHA
    "qwen3": dict(num_heads=4, num_kv_heads=4, qk_norm=True, model_type="qwen3"),
}


TEST_SHAPE = os.environ.get("JAXSPEC_TEST_SHAPE")  # None: tiny models


def _config(family: str) -> TargetConfig:
    """The family's tiny model, or (JAXSPEC_TEST_SHAPE) the real shape with the family's extras, every layer's input
    as an aux feature."""
    extra = FAMILIES[family]
    if TEST_SHAPE is None:
        return TargetConfig(
            vocab_size=97, hidden_size=64, intermediate_size=96, num_layers=3, head_dim=16, aux_layer_ids=(0, 1, 2),
            **extra,
        )
    base = reference_config(TEST_SHAPE)
    keep = {k: v for k, v in extra.items() if k not in ("num_heads", "num_kv_heads", "tie_word_embeddings")}
    return dataclasses.replace(base, aux_layer_ids=tuple(range(base.num_layers)), **keep)


@functools.cache
def model(family: str, dtype: str, attention: str = "reference", row_kernel: bool | None = None) -> LlamaModel:
    """attention: "reference", "interpret" (the Pallas kernel in interpret mode) or "pallas" (compiled);
    row_kernel: None, the backend's default numerics; False, CPU matmuls on one-row tiles (where the row kernel
    cannot be built)."""
    cfg = _config(family)
    m = LlamaModel(cfg, dtype=jnp.dtype(dtype), rngs=nnx.Rngs(3))
    m.numerics = dataclasses.replace(m.invariant_numerics(), kernels=attention)
    if row_kernel is not None:
        m.numerics = dataclasses.replace(m.numerics, row_kernel=row_kernel)
    if cfg.attention_bias:  # non-zero biases
        for layer in m.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                bias = 0.1 * jax.random.normal(jax.random.key(5), proj.bias.shape)
                proj.bias.set_value(hold(bias, dtype))
    return m


@functools.cache
def _forward(m):
    """One jitted forward per model (compiled once per shape)."""
    gd, params = nnx.split(m)

    @functools.partial(jax.jit, static_argnames=("empty",))
    def run(params, tokens, positions, cache, ancestors=None, empty=False):
        out = nnx.merge(gd, params)(tokens, positions, cache, ancestors=ancestors, return_aux=True, empty_cache=empty)
        return out.logits, out.aux, out.cache

    return lambda *a, **k: run(params, *a, **k)


def decode_one_by_one(m, seq: np.ndarray, prompt: int = 1, capacity: int = 128):
    """The canonical numbers: the first `prompt` tokens prefilled alone (batch 1), then every other token run
    through the target alone (T=1, batch 1). → logits [n, V], aux [n, F] (rows < prompt: the prefill's)."""
    return _decoded(m, tuple(int(x) for x in seq), prompt, capacity)


@functools.cache
def _decoded(m, seq: tuple, prompt: int, capacity: int):
    fwd = _forward(m)
    lg, ax, cache = _prefill(m, fwd, [np.asarray(seq[:prompt], np.int32)], capacity)
    logits, aux = list(np.asarray(lg[0, :prompt])), list(np.asarray(ax[0, :prompt].astype(jnp.float32)))
    for i in range(prompt, len(seq)):
        lg, ax, cache = fwd(jnp.asarray([[seq[i]]], jnp.int32), jnp.asarray([[i]], jnp.int32), cache)
        cache = kvc.advance(cache, 1)
        logits.append(np.asarray(lg[0, 0]))
        aux.append(np.asarray(ax[0, 0].astype(jnp.float32)))
    return np.stack(logits), np.stack(aux)


def assert_same_bits(got_logits, got_aux, want_logits, want_aux, m, what):
    """Per-layer comparison first, so that the message names where the bits part."""
    h = m.config.hidden_size
    for layer in range(len(m.config.aux_layer_ids)):
        sl = slice(layer * h, (layer + 1) * h)
        np.testing.assert_array_equal(got_aux[..., sl], want_aux[..., sl], err_msg=f"{what}: input of layer {layer}")
    np.testing.assert_array_equal(got_logits, want_logits, err_msg=f"{what}: logits")


def _sequence(seed: int, n: int, vocab: int = 97) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, n).astype(np.int32)


PREFILL_WIDTH = 96  # every prefill pads to this many tokens: one compiled program per model and batch size


@pytest.fixture(autouse=True)
def _fresh_programs():
    """Each test compiles its own programs and frees them after (see conftest: XLA:CPU's code mappings)."""
    yield
    _forward.cache_clear()
    _decoded.cache_clear()
    model.cache_clear()  # at a real shape each model is gigabytes
    jax.clear_caches()


def _prefill(m, fwd, rows: list[np.ndarray], capacity: int, width: int = PREFILL_WIDTH):
    """Prefill right-padded rows together (padded to `width`); → cache advanced by each row's length."""
    t = width
    assert max(len(r) for r in rows) <= t
    toks = np.zeros((len(rows), t), np.int32)
    for i, r in enumerate(rows):
        toks[i, : len(r)] = r
    pos = np.broadcast_to(np.arange(t, dtype=np.int32), toks.shape)
    lg, ax, cache = fwd(jnp.asarray(toks), jnp.asarray(pos), m.init_cache(len(rows), capacity), empty=True)
    return lg, ax, kvc.advance(cache, jnp.asarray([len(r) for r in rows], jnp.int32))


# (family, dtype, attention): every family and dtype with the jax.numpy attention, and two with the Pallas kernel
# (interpret mode; on a GPU or TPU also compiled)
CASES = [(f, d, "reference") for f in FAMILIES for d in ("float32", "bfloat16")] + [
    ("llama", "bfloat16", "interpret"), ("qwen2", "float32", "interpret"),
] + ([("llama", "bfloat16", "pallas"), ("qwen2", "float32", "pallas")] if jax.default_backend() != "cpu" else [])


def matrix(combos, in_ci) -> list:
    """Parameters for every combination; those not in the CI subset are marked slow (`pytest -m slow` runs them:
    the whole matrix takes ~17 minutes on 2 CPU cores). The CI subset keeps one case per kind of step (prefill,
    chain, on a mesh, end to end; a tree's verify end to end only) with the jax.numpy attention, the families and dtypes spread over them; the
    Pallas kernel (interpret mode) runs in CI against its reference in test_invariant_kernel_lowering and end to
    end in test_cli (`--kernels pallas --tree`)."""
    return [pytest.param(*(c if isinstance(c, tuple) else (c,)), marks=() if c in in_ci else pytest.mark.slow)
            for c in combos]


@pytest.mark.parametrize(
    "family,dtype,attention",
    matrix(CASES, {("llama", "bfloat16", "reference")}),
)
def test_prefill_is_batch_invariant(family, dtype, attention):
    """A prompt's rows: alone, next to other rows, padded to another width, at another capacity; and where a
    prefill has the decode's tiles (GPU, TPU) or the CPU row kernel, the bits of decoding it token by token."""
    m = model(family, dtype, attention)
    seq = _sequence(1, 21)
    want_l, want_a = decode_one_by_one(m, seq, prompt=len(seq))  # prefilled alone at PREFILL_WIDTH
    fwd = _forward(m)
    for batch, width, capacity in ((1, 40, 64), (4, PREFILL_WIDTH, 128), (3, 130, 256)):
        others = [_sequence(10 + i, 5 + 7 * i) for i in range(batch - 1)]
        lg, ax, _ = _prefill(m, fwd, [seq, *others], capacity=capacity, width=width)
        assert_same_bits(
            np.asarray(lg[0, :21]), np.asarray(ax[0, :21].astype(jnp.float32)), want_l, want_a, m,
            f"prefill batch {batch}, width {width}",
        )
    # a decode's bits too where a prefill has the decode's tiles (GPU, TPU) or its matmuls on the CPU row kernel
    # (experts aside: they keep a prefill's 64-row tiles)
    if m.numerics.for_prefill() == m.numerics or (m.numerics.row_kernel and m.config.moe is None):
        dec_l, dec_a = decode_one_by_one(m, seq)
        assert_same_bits(want_l, want_a, dec_l, dec_a, m, "prefill vs decode")


@pytest.mark.parametrize("family,dtype,attention,k", matrix(
    [(*c, k) for c in CASES for k in (1, 3, 5)],
    {("llama", "bfloat16", "reference", 5)},  # the Pallas kernel in a model: the tree case below
))
def test_chain_verify_equals_decode(family, dtype, attention, k):
    """Verify blocks of K+1 after prefixes of several lengths (across key-block boundaries), batch 1 and 4 with
    other rows at other lengths, at another cache capacity than the decode's."""
    check_chain_verify(model(family, dtype, attention), k)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="one-row tiles are CPU's numerics")
def test_chain_verify_equals_decode_on_row_tiles():
    """Where the CPU row kernel cannot be built (no C++ compiler), the matmuls run on one-row tiles: the same
    guarantee."""
    check_chain_verify(model("llama", "bfloat16", "reference", row_kernel=False), 5)


def check_chain_verify(m: LlamaModel, k: int) -> None:
    n = 80
    seq = _sequence(1, n)
    fwd = _forward(m)
    for batch in (1, 4):
        for start in (1, 60, 64 - k, n - k - 1):
            want_l, want_a = decode_one_by_one(m, seq[: start + k + 1], prompt=start)
            rows = [seq[:start]] + [_sequence(20 + i, 3 + 11 * i) for i in range(batch - 1)]
            _, _, cache = _prefill(m, fwd, rows, capacity=256)
            block = np.zeros((batch, k + 1), np.int32)
            block[0] = seq[start : start + k + 1]
            block[1:] = np.random.default_rng(start).integers(0, 97, (batch - 1, k + 1))
            pos = cache.lengths[:, None] + jnp.arange(k + 1, dtype=jnp.int32)
            lg, ax, _ = fwd(jnp.asarray(block), pos, cache)
            assert_same_bits(
                np.asarray(lg[0]), np.asarray(ax[0].astype(jnp.float32)), want_l[start : start + k + 1],
                want_a[start : start + k + 1], m, f"chain K={k} batch {batch} after {start}",
            )


def random_tree(rng, n: int, max_depth: int) -> np.ndarray:
    """Parent pointers of a random tree of n nodes (node 0 the root), parents before children, depth ≤ max_depth."""
    parents, depth = [-1], [0]
    for _ in range(1, n):
        choices = [i for i in range(len(parents)) if depth[i] < max_depth]
        p = int(rng.choice(choices))
        parents.append(p)
        depth.append(depth[p] + 1)
    return np.asarray(parents, np.int32)


@pytest.mark.parametrize("family,dtype,attention,nodes,max_depth", matrix(
    [(*c, *size) for c in CASES for size in ((4, 3), (12, 5), (20, 7))],
    set(),  # -m slow (~45 s a case). In CI a tree's verify meets decoding end to end: test_spec_tree's greedy trees
))  # and the bfloat16 tree below equal target-only; the kernel's trees: test_cli (--kernels pallas --tree)
def test_tree_verify_equals_decode(family, dtype, attention, nodes, max_depth):
    """Every node of a random tree (random tokens) gets the bits of decoding its own root-to-node path."""
    m = model(family, dtype, attention)
    rng = np.random.default_rng(nodes)
    fwd = _forward(m)
    prefix_len = int(rng.integers(1, 70))
    prefix = _sequence(nodes, prefix_len)
    for batch in (1, 4):
        parents = np.stack([random_tree(rng, nodes, max_depth) for _ in range(batch)])
        tokens = rng.integers(0, 97, (batch, nodes)).astype(np.int32)
        dt = tree_from_parents(jnp.asarray(tokens), jnp.asarray(parents), max_depth)
        rows = [prefix] + [_sequence(40 + i, 2 + 13 * i) for i in range(batch - 1)]
        _, _, cache = _prefill(m, fwd, rows, capacity=256)
        pos = cache.lengths[:, None] + dt.depths
        lg, ax, _ = fwd(jnp.asarray(tokens), pos, cache, dt.ancestors)
        depths = np.asarray(dt.depths[0])
        for leaf in range(nodes):
            path = [leaf]
            while parents[0, path[-1]] >= 0:
                path.append(int(parents[0, path[-1]]))
            path = path[::-1]
            want_l, want_a = decode_one_by_one(m, np.concatenate([prefix, tokens[0, path]]), prompt=prefix_len)
            assert depths[leaf] == len(path) - 1
            assert_same_bits(
                np.asarray(lg[0, leaf]), np.asarray(ax[0, leaf].astype(jnp.float32)), want_l[-1], want_a[-1], m,
                f"tree node {leaf} (depth {depths[leaf]}) of {nodes}, batch {batch}",
            )
            if leaf > 3:
                break  # a few nodes per tree: each check decodes its whole path


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices (XLA_FLAGS host device count)")
@pytest.mark.parametrize("dtype,attention", matrix(
    [("float32", "reference"), ("bfloat16", "reference"), ("bfloat16", "interpret")], set()
))  # in CI, meshes equal one device in tests/test_mesh.py (target-only, the tree with repeated KV heads)
def test_invariant_on_the_mesh(dtype, attention):
    """On a data=4 x model=2 mesh: after the same prefill (whose rows do not depend on its padding), decode and
    chain/tree verify agree bit for bit with each other (the mesh has its own bits: a model axis splits contractions,
    so they need not equal one device's); the kernel runs per shard."""
    m = nnx.clone(model("llama", dtype, attention))
    mesh = sharding.make_mesh(sharding.MeshConfig(data=4, model=2))
    gd, params = nnx.split(m)
    params = sharding.shard_params(params, mesh)

    @functools.partial(jax.jit, static_argnames="empty")
    def forward(p, t, q, c, a, empty):
        out = nnx.merge(gd, p)(t, q, kvc.constrain(c), ancestors=a, return_aux=True, empty_cache=empty)
        return out.logits, out.aux, out.cache

    def run(tokens, positions, cache, ancestors=None, empty=False):
        with sharding.mesh_context(mesh):
            return forward(params, tokens, positions, cache, ancestors, empty)

    batch, n = 4, 30
    seqs = [_sequence(70 + i, n) for i in range(batch)]

    def prefill(width: int, capacity: int):  # the first 12 tokens of each row, padded to `width`
        toks = jnp.asarray(np.stack([np.pad(s[:12], (0, width - 12)) for s in seqs]))
        pos = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (batch, width))
        return run(toks, pos, m.init_cache(batch, capacity), empty=True)

    # a prompt's rows do not depend on its padding or the cache's capacity
    lg, ax, cache = prefill(12, 128)
    wide_l, wide_a, _ = prefill(16, 64)
    assert_same_bits(np.asarray(wide_l[:, :12]), np.asarray(wide_a[:, :12].astype(jnp.float32)), np.asarray(lg),
                     np.asarray(ax.astype(jnp.float32)), m, "mesh prefill, padded")
    # canonical on the mesh: after the prefill, one token at a time, all four rows together
    _, _, dec_cache = prefill(12, 64)
    dec_cache = kvc.advance(dec_cache, 12)
    want_l, want_a = [], []
    for i in range(12, 18):
        lg, ax, dec_cache = run(jnp.asarray([[s[i]] for s in seqs]), jnp.full((batch, 1), i, jnp.int32), dec_cache)
        dec_cache = kvc.advance(dec_cache, 1)
        want_l.append(np.asarray(lg[:, 0]))
        want_a.append(np.asarray(ax[:, 0].astype(jnp.float32)))
    want_l, want_a = np.stack(want_l, 1), np.stack(want_a, 1)  # [B, 6, ...]: positions 12..17
    cache = kvc.advance(cache, 12)
    block = jnp.asarray(np.stack([s[12:18] for s in seqs]))
    lg, ax, _ = run(block, 12 + jnp.broadcast_to(jnp.arange(6, dtype=jnp.int32), (batch, 6)), cache)
    assert_same_bits(np.asarray(lg), np.asarray(ax.astype(jnp.float32)), want_l, want_a, m, "mesh chain verify")
    # a tree whose first path is the true continuation: those nodes get the decode's bits
    parents = jnp.asarray([[-1, 0, 0, 1, 2, 3, 3]] * batch, jnp.int32)
    tree_tok = np.stack([[s[12], s[13], 5, s[14], 7, s[15], 9] for s in seqs]).astype(np.int32)
    dt = tree_from_parents(jnp.asarray(tree_tok), parents, 4)
    lg, ax, _ = run(jnp.asarray(tree_tok), 12 + dt.depths, cache, dt.ancestors)
    on_path = [0, 1, 3, 5]
    assert_same_bits(np.asarray(lg[:, on_path]), np.asarray(ax[:, on_path].astype(jnp.float32)), want_l[:, :4],
                     want_a[:, :4], m, "mesh tree verify")


def _as_dtype(m: LlamaModel, dtype) -> LlamaModel:
    """The same weights in another dtype (a fresh skeleton filled with the cast parameters)."""
    out = LlamaModel(m.config, dtype=dtype, rngs=None)
    nnx.update(out, jax.tree.map(lambda x: hold(x, dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x,
                                 nnx.state(m, nnx.Param)))  # as a loaded model holds them (float32 on CPU)
    return out


@pytest.mark.parametrize("tree,batch,attention", matrix(
    [(tree, b, a) for tree in (None, "8,4,3") for b, a in ((1, "reference"), (4, "reference"), (4, "interpret"))],
    {("8,4,3", 4, "reference")},
))
def test_bfloat16_greedy_speculation_equals_target_only(tree, batch, attention):
    """End to end in bfloat16, where plain XLA numerics part the texts: the engine's output is the target's, with
    the jax.numpy attention and with the Pallas kernel (interpret mode)."""
    from spec_fixtures import PROMPTS, fitted_head, tiny_target

    from jaxspec.engine.generation import Generator
    from jaxspec.engine.generator import SpeculativeGenerator
    from jaxspec.engine.tree import TreeConfig

    target = _as_dtype(tiny_target(), jnp.bfloat16)
    target.numerics = dataclasses.replace(target.invariant_numerics(), kernels=attention)
    want = [c.token_ids for c in Generator(target, batch_size=1).generate(PROMPTS, max_new_tokens=40)]
    gen = SpeculativeGenerator(
        target, fitted_head(), num_draft=5, batch_size=batch, tree=None if tree is None else TreeConfig.parse(tree)
    )
    got = gen.generate(PROMPTS, max_new_tokens=40)
    assert [c.token_ids for c in got] == want
    assert np.mean([c.stats["mean_accepted_length"] for c in got]) > 1.5  # drafts really are accepted


@pytest.mark.parametrize("batch", matrix([1, 4], set()))  # in CI: test_ngram_proposer (float32)
def test_bfloat16_ngram_equals_target_only(batch):
    """Prompt lookup in bfloat16: steps that verify K + 1 tokens and steps without a match, which run the root alone
    (a one-token decode), both emit the target-only tokens."""
    from spec_fixtures import PROMPTS, tiny_target

    from jaxspec.engine.generation import Generator
    from jaxspec.engine.proposers.ngram import NgramProposer

    target = _as_dtype(tiny_target(), jnp.bfloat16)
    prompts = PROMPTS + [PROMPTS[1] * 3]
    want = [c.token_ids for c in Generator(target, batch_size=1).generate(prompts, max_new_tokens=40)]
    got = Generator(target, proposer=NgramProposer(4, 2, 3), batch_size=batch).generate(prompts, max_new_tokens=40)
    assert [c.token_ids for c in got] == want
    outcomes = {k: sum(c.stats["rejections"][k] for c in got) for k in ("no_draft", "miss", "all_accepted")}
    assert outcomes["no_draft"] > 0 and outcomes["miss"] + outcomes["all_accepted"] > 0  # both kinds of step ran


@pytest.mark.parametrize("family", matrix(list(FAMILIES), set()))  # both forms run in CI: test_mesh (separate)
def test_fused_qkv_held_and_separate(family):
    """Numerics.fused_qkv (one q/k/v dot, CPU's default): the kernels held once before a loop (`hold_step_weights`, as
    the generators run them) give the bits of kernels concatenated in each call, in a decode and in a verify block;
    and separate q/k/v dots give the same values to float32 rounding (their bits may differ: another dot shape)."""
    base = model(family, "float32")
    seq = _sequence(3, 40)

    def run(numerics, held):
        m = nnx.merge(*nnx.split(base))
        m.numerics = numerics
        gd, params = nnx.split(m)

        @jax.jit
        def fwd(params, tokens, positions, cache):
            target = nnx.merge(gd, params)
            if held:
                target.hold_step_weights()
            out = target(tokens, positions, cache, return_aux=True)
            return out.logits, out.aux

        _, _, cache = _prefill(m, _forward(m), [seq[:30]], capacity=128)
        outs = []
        for t in (1, 4):  # a decode, a chain verify of 4
            pos = cache.lengths[:, None] + jnp.arange(t, dtype=jnp.int32)
            outs += [np.asarray(x) for x in fwd(params, jnp.asarray(seq[None, 30 : 30 + t]), pos, cache)]
        return outs

    fused = dataclasses.replace(base.numerics, fused_qkv=True)
    held, per_call = run(fused, True), run(fused, False)
    separate = run(dataclasses.replace(fused, fused_qkv=False), False)
    for a, b, c in zip(held, per_call, separate):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_allclose(a, c, rtol=1e-5, atol=1e-5)


def test_hold_step_weights_holds_once():
    """What the CLIs hold at load is what every later program reads: a second hold (each step program's) keeps it.
    On one-row tiles the side-by-side q/k/v kernel; with the CPU row kernel its panels and every other matmul's,
    the tied table's included; numerics with neither hold nothing."""
    base = model("qwen2", "float32")  # biases and a tied table
    m = nnx.merge(*nnx.split(base))
    m.numerics = dataclasses.replace(base.numerics, fused_qkv=True, row_kernel=False)
    first = m.hold_step_weights().layers[0].self_attn.qkv_fused[0]
    assert first.shape == (64, (6 + 2 * 2) * 16)  # [hidden, q + k + v columns]
    assert m.hold_step_weights().layers[0].self_attn.qkv_fused[0] is first
    assert m.layers[0].mlp.up_proj.panels is None and m.head_panels is None

    panelled = nnx.merge(*nnx.split(base))
    panelled.numerics = dataclasses.replace(base.numerics, fused_qkv=True, row_kernel=True)
    attn = panelled.hold_step_weights().layers[0].self_attn
    panels, bias, _ = attn.qkv_panels
    assert panels.shape == ((6 + 2 * 2) * 16 // 16, 64, 16) and bias.shape == ((6 + 2 * 2) * 16,)
    assert attn.qkv_fused is None and attn.q_proj.panels is None  # the fused panels stand for q, k and v
    assert panelled.layers[0].mlp.up_proj.panels.shape == (-(-96 // 16), 64, 16)
    assert panelled.head_panels.shape == (-(-97 // 16), 64, 16)  # the tied table [V, H] as the LM head
    assert panelled.hold_step_weights().layers[0].self_attn.qkv_panels[0] is panels

    plain = nnx.merge(*nnx.split(base))
    plain.numerics = dataclasses.replace(base.numerics, fused_qkv=False, row_kernel=False)
    plain.hold_step_weights()
    assert all(layer.self_attn.qkv_fused is None and layer.mlp.up_proj.panels is None for layer in plain.layers)


