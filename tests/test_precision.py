"""Mixed-precision head training (train/precision.py): 16-bit products with float32 sums in the forward and the
backward (`accumulating_matmul`), a compute copy of the target and head (`computing_in`), float32 master weights
updated by a step that computes in bfloat16, and `auto` choosing by what this machine runs faster."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_train_step import setup

from jaxspec.models.layers import accumulating_matmul
from jaxspec.models.llama import Linear
from train import precision
from train.precision import computing_in, resolve_compute_dtype
from train.step import split_head, train_step


def _bf16(x):
    return x.astype(jnp.bfloat16)


@pytest.mark.parametrize("lead", [(5,), (2, 7), (3, 1, 4)])
def test_accumulating_matmul_and_its_gradient(lead):
    """Forward: the float32 product of the 16-bit values, rounded once. Gradients: those of float32 autodiff on the
    same values, up to rounding the cotangent and the results to bfloat16 (the products stay exact in float32)."""
    kx, kw, kg = jax.random.split(jax.random.key(len(lead)), 3)
    x = _bf16(jax.random.normal(kx, (*lead, 48), jnp.float32))  # [..., K]
    w = _bf16(0.1 * jax.random.normal(kw, (48, 24), jnp.float32))  # [K, N]
    g = _bf16(jax.random.normal(kg, (*lead, 24), jnp.float32))  # cotangent [..., N]
    y, vjp = jax.vjp(lambda a, b: accumulating_matmul(a, b, jnp.float32), x, w)
    assert y.dtype == jnp.bfloat16
    want = jnp.einsum("...k,kn->...n", x.astype(jnp.float32), w.astype(jnp.float32),
                      precision=jax.lax.Precision.HIGHEST)
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(_bf16(want), np.float32))
    dx, dw = vjp(g)
    assert dx.dtype == jnp.bfloat16 and dw.dtype == jnp.bfloat16 and dx.shape == x.shape and dw.shape == w.shape
    _, f32_vjp = jax.vjp(lambda a, b: jnp.einsum("...k,kn->...n", a, b, precision=jax.lax.Precision.HIGHEST),
                         x.astype(jnp.float32), w.astype(jnp.float32))
    want_dx, want_dw = f32_vjp(g.astype(jnp.float32))
    np.testing.assert_allclose(np.asarray(dx, np.float32), np.asarray(want_dx), rtol=1e-2, atol=1e-2)
    np.testing.assert_allclose(np.asarray(dw, np.float32), np.asarray(want_dw), rtol=1e-2, atol=1e-2)


def test_computing_in_copies_and_leaves_the_original_alone():
    _, _, hgd, params, frozen, _, _ = setup()
    head = nnx.merge(hgd, params, frozen)
    copy = computing_in(head, jnp.bfloat16)
    assert copy.dtype == jnp.bfloat16 and head.dtype == jnp.float32
    assert copy.lm_head.kernel[...].dtype == jnp.bfloat16 and head.lm_head.kernel[...].dtype == jnp.float32
    assert copy.d2t[...].dtype == jnp.int32  # integer buffers are not cast
    linears = [m for _, m in nnx.iter_graph(copy) if isinstance(m, Linear)]
    assert linears and all(m.accumulate == jnp.float32 for m in linears)
    assert all(m.accumulate is None for _, m in nnx.iter_graph(head) if isinstance(m, Linear))
    assert computing_in(head, jnp.float32).lm_head.accumulate is None  # 32-bit: plain dots


def test_bfloat16_step_updates_float32_masters_like_a_float32_step():
    """Three steps computing in bfloat16 from the same start: the loss follows float32's closely and the
    parameters the optimizer returns are still float32 masters."""
    tgd, tparams, hgd, params, frozen, tx, batch = setup()
    target = computing_in(nnx.merge(tgd, tparams), jnp.bfloat16)
    tgd16, tparams16 = nnx.split(target)
    hgd16 = split_head(computing_in(nnx.merge(hgd, params, frozen), jnp.bfloat16))[0]
    runs = {}
    for name, (t_gd, t_params, h_gd, compute) in {
        "float32": (tgd, tparams, hgd, None),
        "bfloat16": (tgd16, tparams16, hgd16, jnp.bfloat16),
    }.items():
        step = jax.jit(functools.partial(train_step, t_gd, head_graphdef=h_gd, tx=tx, num_steps=3,
                                         compute_dtype=compute))
        p, opt_state, losses = params, tx.init(params), []
        for _ in range(3):
            p, opt_state, loss, _ = step(t_params, params=p, frozen=frozen, opt_state=opt_state, batch=batch)
            losses.append(float(loss))
        runs[name] = (p, losses)
    p16, losses16 = runs["bfloat16"]
    assert {x.dtype for x in jax.tree.leaves(p16) if jnp.issubdtype(x.dtype, jnp.floating)} == {jnp.dtype("float32")}
    np.testing.assert_allclose(losses16, runs["float32"][1], rtol=2e-2)
    assert losses16[-1] < losses16[0]


def test_auto_chooses_by_the_timed_matmul(monkeypatch):
    assert resolve_compute_dtype("float32", 8, 8, 8) == "float32"
    assert resolve_compute_dtype("bfloat16", 8, 8, 8) == "bfloat16"
    assert resolve_compute_dtype("auto", 8, 8, 8, backend="gpu") == "bfloat16"
    times = {"float32": 1.0, "bfloat16": 0.5}
    monkeypatch.setattr(precision, "_matmul_seconds", lambda rows, hidden, columns, dtype: times[dtype])
    assert resolve_compute_dtype("auto", 8, 8, 8, backend="cpu") == "bfloat16"
    times["bfloat16"] = 0.9  # not faster by the margin: float32
    assert resolve_compute_dtype("auto", 8, 8, 8, backend="cpu") == "float32"
