"""Which implementation of the Pallas-backed ops the engine runs: the target's attention
(`invariant_attention.py`) and draft verification (`rejection.py`).

Three implementations compute the same bits (the kernels are tested bit for bit against their references):
- "reference": the jax.numpy references, compiled by XLA, on every backend;
- "pallas": the kernels compiled for the device (Triton on GPUs, Mosaic on TPUs: `variants.py`, and each kernel's
  docstring);
- "interpret": the kernels in Pallas interpret mode, which XLA runs on any backend: how CPU runs them (slow; tests).

The user picks with `--kernels auto|pallas|reference` (or JAXSPEC_KERNELS for a whole process, e.g. to run the test
suite with the kernels on). `auto` compiles the kernels only on backends in VALIDATED_BACKENDS: a backend joins when
the kernels' compiled tests and the engine's tests have passed on the real chip, recorded in BENCHMARKS.md. GPUs
have (an H200, 2026-11-28: the whole compiled suite with the kernels compiled by Triton), so `auto` compiles the
kernels on GPU; TPUs have not yet (the kernels lower for `tpu` in CI and pass in TPU interpret mode, but have not run
on the chip), so `auto` runs the references there and on CPU.
The choice is resolved once, on the host, and travels as a static string: nothing reads it back from a global while
tracing, so two generators in one process can use different implementations.
"""

from __future__ import annotations

import os

import jax

from pallas_kernels.mesh_axes import DATA, MODEL

CHOICES = ("auto", "pallas", "reference", "interpret")  # what a user asks for
IMPLEMENTATIONS = ("reference", "pallas", "interpret")  # what runs
ENV_VAR = "JAXSPEC_KERNELS"

# Backends where `auto` compiles the kernels. Add one only after `pytest tests/test_invariant_attention.py
# tests/test_rejection.py` compiled on it and `JAXSPEC_KERNELS=pallas pytest tests/test_spec_greedy.py ...` pass there
# (scripts/gpu_sitting.sh runs that suite). gpu: one H200, 2026-11-28, JAX 0.11.2 — the sitting's compiled suite whole
# (68 of 68: test_invariant_attention, test_rejection, test_dispatch, test_spec_greedy, test_spec_tree,
# test_spec_sampling, test_invariance; not slow, no mesh, one GPU) and 74 of its 149 slow cases, none failed.
VALIDATED_BACKENDS: frozenset[str] = frozenset({"gpu"})


def resolve_kernels(choice: str | None = None, backend: str | None = None) -> str:
    """The implementation to run for a user's choice on a backend. None or "auto": $JAXSPEC_KERNELS when set,
    else "pallas" on validated backends and "reference" elsewhere. "pallas" on CPU, which cannot compile Pallas
    kernels, runs them in interpret mode. An implementation resolves to itself, so resolving twice is harmless."""
    if choice in (None, "auto"):
        choice = os.environ.get(ENV_VAR, "auto") or "auto"
        if choice not in CHOICES:
            raise ValueError(f"{ENV_VAR}={choice!r}: expected one of {', '.join(CHOICES)}")
    if choice not in CHOICES:
        raise ValueError(f"kernels must be one of {', '.join(CHOICES)}, got {choice!r}")
    backend = backend or jax.default_backend()
    if choice == "auto":
        choice = "pallas" if backend in VALIDATED_BACKENDS else "reference"
    if choice == "pallas" and backend == "cpu":
        return "interpret"
    return choice


def describe(impl: str, backend: str | None = None) -> str:
    """One line for the log: which implementation runs, and why."""
    backend = backend or jax.default_backend()
    if impl == "reference":
        if backend == "cpu":
            why = "; CPU cannot compile the Pallas kernels (--kernels pallas runs them in interpret mode)"
        elif backend not in VALIDATED_BACKENDS:
            why = f"; the Pallas kernels are not validated on {backend} yet (--kernels pallas to try them)"
        else:
            why = ""
        return f"kernels: jax.numpy references (attention, draft verification){why}"
    if impl == "interpret":
        return f"kernels: Pallas kernels in interpret mode ({backend} cannot compile them; slow, for testing)"
    note = "" if backend in VALIDATED_BACKENDS else " (not validated on this backend yet)"
    return f"kernels: Pallas kernels compiled for {backend}{note}"


def on_mesh() -> bool:
    """Whether a (data, model) mesh is set for the function being traced: the kernels then run per shard."""
    mesh = jax.sharding.get_abstract_mesh()
    return not mesh.empty and {DATA, MODEL} <= set(mesh.axis_names)
