"""The CPU row kernel (pallas_kernels/row_matmul.py, cpu_rows.cc): the kernel equals its jax.numpy reference bit for
bit at ragged shapes (rows 1..70 across its register tiles, columns off whole panels, contractions of 1 to 1,536,
columns enough to split over threads), with bfloat16 and int8 panels, and built for each narrower x86 instruction
set (each its own tiling); a row's bits do not depend on the rows beside it or their number; the model's use of it
(`numerics.panel_matmul`: 16-bit activations, 8-bit scales, biases, a data mesh) computes what `contract` computes;
and it can be turned off or fail to build with a one-line reason."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.models.numerics import contract, default_numerics, panel_matmul
from pallas_kernels import cpu_library
from pallas_kernels import row_matmul as rk

pytestmark = pytest.mark.skipif(not rk.available(), reason=f"row kernel unavailable: {rk.unavailable_reason()}")

kernel = jax.jit(rk.row_matmul, static_argnums=2)
reference = jax.jit(rk.row_matmul_reference, static_argnums=2)


def _weights(k: int, n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((k, n), dtype=np.float32)


@pytest.mark.parametrize("rows,k,n", [
    (1, 576, 960), (2, 64, 16), (7, 37, 50), (8, 96, 64), (9, 1, 3), (16, 1536, 576), (70, 200, 1000),
    (3, 64, 49152 // 16),  # enough columns for several chunks per thread
])
def test_kernel_equals_reference_bit_for_bit(rows, k, n):
    w = _weights(k, n)
    x = np.random.default_rng(1).standard_normal((rows, k), dtype=np.float32)
    panels = rk.pack_panels(jnp.asarray(w))
    got, want = np.asarray(kernel(jnp.asarray(x), panels, n)), np.asarray(reference(jnp.asarray(x), panels, n))
    np.testing.assert_array_equal(got, want)
    np.testing.assert_allclose(got, x @ w, rtol=1e-4, atol=1e-4 * np.sqrt(k))  # and it is the product


def test_a_rows_bits_are_its_own():
    """Row r alone, among 5 or 69 others, at another position, with other neighbours: the same bits."""
    k, n = 576, 1536
    panels = rk.pack_panels(jnp.asarray(_weights(k, n)))
    x = np.random.default_rng(2).standard_normal((70, k), dtype=np.float32)
    alone = np.stack([np.asarray(kernel(jnp.asarray(x[i : i + 1]), panels, n))[0] for i in range(0, 70, 9)])
    for rows in (6, 17, 70):
        shuffled = np.random.default_rng(rows).permutation(70)[:rows]
        block = x[shuffled].copy()
        got = np.asarray(kernel(jnp.asarray(block), panels, n))
        for j, i in enumerate(shuffled):
            if i % 9 == 0:
                np.testing.assert_array_equal(got[j], alone[i // 9], err_msg=f"row {i} at {j} of {rows}")


def test_tied_table_panels():
    """A [V, H] table packed as the LM head (out_in) gives table-transposed products."""
    table = _weights(97, 64, seed=3)  # [V, H]
    x = np.random.default_rng(4).standard_normal((5, 64), dtype=np.float32)
    got = np.asarray(kernel(jnp.asarray(x), rk.pack_panels(jnp.asarray(table), out_in=True), 97))
    np.testing.assert_array_equal(got, np.asarray(reference(jnp.asarray(x), rk.pack_panels(jnp.asarray(table.T)), 97)))
    np.testing.assert_allclose(got, x @ table.T, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_panel_matmul_is_contract_with_bias_and_scale(dtype):
    """The model's call: activations in the model dtype widened to float32, an 8-bit weight's scale applied to the
    float32 sums, rounded to the dtype, then the bias — to the rounding of `contract`'s dot; leading dims kept."""
    k, n = 96, 40
    w = jnp.asarray(np.round(_weights(k, n, 5) * 20))  # int8-like values held as floats
    scale = jnp.asarray(np.random.default_rng(6).uniform(0.01, 0.02, n).astype(np.float32))
    bias = jnp.asarray(np.random.default_rng(7).standard_normal(n).astype(np.float32)).astype(dtype)
    x = jnp.asarray(np.random.default_rng(8).standard_normal((2, 3, k), dtype=np.float32)).astype(dtype)
    got = jax.jit(lambda x, p: panel_matmul(x, p, n, bias, scale))(x, rk.pack_panels(w))
    want = contract(x, w, ((2,), (0,)), scale) + bias
    assert got.shape == (2, 3, n) and got.dtype == jnp.dtype(dtype)
    tol = 1e-5 if dtype == "float32" else 2e-2
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=tol, atol=tol)


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices (XLA_FLAGS host device count)")
def test_panel_matmul_on_a_data_mesh_keeps_each_rows_bits():
    """Under a data mesh each device runs its own rows: the bits of one device."""
    from jax.sharding import NamedSharding, PartitionSpec

    from jaxspec import sharding

    k, n = 64, 96
    panels = rk.pack_panels(jnp.asarray(_weights(k, n, 9)))
    x = jnp.asarray(np.random.default_rng(10).standard_normal((4, 3, k), dtype=np.float32))
    want = np.asarray(jax.jit(lambda x, p: panel_matmul(x, p, n))(x, panels))
    mesh = sharding.make_mesh(sharding.MeshConfig(data=4, model=1))
    with jax.set_mesh(mesh):
        xs = jax.device_put(x, NamedSharding(mesh, PartitionSpec("data")))
        got = np.asarray(jax.jit(lambda x, p: panel_matmul(x, p, n))(xs, panels))
    np.testing.assert_array_equal(got, want)


