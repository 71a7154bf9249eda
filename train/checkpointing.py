"""Orbax checkpoints of a training run: parameters, optimizer state and the data position, atomically written
(orbax finalizes a step directory only when it is complete), the last N kept, and restored into the shapes and
shardings of a freshly built state so that a killed run resumes exactly where its last checkpoint stopped."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import jax
import orbax.checkpoint as ocp

from jaxspec.errors import JaxspecError


class RunCheckpoints:
    def __init__(self, directory: str | Path, keep: int = 3):
        self.directory = Path(directory).absolute()
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

    def latest_meta(self) -> dict | None:
        """The newest checkpoint's metadata alone (its settings, read before the state is restored into shapes
        that may no longer match them), or None when there is none or it cannot be read."""
        step = self.manager.latest_step()
        if step is None:
            return None
        try:
            return self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        except Exception:  # a damaged checkpoint: restore_latest says so, and falls back
            return None

    def restore_latest(self, like, say: Callable[[str], None]):
        """(step, state, meta) of the newest checkpoint that restores, or None when there is none. A newer one that
        cannot be read (orbax finalizes a step only when it is complete, but a full disk, a cut copy or a bad
        sector can damage it afterwards) is moved aside to <directory>-unreadable/STEP, so that the run goes on
        from the previous one kept and later saves do not meet it; `say` tells which. When none can be read, a
        one-line error names the newest's problem and nothing is moved."""
        unreadable = []
        for step in sorted(self.manager.all_steps(), reverse=True):
            try:
                state, meta = self.restore(step, like)
            except Exception as e:  # orbax's errors on damaged files vary: JSON, missing items, tensorstore
                unreadable.append((step, f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"))
                continue
            if unreadable:
                aside = self._set_aside([s for s, _ in unreadable])
                newest, why = unreadable[0]
                say(f"the checkpoint of step {newest} cannot be read ({why}); resuming from step {step}, the "
                    f"newest one that can (the unreadable {'ones' if len(unreadable) > 1 else 'one'} moved to "
                    f"{aside})")
            return step, state, meta
        if unreadable:
            newest, why = unreadable[0]
            raise JaxspecError(f"no checkpoint in {self.directory} can be read (step {newest}: {why}); delete the "
                               "directory to start the run over, or restore it from a copy")
        return None

    def _set_aside(self, steps: list[int]) -> Path:
        aside = self.directory.with_name(self.directory.name + "-unreadable")
        aside.mkdir(exist_ok=True)
        for step in steps:
            shutil.rmtree(aside / str(step), ignore_errors=True)  # set aside once before: the same step again
            shutil.move(self.directory / str(step), aside / str(step))
        self.manager.reload()
        return aside

    def delete(self, step: int) -> None:
        self.manager.delete(step)

    def close(self) -> None:
        self.manager.close()
