"""The names of the device-mesh axes, in one place: the engine's shardings (`jaxspec.sharding`), the kernels' per-shard
forms (`pallas_kernels`), the invariant numerics' row tiles and the trainer's mesh all read them from here.
They live on the ground floor, beside the kernels, so that the kernels import nothing of `jaxspec`.

    DATA   rows of the batch (inference: whole sequences per device; training: data parallelism)
    MODEL  tensor parallelism at inference: attention heads, KV heads (repeated when the axis is wider), MLP columns
    FSDP   training: parameters and optimizer state split over it, batch rows over (DATA, FSDP)
"""

DATA = "data"
MODEL = "model"
FSDP = "fsdp"