def test_turned_off_and_unbuildable(monkeypatch, tmp_path):
    """JAXSPEC_CPU_ROW_KERNEL=off: the CPU numerics keep their one-row tiles and one-pass prefills on 64-row tiles,
    with the reason said; a machine without a compiler gets a one-line BuildError, not a traceback from the
    compiler."""
    monkeypatch.setenv(rk.ENV_VAR, "off")
    assert not rk.available() and rk.unavailable_reason() == f"{rk.ENV_VAR}=off"
    off = default_numerics("cpu")
    monkeypatch.delenv(rk.ENV_VAR)
    on = default_numerics("cpu")
    assert on.row_kernel and on.row_attention and on.prefill_loop_chunk == 32
    assert off == dataclasses.replace(on, row_kernel=False, row_attention=False, prefill_loop_chunk=None)
    assert off.for_prefill().row_kernel is False and on.for_prefill().row_kernel is True
    assert default_numerics("gpu").row_kernel is False and default_numerics("gpu").row_attention is False

    monkeypatch.setattr(cpu_library, "_compiler", lambda: None)
    with pytest.raises(rk.BuildError, match="no C.. compiler found"):
        rk.build(tmp_path)
    monkeypatch.undo()
    monkeypatch.setattr(cpu_library, "SOURCES", (tmp_path / "broken.cc",))
    (tmp_path / "broken.cc").write_text("this is not C++\n")
    with pytest.raises(rk.BuildError, match="could not compile broken.cc") as e:
        rk.build(tmp_path / "cache")
    assert "\n" not in str(e.value)


def test_drafters_run_on_the_kernel_and_targets_train_through_plain_calls():
    """A loaded drafter's plain matmuls run on its held panels (`hold_draft_weights`): a float weight's as int8
    values with a scale per output column (the dot of the dequantized weight, near the plain dot's values), an
    8-bit weight's with its own scale; a target's own panels (`hold_step_weights`) serve its numerics and a
    drafter's `drafting` read of its LM head, never a plain call, so gradients through the target's head (DFlash
    training) still flow."""
    from flax import nnx

    from jaxspec.config import TargetConfig
    from jaxspec.models.llama import LlamaModel, hold_draft_weights
    from jaxspec.models.quantize import quantize_weight

    cfg = TargetConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2,
                       head_dim=16, tie_word_embeddings=False)
    target = LlamaModel(cfg, rngs=nnx.Rngs(0))
    drafter = LlamaModel(cfg, rngs=nnx.Rngs(1), numerics=None)  # any module of Linears
    x = jnp.asarray(np.random.default_rng(11).standard_normal((3, 64), dtype=np.float32))
    plain = drafter.layers[0].mlp.up_proj(x)
    hold_draft_weights(drafter, target)
    up = drafter.layers[0].mlp.up_proj
    assert up.draft_panels.dtype == jnp.int8 and up.draft_scale.shape == (96,)
    assert "ffi_call" in str(jax.make_jaxpr(lambda a: up(a))(x))
    values, scale = quantize_weight(up.kernel[...], "int8", jnp.float32)
    np.testing.assert_allclose(np.asarray(up(x)), np.asarray(x @ (values * scale)), rtol=1e-5, atol=1e-5)
    assert float(jnp.max(jnp.abs(up(x) - plain))) < 0.02 * float(jnp.max(jnp.abs(plain)))  # int8's rounding

    quantized = LlamaModel(cfg, rngs=nnx.Rngs(1), numerics=None)
    down = quantized.layers[0].mlp.down_proj
    down.quantize("int8")
    hold_draft_weights(quantized, target)
    assert down.draft_panels.dtype == jnp.int8 and down.draft_scale is None  # its own values and scale
    h = jnp.asarray(np.random.default_rng(12).standard_normal((3, 96), dtype=np.float32))
    want = (h @ down.kernel[...].astype(jnp.float32)) * down.scale[...]
    np.testing.assert_allclose(np.asarray(down(h)), np.asarray(want), rtol=1e-5, atol=1e-5)

    target.hold_step_weights()
    assert target.lm_head.panels is not None and target.lm_head.draft_panels is None
    drafting = str(jax.make_jaxpr(lambda a: target.vocab_logits(a, drafting=True))(x))
    assert "ffi_call" in drafting and "ffi_call" not in str(jax.make_jaxpr(lambda a: target.vocab_logits(a))(x))
    grad = jax.grad(lambda a: target.vocab_logits(a).sum())(x)  # plain: differentiable
    assert grad.shape == x.shape and bool(jnp.all(jnp.isfinite(grad)))
    plain_target = LlamaModel(cfg, rngs=nnx.Rngs(0), numerics=None)
    hold_draft_weights(plain_target.layers[0], plain_target)  # a target on plain numerics holds nothing
    assert plain_target.layers[0].mlp.up_proj.draft_panels is None


