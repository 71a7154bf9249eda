"""`python -m jaxspec.bench --compiled-cost`: what the target's forward costs on an H100 or a TPU v5e, read from the
program XLA compiles for that chip on this machine, without the chip.

Why: a step's speed on an accelerator is bounded by the bytes it moves (a decode reads every weight once) and, at
small batch, by how many kernels it launches. Both are fixed by the compiled program, which XLA builds without a
device: the CUDA plugin compiles for a GPU described by a target config (`h100_target_config.txtpb`, beside this
file), libtpu for a TPU topology. So a change that adds kernels or bytes shows on any machine, in CI, before a chip
is lent (docs/GPU_AOT.md in the shared notes says how and what was checked).

What is compiled: the target's forward (`LlamaModel.__call__`) under `jax.jit` with the KV cache donated, as
`engine.auto.step_costs.time_forwards` times it, from abstract weights (no real ones), at a real shape, with the
numerics a user gets on that chip (invariant numerics, kernels as `auto` resolves them there), for a decode step
(T = 1), a chain verify (T = K + 1) and a tree verify (T nodes with an ancestor mask and ancestors, as
`engine.core._verify` passes them). Greedy acceptance, sampling and the head are not part of it. The cache holds
`generation.capacity_bucket(length + T)` slots, as generation would allocate for `length` committed tokens.

Layers: a model of L and one of L + 1 layers are compiled (L = 2 on an H100, 4 on a v5e: `Platform.layers`); each
count is fixed + L × per layer, so per layer = count(L + 1) − count(L), exactly, and the real model's count =
count(L) + (L_real − L) × per layer.
Temporaries are reported as measured at L + 1 layers (buffers are reused between layers, so they do not scale).

Each platform runs in its own process (`python -m jaxspec.bench.compiled_cost`, JSON in and out): the CUDA plugin
must be imported with JAX_PLATFORMS=cpu (without a GPU its initialisation fails otherwise) and libtpu changes how
jax starts. The wheels are pinned to the installed jax and installed once into the user's cache directory
(`checkpoints.builtin.cache_root`), never into the environment.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from importlib.metadata import requires, version
from pathlib import Path

from jaxspec.errors import JaxspecError

H100_TARGET_CONFIG = Path(__file__).with_name("h100_target_config.txtpb")
STEPS = {"decode": 1, "chain": 6, "tree": 16}  # tokens per row: one decode, a verify of K = 5 drafts, 16 tree nodes
TREE_DEPTH = 5  # the tree's draft levels below the root (a 16,5,4 tree: `engine.tree.TreeConfig`)
GOALS = {"decode": 1.10, "chain": 1.15}  # the goals: bytes accessed / (weights + KV) a step must read


@dataclasses.dataclass(frozen=True)
class Platform:
    """A chip XLA compiles for here without it: the jax backend the model is traced for (which decides the
    numerics and kernels, `pallas_kernels.dispatch`) and the wheel that brings its compiler."""

    name: str
    backend: str  # what jax.default_backend() says on the chip
    description: str
    # layers of the smaller compile: the fewest from which one more layer adds what every further one adds. On a
    # v5e, memory-space assignment places a 2- or 3-layer program's KV caches unlike a longer one's (an in-place
    # 6-slot cache write at 8,192 committed: +560 MB from 2 to 3 layers, +505 from 4 to 5, 8 to 9 and 9 to 12)
    layers: int = 2


PLATFORMS = {
    "h100": Platform("h100", "gpu", "NVIDIA H100 SXM (CUDA plugin, deviceless; heuristic GEMM tiles, no autotuning)"),
    "v5e": Platform("v5e", "tpu", "TPU v5e, one chip of a v5e:2x2 topology (libtpu AOT)", layers=4),
}


@dataclasses.dataclass(frozen=True)
class CostCase:
    """One compiled forward: the model shape, the step, the batch and committed cache length, and the numerics."""

    platform: str  # a key of PLATFORMS
    shape: str = "llama3.1-8b"  # a key of reference_shapes.SHAPES
    step: str = "decode"  # a key of STEPS
    batch: int = 1
    length: int = 1024  # committed tokens in the cache
    numerics: str = "invariant"  # or "plain"
    kernels: str = "auto"  # auto / reference / pallas, resolved for the platform's backend
    layers: int | None = None  # compiled layers (and one more), extrapolated to the shape's; None: the platform's
    quantize: str | None = None  # "int8": the decoder's matmul weights quantized (models/quantize.py)

    @property
    def tokens(self) -> int:
        return STEPS[self.step]

    @property
    def capacity(self) -> int:
        from jaxspec.engine.generation import capacity_bucket

        return capacity_bucket(self.length + self.tokens, 1 << 30)

    @property
    def first_layers(self) -> int:
        return self.layers if self.layers is not None else PLATFORMS[self.platform].layers

    def label(self) -> str:
        return f"{self.step} T={self.tokens}, batch {self.batch}, {self.length} committed"


# ---------------------------------------------------------------------------------------------------------------
# The wheels, installed once into the user's cache directory


def installed_wheels(name: str, requirements: list[str]) -> Path:
    """A directory holding `requirements` (pip specifiers, installed with --no-deps into cache_root()/name/<pins>),
    to put on a subprocess's PYTHONPATH: installed on first use, with a note on stderr (hundreds of MB)."""
    from jaxspec.checkpoints.builtin import cache_root

    import filelock

    target = cache_root() / name / re.sub(r"[^0-9A-Za-z.]+", "-", "+".join(requirements))
    packages = [re.split(r"[=<>~!]", r)[0].replace("-", "_") for r in requirements]
    installed = lambda: all(any(target.glob(f"{p}-*.dist-info")) for p in packages)  # noqa: E731
    if installed():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # one installer at a time: pip --target skips what another pip has moved in already, and could return while
    # the first is still copying
    with filelock.FileLock(target.parent / f".{target.name}.lock"):
        if not installed():
            print(f"compiled-cost: installing {' '.join(requirements)} into {target} (once)", file=sys.stderr,
                  flush=True)
            proc = subprocess.run(
                [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(target),
                 *requirements],
                capture_output=True, text=True, timeout=1800, check=False,
            )
            if proc.returncode != 0:
                raise JaxspecError(f"could not install {' '.join(requirements)}: {proc.stderr.strip()[-500:]}")
    return target


