"""Wide row tiles (jaxspec/models/numerics.py): long inputs run the bulk of their rows as 64-row dots, on a machine
where a 64-row dot was measured to give each row the one-row dot's bits. Here: how rows are split between wide and
narrow tiles, that the split changes no bit at ragged row counts, that the measurement decides, and that a `model`
mesh axis (whose per-device dots were not measured) keeps narrow tiles. Wide tiles serve long verify blocks: a
prefill has tiles of its own (`Numerics.for_prefill`, tests/test_invariance.py)."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec import sharding
from jaxspec.models import numerics
from jaxspec.models.numerics import default_numerics, hold, tile_split, tiled_matmul, wide_tiles_agree

WIDE = numerics.CPU_WIDE_ROW_TILE


@pytest.mark.parametrize("rows,want", [
    (0, (0, 1)), (1, (0, 1)), (39, (0, 39)), (40, (1, 0)), (64, (1, 0)), (65, (1, 1)), (103, (1, 39)),
    (104, (2, 0)), (128, (2, 0)), (200, (3, 8)),
])
def test_tile_split(rows, want):
    """Whole wide tiles first; a rest of at least WIDE_FILL of a tile (40 of 64 rows) takes one more, padded."""
    assert tile_split(rows, 1, WIDE) == want
    assert tile_split(rows, 1, None) == (0, max(rows, 1))


def _inputs(rows: int, k: int, n: int, dtype, seed: int):
    kx, kw, kb = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(kx, (rows, k), jnp.float32).astype(dtype)  # [rows, K]
    w = hold(jax.random.normal(kw, (k, n), jnp.float32), dtype)  # [K, N]
    bias = hold(0.1 * jax.random.normal(kb, (n,), jnp.float32), dtype)  # [N]
    return x, w, bias


@pytest.mark.parametrize("k,n,dtype", [  # CI: a small shape in bfloat16 (SmolLM2's q/k/v width: -m slow)
    pytest.param(k, n, dtype, marks=() if (k, dtype) == (64, "bfloat16") else pytest.mark.slow)
    for dtype in ("float32", "bfloat16") for k, n in ((64, 96), (96, 64), (576, 192))
])
def test_wide_tiles_give_narrow_tiles_bits(k, n, dtype):
    """At ragged row counts around the tile edges, with a bias, batch dimensions and fresh inputs per count."""
    if not wide_tiles_agree(k, n, dtype, 1, WIDE, jax.default_backend()):
        pytest.skip(f"this machine's {k}x{n} {dtype} dot gives 64 rows other bits than one row: wide tiles stay off")
    narrow = jax.jit(lambda x, w, b: tiled_matmul(x, w, 1, b))
    wide = jax.jit(lambda x, w, b: tiled_matmul(x, w, 1, b, wide_row_tile=WIDE))
    for seed, rows in enumerate([39, 40, 63, 64, 65, 100, 130]):
        x, w, b = _inputs(rows, k, n, dtype, seed)
        np.testing.assert_array_equal(wide(x, w, b), narrow(x, w, b), err_msg=f"{rows} rows")
    x, w, b = _inputs(2 * 70, k, n, dtype, 99)
    x = x.reshape(2, 70, k)  # [batch, seq, K]: rows are flattened across the batch
    np.testing.assert_array_equal(wide(x, w, b), narrow(x, w, b), err_msg="[2, 70] rows")


def test_the_measurement_decides_per_matmul_and_only_for_long_inputs(monkeypatch):
    """Numerics.wide_tile: a matmul gets wide tiles when its input fills one and its own [K, N] shape agrees; an
    input too short for a wide tile (a decode step, a chain) never triggers the measurement."""
    answers, asked = {(64, 96): True, (96, 64): False}, []
    monkeypatch.setattr(numerics, "wide_tiles_agree", lambda k, n, *rest: asked.append((k, n)) or answers[(k, n)])
    nm = default_numerics("cpu")
    assert nm.wide_row_tile == WIDE
    x64, x96 = jnp.zeros((2, 20, 64)), jnp.zeros((50, 96))  # 40 and 50 rows: each fills a wide tile
    assert nm.wide_tile(x64, jnp.zeros((64, 96))) == WIDE
    assert nm.wide_tile(x96, jnp.zeros((96, 64))) is None  # this shape gives 64 rows other bits
    assert asked == [(64, 96), (96, 64)]
    assert nm.wide_tile(jnp.zeros((39, 64)), jnp.zeros((64, 96))) is None and len(asked) == 2  # too few rows
    assert nm.narrow().wide_tile(x64, jnp.zeros((64, 96))) is None and len(asked) == 2
    assert default_numerics("gpu").wide_tile(x64, jnp.zeros((64, 96))) is None and len(asked) == 2
    if jax.device_count() >= 8:  # a model axis splits w: its per-device shape was not measured
        with sharding.mesh_context(sharding.make_mesh(sharding.MeshConfig(data=4, model=2))):
            assert nm.wide_tile(jnp.zeros((4 * 40, 64)), jnp.zeros((64, 96))) is None and len(asked) == 2


def _dot_rows(fn, *args) -> set[int]:
    """The row counts of the dots in fn's jaxpr, loops included (each dot's output is [shards, rows, N])."""
    text = str(jax.make_jaxpr(fn)(*args))
    return {int(m) for m in re.findall(r":f32\[\d+,(\d+),\d+\] = dot_general", text)}


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices (XLA_FLAGS host device count)")
def test_a_model_axis_keeps_narrow_tiles():
    """Under data=4 x model=2 each device's dot has half a weight's shape, which nothing measured: narrow tiles only.
    Under data=8 alone the per-device dot keeps the measured shape, and rows split per shard."""
    x, w, _ = _inputs(8 * 100, 64, 96, "float32", 0)
    fn = functools.partial(tiled_matmul, row_tile=1, wide_row_tile=WIDE)
    with sharding.mesh_context(sharding.make_mesh(sharding.MeshConfig(data=4, model=2))):
        assert _dot_rows(fn, x, w) == {1}
    mesh = sharding.make_mesh(sharding.MeshConfig(data=8))
    with sharding.mesh_context(mesh):
        assert _dot_rows(fn, x, w) == {1, WIDE}  # 100 rows per shard: one wide tile and 36 one-row tiles
        rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
        x = jax.device_put(x, rows)
        if wide_tiles_agree(64, 96, "float32", 1, WIDE, jax.default_backend()):
            narrow = jax.jit(lambda x, w: tiled_matmul(x, w, 1))
            np.testing.assert_array_equal(jax.jit(fn)(x, w), narrow(x, w), err_msg="data=8")


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices (XLA_FLAGS host device count)")
def test_the_measurement_runs_alone_under_a_mesh_and_while_tracing():
    """A model may be built under the caller's mesh (a sharded load) or inside a trace: the measurement still runs
    real one-device dots, so it answers what it answers outside both (under data=8 a 64-row input would otherwise
    split into 8-row shards and compare narrow tiles with narrow tiles)."""
    measure = wide_tiles_agree.__wrapped__  # uncached
    backend = jax.default_backend()
    want = measure(64, 96, "float32", 1, WIDE, backend)
    with sharding.mesh_context(sharding.make_mesh(sharding.MeshConfig(data=8))):
        assert measure(64, 96, "float32", 1, WIDE, backend) == want
    seen = []
    jax.jit(lambda x: seen.append(measure(64, 96, "float32", 1, WIDE, backend)) or x)(1.0)
    assert seen == [want]