@pytest.mark.parametrize("rows,k,n", [(1, 576, 960), (9, 37, 50), (16, 1536, 576)])
def test_bfloat16_panels_give_the_float32_panels_bits(rows, k, n):
    """A weight whose values are bfloat16 values, held as bfloat16 panels: each value widened exactly in the
    kernel, so the sums of its float32 panels (and of the reference), from half the bytes."""
    w = jnp.asarray(_weights(k, n, 12)).astype(jnp.bfloat16).astype(jnp.float32)
    x = jnp.asarray(np.random.default_rng(13).standard_normal((rows, k), dtype=np.float32))
    half = rk.pack_panels(w, dtype=jnp.bfloat16)
    assert half.dtype == jnp.bfloat16 and half.nbytes * 2 == rk.pack_panels(w).nbytes
    got = np.asarray(kernel(x, half, n))
    np.testing.assert_array_equal(got, np.asarray(kernel(x, rk.pack_panels(w), n)))
    np.testing.assert_array_equal(got, np.asarray(reference(x, half, n)))


@pytest.mark.parametrize("rows,k,n", [(1, 576, 960), (9, 37, 50), (16, 1536, 576)])
def test_int8_panels_give_the_float32_panels_bits(rows, k, n):
    """A weight whose values are int8 values (an int8-quantized target's, held as float32), held as int8 panels:
    each value converted exactly in the kernel, so the sums of its float32 panels from a quarter of the bytes; its
    -0.0 values (rounding gives them) become +0.0, which changes no bit (the chain never holds -0.0); rows of
    zeros, signed zeros and an infinity as well."""
    w = np.clip(np.round(_weights(k, n, 15) * 40), -128, 127)
    assert np.any((w == 0) & np.signbit(w))
    w = jnp.asarray(w)
    x = np.random.default_rng(16).standard_normal((rows, k), dtype=np.float32)
    x[0, ::2] = -0.0
    if rows > 2:
        x[1] = 0.0
        x[2, 3] = np.inf
    x = jnp.asarray(x)
    quarter = rk.pack_panels(w, dtype=jnp.int8)
    assert quarter.dtype == jnp.int8 and quarter.nbytes * 4 == rk.pack_panels(w).nbytes
    got = np.asarray(kernel(x, quarter, n)).view(np.uint32)
    np.testing.assert_array_equal(got, np.asarray(kernel(x, rk.pack_panels(w), n)).view(np.uint32))
    np.testing.assert_array_equal(got, np.asarray(reference(x, quarter, n)).view(np.uint32))