def libtpu_requirement() -> str:
    """What `jax[tpu]` pins for the installed jax, e.g. "libtpu==0.0.42.*"."""
    (pin,) = [r.split(";")[0].strip() for r in requires("jax") or [] if r.startswith("libtpu")]
    return pin


def libtpu_dir() -> Path:
    return installed_wheels("libtpu", [libtpu_requirement()])


def cuda_plugin_dir() -> Path:
    """jax-cuda12-plugin and jax-cuda12-pjrt at exactly the installed jax's version (the plugin must match jaxlib)."""
    pin = version("jax")
    return installed_wheels("jax-cuda12-plugin", [f"jax-cuda12-plugin=={pin}", f"jax-cuda12-pjrt=={pin}"])


def ptxas_dir(search: list[Path]) -> Path:
    """The directory of the `ptxas` XLA calls for the last GPU compile step (PTX to cubin): on PATH, or the one the
    nvidia-cuda-nvcc-cu12 wheel ships (nvidia/cuda_nvcc/bin) in one of `search`."""
    found = shutil.which("ptxas")
    if found:
        return Path(found).parent
    for root in search:
        candidate = root / "nvidia" / "cuda_nvcc" / "bin" / "ptxas"
        if candidate.exists():
            return candidate.parent
    raise JaxspecError(
        "the H100 compile needs CUDA's ptxas (PTX to cubin), found neither on PATH nor from the nvidia-cuda-nvcc-cu12 "
        "wheel: install the CUDA toolkit or `pip install nvidia-cuda-nvcc-cu12`, or leave h100 out (--cost-platforms)"
    )


def platform_env(platform: str) -> dict[str, str]:
    """The environment of a subprocess that compiles for `platform`: its wheel and this project on PYTHONPATH, jax on
    the CPU (the compile targets the chip's topology, not a local device)."""
    if platform == "h100":
        wheels = cuda_plugin_dir()
        path = [str(ptxas_dir([wheels, *map(Path, sys.path)])), os.environ.get("PATH", "")]
        extra = {"PATH": os.pathsep.join(path)}
    else:
        wheels, extra = libtpu_dir(), {}
    project = str(Path(__file__).resolve().parents[2])
    pythonpath = [str(wheels), project, *filter(None, [os.environ.get("PYTHONPATH")])]
    return {**os.environ, **extra, "PYTHONPATH": os.pathsep.join(pythonpath), "JAX_PLATFORMS": "cpu",
            "TF_CPP_MIN_LOG_LEVEL": "2"}


