"""The device's memory bandwidth, measured, and the weights-only decode roofline it implies (`jaxspec.bench`).

Why a copy: a decode step streams the weights from memory, so its ceiling is set by how fast the device moves
bytes. A reduction over a large array (the earlier probe) under-reads on GPUs (1763 GB/s on an H100, whose
roofline then came out below the speed jaxspec reached); an in-place pass that reads and writes every byte of a
buffer far past the caches is the standard measure (bytes read + written per second).
"""

from __future__ import annotations

import time

PROBE_GIB_ACCELERATOR = 1.0  # buffer size on GPUs/TPUs: far past any last-level cache (H100 L2: 50 MB)
PROBE_MIB_CPU = 128  # on CPU (past a server's L3; keeps CI quick)
PROBE_PASSES = {"cpu": 4}  # passes per timed program; 10 elsewhere (~7 ms at 3 TB/s: dispatch amortized)
PROBE_METHOD = (
    "device memory bandwidth: one jitted program making {passes} in-place passes y <- y + 1 over a donated "
    "{mib} MiB float32 buffer (each pass reads and writes every byte; an optimization barrier between passes keeps "
    "XLA from fusing them); bytes read + written / best of {repeats} timed runs"
)


def probe_settings(nbytes: int | None = None, passes: int | None = None, device=None) -> tuple[int, int]:
    """(buffer bytes, passes) of the bandwidth probe on `device` (default: the first): 1 GiB and 10 passes on
    accelerators, 128 MiB and 4 on CPU; the buffer is capped at a quarter of the free device memory where the
    device reports it (it runs after the model is loaded)."""
    import jax

    device = device or jax.devices()[0]
    cpu = device.platform == "cpu"
    if nbytes is None:
        nbytes = PROBE_MIB_CPU << 20 if cpu else int(PROBE_GIB_ACCELERATOR * (1 << 30))
        stats = device.memory_stats() if not cpu else None
        if stats and stats.get("bytes_limit"):
            nbytes = min(nbytes, max(16 << 20, (stats["bytes_limit"] - stats.get("bytes_in_use", 0)) // 4))
    return max(4096, nbytes // 4096 * 4096), passes or PROBE_PASSES.get(device.platform, 10)


def probe_program(passes: int):
    """The probe's program: `passes` in-place passes over a donated float32 buffer, each y <- y + 1 (one read and one
    write of every element). The trip count is static and every pass ends in `lax.optimization_barrier`, so however
    XLA schedules or unrolls the loop no two passes fuse into one and none is elided; the donated buffer is updated
    in place. tests/test_bench_kernels.py checks the compiled HLO on CPU: a while loop of `passes` trips around one
    add fusion over the buffer, and no copy of it."""
    import jax

    def run(y):
        return jax.lax.fori_loop(0, passes, lambda _, y: jax.lax.optimization_barrier(y + 1.0), y)

    return jax.jit(run, donate_argnums=0)


def bandwidth_probe(nbytes: int | None = None, *, passes: int | None = None, repeats: int = 5) -> dict:
    """Memory bandwidth of the default device: the probe program (`probe_program`) over a buffer past the caches,
    warmed up, then timed `repeats` times with the host clock around a blocking call of the whole program (its one
    dispatch is spread over all the passes, so the figure is at most slightly low); bytes = read + written =
    2 × buffer × passes per run, over the best run. The values are checked (every pass added its 1).
    → {gb_per_s, buffer_bytes, passes, bytes_per_run, best_seconds, method}."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    nbytes, passes = probe_settings(nbytes, passes)
    n = nbytes // 4
    run = probe_program(passes)
    x = jax.jit(lambda: (jnp.arange(n, dtype=jnp.int32) % 1024).astype(jnp.float32))()  # not zeros; exact sums
    x = run(x)  # compile and warm up
    x.block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        x = run(x)
        x.block_until_ready()
        best = min(best, time.perf_counter() - start)
    head = np.asarray(x[:8])
    if not np.array_equal(head, np.arange(8, dtype=np.float32) + passes * (repeats + 1)):
        raise RuntimeError(f"bandwidth probe: passes missing from the result ({head})")
    moved = 2 * nbytes * passes
    return {
        "gb_per_s": moved / best / 1e9, "buffer_bytes": nbytes, "passes": passes, "bytes_per_run": moved,
        "best_seconds": best, "method": probe_description(nbytes, passes, repeats),
    }


def probe_description(nbytes: int | None = None, passes: int | None = None, repeats: int = 5) -> str:
    """How the probe measures, in words (for the JSON and tables); defaults: this device's settings."""
    nbytes, passes = probe_settings(nbytes, passes)
    return PROBE_METHOD.format(passes=passes, mib=nbytes >> 20, repeats=repeats)


def measure_bandwidth_gbs(nbytes: int | None = None, **probe) -> float:
    """GB/s (1e9 bytes, read + written) of the default device's memory, from `bandwidth_probe`."""
    return bandwidth_probe(nbytes, **probe)["gb_per_s"]


def decode_weight_bytes(model) -> int:
    """The weight bytes a target's decode step reads: every parameter once, except the embedding table of a model
    whose LM head is its own matrix (a step gathers only its B·T rows; counting it put an 8B-shaped target's
    roofline 1.05 GB too high). Works on abstract models (shapes only) too."""
    import math

    import jax
    import jax.numpy as jnp
    from flax import nnx

    params = jax.tree.leaves(nnx.state(model, nnx.Param))
    total = sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in params)
    if not model.config.tie_word_embeddings:
        table = nnx.state(model, nnx.Param)["embed_tokens"]
        total -= math.prod(table.shape) * jnp.dtype(table.dtype).itemsize
    return int(total)


def weights_roofline(weight_bytes: int, batch_size: int, gb_per_s: float) -> dict:
    """The weights-only roofline: tokens/s if every decode step read each weight once at the probe's bandwidth and
    did nothing else (batch × bandwidth / weight bytes). KV cache reads, activations, compute and launch gaps are
    left out, so real decoding stays below it; at long contexts or large batches the KV bytes matter too."""
    return {
        "what": "weights-only decode roofline: batch_size x bandwidth / weight_bytes tokens/s (each step reads "
        "every weight once; KV cache, activations and compute ignored)",
        "weight_bytes": weight_bytes,
        "batch_size": batch_size,
        "bandwidth_gb_per_s": round(gb_per_s, 2),
        "bandwidth_probe": probe_description(),
        "tokens_per_second": round(batch_size * gb_per_s * 1e9 / weight_bytes, 2),
    }
