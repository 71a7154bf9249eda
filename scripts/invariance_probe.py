"""Which primitive ops give a row the same bits whatever else is computed with it, on this backend.

    python scripts/invariance_probe.py [--dtype bfloat16] [--json OUT.json] [--time]

Batch-invariant numerics (jaxspec/models/numerics.py) rest on these facts; they differ by backend and XLA version,
so measure them where the target runs. Each probe computes f on rows 0..m-1 alone and inside a larger batch and
reports the row counts m whose bits differ ("bad"). `--time` adds, at Llama-3.1-8B MLP shapes, the time of one
[rows, 4096] x [4096, 14336] dot per row count (what a fixed row tile costs a decode step).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.models.numerics import contract, hold

ROWS = (1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32, 48, 64)


def prefix_probe(f, x, rows=ROWS) -> list[int]:
    """Rows m where f(x[:m]) differs from f(x)[:m]."""
    full = np.asarray(jax.jit(f)(x))
    return [m for m in rows if m <= x.shape[0] and not np.array_equal(np.asarray(jax.jit(f)(x[:m])), full[:m])]


def neighbour_probe(f, x, trials: int = 4) -> int:
    """Fixed shape: rows shuffled and half the others replaced; trials where a row's result did not follow it."""
    rng = np.random.default_rng(0)
    base = np.asarray(jax.jit(f)(x))
    bad = 0
    for _ in range(trials):
        p = rng.permutation(x.shape[0])
        other = jax.random.normal(jax.random.key(int(rng.integers(1 << 30))), x.shape, jnp.float32).astype(x.dtype)
        keep = rng.random(x.shape[0]) < 0.5
        out = np.asarray(jax.jit(f)(jnp.where(keep[:, None], x[p], other)))
        bad += int(not np.array_equal(out[keep], base[p][keep]))
    return bad


def model_dot(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [rows, K] @ w [K, N] as the target computes it: w held as `numerics.hold` keeps it (float32 on CPU for a
    16-bit model, the model dtype elsewhere) and contracted with `numerics.contract`. Probing a plain bfloat16 x
    bfloat16 dot on CPU would measure a form the target never runs."""
    return contract(x, w, ((1,), (0,)))


def probes(dtype) -> dict:
    key = jax.random.key(0)
    res = {}
    for k_dim, n_dim in ((576, 1536), (4096, 1024), (4096, 14336)):
        x = jax.random.normal(key, (64, k_dim), jnp.float32).astype(dtype)
        w = hold(0.02 * jax.random.normal(jax.random.key(1), (k_dim, n_dim), jnp.float32), dtype)
        res[f"dot K={k_dim} N={n_dim}: bad row counts"] = prefix_probe(lambda a, w=w: model_dot(a, w), x)
        for tile in (8, 64):
            res[f"dot K={k_dim} N={n_dim} fixed {tile}-row tile: bad trials"] = neighbour_probe(
                lambda a, w=w: model_dot(a, w), x[:tile]
            )
    for g, d, bk in ((3, 64, 64), (4, 128, 64)):
        q = jax.random.normal(key, (48, g, d), jnp.float32).astype(dtype)
        k = jax.random.normal(jax.random.key(2), (48, bk, d), jnp.float32).astype(dtype)
        res[f"batched dot [{g},{d}]x[{d},{bk}], batch count: bad counts"] = prefix_probe(
            lambda a, k=k: jnp.einsum("nrd,ncd->nrc", a, k[: a.shape[0]], preferred_element_type=jnp.float32), q
        )
    x = jax.random.normal(key, (64, 4096), jnp.float32)
    res["sum over last axis: bad row counts"] = prefix_probe(lambda a: jnp.sum(a * a, axis=-1), x)
    res["exp: bad row counts"] = prefix_probe(jnp.exp, x)
    rng = np.random.default_rng(0)
    a, b, c = (rng.standard_normal(1 << 16).astype(np.float32) for _ in range(3))
    got = np.asarray(jax.jit(lambda a, b, c: a * b + c)(a, b, c))
    fma = (a.astype(np.float64) * b + c).astype(np.float32)
    res["a*b+c contracted to FMA (fraction equal to FMA)"] = float(np.mean(got == fma))
    hlo = jax.jit(lambda a: jax.lax.optimization_barrier(a * 2.0) + 1.0).lower(a).compile().as_text()
    res["optimization_barrier kept in compiled HLO"] = "opt-barrier" in hlo
    return res


def time_tiles(dtype) -> dict:
    w = hold(0.02 * jax.random.normal(jax.random.key(1), (4096, 14336), jnp.float32), dtype)
    out = {}
    for rows in (1, 8, 16, 64, 128, 256):
        x = jax.random.normal(jax.random.key(rows), (rows, 4096), jnp.float32).astype(dtype)
        f = jax.jit(lambda a: model_dot(a, w))
        f(x).block_until_ready()
        ts = []
        for _ in range(50):
            t0 = time.perf_counter()
            f(x).block_until_ready()
            ts.append(time.perf_counter() - t0)
        out[f"dot [{rows},4096]x[4096,14336] ms (median of 50, host-timed)"] = round(statistics.median(ts) * 1e3, 4)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--time", action="store_true", help="time fixed-tile dots at Llama-3.1-8B MLP shapes")
    args = ap.parse_args()
    res = {"backend": jax.default_backend(), "device": jax.devices()[0].device_kind, "jax": jax.__version__,
           "dtype": args.dtype, **probes(jnp.dtype(args.dtype))}
    if args.time:
        res.update(time_tiles(jnp.dtype(args.dtype)))
    for k, v in res.items():
        print(f"{k}: {v}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
