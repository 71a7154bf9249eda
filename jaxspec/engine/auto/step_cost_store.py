"""Timed step costs kept on disk, so that automatic speculation times a shape once per machine, not once per process.

Why: timing compiles three target forwards and a head step per cache bucket (`step_costs.measure_step_costs`);
even with every program in the persistent compilation cache, tracing and loading them took ~18 s per bucket on a
2-core CPU, so the default command's one-prompt run took 39 s against `--no-draft`'s 16 s. The costs of a shape
depend on the machine, the software and the model, not on the prompts, so they are stored under a key made of
exactly those (`cost_key`) and read back by later processes. So is the calibration (`auto.config.StepCalibration`:
what the generation loop's steps really took against those costs), or a process's first choice rests on isolated
forwards: measured on a 2-core CPU, a timed decode of 48 ms where the loop's steps took ~37 ms, so a one-prompt
run drafted one token at 20 tokens/s where target-only ran at 25. A stored calibration weighs as much as
CALIBRATION_SECONDS of steps, so that a process's own batches soon outweigh it where the machine has changed. A
stale entry costs speed, never output: every choice gives the target's tokens.

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
from jaxspec.engine.auto.config import StepCalibration, StepCosts, method_key, parse_method_key
from jaxspec.engine.auto.step_costs import TIMING
from jaxspec.engine.tree import TreeConfig
from jaxspec.models.llama import draft_holding
from pallas_kernels import cpu_library

STORE_ENV = "JAXSPEC_STEP_COSTS"
CALIBRATION_SECONDS = 30.0  # a stored calibration weighs as much as this many seconds of this process's steps


@dataclasses.dataclass(frozen=True)
class StepCostStore:
    """A JSON file {key: entry}: timed costs ({"decode", "verify", "draft": seconds, "tree_drafts": {tree spec:
    seconds}, "timed": date, "what": the key's parts}) per shape, and calibrations ({"measured", "predicted":
    {method: seconds}}, methods named by `auto.config.method_key`) per machine, model and batch size
    (`calibration_key`)."""

    path: Path

    def __post_init__(self) -> None:
        """A file that is there must be a store (or empty): it is rewritten whole on every put, and a
        JAXSPEC_STEP_COSTS naming some other file once overwrote it without a word."""
        if self.path.is_dir():
            raise JaxspecError(f"{STORE_ENV}: {str(self.path)!r} is a directory; name a file (or 'off')")
        if not self.path.is_file() or self.path.stat().st_size == 0:
            return
        try:
            entries = json.loads(self.path.read_text())
            own = isinstance(entries, dict) and all(isinstance(e, dict) and "what" in e for e in entries.values())
        except (OSError, ValueError):
            own = False
        if not own:
            raise JaxspecError(
                f"{str(self.path)!r} is not a jaxspec step-cost store, and storing costs would overwrite it; point "
                f"{STORE_ENV} at a new file (or 'off'), or delete this one if it is a store of an older version"
            )

    def get(self, key: str) -> StepCosts | None:
        """The stored costs under `key`, or None (absent, or an entry or file this version cannot read)."""
        entry = self._read().get(key)
        try:
            trees = tuple((TreeConfig.parse(k), float(v)) for k, v in entry.get("tree_drafts", {}).items())
            return StepCosts(float(entry["decode"]), tuple(float(v) for v in entry["verify"]), float(entry["draft"]),
                             trees, bool(entry.get("block_draft", False)))
        except (TypeError, KeyError, ValueError, AttributeError, JaxspecError):  # JaxspecError: not positive
            return None

    def put(self, key: str, costs: StepCosts, what: dict) -> None:
        """Store `costs` under `key` (`what`: the key's parts, for a reader of the file)."""
        self._write(key, {"decode": costs.decode, "verify": list(costs.verify), "draft": costs.draft,
                          "tree_drafts": {t.spec: v for t, v in costs.tree_drafts}, "block_draft": costs.block_draft,
                          "timed": datetime.date.today().isoformat(), "what": what})

    def get_calibration(self, key: str) -> StepCalibration | None:
        """The calibration stored under `key` (per method, the seconds the generation loop's steps took and the
        seconds the stored costs predicted for them), or None."""
        entry = self._read().get(key)
        try:
            measured = {parse_method_key(k): float(v) for k, v in entry["measured"].items()}
            predicted = {parse_method_key(k): float(v) for k, v in entry["predicted"].items()}
        except (TypeError, KeyError, ValueError, AttributeError, JaxspecError):
            return None
        if measured.keys() != predicted.keys() or any(v <= 0 for v in (*measured.values(), *predicted.values())):
            return None
        return StepCalibration(measured, predicted)

    def put_calibration(self, key: str, calibration: StepCalibration, what: dict) -> None:
        self._write(key, {"measured": {method_key(k): v for k, v in calibration.measured.items()},
                          "predicted": {method_key(k): v for k, v in calibration.predicted.items()},
                          "updated": datetime.date.today().isoformat(), "what": what})

    def _write(self, key: str, entry: dict) -> None:
        """Set one entry, through a temporary file renamed over the store, so that a reader — another process —
        never sees half a file. Two processes writing at once may lose one's entry (the last rename wins): a cache
        miss, timed again by the next process."""
        entries = self._read()
        entries[key] = entry
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


def calibration_key(
    model, head, batch: int, max_draft: int, mesh: jax.sharding.Mesh | None, trees: tuple[TreeConfig, ...] = ()
) -> tuple[str, dict]:
    """(key, its parts) of the calibration: `cost_key` without the cache capacity (calibrations pool the buckets)."""
    key, what = cost_key(model, head, batch, None, max_draft, mesh, trees)
    return f"calibration-{key}", what


def cost_key(
    model,
    head,
    batch: int,
    capacity: int | None,
    max_draft: int,
    mesh: jax.sharding.Mesh | None,
    trees: tuple[TreeConfig, ...] = (),
) -> tuple[str, dict]:
    """(key, its parts): what a step's cost depends on — this machine (backend, device kind and count, CPU model
    and cores), the software (jax, jaxlib), the target and head (configs, dtypes, numerics), the shape (batch,
    cache capacity, longest chain, the candidate trees, mesh), how the costs were timed (`step_costs.TIMING`) and,
    on CPU, the code of jaxspec's CPU kernels where they run (a faster kernel changes what a verify costs) and how
    the head's matmuls are held on them (`llama.draft_holding`: int8 panels made its step ~25% cheaper).
    An entry holds the costs of the candidate trees worth timing there (`auto.config.tree_worth_timing`)."""
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
        "timing": TIMING,
    }
    if what["backend"] == "cpu" and cpu_library.available():  # the CPU kernels' code: a change to it is re-timed
        what["cpu_kernels"] = cpu_library.sources_digest()
    held = draft_holding(head)
    if held is not None:  # how the head's matmuls are held on the CPU kernels (absent where they are not)
        what["head_held"] = held
    if model.quantization:  # absent unquantized, as above
        what["quantization"] = model.quantization
    if trees:  # absent without trees, so that entries stored before trees were candidates keep their keys
        what["trees"] = [t.spec for t in trees]
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
