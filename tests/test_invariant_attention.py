"""The invariant-attention Pallas kernel (pallas_kernels/invariant_attention.py) against its jax.numpy reference, bit
for bit, on fresh random inputs shaped as the target passes them (jaxspec/models/llama.py): the cache already holds
this call's K/V at slots lengths + i (write before read), and slots past them hold stale values; chains (decode at
T = 1, verify) at positions lengths + i; prefills from an empty cache with a static block bound; draft trees at
positions lengths + depth with their ancestors (jaxspec.engine.tree). Ragged committed lengths per row (small, a whole
number of key blocks, one past, a block's last slot, up to 4096), GQA groups 1, 2, 3 and 4, float32 and bfloat16,
batch 1 and 4; and each row's bits do not depend on the other rows (the batch invariance the engine relies on). The
kernel's split (flash-decoding) form, forced on, gives the same bits as the reference and as its one-pass form.

On CPU the kernel runs in Pallas interpret mode; on an accelerator it is compiled, which is the check
pallas_kernels/dispatch.py asks for before a backend joins VALIDATED_BACKENDS."""

from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.models.numerics import Numerics
from jaxspec.engine.tree import random_parents, tree_from_parents
from pallas_kernels.invariant_attention import invariant_attention, invariant_attention_reference

KEY_BLOCK = Numerics().key_block  # the target's (64)
INTERPRET = jax.default_backend() == "cpu"  # CPU cannot compile Pallas kernels: run them in interpret mode

# jitted once per module (as the target runs it, inside its jitted forward): one compile per shape
reference = jax.jit(invariant_attention_reference, static_argnames=("key_block", "num_blocks"))


def bits(x) -> np.ndarray:
    x = np.asarray(x)
    return x.view({2: np.uint16, 4: np.uint32}[x.dtype.itemsize])