def run_platforms(cases: list[CostCase], say=print) -> list[dict]:
    """Every case, each platform's in its own subprocess (this module's main), in order; the results as dicts."""
    results = []
    for platform in dict.fromkeys(c.platform for c in cases):
        mine = [c for c in cases if c.platform == platform]
        env = platform_env(platform)
        say(f"compiling {len(mine)} case(s) for {PLATFORMS[platform].description}, each at {mine[0].first_layers} and "
            f"{mine[0].first_layers + 1} layers, in a subprocess")
        mine = [dataclasses.asdict(c) for c in mine]
        proc = subprocess.run(
            [sys.executable, "-m", "jaxspec.bench.compiled_cost"], input=json.dumps(mine), stdout=subprocess.PIPE,
            stderr=None, text=True, env=env, check=False,
        )
        if proc.returncode != 0:
            raise JaxspecError(f"the {platform} compile failed (exit {proc.returncode}); its log is above")
        results += json.loads(proc.stdout)
    return results


# ---------------------------------------------------------------------------------------------------------------
# Compiling a case (in the platform's subprocess)


@contextlib.contextmanager
def traced_for(backend: str) -> Iterator[None]:
    """Trace as on `backend`: the project picks weight dtypes (`held_dtype`), numerics and kernel variants from
    `jax.default_backend()`, which is "cpu" in a process that compiles for a chip it does not have."""
    import jax

    saved = jax.default_backend
    jax.default_backend = lambda: backend
    try:
        yield
    finally:
        jax.default_backend = saved


def topology_device(platform: str):
    """One device of the chip's topology, described without the chip (jax.experimental.topologies)."""
    from jax.experimental import topologies

    if platform == "h100":
        topo = topologies.get_topology_desc(
            platform="cuda", topology="1x1x1", target_config=H100_TARGET_CONFIG.read_text()
        )
    else:
        topo = topologies.get_topology_desc(topology_name="v5e:2x2", platform="tpu")
    return topo.devices[0]


