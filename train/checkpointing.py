"""Orbax checkpoints of a training run: parameters, optimizer state and the data position, atomically written
(orbax finalizes a step directory only when it is complete), the last N kept, and restored into the shapes and
shardings of a freshly built state so that a killed run resumes exactly where its last checkpoint stopped."""

from __future__ import annotations

from pathlib import Path

import jax
import orbax.checkpoint as ocp


class RunCheckpoints:
    def __init__(self, directory: str | Path, keep: int = 3):
        self.manager = ocp.CheckpointManager(
            Path(directory).absolute(),
            options=ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=False),
        )

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state, meta: dict) -> None:
        self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)))
        self.manager.wait_until_finished()

    def restore(self, step: int, like):
        """Restore into the structure, dtypes and shardings of `like` (a state built as for a fresh run)."""
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), like)
        out = self.manager.restore(
            step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore())
        )
        return out["state"], out["meta"]

    def delete(self, step: int) -> None:
        self.manager.delete(step)

    def close(self) -> None:
        self.manager.close()