def test_panels_are_narrow_only_where_no_value_changes():
    exact = jnp.asarray(_weights(8, 16, 14)).astype(jnp.bfloat16).astype(jnp.float32)
    assert rk.exact_panel_dtype(exact) == jnp.bfloat16
    assert rk.exact_panel_dtype(exact.at[3, 4].add(1e-4)) == jnp.float32  # one value off the bfloat16 grid
    ints = jnp.clip(jnp.round(exact * 100), -128, 127)
    assert rk.exact_panel_dtype(ints) == jnp.int8  # int8 values
    assert rk.exact_panel_dtype(ints.astype(jnp.bfloat16)) == jnp.int8
    assert rk.exact_panel_dtype(ints.at[0, 0].set(128.0)) == jnp.bfloat16  # past int8, still bfloat16 values
    assert rk.exact_panel_dtype(ints.at[0, 0].set(0.5)) == jnp.bfloat16
    assert rk.exact_panel_dtype(ints.at[0, 0].set(jnp.inf)) == jnp.bfloat16  # a bfloat16 value, no int8 one
    assert rk.exact_panel_dtype(ints.at[0, 0].set(jnp.nan)) == jnp.bfloat16  # NaN: a bfloat16 bit pattern
    assert rk.exact_panel_dtype(ints.at[0, 0].set(1 + 2.0 ** -10)) == jnp.float32
    assert rk.exact_panel_dtype(jnp.zeros((0, 16), jnp.float32)) == jnp.int8  # no value to lose
    seen = []  # inside a trace the values are unknown: float32, and no error
    jax.jit(lambda w: seen.append(rk.exact_panel_dtype(w)) or w)(exact)
    assert seen == [jnp.float32]


def _instruction_set_builds():
    """The kernel built for each narrower x86 instruction set this machine also runs (AVX2 without AVX-512, AVX
    without AVX2, SSE4.1 without AVX, SSE2 alone): each has its own register tiling (cpu_rows.cc kWidth, kRegisters)
    or its own int8 widening (cpu_common.h), whatever CI's CPU is."""
    import platform

    if platform.machine() not in ("x86_64", "AMD64"):
        return []
    builds = []
    for flags in [("-mno-avx512f",), ("-mno-avx2",), ("-mno-avx",), ("-mno-sse4.1",)]:
        try:
            builds.append((flags, rk.build(extra_flags=flags)))  # cached beside the default build, keyed by flags
        except rk.BuildError as e:
            pytest.skip(f"the compiler does not build {flags}: {e}")
    return builds


def test_every_instruction_sets_tiling_gives_the_reference_bits():
    import ctypes

    builds = _instruction_set_builds()
    if not builds:
        pytest.skip("narrower builds are x86 only")
    # rows 1..13: every row-group size of the 8-, 6- and 2-row tilings; panels 1..8: every group remainder and
    # every tile width (3, 2, 1) with what is left of a group
    cases = [(1, 37, 16 * 7 + 3), (2, 64, 16 * 5), (2, 20, 16 * 4), (3, 50, 16 * 2), (4, 33, 16 * 8),
             (5, 96, 16 * 4 + 1), (6, 576, 960), (7, 1, 40), (10, 64, 16 * 3), (13, 200, 300)]
    for i, (flags, library) in enumerate(builds):
        lib = ctypes.cdll.LoadLibrary(str(library))
        name = f"jaxspec_row_matmul_test_{i}"
        jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(lib.JaxspecRowMatmul), platform="cpu")
        jax.ffi.register_ffi_target(name + "_bf16", jax.ffi.pycapsule(lib.JaxspecRowMatmulBF16), platform="cpu")
        jax.ffi.register_ffi_target(name + "_s8", jax.ffi.pycapsule(lib.JaxspecRowMatmulS8), platform="cpu")
        for rows, k, n in cases:
            w = jnp.asarray(_weights(k, n, 20)).astype(jnp.bfloat16).astype(jnp.float32)
            ints = jnp.clip(jnp.round(w * 40), -128, 127)
            x = jnp.asarray(np.random.default_rng(21).standard_normal((rows, k), dtype=np.float32))
            narrow = (rk.pack_panels(w, dtype=jnp.bfloat16), rk.pack_panels(ints, dtype=jnp.int8))
            for panels in (rk.pack_panels(w), *narrow):
                target = name + rk.SUFFIXES[jnp.dtype(panels.dtype)]
                out = jax.ShapeDtypeStruct((rows, panels.shape[0] * rk.LANES), jnp.float32)
                got = np.asarray(jax.jit(jax.ffi.ffi_call(target, out))(x, panels))[:, :n]
                np.testing.assert_array_equal(got, np.asarray(reference(x, panels, n)),
                                              err_msg=f"{flags} rows={rows} k={k} n={n} {panels.dtype}")
