"""Timed step costs kept on disk, so that automatic speculation times a shape once per machine, not once per process.

Why: timing compiles three target forwards and a head step per cache bucket (`step_costs.measure_step_costs`);
even with every program in the persistent compilation cache, tracing and loading them took ~18 s per bucket on a
2-core CPU, so the default command's one-prompt run took 39 s against `--no-draft`'s 16 s. The costs of a shape
depend on the machine, the software and the model, not on the prompts, so they are stored under a key made of
exactly those (`cost_key`) and read back by later processes. A stale entry costs speed, never output: every
choice gives the target's tokens, and each batch's own step times rescale the stored costs
(`auto_config.StepCalibration`) as they do freshly timed ones.

Where: the JAXSPEC_STEP_COSTS file ("off" disables the store; the tests set that), else step-costs.json in
jaxspec's cache directory (beside the built-in target). Delete the file to time afresh.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import importlib.metadata
import json
import os
import platform
from pathlib import Path

import jax

from jaxspec.errors import JaxspecError
from jaxspec.spec.auto_config import StepCosts

STORE_ENV = "JAXSPEC_STEP_COSTS"


@dataclasses.dataclass(frozen=True)
class StepCostStore:
    """A JSON file {key: {"decode", "verify", "draft" (seconds), "timed": date, "what": the key's parts}}."""

    path: Path

    def get(self, key: str) -> StepCosts | None:
        """The stored costs under `key`, or None (absent, or an entry or file this version cannot read)."""
        entry = self._read().get(key)
        try:
            return StepCosts(float(entry["decode"]), tuple(float(v) for v in entry["verify"]), float(entry["draft"]))
        except (TypeError, KeyError, ValueError, JaxspecError):  # JaxspecError: costs that are not positive
            return None

    def put(self, key: str, costs: StepCosts, what: dict) -> None:
        """Store `costs` under `key` (`what`: the key's parts, for a reader of the file). Written to a temporary
        file and renamed, so that a reader — another process — never sees half a file."""
        entries = self._read()
        entries[key] = {"decode": costs.decode, "verify": list(costs.verify), "draft": costs.draft,
                        "timed": datetime.date.today().isoformat(), "what": what}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(entries, indent=1) + "\n")
        os.replace(tmp, self.path)

    def _read(self) -> dict:
        try:
            entries = json.loads(self.path.read_text())
        except (OSError, ValueError):  # no file yet, or one cut short: the store is a cache, start over
            return {}
        return entries if isinstance(entries, dict) else {}


def default_store() -> StepCostStore | None:
    """The store JAXSPEC_STEP_COSTS names ("off": None), else step-costs.json in jaxspec's cache directory."""
    where = os.environ.get(STORE_ENV, "")
    if where == "off":
        return None
    if where:
        return StepCostStore(Path(where))
    from jaxspec.checkpoints.builtin import cache_root

    return StepCostStore(cache_root() / "step-costs.json")


def cost_key(model, head, batch: int, capacity: int, max_draft: int, mesh: jax.sharding.Mesh | None) -> tuple[str, dict]:
    """(key, its parts): what a step's cost depends on — this machine (backend, device kind and count, CPU model
    and cores), the software (jax, jaxlib), the target and head (configs, dtypes, numerics) and the shape (batch,
    cache capacity, longest chain, mesh)."""
    device = jax.devices()[0]
    what = {
        "backend": jax.default_backend(),
        "devices": f"{jax.device_count()} x {device.device_kind}",
        "host": f"{_cpu_model()}, {os.cpu_count()} cores",
        "jax": jax.__version__,
        "jaxlib": _version("jaxlib"),
        "target": repr(model.config),
        "target_dtype": str(model.dtype),
        "numerics": repr(model.numerics),
        "head": repr(head.config),
        "head_dtype": str(head.dtype),
        "batch": batch,
        "capacity": capacity,
        "max_draft": max_draft,
        "mesh": dict(mesh.shape) if mesh is not None else None,
    }
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:32], what


def _cpu_model() -> str:
    """The CPU's model name and a digest of its feature flags (Linux: /proc/cpuinfo; virtual machines often report
    one name for CPUs with and without, e.g., AMX), else what `platform` reports."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    fields = dict(line.split(":", 1) for line in lines if ":" in line)  # the last CPU's fields; all are alike
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    if "model name" not in fields:
        return platform.processor() or platform.machine()
    flags = hashlib.sha256(fields.get("flags", "").encode()).hexdigest()[:12]
    return f"{fields['model name']} (flags {flags})"


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return ""
