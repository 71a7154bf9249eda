"""Load time of a target from its Hugging Face safetensors against its `jaxspec.convert target` orbax copy.

Both loads end with the parameters on the device(s) (placed on the mesh when one is given: safetensors are read on
the host and then sharded, orbax restores each shard in place), interleaved so that both see the same page cache
and machine load, after one untimed warm-up load each.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

from jaxspec.errors import JaxspecError


def time_loads(hf_dir: Path, orbax_dir: Path, *, dtype: str, mesh=None, repeats: int = 5) -> dict:
    import jax
    import numpy as np
    from flax import nnx

    from jaxspec import sharding
    from jaxspec.checkpoints.hf import load_target
    from jaxspec.checkpoints.orbax_target import is_orbax_target

    if not is_orbax_target(orbax_dir):
        raise JaxspecError(
            f"{str(orbax_dir)!r} is not an orbax target; make one with "
            f"`python -m jaxspec.convert target --target {hf_dir} --out DIR`"
        )
    if is_orbax_target(hf_dir):
        raise JaxspecError("--target must be the Hugging Face original of the --load-time orbax copy")
    if repeats < 1:
        raise JaxspecError(f"--repeats must be at least 1, got {repeats}")

    def from_safetensors():
        params = nnx.state(load_target(hf_dir, dtype=dtype))
        return params if mesh is None else sharding.shard_params(params, mesh)

    def from_orbax():
        return nnx.state(load_target(orbax_dir, dtype=dtype, mesh=mesh))

    loaders = {"safetensors": from_safetensors, "orbax": from_orbax}
    seconds: dict[str, list[float]] = {name: [] for name in loaders}
    loaded = {name: jax.block_until_ready(fn()) for name, fn in loaders.items()}  # warm-up: page cache, compiles
    same = all(
        np.array_equal(sharding.to_host(a), sharding.to_host(b))
        for a, b in zip(jax.tree.leaves(loaded["safetensors"]), jax.tree.leaves(loaded["orbax"]), strict=True)
    )
    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(loaded["orbax"]))
    del loaded
    for _ in range(repeats):
        for name, fn in loaders.items():
            start = time.perf_counter()
            params = jax.block_until_ready(fn())
            seconds[name].append(time.perf_counter() - start)
            del params
    median = {name: statistics.median(times) for name, times in seconds.items()}
    return {
        "dtype": dtype,
        "mesh": None if mesh is None else dict(mesh.shape),
        "weight_bytes": weight_bytes,  # as held in memory (numerics.held_dtype: float32 for 16-bit models on CPU)
        "repeats": repeats,
        "identical_parameters": same,
        "seconds": {name: [round(t, 3) for t in times] for name, times in seconds.items()},
        "median_seconds": {name: round(t, 3) for name, t in median.items()},
        # the load-speed measure: weights placed on the device(s) per second, as they are held there
        "gb_per_s": {name: round(weight_bytes / t / 1e9, 2) for name, t in median.items()},
        "orbax_speedup": round(median["safetensors"] / median["orbax"], 2),
    }


def load_table(r: dict) -> str:
    mesh = "one device" if r["mesh"] is None else " × ".join(f"{k}={v}" for k, v in r["mesh"].items())
    lines = [
        f"{r['weight_bytes'] / 1e9:.2f} GB of {r['dtype']} weights as held in memory, {mesh}, "
        f"median of {r['repeats']} loads; "
        f"identical parameters: {'yes' if r['identical_parameters'] else 'NO'}",
        "| source | median s | GB/s placed | all loads (s) |",
        "|---|---|---|---|",
    ]
    for name, times in r["seconds"].items():
        lines.append(
            f"| {name} | {r['median_seconds'][name]:.2f} | {r['gb_per_s'][name]:.2f} | "
            f"{', '.join(f'{t:.2f}' for t in times)} |"
        )
    lines.append(f"orbax reloads {r['orbax_speedup']:.2f}x as fast as safetensors")
    return "\n".join(lines)
