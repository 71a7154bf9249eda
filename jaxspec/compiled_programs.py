"""Compiled programs kept per owner (a `Generator`'s, by shape key) under one process-wide bound on memory maps.

Why: XLA:CPU maps code memory for every compiled program and keeps the maps until the program is freed: measured
~1,300 per SmolLM2 program with invariant numerics, ~100 for a tiny target's prefill. Linux caps a process's
maps (`vm.max_map_count`, 65,530 by default), and past the cap LLVM aborts the process in the middle of a compile
("Unable to allocate section memory") — after ~75 minutes in a benchmark suite, and as early as ~50 programs into a
long `generate` run whose prompts span many shape buckets (each prompt bucket × cache capacity × chain length is a
program). So before compiling a new program, if the process has reached half its map limit, the least recently
used half of the programs held here are dropped (never the newest two: the batch being set up holds them) and JAX's
own caches cleared (`jax.clear_caches`: JAX's lowering cache also holds each executable, so dropping ours alone
frees nothing; measured). A dropped program compiles again on its next use, from the on-disk compile cache when
that is on. If a release leaves the process above the threshold (maps held elsewhere), the next one waits until half
of the remaining headroom is used, so that releases do not repeat on every compile. Where the limit or the maps
cannot be read (not Linux), the bound is off. Each process decides alone: on a multi-host mesh a host that releases
recompiles while the others wait for it, which costs time, never output.
"""

from __future__ import annotations

import gc
import itertools
import logging
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from pathlib import Path

import jax

log = logging.getLogger(__name__)

RELEASE_AT = 0.5  # share of the process's map limit at which a new compile first releases old programs
KEEP_NEWEST = 2  # programs a release never drops: the batch being set up (its prefill, then its step) holds them
MAX_MAP_COUNT = Path("/proc/sys/vm/max_map_count")
SELF_MAPS = Path("/proc/self/maps")


class _Bound:
    """The process-wide state: every held program, least recently used first, as (owner serial, key) -> a weak
    reference to the owner (owners that are gone remove their entries); the map count that triggers the next
    release; how many releases ran."""

    def __init__(self) -> None:
        self.order: OrderedDict[tuple[int, Hashable], weakref.ref[ProgramCache]] = OrderedDict()
        self.serials = itertools.count()
        self.next_release_at: int | None = None  # None: RELEASE_AT of the limit
        self.releases = 0


_BOUND = _Bound()


def map_limit() -> int | None:
    """The kernel's per-process memory-map limit, or None where there is none to read (not Linux)."""
    try:
        return int(MAX_MAP_COUNT.read_text())
    except (OSError, ValueError):
        return None


def maps_in_use() -> int | None:
    """This process's memory maps now (lines of /proc/self/maps), or None where they cannot be read."""
    try:
        with SELF_MAPS.open("rb") as f:
            return sum(1 for _ in f)
    except OSError:
        return None


def held() -> int:
    """Programs held by live owners, process-wide."""
    return len(_BOUND.order)


def release_count() -> int:
    """How many times this process released programs."""
    return _BOUND.releases


class ProgramCache:
    """One owner's compiled programs by key. `get` compiles on a miss; the process-wide bound may drop any entry
    but the newest two before a later compile, after which the same key compiles again."""

    def __init__(self) -> None:
        self._programs: dict[Hashable, jax.stages.Compiled] = {}
        self._serial = next(_BOUND.serials)  # unlike id(), never reused by a later owner
        self._ref = weakref.ref(self, _forget_owner(self._serial))  # what the process-wide order holds

    def get(self, key: Hashable, compile_program: Callable[[], jax.stages.Compiled]) -> jax.stages.Compiled:
        """The program for `key`, compiled by `compile_program()` if not held (after making room for it)."""
        if key in self._programs:
            _BOUND.order.move_to_end((self._serial, key))
            return self._programs[key]
        make_room()
        program = compile_program()
        self._programs[key] = program
        _BOUND.order[(self._serial, key)] = self._ref
        return program

    def items(self) -> Iterator[tuple[Hashable, jax.stages.Compiled]]:
        return iter(list(self._programs.items()))

    def drop(self, key: Hashable) -> None:
        """Forget one program (the process-wide release calls this on each owner it takes programs from)."""
        self._programs.pop(key, None)
        _BOUND.order.pop((self._serial, key), None)


def _forget_owner(serial: int) -> Callable[[weakref.ref], None]:
    """A weakref callback that removes a collected owner's entries from the process-wide order."""

    def forget(_ref: weakref.ref) -> None:
        for entry in [e for e in list(_BOUND.order) if e[0] == serial]:
            _BOUND.order.pop(entry, None)

    return forget


def release(entries: list[tuple[int, Hashable]] | None = None) -> None:
    """Drop these held programs (default: all of them) from their owners, then JAX's caches, which also hold every
    executable; the maps go once nothing references a program. Also what `jaxspec.bench --suite` calls after each
    run, so that no run's programs outlive it."""
    for entry in list(_BOUND.order) if entries is None else entries:
        ref = _BOUND.order.pop(entry, None)
        owner = ref() if ref is not None else None
        if owner is not None:
            owner.drop(entry[1])
    jax.clear_caches()
    gc.collect()
    _BOUND.releases += 1


def make_room(limit: int | None = None) -> bool:
    """Release the least recently used half of the held programs (never the newest KEEP_NEWEST) and JAX's caches
    if this process has reached its release threshold; True if it released. limit: the map limit (default: the
    kernel's)."""
    limit = map_limit() if limit is None else limit
    before = maps_in_use()
    if limit is None or before is None or len(_BOUND.order) <= KEEP_NEWEST:
        return False
    threshold = _BOUND.next_release_at or int(RELEASE_AT * limit)
    if before < threshold:
        return False
    oldest = list(_BOUND.order)[: -KEEP_NEWEST]
    release(oldest[: -(-len(_BOUND.order) // 2)])  # half of all held, rounded up, from the oldest
    after = maps_in_use() or 0
    # still above the threshold: maps held elsewhere; release next at half of the remaining headroom
    _BOUND.next_release_at = after + (limit - after) // 2 if after >= RELEASE_AT * limit else None
    log.info(
        "memory maps at %d of the process limit %d: released the least recently used compiled programs (%d maps "
        "now, %d programs held); they compile again when next used", before, limit, after, len(_BOUND.order),
    )
    return True