def make_inputs(seed: str, kind: str, dtype: str, b: int, t: int, hq: int, hkv: int, d: int, s: int, lengths,
                max_depth: int | None = None, parents: np.ndarray | None = None):
    """→ (args, num_blocks) for one call: args = (q, k_cache, v_cache, lengths, positions, ancestors).

    kind: "chain" (T new tokens at slots/positions lengths + i; T = 1 is a decode), "prefill" (lengths 0, positions
    0..T-1, num_blocks = ceil(T / Bk) as the target passes for an empty cache) or "tree" (random trees of depth ≤
    max_depth, or the given parents [B, T]: node i's K/V at slot lengths + i, position lengths + depth_i). Every
    cache slot holds random values, those past the new tokens too (stale entries: the kernel must not see them)."""
    rng = np.random.default_rng(zlib.crc32(seed.encode()))
    keys = jax.random.split(jax.random.key(int(rng.integers(2**31))), 3)
    q = (2 * jax.random.normal(keys[0], (b, t, hq, d))).astype(dtype)
    k_cache = (2 * jax.random.normal(keys[1], (b, hkv, s, d))).astype(dtype)
    v_cache = jax.random.normal(keys[2], (b, hkv, s, d)).astype(dtype)
    lengths = np.asarray(lengths, np.int32)
    assert lengths.shape == (b,)
    num_blocks, ancestors = None, None
    if kind == "chain":
        positions = lengths[:, None] + np.arange(t, dtype=np.int32)
    elif kind == "prefill":
        assert not lengths.any()
        positions = np.broadcast_to(np.arange(t, dtype=np.int32), (b, t))
        num_blocks = -(-t // KEY_BLOCK)
    elif kind == "tree":
        if parents is None:
            parents = np.stack([random_parents(rng, t, max_depth) for _ in range(b)])
        tree = tree_from_parents(jnp.zeros((b, t), jnp.int32), jnp.asarray(parents), max_depth)
        ancestors = tree.ancestors  # [B, T, max_depth + 1], as the engine passes them
        positions = lengths[:, None] + np.asarray(tree.depths)
    else:
        raise ValueError(kind)
    assert lengths.max() + t <= s, "the cache holds every new token"
    args = (q, k_cache, v_cache, jnp.asarray(lengths), jnp.asarray(positions, jnp.int32), ancestors)
    return args, num_blocks


def run_both(args, num_blocks, **kernel_opts):
    """→ (kernel, reference) outputs; kernel_opts: `split`."""
    opts = {"key_block": KEY_BLOCK, "num_blocks": num_blocks}
    return invariant_attention(*args, **opts, interpret=INTERPRET, **kernel_opts), reference(*args, **opts)


def check(args, num_blocks, what: str, **kernel_opts) -> np.ndarray:
    """The kernel's bits are the reference's; → the kernel's output."""
    got, want = run_both(args, num_blocks, **kernel_opts)
    q = args[0]
    assert got.shape == want.shape == q.shape and got.dtype == want.dtype == q.dtype
    np.testing.assert_array_equal(bits(got), bits(want), err_msg=what)
    assert np.isfinite(np.asarray(got, np.float32)).all(), what
    return np.asarray(got)


def case_id(kind, dtype, b, t, hq, hkv, d, s, lengths, *rest) -> str:
    return f"{kind}-{dtype}-B{b}-T{t}-G{hq // hkv}-D{d}-S{s}-L{'_'.join(map(str, lengths))}" + "".join(
        f"-depth{r}" for r in rest
    )


# Committed lengths per row: small or 0, a whole number of key blocks (the new tokens start a block), one past, a
# block's last slot, and up to the capacity (the last token at slot S - 1). Capacities not a whole number of blocks
# make the kernel pad the cache. Each case is a compile of both kernel and reference (most of a case's time); the
# fast set covers every T, G, dtype, kind and batch size, `pytest -m slow` the rest of the matrix.
# (kind, dtype, B, T, Hq, Hkv, D, S, lengths)
FAST_CHAINS = [  # with test_long_context_equals_reference[decode]: a float32 decode of 4 rows
    ("chain", "bfloat16", 1, 1, 8, 2, 32, 128, (65,)),  # decode; G = 4
    ("chain", "float32", 4, 6, 6, 2, 16, 256, (1, 64, 65, 250)),  # G = 3
    ("chain", "bfloat16", 4, 16, 8, 2, 16, 256, (48, 128, 129, 240)),  # row 0 ends at a block's last slot; G = 4
    ("chain", "float32", 1, 60, 4, 2, 16, 256, (30,)),  # across a block boundary
    ("chain", "bfloat16", 4, 64, 4, 2, 16, 256, (1, 62, 64, 129)),  # (shapes shared with test_path_tree_equals_chain)
    ("prefill", "float32", 4, 1, 4, 2, 16, 128, (0,) * 4),  # lengths 0 (empty cache), num_blocks = ceil(T / Bk)
    ("prefill", "bfloat16", 1, 64, 6, 2, 16, 128, (0,)),
]
SLOW_CHAINS = [
    ("chain", "float32", 4, 1, 4, 2, 16, 200, (0, 63, 64, 199)),  # G = 2
    ("chain", "bfloat16", 4, 1, 6, 2, 16, 256, (2, 128, 129, 255)),
    ("chain", "bfloat16", 1, 6, 4, 2, 32, 192, (60,)),
    ("chain", "float32", 1, 16, 8, 2, 32, 192, (0,)),
    ("chain", "bfloat16", 4, 60, 6, 2, 16, 256, (0, 64, 65, 196)),
    ("chain", "float32", 1, 64, 8, 2, 16, 200, (64,)),  # exactly one block of new tokens
    ("prefill", "bfloat16", 1, 6, 6, 2, 32, 128, (0,)),
    ("prefill", "float32", 4, 16, 4, 2, 16, 128, (0,) * 4),
    ("prefill", "bfloat16", 4, 60, 8, 2, 16, 128, (0,) * 4),
    ("prefill", "float32", 1, 100, 4, 2, 16, 200, (0,)),  # two blocks, seven 16-token chunks (the last one partial)
]

# trees: (..., max depth); the tails span blocks n0 and n0 + 1 (n0 = lengths // Bk): committed lengths just before a
# boundary make every node's ancestors straddle it
FAST_TREES = [
    ("tree", "float32", 4, 6, 6, 2, 16, 256, (62, 64, 65, 250), 3),  # G = 3
    ("tree", "bfloat16", 4, 64, 4, 2, 16, 256, (1, 62, 64, 129), 63),  # depth + 1 = Bk: the most the tail holds
]
SLOW_TREES = [
    ("tree", "float32", 4, 1, 4, 2, 16, 200, (0, 63, 64, 199), 0),  # a root only: a decode
    ("tree", "bfloat16", 1, 6, 4, 2, 32, 192, (61,), 5),
    ("tree", "float32", 4, 16, 4, 2, 16, 256, (0, 63, 128, 129), 15),
    ("tree", "bfloat16", 1, 16, 8, 2, 16, 192, (56,), 7),
    ("tree", "float32", 1, 60, 6, 2, 16, 192, (30,), 12),
]

# One query head per KV head (MHA, G = 1): the reference's one-row dots would be matrix-vector products on XLA:CPU,
# which sum in another order than the kernel's 16-row dots; `block_partial` gives them a zero second row.
MHA = [
    pytest.param("chain", "float32", 4, 1, 2, 2, 16, 200, (0, 63, 64, 199)),
    pytest.param("chain", "float32", 1, 16, 4, 4, 32, 192, (48,), marks=pytest.mark.slow),
    pytest.param("tree", "float32", 1, 6, 4, 4, 16, 192, (61,), 5, marks=pytest.mark.slow),
    pytest.param("tree", "bfloat16", 4, 64, 2, 2, 16, 256, (1, 64, 65, 150), 63, marks=pytest.mark.slow),
]
def params(fast, slow) -> list:
    return [pytest.param(*c, id=case_id(*c)) for c in fast] + [
        pytest.param(*c, id=case_id(*c), marks=pytest.mark.slow) for c in slow
    ]


@pytest.mark.parametrize("kind,dtype,b,t,hq,hkv,d,s,lengths", params(FAST_CHAINS, SLOW_CHAINS))
def test_chain_and_prefill_equal_reference(kind, dtype, b, t, hq, hkv, d, s, lengths):
    what = case_id(kind, dtype, b, t, hq, hkv, d, s, lengths)
    check(*make_inputs(what, kind, dtype, b, t, hq, hkv, d, s, lengths), what)


@pytest.mark.parametrize("kind,dtype,b,t,hq,hkv,d,s,lengths,max_depth", params(FAST_TREES, SLOW_TREES))
def test_tree_equals_reference(kind, dtype, b, t, hq, hkv, d, s, lengths, max_depth):
    what = case_id(kind, dtype, b, t, hq, hkv, d, s, lengths, max_depth)
    check(*make_inputs(what, kind, dtype, b, t, hq, hkv, d, s, lengths, max_depth), what)


@pytest.mark.parametrize("kind,dtype,b,t,hq,hkv,d,s,lengths,max_depth", [
    pytest.param(*p.values, *((None,) if len(p.values) == 9 else ()), marks=p.marks, id=case_id(*p.values))
    for p in MHA
])
def test_mha_equals_reference(kind, dtype, b, t, hq, hkv, d, s, lengths, max_depth):
    what = case_id(kind, dtype, b, t, hq, hkv, d, s, lengths, *(() if max_depth is None else (max_depth,)))
    check(*make_inputs(what, kind, dtype, b, t, hq, hkv, d, s, lengths, max_depth), what)


def test_path_tree_equals_chain():
    """A tree that is one path of 64 nodes (depth 63) is a chain: the same bits as the chain call, whose tail blocks
    are read from the cache instead of gathered by ancestors."""
    b, t, lengths = 4, 64, (1, 62, 64, 129)
    parents = np.broadcast_to(np.arange(t, dtype=np.int32) - 1, (b, t))
    shape = ("bfloat16", b, t, 4, 2, 16, 256, lengths)
    tree_args, _ = make_inputs("path", "tree", *shape, max_depth=t - 1, parents=parents)
    chain_args, _ = make_inputs("path", "chain", *shape)
    np.testing.assert_array_equal(tree_args[4], chain_args[4])
    got_tree = check(tree_args, None, "path tree")
    got_chain = check(chain_args, None, "chain")
    np.testing.assert_array_equal(bits(got_tree), bits(got_chain))


# 4k contexts, capacity 4160 (65 blocks); several sets of ragged lengths per compile (lengths are traced)
LONG = [
    pytest.param("chain", "float32", 4, 1, 4, 2, 16, ((1, 2048, 2049, 4096), (4095, 64, 4032, 0)), None, id="decode"),
    pytest.param("chain", "bfloat16", 2, 16, 6, 2, 16, ((4032, 4144), (4080, 127)), None, id="chain16",
                 marks=pytest.mark.slow),
    pytest.param("tree", "bfloat16", 2, 16, 8, 2, 16, ((4095, 4096), (4033, 63)), 6, id="tree16",
                 marks=pytest.mark.slow),
    pytest.param("chain", "float32", 1, 64, 6, 2, 16, ((4032,), (4096,)), None, id="chain64",
                 marks=pytest.mark.slow),
]


@pytest.mark.parametrize("kind,dtype,b,t,hq,hkv,d,length_sets,max_depth", LONG)
def test_long_context_equals_reference(kind, dtype, b, t, hq, hkv, d, length_sets, max_depth):
    s = 4160
    for lengths in length_sets:
        what = case_id(kind, dtype, b, t, hq, hkv, d, s, lengths)
        check(*make_inputs(what, kind, dtype, b, t, hq, hkv, d, s, lengths, max_depth), what)


# The split (flash-decoding) form forced on, against the reference and the one-pass form (`split=False`). `split`:
# True (the rule's blocks per program) or a number of blocks per program, so that the programs' ranges end inside
# the rows' visible blocks and past them. G = 3 and 1 keep 4 and 1 of the 16 rows. The 4k decode's shapes are
# test_long_context_equals_reference[decode]'s (which pick the split form by themselves) and the tree's are the first
# FAST_TREES case's: compiles shared when the whole file runs.
# (kind, dtype, B, T, Hq, Hkv, D, S, length sets, max depth, split)
SPLIT = [
    pytest.param("chain", "float32", 4, 1, 4, 2, 16, 4160, ((1, 2048, 2049, 4096), (4095, 64, 4032, 0)), None, True,
                 id="decode4k-float32"),
    pytest.param("chain", "bfloat16", 4, 6, 6, 2, 16, 520, ((0, 63, 64, 450),), None, 3, id="chain6-bfloat16"),
    pytest.param("tree", "float32", 4, 6, 6, 2, 16, 256, ((62, 64, 127, 250),), 3, 1, id="tree6-float32"),
    pytest.param("chain", "bfloat16", 1, 1, 8, 2, 32, 4160, ((4095,), (2047,)), None, True, id="decode4k-bfloat16",
                 marks=pytest.mark.slow),
    pytest.param("tree", "bfloat16", 2, 16, 8, 2, 16, 4160, ((4095, 4033),), 6, 5, id="tree16-4k-bfloat16",
                 marks=pytest.mark.slow),
    pytest.param("chain", "float32", 2, 6, 2, 2, 16, 300, ((0, 250),), None, 2, id="mha-chain6-float32",
                 marks=pytest.mark.slow),
    pytest.param("prefill", "bfloat16", 1, 100, 4, 2, 16, 200, ((0,),), None, 1, id="prefill100-bfloat16",
                 marks=pytest.mark.slow),
]


@pytest.mark.parametrize("kind,dtype,b,t,hq,hkv,d,s,length_sets,max_depth,split", SPLIT)
def test_split_equals_reference_and_one_pass(kind, dtype, b, t, hq, hkv, d, s, length_sets, max_depth, split):
    """Phase 1 stores each visible block's partial, phase 2 folds them in order: the reference's bits, and the one-pass
    kernel's."""
    for lengths in length_sets:
        what = case_id(kind, dtype, b, t, hq, hkv, d, s, lengths) + f"-split{split}"
        args, num_blocks = make_inputs(what, kind, dtype, b, t, hq, hkv, d, s, lengths, max_depth)
        got = check(args, num_blocks, what, split=split)
        one_pass = invariant_attention(*args, key_block=KEY_BLOCK, num_blocks=num_blocks, interpret=INTERPRET,
                                       split=False)
        np.testing.assert_array_equal(bits(got), bits(one_pass), err_msg=f"{what}: split vs one pass")


@pytest.mark.parametrize("kind,dtype,t,hq", [
    ("chain", "float32", 6, 6), pytest.param("tree", "bfloat16", 16, 8, marks=pytest.mark.slow),
])
def test_rows_are_independent(kind, dtype, t, hq):
    """A row's bits are the same whatever the other rows hold (cache, queries, lengths, tree) and wherever it sits in
    the batch, and equal to running it alone: kernel and reference. (The chain's batch-4 shapes are a
    FAST_CHAINS case's: one compile.)"""
    b, hkv, d, s, depth = 4, 2, 16, 256, 5
    shape = (hq, hkv, d, s)
    first, _ = make_inputs("rows a", kind, dtype, b, t, *shape, (65, 0, 127, 190), depth)
    other, _ = make_inputs("rows b", kind, dtype, b, t, *shape, (65, 200, 3, 64), depth)
    row = 0

    def with_row(args, at):  # `first`'s row 0 placed at row `at` of `args`
        return tuple(None if x is None else jnp.asarray(x).at[at].set(jnp.asarray(y)[row]) for x, y in zip(args, first))

    alone = tuple(None if x is None else jnp.asarray(x)[row : row + 1] for x in first)
    got_alone, want_alone = run_both(alone, None)
    np.testing.assert_array_equal(bits(got_alone), bits(want_alone), err_msg="alone")
    for at, args in ((0, first), (0, with_row(other, 0)), (3, with_row(other, 3))):
        got, want = run_both(args, None)
        for name, out in (("kernel", got), ("reference", want)):
            np.testing.assert_array_equal(bits(out[at]), bits(got_alone[0]), err_msg=f"{name}: row at {at}")


# Sliding windows (Gemma's sliding layers) with the scores unscaled (scale 1.0: Gemma 4 norms q and k instead):
# windows shorter than a block, a block, and across blocks, so that whole blocks and parts of blocks fall out; and
# Gemma 2's soft-capped scores (a cap of 2 at scale 1/2: most scores saturate), with and without a window.
WINDOWED = [
    pytest.param("chain", "float32", 4, 6, 6, 2, 16, 256, (1, 64, 65, 250), None, 8, 1.0, None, id="chain6-window8"),
    pytest.param("chain", "bfloat16", 4, 6, 6, 2, 16, 256, (1, 64, 65, 250), None, 8, 0.5, 2.0,
                 id="chain6-window8-softcap"),
    pytest.param("tree", "bfloat16", 4, 16, 8, 2, 16, 256, (62, 64, 130, 200), 7, 100, 1.0, None,
                 id="tree16-window100", marks=pytest.mark.slow),
    pytest.param("tree", "float32", 4, 16, 8, 2, 16, 256, (62, 64, 130, 200), 7, None, 0.5, 2.0,
                 id="tree16-softcap", marks=pytest.mark.slow),
    pytest.param("chain", "bfloat16", 1, 1, 8, 2, 32, 4160, (4095,), None, 64, 1.0, None, id="decode4k-window64",
                 marks=pytest.mark.slow),
    pytest.param("prefill", "float32", 1, 100, 4, 2, 16, 200, (0,), None, 30, 1.0, None, id="prefill100-window30",
                 marks=pytest.mark.slow),
]


@pytest.mark.parametrize("kind,dtype,b,t,hq,hkv,d,s,lengths,max_depth,window,scale,softcap", WINDOWED)
def test_a_sliding_window_kernel_equals_reference_and_masks_by_position(kind, dtype, b, t, hq, hkv, d, s, lengths,
                                                                         max_depth, window, scale, softcap):
    """The kernel (one-pass, and the split form on long caches; its Triton and TPU variants) gives the reference's
    bits under a window and a soft cap, starting from the first block the window reaches, and both are
    softmax(cap(q·k·scale)) over the keys at positions p - window < position <= p (a direct float32 computation)."""
    args, num_blocks = make_inputs(f"window-{kind}-{window}", kind, dtype, b, t, hq, hkv, d, s, lengths, max_depth)
    opts = {"key_block": KEY_BLOCK, "num_blocks": num_blocks, "scale": scale, "window": window, "softcap": softcap}
    windowed = jax.jit(invariant_attention_reference, static_argnames=tuple(opts))
    want = windowed(*args, **opts)
    for split in (False, True) if s > 1024 else (None,):
        got = invariant_attention(*args, **opts, interpret=INTERPRET, split=split)
        np.testing.assert_array_equal(bits(got), bits(want), err_msg=f"split={split}")
    if INTERPRET and kind != "prefill":  # the Mosaic TPU variant, in TPU interpret mode: DMAs from the first
        # visible block on (the blocks left of the window are never copied)
        from jax.experimental.pallas import tpu as pltpu

        got = invariant_attention(*args, **opts, interpret=pltpu.InterpretParams(), backend="tpu")
        pltpu.reset_tpu_interpret_mode_state()
        np.testing.assert_array_equal(bits(got), bits(want), err_msg="tpu")
    q, k_cache, v_cache, lens, positions, ancestors = (None if a is None else np.asarray(a, np.float32) for a in args)
    g = hq // hkv
    for i in range(b):
        for j in range(t):
            p = int(positions[i, j])
            if ancestors is None:
                slots = np.arange(p + 1)
            else:  # committed slots, then the node's ancestors (itself last), each at slot lengths + node
                depth = p - int(lens[i])
                slots = np.concatenate([np.arange(int(lens[i])), int(lens[i]) + ancestors[i, j, :depth + 1]])
            key_pos = np.arange(len(slots))  # slots in position order: slot list index = position
            if window is not None:
                slots = slots[key_pos > p - window]
            slots = slots.astype(int)
            for h in range(hq):
                scores = (k_cache[i, h // g, slots] @ q[i, j, h]) * scale
                if softcap is not None:
                    scores = softcap * np.tanh(scores / softcap)
                probs = np.exp(scores - scores.max())
                direct = (probs / probs.sum()) @ v_cache[i, h // g, slots]
                tol = 2e-2 if dtype == "bfloat16" else 1e-5
                np.testing.assert_allclose(np.asarray(want[i, j, h], np.float32), direct, rtol=tol, atol=tol)


@pytest.mark.parametrize("kind,dtype,b,t,hq,hkv,d,s,lengths", [
    ("chain", "bfloat16", 4, 1, 8, 2, 32, 448, (0, 64, 200, 447)),  # decodes of 4 rows; 7 key blocks
    ("chain", "float32", 2, 6, 6, 2, 16, 400, (63, 300)),  # a verify of 6; a partial last block
    ("prefill", "float32", 1, 100, 4, 2, 16, 256, (0,)),  # QUERY_CHUNK passes
])
def test_blocks_folded_in_groups_give_the_same_bits(kind, dtype, b, t, hq, hkv, d, s, lengths):
    """The reference's partials a group of key blocks at a time (`fold_group`, what a TPU does for large batches,
    `fold_group_for`), each group folded before the next, give the bits of all blocks at once: the same per-block
    dots and the same left fold. Groups of 1, of 3 (not dividing the blocks) and of every block."""
    args, num_blocks = make_inputs(f"fold-{kind}-{t}", kind, dtype, b, t, hq, hkv, d, s, lengths)
    run = jax.jit(invariant_attention_reference, static_argnames=("key_block", "num_blocks", "fold_group"))
    whole = run(*args, key_block=KEY_BLOCK, num_blocks=num_blocks, fold_group=None)
    for group in (1, 3):
        got = run(*args, key_block=KEY_BLOCK, num_blocks=num_blocks, fold_group=group)
        np.testing.assert_array_equal(bits(got), bits(whole), err_msg=f"groups of {group}")


def test_a_tpu_folds_large_partials_in_groups():
    """Llama-3.1-8B's a-partials (8 KV heads, 16 query rows a decode, D 128, float32) over 132 key blocks (8k):
    batch 8 on a TPU in groups of 4 blocks (2 MB each; a verify's 2), batch 1 at once; other backends at once."""
    from pallas_kernels.invariant_attention import FOLD_GROUP_BYTES, fold_group_for

    def partials(batch, rows=16):  # a verify of 6 tokens: 32 rows
        return batch * 8 * 132 * rows * 128 * 4

    assert fold_group_for(partials(8), 132, "tpu") == FOLD_GROUP_BYTES // (8 * 8 * 16 * 128 * 4) == 4
    assert fold_group_for(partials(8, rows=32), 132, "tpu") == 2
    assert fold_group_for(partials(1), 132, "tpu") == fold_group_for(partials(1, rows=32), 132, "tpu") == 132
    assert fold_group_for(partials(8), 132, "gpu") == fold_group_for(partials(8), 132, "cpu") == 132
