"""What generation holds in device memory: parameters, KV caches, and the compiled step's peak, per device.

Why: serving users size batches and contexts by memory (the ExecuTorch EAGLE-3 RFC asks for target, draft,
draft-KV and peak memory). The figures are read from the arrays themselves (each array's shard shape times its
item size, so a mesh reports what one device holds) and from XLA's memory analysis of the compiled step, not
estimated from the config.
"""

from __future__ import annotations

import dataclasses
import math

import jax


def device_bytes(tree) -> int:
    """Bytes one device holds of the arrays in `tree`: each array's shard shape (from its sharding, no data touched;
    the whole array on one device) times its item size."""
    return sum(
        math.prod(leaf.sharding.shard_shape(leaf.shape)) * leaf.dtype.itemsize
        for leaf in jax.tree.leaves(tree)
        if isinstance(leaf, jax.Array)
    )


def compiled_peak_bytes(compiled) -> int | None:
    """XLA's estimate of one device's live bytes while the compiled program runs: its arguments, outputs not
    aliased to a donated argument, and temporaries. None where the backend gives no analysis."""
    try:
        stats = compiled.memory_analysis()
    except (NotImplementedError, RuntimeError):
        return None
    if stats is None:
        return None
    peak = getattr(stats, "peak_memory_in_bytes", 0)  # newer jaxlibs compute it; otherwise the sum below
    if peak:
        return int(peak)
    return int(
        stats.argument_size_in_bytes + stats.output_size_in_bytes - stats.alias_size_in_bytes
        + stats.temp_size_in_bytes
    )


@dataclasses.dataclass(frozen=True)
class MemoryReport:
    """Bytes per device of one generation batch shape (all figures for the first device of the mesh)."""

    devices: int  # devices the arrays are spread over (1 without a mesh)
    batch_size: int
    cache_capacity: int  # the target cache's slots per row
    target_parameters: int
    target_kv_cache: int
    head_parameters: int  # 0 for target-only generation
    head_kv_cache: int
    step_peak: int | None  # the compiled decode / speculative step (XLA's memory analysis)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    def lines(self) -> list[str]:
        """The report as text lines (MB = 10^6 bytes)."""
        mb = lambda n: "n/a" if n is None else f"{n / 1e6:,.1f} MB"  # noqa: E731
        where = "per device" if self.devices > 1 else "on the device"
        rows = [
            ("target parameters", self.target_parameters),
            (f"target KV cache (batch {self.batch_size} x {self.cache_capacity} slots)", self.target_kv_cache),
        ]
        if self.head_parameters:
            rows += [("draft head parameters", self.head_parameters), ("draft head KV cache", self.head_kv_cache)]
        rows.append(("peak of the compiled step (XLA)", self.step_peak))
        width = max(len(name) for name, _ in rows)
        return [f"memory {where} ({self.devices} device{'s' if self.devices > 1 else ''}):"] + [
            f"  {name:<{width}}  {mb(n):>12}" for name, n in rows
        ]