def compile_forward(case: CostCase, layers: int, device):
    """(the compiled forward of `case` with `layers` layers, the weight bytes a step must read): every weight once,
    the embedding table excepted when the LM head is its own matrix (a step gathers B·T rows of it)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from jaxspec.models.numerics import default_numerics
    from jaxspec.models.target import target_model
    from jaxspec.reference_shapes import reference_config

    backend = PLATFORMS[case.platform].backend
    sharding = jax.sharding.NamedSharding(jax.sharding.Mesh(np.array([device]), ("x",)), jax.sharding.PartitionSpec())

    def abstract(tree):
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree)

    with traced_for(backend):
        cfg = reference_config(case.shape, num_layers=layers, aux_layer_ids=None)
        numerics = None
        if case.numerics == "invariant":
            numerics = default_numerics(backend, case.kernels)
        model = target_model(cfg, dtype=jnp.bfloat16, rngs=None, numerics=numerics)  # rngs=None: shapes only
        if case.quantize:
            from jaxspec.models.quantize import quantize_target

            quantize_target(model, case.quantize)
        graphdef, params = nnx.split(model)
        b, t = case.batch, case.tokens
        cache = jax.eval_shape(lambda: model.init_cache(b, case.capacity))

        def forward(params, cache, tokens, positions, block_mask, ancestors):
            out = nnx.merge(graphdef, params)(tokens, positions, cache, block_mask=block_mask, ancestors=ancestors)
            return out.logits, out.cache

        ints = jax.ShapeDtypeStruct((b, t), jnp.int32)
        tree = case.step == "tree"
        mask = jax.ShapeDtypeStruct((b, t, t), jnp.bool_) if tree else None
        ancestors = jax.ShapeDtypeStruct((b, t, TREE_DEPTH + 1), jnp.int32) if tree else None
        args = abstract((params, cache, ints, ints, mask, ancestors))
        options = numerics.compiler_options(backend) if numerics is not None else {}  # what generation compiles with
        compiled = jax.jit(forward, donate_argnums=1).trace(*args).lower().compile(compiler_options=options or None)
    weight_bytes = sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    if not cfg.tie_word_embeddings:
        weight_bytes -= cfg.vocab_size * cfg.hidden_size * jnp.dtype(jnp.bfloat16).itemsize
    return compiled, weight_bytes


def module_cost(compiled) -> dict[str, float]:
    """{"flops", "bytes accessed"} of a compiled program by XLA's cost model. libtpu answers
    `compiled.cost_analysis()`; the GPU plugin without a GPU does not (`GetCostAnalysis is not supported`), so XLA's
    generic HloCostAnalysis runs on the optimized module through jaxlib's private binding. That binding is reached
    here and nowhere else: if it moves, this fails with a message saying so."""
    try:
        cost = compiled.cost_analysis()
    except Exception:  # noqa: BLE001 (the plugin raises XlaRuntimeError; any failure means: not supported)
        cost = None
    if cost:
        return {"flops": float(cost.get("flops", 0.0)), "bytes accessed": float(cost["bytes accessed"])}
    try:
        from jax._src import xla_bridge
        from jax._src.lib import _jax

        module = compiled._executable.xla_extension_executable().hlo_modules()[0]
        cost = _jax.hlo_module_cost_analysis(xla_bridge.get_backend("cpu"), module)
    except (ImportError, AttributeError, IndexError) as e:
        raise JaxspecError(
            "jaxlib's private cost-model binding (jax._src.lib._jax.hlo_module_cost_analysis on the optimized module) "
            f"is not where jaxspec.bench.compiled_cost.module_cost looks for it in this jax ({e}); update that helper"
        ) from None
    return {"flops": float(cost.get("flops", 0.0)), "bytes accessed": float(cost["bytes accessed"])}


# ---------------------------------------------------------------------------------------------------------------
# Reading the optimized HLO


@dataclasses.dataclass(frozen=True)
class Instruction:
    name: str
    opcode: str
    shape: str  # the result shape as printed, tuples included
    operands: tuple[str, ...]
    attrs: str  # everything after the operand list (calls=, kind=, backend_config=, ...)
    index: int | None = None  # a parameter's number


_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
                "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "s4": 0.5, "u4": 0.5,
                # the 8-bit floats (an fp8 target's weights: models/quantize.py) and the 4-bit one, by XLA's names
                "f8e4m3fn": 1, "f8e4m3": 1, "f8e5m2": 1, "f8e4m3fnuz": 1, "f8e5m2fnuz": 1, "f8e4m3b11fnuz": 1,
                "f8e3m4": 1, "f8e8m0fnu": 1, "f4e2m1fn": 0.5}
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\](\{[^}]*\})?")
# ops that launch nothing: values that are views, tuples or parameters; control flow is followed into its bodies
NO_KERNEL = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while", "conditional", "call",
             "after-all", "add-dependency", "opt-barrier", "partition-id", "replica-id", "domain"}


def launches(ins: Instruction) -> bool:
    """Whether `ins` is a kernel (GPU) or an op (TPU) by `count_kernels`' rule; an async pair (copy-start and
    copy-done, slice-start and slice-done on TPU) is one, its start."""
    return ins.opcode not in NO_KERNEL and not ins.opcode.endswith("-done")


def shape_bytes(shape: str, on_chip: bool = False) -> float:
    """Bytes of the arrays in a printed shape (`bf16[1,8,2048,128]{3,2,1,0}`, or a tuple of them) that live in
    device memory, or with on_chip, those whose layout puts them in another memory space (`S(1)`: a TPU's VMEM,
    where the compiler prefetches weight slices)."""
    total = 0.0
    for dtype, dims, layout in _ARRAY.findall(shape):
        if dtype in _DTYPE_BYTES and bool(re.search(r"S\([1-9]", layout)) == on_chip:
            total += _DTYPE_BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)
    return total


def _closing(text: str, start: int) -> int:
    """The index of the bracket closing the one at `start` (any of ( [ {)."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] in "([{":
            depth += 1
        elif text[i] in ")]}":
            depth -= 1
            if depth == 0:
                return i
    return len(text)


def parse_hlo(text: str) -> tuple[dict[str, list[Instruction]], str]:
    """({computation name: its instructions}, the ENTRY computation's name) of an HLO module's text."""
    computations: dict[str, list[Instruction]] = {}
    entry, current = "", None
    for line in text.splitlines():
        if line and not line[0].isspace() and line.rstrip().endswith("{"):
            head = line.split("(", 1)[0].split()
            current = head[-1].lstrip("%")
            computations[current] = []
            entry = current if head[0] == "ENTRY" else entry
            continue
        m = re.match(r"\s+(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*", line)
        if current is None or not m:
            continue
        rest = line[m.end():]
        cut = _closing(rest, 0) + 1 if rest.startswith("(") else rest.index(" ")
        shape, rest = rest[:cut], rest[cut:].lstrip()
        opcode = rest.split("(", 1)[0]
        close = _closing(rest, len(opcode))
        operands = tuple(re.findall(r"%([\w.\-]+)", rest[len(opcode):close]))
        number = re.match(r"\((\d+)\)", rest[len(opcode):]) if opcode == "parameter" else None
        computations[current].append(Instruction(m.group(1), opcode, shape, operands, rest[close + 1:],
                                                 int(number.group(1)) if number else None))
    return computations, entry


def _called(ins: Instruction, key: str) -> list[str]:
    m = re.search(key + r"=\{?([^}\s]*(?:,\s*%[\w.\-]+)*)\}?", ins.attrs)
    return re.findall(r"%?([\w.\-]+)", m.group(1)) if m else []


def _trip_count(ins: Instruction) -> int | None:
    m = re.search(r'"known_trip_count":\{"n":"(\d+)"', ins.attrs)
    return int(m.group(1)) if m else None


def launched(computations: dict[str, list[Instruction]], entry: str,
             unknown_trips: int = 1) -> tuple[list[tuple[Instruction, int]], bool]:
    """([(instruction, launches per run)] of every kernel the program launches, whether a loop's trip count was
    unknown and counted `unknown_trips` times: a mixture-of-experts layer's loop over the tiles in use, whose count
    depends on the routing; `expected_tiles` estimates it).

    The rule: an instruction of a computation that runs on the device launches one kernel (GPU) or is one op
    (TPU) unless it is a view, a tuple, a parameter or a constant (NO_KERNEL). So each fusion is one (loop, input,
    output and Triton GEMM fusions alike: XLA:GPU emits one kernel per fusion), each custom call (cuBLAS, cuDNN, a
    Pallas kernel) one, and each unfused op (a copy, a sort) one; an async pair one. Fusions' own computations are
    not entered: they are inside their kernel. Control flow is followed: a while loop runs its condition and body
    once per trip (the trip count XLA recorded; once if none), a conditional its largest branch, a call its
    computation."""
    unknown = False

    def walk(name: str, times: int) -> list[tuple[Instruction, int]]:
        nonlocal unknown
        out = []
        for ins in computations.get(name, []):
            if ins.opcode == "while":
                trips = _trip_count(ins)
                unknown |= trips is None
                for c in _called(ins, "body") + _called(ins, "condition"):
                    out += walk(c, times * (trips or unknown_trips))
            elif ins.opcode == "conditional":
                out += max((walk(c, times) for c in _called(ins, "branch_computations")), key=len, default=[])
            elif ins.opcode == "call":
                for c in _called(ins, "to_apply"):
                    out += walk(c, times)
            elif launches(ins):
                out.append((ins, times))
        return out

    return walk(entry, 1), unknown


def count_kernels(computations: dict[str, list[Instruction]], entry: str,
                  unknown_trips: int = 1) -> tuple[int, bool]:
    """(kernels one run of the program launches, whether a loop's trip count was unknown): `launched`'s rule."""
    kernels, unknown = launched(computations, entry, unknown_trips)
    return sum(times for _, times in kernels), unknown


SLICING = ("gather", "dynamic-slice", "slice")  # ops that read only the part of their first operand they return
IN_PLACE = ("dynamic-update-slice", "scatter")  # ops that write into their first operand's buffer (its only user)


def kernel_bytes(computations: dict[str, list[Instruction]], entry: str, unknown_trips: int = 1) -> list[dict]:
    """Every kernel the program launches (`launched`) with the bytes it moves in device memory per run of the
    program (a kernel in a loop: per launch × launches), largest first.

    How, from the shapes printed in the optimized module: an instruction's operands' sizes (each that of the
    instruction defining it) plus its result's size, except that
    - an operand a fusion only slices or gathers from (the embedding table, a cache window) is charged what those
      slices return, not the whole operand;
    - an in-place update (a dynamic-update-slice or scatter, or a fusion whose root is one, into a buffer of its
      result's shape: a KV cache write) is charged its other operands twice (read, then written), not the buffer,
      as XLA's own cost model charges it: where the buffer cannot be updated in place, XLA inserts a copy of it
      before, and the copy is charged;
    - on-chip arrays (TPU VMEM, `S(1)`) are not device memory: reading or writing them is free, and the async copy
      that brings a weight slice on chip (copy-start, slice-start) is charged the slice it brings.
    Why not XLA's cost model alone: it charges a gather fused into a kernel the whole table it gathers from, and
    XLA:GPU duplicates the embedding gather into every consumer of a verify's embeddings (a 6-token chain verify
    at 3 layers: 7 gathers, each charged the 1.05 GB table), so its total was not even monotone in the layers."""
    shapes = {ins.name: ins.shape for comp in computations.values() for ins in comp}
    rows = []
    for ins, times in launched(computations, entry, unknown_trips)[0]:
        if ins.opcode.endswith("-start") and shape_bytes(ins.shape, on_chip=True):
            moved = shape_bytes(ins.shape, on_chip=True)
        elif _called(ins, "calls"):
            moved = _fusion_bytes(computations, ins, shapes)
        elif ins.opcode in IN_PLACE:  # unfused (XLA:TPU leaves a cache write so): the update, read and written
            moved = 2 * sum(shape_bytes(shapes.get(op, "")) for op in ins.operands[1:])
        else:
            moved = shape_bytes(ins.shape) + _operand_bytes(ins, shapes, sliced=ins.opcode in SLICING)
        rows.append({"name": ins.name, "what": _what(computations, ins), "bytes": moved * times, "launches": times})
    return sorted(rows, key=lambda r: -r["bytes"])


def _operand_bytes(ins: Instruction, shapes: dict[str, str], sliced: bool = False) -> float:
    """The operands' sizes; with `sliced`, the first operand charged the result's size (what a slice reads)."""
    sizes = [shape_bytes(shapes.get(op, "")) for op in ins.operands]
    if sliced and sizes:
        sizes[0] = shape_bytes(ins.shape)
    return sum(sizes)


def _fusion_bytes(computations: dict[str, list[Instruction]], ins: Instruction, shapes: dict[str, str]) -> float:
    """A fusion's bytes by `kernel_bytes`' rules: each fused parameter charged what its users inside read of it."""
    body = computations.get(_called(ins, "calls")[0], [])
    params = [i for i in body if i.opcode == "parameter"]
    result = shape_bytes(ins.shape)
    in_place = body and body[-1].opcode in IN_PLACE
    total = 0.0 if in_place else result
    for param in params:
        outer = ins.operands[param.index] if param.index is not None and param.index < len(ins.operands) else ""
        size = shape_bytes(shapes.get(outer, ""))
        users = [(u, u.operands.index(param.name)) for u in body if param.name in u.operands]
        if in_place and size == result and any(u is body[-1] and pos == 0 for u, pos in users):
            continue  # the buffer updated in place
        if users and all(u.opcode in SLICING and pos == 0 for u, pos in users):
            size = min(size, sum(shape_bytes(u.shape) for u, _ in users))
        total += size * (2 if in_place else 1)
    return total


def _what(computations: dict[str, list[Instruction]], ins: Instruction) -> str:
    """A fusion by its main op: the custom call target, dot or convolution (with operand shapes), gather, scatter,
    dynamic-update-slice or reduce inside it, else its root op."""
    target = re.search(r'custom_call_target="([^"]+)"', ins.attrs)
    if target:
        return target.group(1)
    called = _called(ins, "calls")
    body = computations.get(called[0], []) if called else []
    shapes = {i.name: i.shape for i in body}
    for op in ("custom-call", "dot", "convolution", "gather", "scatter", "dynamic-update-slice", "reduce"):
        for i in body:
            if i.opcode == op:
                args = "x".join(a.group(1) + f"[{a.group(2)}]" for o in i.operands[:2]
                                if (a := _ARRAY.search(shapes.get(o, ""))))
                return f"{op} {args or i.shape.split('{')[0]}"
    return body[-1].opcode if body else ins.opcode


# ---------------------------------------------------------------------------------------------------------------
# Measuring


def read_program(compiled, unknown_trips: int = 1) -> dict:
    """Kernels, cost model, memory and the largest groups of kernels by bytes (kernels of one op on the same
    shapes, e.g. every layer's down_proj dot) of one compiled program; loops of unknown trip count counted
    `unknown_trips` times (`launched`)."""
    computations, entry = parse_hlo(compiled.as_text())
    kernels, unknown = count_kernels(computations, entry, unknown_trips)
    memory = compiled.memory_analysis()
    moved = kernel_bytes(computations, entry, unknown_trips)
    groups: dict[str, dict] = {}  # kernels doing the same op on the same shapes (every layer's q_proj dot ...)
    for r in moved:
        group = groups.setdefault(r["what"], {"what": r["what"], "kernels": 0, "bytes": 0.0})
        group["kernels"] += r["launches"]
        group["bytes"] += r["bytes"]
    return {
        "kernels": kernels, "loop_trips_unknown": unknown, **module_cost(compiled),
        "parsed bytes": sum(r["bytes"] for r in moved),
        "temp_bytes": int(memory.temp_size_in_bytes) if memory is not None else None,
        "top": sorted(groups.values(), key=lambda g: -g["bytes"])[:10],
    }


def kv_bytes(case: CostCase, cfg) -> int:
    """Keys and values a step must read at least: the committed tokens' and its own, every layer, every row; a
    sliding-window layer (Gemma 4) only those of its window before the step's first token."""
    seen = case.length + case.tokens
    g = cfg.gemma
    if g is None:
        return case.batch * seen * 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2  # K and V, bfloat16
    total = 0
    for i in g.cache_layers:
        if g.sliding(i):
            total += min(seen, g.sliding_window - 1 + case.tokens) * cfg.num_kv_heads * cfg.head_dim
        else:
            total += seen * g.full_kv_heads * g.full_head_dim
    return case.batch * total * 2 * 2


def expected_experts(tokens: int, moe) -> float:
    """Distinct experts `tokens` tokens route to, expected under uniform routing: each token picks top_k of the
    num_experts, so an expert is missed by all with probability (1 - k/E)^tokens."""
    return moe.num_experts * (1 - (1 - moe.top_k / moe.num_experts) ** tokens)


def expected_tiles(case: CostCase, cfg, row_tile: int) -> int:
    """The tiles a sparse layer's loop runs (models/moe.py) for the case's B·T tokens: one per expert in use while
    its tokens fit a tile, at least the slots over the tile rows."""
    tokens = case.batch * case.tokens
    return max(round(expected_experts(tokens, cfg.moe)), -(-tokens * cfg.moe.top_k // row_tile))


def inactive_expert_bytes(case: CostCase, cfg) -> float:
    """Bytes of the experts a step does not read (bfloat16): every sparse layer's experts no token routes to."""
    moe = cfg.moe
    unused = moe.num_experts - expected_experts(case.batch * case.tokens, moe)
    return len(moe.layers) * unused * 3 * cfg.hidden_size * moe.intermediate_size * 2


def measure(case: CostCase, device, say=print) -> dict:
    """The case compiled at `case.first_layers` and one more layer, extrapolated to the shape's layers (module
    docstring). A mixture-of-experts shape: the loop over each sparse layer's tiles counted `expected_tiles` times,
    and the weights a step must read are those of the experts `expected_experts` says its tokens use."""
    from pallas_kernels.dispatch import resolve_kernels

    from jaxspec.models.numerics import default_numerics
    from jaxspec.reference_shapes import layer_period, reference_config

    real = reference_config(case.shape)
    begin = time.perf_counter()
    # whole periods of layers where layer types alternate (Gemma 4: one period of six, then two), else layers
    period = layer_period(real)
    first = case.first_layers if period == 1 else period
    (small, w_small), (big, w_big) = (compile_forward(case, n, device) for n in (first, first + period))
    trips = 1
    if real.moe is not None and case.numerics == "invariant":
        trips = expected_tiles(case, real, default_numerics(PLATFORMS[case.platform].backend).row_tile)
    a, b = read_program(small, trips), read_program(big, trips)
    extra = (real.num_layers - first) / period  # periods beyond the first compile's

    def extrapolate(key: str) -> float:
        return a[key] + extra * (b[key] - a[key])

    def per_layer(difference):  # a period's difference shared by its layers (exact where the period is one)
        return difference if period == 1 else round(difference / period, 2)

    weights = w_small + extra * (w_big - w_small)
    if real.moe is not None:
        weights -= inactive_expert_bytes(case, real)
    kv = kv_bytes(case, real)
    accessed = extrapolate("parsed bytes")
    kernels = None if case.numerics == "plain" else resolve_kernels(case.kernels, PLATFORMS[case.platform].backend)
    row = {
        **dataclasses.asdict(case), "tokens": case.tokens, "capacity": case.capacity, "real_layers": real.num_layers,
        "kernels_resolved": kernels,
        "kernels_per_step": int(extrapolate("kernels")),
        "kernels_per_layer": per_layer(b["kernels"] - a["kernels"]),
        "compiled_layers": (first, first + period), "layer_period": period,
        "loop_trips_unknown": a["loop_trips_unknown"] or b["loop_trips_unknown"],
        "moe_tiles": trips if real.moe is not None else None,
        "bytes_accessed": accessed, "bytes_per_layer": per_layer(b["parsed bytes"] - a["parsed bytes"]),
        "cost_model_bytes": extrapolate("bytes accessed"),
        "weight_bytes": weights, "kv_bytes": kv, "bytes_over_floor": accessed / (weights + kv),
        "flops": extrapolate("flops"), "temp_bytes": b["temp_bytes"], "top": b["top"],
        "compile_seconds": round(time.perf_counter() - begin, 1),
    }
    say(f"{case.platform} {case.numerics} {case.label()}: {row['kernels_per_step']} kernels "
        f"({row['kernels_per_layer']}/layer), {accessed / 1e9:.2f} GB ({row['bytes_over_floor']:.3f}x weights+KV), "
        f"{row['compile_seconds']} s")
    return row


def run_cases(cases: list[CostCase], say=print) -> list[dict]:
    """Every case of one platform, in this process (which must have been started by `platform_env`)."""
    import jax

    if jax.default_backend() != "cpu":
        raise JaxspecError("compiled-cost cases run in a process with JAX_PLATFORMS=cpu (run_platforms starts one)")
    devices = {}
    rows = []
    for case in cases:
        if case.platform not in devices:
            devices[case.platform] = topology_device(case.platform)
        rows.append(measure(case, devices[case.platform], say))
    return rows


# ---------------------------------------------------------------------------------------------------------------
# The report


def machine_versions() -> dict[str, str]:
    """The versions the compile ran with (jax here; the wheels' from their directories' metadata)."""
    out = {"jax": version("jax")}
    for name, directory in (("jax-cuda12-plugin", "jax-cuda12-plugin"), ("libtpu", "libtpu")):
        from jaxspec.checkpoints.builtin import cache_root

        metas = sorted((cache_root() / directory).glob(f"*/{name.replace('-', '_')}-*.dist-info"))
        if metas:
            out[name] = metas[-1].name.split("-")[1].removesuffix(".dist")
    return out


def _gb(x: float) -> str:
    return f"{x / 1e9:.2f}"


def markdown(rows: list[dict], top: int = 3) -> str:
    """One table of every case, then each case's largest kernels by bytes."""
    layers = sorted({(tuple(r["compiled_layers"]), r["real_layers"], r["layer_period"]) for r in rows})
    lines = [
        "| platform | numerics | step | batch | committed | kernels/step | kernels/layer | GB/step | weights+KV GB | "
        "ratio | goal | GB/step (XLA cost model) | TFLOP | temp MB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        goal = GOALS.get(r["step"])
        verdict = "" if goal is None else (f"≤ {goal}: " + ("met" if r["bytes_over_floor"] <= goal else "**over**"))
        numerics = r["numerics"] + (f" ({r['kernels_resolved']})" if r["kernels_resolved"] else "") + (
            f", {r['quantize']} weights" if r.get("quantize") else "")
        lines.append(
            f"| {r['platform']} | {numerics} | {r['step']} T={r['tokens']} | {r['batch']} | {r['length']} | "
            f"{r['kernels_per_step']}{'*' if r['loop_trips_unknown'] else ''} | {r['kernels_per_layer']} | "
            f"{_gb(r['bytes_accessed'])} | {_gb(r['weight_bytes'] + r['kv_bytes'])} | {r['bytes_over_floor']:.3f} | "
            f"{verdict} | {_gb(r['cost_model_bytes'])} | {r['flops'] / 1e12:.3f} | {r['temp_bytes'] / 1e6:.0f} |"
        )
    lines += [
        "",
        "Compiled at " + ", ".join(f"{n} and {m} layers" for (n, m), _, _ in layers) + "; per layer = the difference "
        "(over a period of layer types where they alternate: Gemma 4's six), per step = the first compile + the "
        "further periods × the difference (" + ", ".join(f"{real} layers" for _, real, _ in layers) + "). "
        "GB/step: the device "
        "memory each kernel reads and writes, from the optimized program's shapes (compiled_cost.kernel_bytes: "
        "slices and gathers charged what they read, in-place cache writes their update, on-chip TPU memory free); "
        "XLA's cost model beside it charges a fused gather its whole table. weights+KV: every weight but the "
        "embedding table once, plus the committed and new tokens' keys and values; ratio = GB/step over it. "
        "Temporaries at the larger compile. * a loop of unknown trip count counted once"
        + ("; a sparse layer's loop over its tiles counted as many times as the tiles the step's tokens are expected "
           "to fill under uniform routing, and weights+KV counts only the experts they are expected to use "
           "(compiled_cost.expected_tiles, expected_experts)" if any(r.get("moe_tiles") for r in rows) else "") + ".",
        "",
        f"Largest groups of kernels by bytes (the same op on the same shapes; at the larger compile), top {top}:",
    ]
    for r in rows:
        tops = "; ".join(f"{t['what']} ×{t.get('kernels', 1)} {t['bytes'] / 1e6:.0f} MB" for t in r["top"][:top])
        lines.append(f"- {r['platform']} {r['numerics']} {r['step']} b{r['batch']} {r['length']}: {tops}")
    return "\n".join(lines)


def main() -> int:
    """The platform subprocess: cases as JSON on stdin, results as JSON on stdout, progress on stderr."""
    cases = [CostCase(**c) for c in json.loads(sys.stdin.read())]
    rows = run_cases(cases, say=lambda text: print(f"compiled-cost: {text}", file=sys.stderr, flush=True))
    json.dump(rows, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
