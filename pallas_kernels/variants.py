"""Which variant of a Pallas kernel to build. Each kernel (`invariant_attention.py`, `rejection.py`) has two with the
same floating-point operations: a Triton one for GPUs (CUDA, ROCm) and a Mosaic TPU one, which differ in what the
compilers ask of blocks, scalars and memory. The variant follows a static `backend` argument, not the device the
trace runs on, so that `jax.export(..., platforms=["tpu"])` on a CPU host builds the TPU variant.

Interpret mode runs either variant on CPU: the Triton one in Pallas's generic interpret mode, the TPU one in TPU
interpret mode (`pltpu.InterpretParams`), which simulates HBM, VMEM, SMEM, scalar prefetch and the DMAs and checks
their bounds, and what a kernel reads before its DMA has been waited for (uninitialized memory reads as NaN).
"""

from __future__ import annotations

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu


def kernel_variant(backend: str | None = None) -> str:
    """The variant for a backend: "tpu" (Mosaic TPU) for tpu, "gpu" (Triton) for any other ("cuda", "rocm", "gpu",
    and "cpu", where only interpret mode runs); None is jax.default_backend()."""
    return "tpu" if (backend or jax.default_backend()) == "tpu" else "gpu"


def tpu_interpret(interpret: bool | pltpu.InterpretParams) -> bool | pltpu.InterpretParams:
    """`pallas_call`'s `interpret` for the TPU variant: TPU interpret mode with default parameters for True, the
    given parameters (race detection, randomized parallel grid order, several cores) as they are."""
    if isinstance(interpret, pltpu.InterpretParams):
        return interpret
    return pltpu.InterpretParams() if interpret else False


def prefetch_next_then_wait(copies, i, slot, has_next) -> None:
    """Double buffering in the TPU variants: start the DMAs of step i + 1 into the other slot (when there is one),
    then wait for step i's, so the next block streams in while this one is computed. copies(i, slot) → the
    step's async copies (`pltpu.make_async_copy`), started for step 0 before the loop."""

    @pl.when(has_next)
    def _():
        for copy in copies(i + 1, 1 - slot):
            copy.start()

    for copy in copies(i, slot):
        copy.wait()
