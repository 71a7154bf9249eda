"""The kernels' Mosaic TPU variants (`backend="tpu"`) in Pallas's TPU interpret mode on CPU, bit for bit against their
jax.numpy references: the same cases as the generic interpret-mode tests (tests/test_invariant_kernel_lowering.py,
tests/test_rejection.py), a representative subset in CI and all of them under `-m slow`.

TPU interpret mode (`pltpu.InterpretParams`) runs the kernel body on CPU as the TPU variant is written: operands left
in HBM (`pl.ANY`), scalar-prefetch operands in SMEM, VMEM scratch that starts as NaN, and DMAs that land only when
waited for, with bounds checked; so a block read before its copy is waited for, a copy into the buffer being read,
or an index past an array's end shows up as wrong bits or an error. One case per kernel also runs with the race
detector on, two simulated cores sharing the parallel grid, and the parallel axes in a shuffled order.
The floating-point operations are those of the Triton variant, and XLA:CPU runs them in both interpret modes, so
equality here is exact (no operation of either kernel is inexact under TPU interpret mode). What it cannot show is
how Mosaic compiles them for a TPU (tests/test_*_lowering.py compile with libtpu where installed)."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu
from test_invariant_kernel_lowering import CASES, check_equals_reference
from test_rejection import BLOCKED_CASES, check_walk, draft_inputs

from pallas_kernels.rejection import verify, verify_reference

# two simulated cores share each parallel grid axis, visited in a shuffled order, under the race detector
RACE_CHECK = pltpu.InterpretParams(detect_races=True, num_cores_or_threads=2, random_seed=7)


@pytest.fixture(autouse=True)
def _fresh_interpreter():
    """TPU interpret mode keeps per-process state that a failed kernel leaves behind (its docs ask for a reset)."""
    yield
    pltpu.reset_tpu_interpret_mode_state()


def _subset(cases, ids, chosen):
    """pytest params: the chosen cases in CI, the others marked slow."""
    return [pytest.param(*case, id=i, marks=() if i in chosen else pytest.mark.slow) for case, i in zip(cases, ids)]


ATTENTION_IDS = [f"{c[0]}-{c[1]}" for c in CASES]
ATTENTION_CI = {"decode-float32", "tree-bfloat16"}  # and chain-bfloat16 in test_attention_has_no_races


@pytest.mark.parametrize("case", _subset([(c,) for c in CASES], ATTENTION_IDS, ATTENTION_CI))
def test_attention_equals_reference(case):
    check_equals_reference(case, interpret=True, backend="tpu")


def test_attention_has_no_races(capfd):
    """A chain of 6 across a block boundary (ragged rows): the double-buffered key/value copies never race the
    reads, with two cores splitting the grid."""
    (case,) = [c for c, i in zip(CASES, ATTENTION_IDS) if i == "chain-bfloat16"]
    check_equals_reference(case, interpret=RACE_CHECK, backend="tpu")
    assert "RACE DETECTED" not in capfd.readouterr().out


REJECTION_IDS = [f"{c[0]}-{c[7]}-{c[3]}" for c in BLOCKED_CASES]
REJECTION_CI = {"tree-plain-100", "tree-sparse-45", "chain-fallback-90", "greedy-ties-37"}  # and chain-plain-300
# in test_verify_has_no_races


def check_verify(mode, batch, n, v, depth, block, chunk, variant, dtype, interpret):
    rng = np.random.default_rng(zlib.crc32(f"blocked-{mode}-{variant}-{n}-{v}".encode()))
    args, q, depth = draft_inputs(rng, mode, batch, n, v, depth, variant=variant, dtype=dtype)
    want = verify_reference(*args, q, mode=mode, max_depth=depth)
    got = verify(*args, q, mode=mode, max_depth=depth, interpret=interpret, vocab_block=block, chunk_blocks=chunk,
                 backend="tpu")
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    check_walk(want, np.asarray(args[0]), np.asarray(args[1]))


@pytest.mark.parametrize(
    "mode,batch,n,v,depth,block,chunk,variant,dtype", _subset(BLOCKED_CASES, REJECTION_IDS, REJECTION_CI)
)
def test_verify_equals_reference(mode, batch, n, v, depth, block, chunk, variant, dtype):
    """Rows over several blocks and chunks, a ragged last block, V below the block, ties across chunks, zero
    weights and zero noise, the fallback race; bfloat16 rows (gathered by XLA before the kernel)."""
    check_verify(mode, batch, n, v, depth, block, chunk, variant, dtype, interpret=True)


def test_verify_has_no_races(capfd):
    """bfloat16 chains over 10 blocks in 4 chunks: the double-buffered copies never race the reads."""
    (case,) = [c for c, i in zip(BLOCKED_CASES, REJECTION_IDS) if i == "chain-plain-300"]
    check_verify(*case, interpret=RACE_CHECK)
    assert "RACE DETECTED" not in capfd.readouterr().out
