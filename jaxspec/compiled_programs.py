"""Compiled programs kept per owner (a `Generator`'s, by shape key) under one process-wide bound on memory maps.

Why: XLA:CPU maps code memory for every compiled program and keeps the maps until the program is freed: measured
~1,300 per SmolLM2 program with invariant numerics, ~100 for a tiny target's prefill. Linux caps a process's
maps (`vm.max_map_count`, 65,530 by default), and past the cap LLVM aborts the process in the middle of a compile
("Unable to allocate section memory") — after ~75 minutes in a benchmark suite, and as early as ~50 programs into a
long `generate` run whose prompts span many shape buckets (each prompt bucket × cache capacity × chain length is a
program). So before compiling a new program, if the process is past half its map limit, the least recently used
half of the programs held here are dropped and JAX's own caches cleared (`jax.clear_caches`: JAX's lowering cache
also holds each executable, so dropping ours alone frees nothing; measured). A dropped program compiles again on
its next use, from the on-disk compile cache when that is on. Elsewhere than Linux the bound is off.
"""

from __future__ import annotations

import gc
import logging
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from pathlib import Path

import jax

log = logging.getLogger(__name__)

RELEASE_AT = 0.5  # share of the process's map limit in use at which a new compile first releases old programs
MAX_MAP_COUNT = Path("/proc/sys/vm/max_map_count")
SELF_MAPS = Path("/proc/self/maps")

# Every held program, least recently used first: (owner id, key) -> the owner. Owners that are gone are skipped.
_ORDER: OrderedDict[tuple[int, Hashable], weakref.ref[ProgramCache]] = OrderedDict()
releases = 0  # how many times this process released programs (tests and logs)


def map_limit() -> int | None:
    """The kernel's per-process memory-map limit, or None where there is none to read (not Linux)."""
    try:
        return int(MAX_MAP_COUNT.read_text())
    except (OSError, ValueError):
        return None


def maps_in_use() -> int:
    """This process's memory maps now (lines of /proc/self/maps)."""
    with SELF_MAPS.open("rb") as f:
        return sum(1 for _ in f)


class ProgramCache:
    """One owner's compiled programs by key. `get` compiles on a miss; the process-wide bound may drop any entry
    before a later compile, after which the same key compiles again."""

    def __init__(self) -> None:
        self._programs: dict[Hashable, Callable] = {}
        self._ref = weakref.ref(self, _forget_owner(id(self)))  # what the process-wide order holds

    def get(self, key: Hashable, compile_program: Callable[[], Callable]) -> Callable:
        if key in self._programs:
            _ORDER.move_to_end((id(self), key))
            return self._programs[key]
        make_room()
        program = compile_program()
        self._programs[key] = program
        _ORDER[(id(self), key)] = self._ref
        return program

    def items(self) -> Iterator[tuple[Hashable, Callable]]:
        return iter(list(self._programs.items()))

    def __len__(self) -> int:
        return len(self._programs)

    def drop(self, key: Hashable) -> None:
        self._programs.pop(key, None)
        _ORDER.pop((id(self), key), None)


def _forget_owner(owner_id: int) -> Callable[[weakref.ref], None]:
    """A weakref callback removing a collected owner's entries, so that a later owner reusing its id() starts
    clean."""

    def forget(_ref: weakref.ref) -> None:
        for entry in [e for e in _ORDER if e[0] == owner_id]:
            del _ORDER[entry]

    return forget


def held() -> int:
    """Programs held by live owners, process-wide."""
    return len(_ORDER)


def make_room(limit: int | None = None) -> bool:
    """Release the least recently used half of the held programs (and JAX's caches) if this process uses more
    than RELEASE_AT of its map limit; True if it released. limit: the map limit (default: the kernel's)."""
    global releases
    limit = map_limit() if limit is None else limit
    if limit is None or not _ORDER:
        return False
    before = maps_in_use()
    if before < RELEASE_AT * limit:
        return False
    for (owner_id, key), ref in list(_ORDER.items())[: -(-len(_ORDER) // 2)]:
        owner = ref()
        if owner is None:
            _ORDER.pop((owner_id, key), None)
        else:
            owner.drop(key)
    jax.clear_caches()
    gc.collect()
    releases += 1
    log.info(
        "memory maps at %d of the process limit %d: released the least recently used compiled programs (%d maps "
        "now, %d programs held); they compile again when next used", before, limit, maps_in_use(), len(_ORDER),
    )
    return True
