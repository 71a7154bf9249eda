"""`python -m jaxspec.bench --kernels-micro`: the Pallas kernels against their jax.numpy references and against the
bytes floor, at given shapes, in one command.

Two ops, called with the inputs the engine gives them:
- the target's attention, `pallas_kernels.invariant_attention.invariant_attention` (what `invariant_attend` runs
  for "pallas") vs `invariant_attention_reference` (jitted), key blocks of `Numerics.key_block`, num_blocks None
  (decode and verify; prefill passes a bound). Kinds: decode (T = 1), chain (T tokens at positions L .. L+T-1, no
  ancestors: a chain verify) and tree (a random tree of T nodes of depth ≤ min(T - 1, TREE_DEPTH), positions L +
  depth, ancestors by depth as `tree_from_parents` makes them). The cache holds L committed entries and this call's
  T; its capacity is L + T rounded up to a key block (the reference computes every block of the capacity, the
  kernel stops at each query's last one, so a larger capacity slows the reference only).
- draft verification, `pallas_kernels.rejection.verify` vs `verify_reference`: greedy (logits, uniforms 0, noise
  ones [B, 1]), chain (Leviathan rejection: p and the draft's q, u[0] = 0, q's last row 0) and tree (p, uniforms,
  Exp(1) noise), on a chain of N nodes (K = N - 1 drafts) or a random tree of N nodes, as `engine/accept.py` and
  `engine/core.py` call them.

The floor of a call is the fewest bytes it must move over the probe's bandwidth (`jaxspec.bench.bandwidth.bandwidth_probe`,
read + written bytes of a device copy):
- attention: K and V of slots 0 .. L+T-1 (the committed entries and this call's), q and the output;
- verification: greedy, every node's logits (the argmax of each row is needed); tree, the final node's p row and
  the noise; chain, its p and q rows and the noise (all float32).

Timing: every case's kernel and reference are compiled first, on several threads (`compile_all`: the reference's
compile grows with the cache capacity, minutes at 16k on a CPU); then per op a warm-up call and `repeats` times a
stream of back-to-back calls with one sync at its end (host clock), the median over repeats; inputs rotate over enough sets that they exceed the last-level cache
(accelerators), so that repeated calls do not read them from it. A call's time includes its dispatch: small calls
are bounded below by it (a few µs on a GPU). On CPU the kernels run in Pallas interpret mode, where XLA runs the
kernel body as ordinary ops: those timings say nothing about the kernels, only that they run and agree.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import statistics
import time

from jaxspec.errors import JaxspecError

TREE_DEPTH = 5  # the bench's default tree (16,5,4): a case's tree has min(T - 1, TREE_DEPTH) levels
ROTATE_BYTES = 512 << 20  # accelerators: input sets per case until they add up to this (past any L2 / SLC)
MAX_SETS = 32
MAX_CALLS = 200  # calls per timed stream


@dataclasses.dataclass(frozen=True)
class Shapes:
    """One micro-benchmark's shapes: the attention geometry and dtype, and the lists every case is drawn from."""

    name: str
    q_heads: int
    kv_heads: int
    head_dim: int
    dtype: str
    batch: tuple[int, ...]
    tokens: tuple[int, ...]  # attention: query tokens per call; verification: nodes per call (N > 1)
    lengths: tuple[int, ...]  # committed cache entries
    vocab: int


PRESETS = {
    # Llama-3.1-8B attention (32 query / 8 KV heads, head_dim 128, bfloat16) and its 128256-token vocabulary
    "llama-8b": Shapes("llama-8b", 32, 8, 128, "bfloat16", (1, 8), (1, 6, 16, 64), (1024, 4096, 16384), 128256),
    # seconds on a CPU (interpret mode): a ragged vocabulary past one 1024-entry block, a length past a key block
    "tiny": Shapes("tiny", 4, 2, 32, "float32", (1,), (1, 6), (100,), 3000),
}


def default_preset(backend: str) -> str:
    return "tiny" if backend == "cpu" else "llama-8b"


def shapes_from_args(args, backend: str) -> Shapes:
    """The preset (`--kernel-shapes`, by default llama-8b on accelerators and tiny on CPU) with the overrides."""
    shapes = PRESETS[args.kernel_shapes or default_preset(backend)]
    changes = {
        field: tuple(value) if isinstance(value, list) else value
        for field, value in (
            ("batch", args.kernel_batch), ("tokens", args.kernel_tokens), ("lengths", args.kernel_lengths),
            ("vocab", args.kernel_vocab), ("dtype", args.dtype),
        )
        if value is not None
    }
    shapes = dataclasses.replace(shapes, **changes)
    if shapes.vocab < 2:
        raise JaxspecError(f"--kernel-vocab must be at least 2, got {shapes.vocab}")
    return shapes


# --- the floors ------------------------------------------------------------------------------------------------------


def attention_floor_bytes(b: int, t: int, length: int, q_heads: int, kv_heads: int, head_dim: int,
                          itemsize: int) -> int:
    """Bytes one attention call must move: K and V of slots 0 .. length+t-1 (each read once), q read, out written."""
    kv = 2 * b * kv_heads * (length + t) * head_dim * itemsize
    return kv + 2 * b * t * q_heads * head_dim * itemsize


def verify_floor_bytes(mode: str, b: int, n: int, vocab: int) -> int:
    """Bytes one verification must read (float32 rows): greedy needs every node's logits (each row's argmax); tree
    the final node's p row and the noise; chain its p and q rows and the noise. The [B, N] scalars are left out."""
    rows = {"greedy": n, "tree": 2, "chain": 3}[mode]
    return b * rows * vocab * 4


def floor_us(nbytes: int, gb_per_s: float) -> float:
    return nbytes / (gb_per_s * 1e9) * 1e6


# --- cases and inputs --------------------------------------------------------------------------------------------------


def attention_cases(shapes: Shapes) -> list[dict]:
    """decode for T = 1, chain and tree for T > 1, at every batch and committed length."""
    cases = []
    for b in shapes.batch:
        for length in shapes.lengths:
            for t in shapes.tokens:
                for kind in ("decode",) if t == 1 else ("chain", "tree"):
                    cases.append({"B": b, "L": length, "T": t, "kind": kind})
    return cases


def verify_cases(shapes: Shapes) -> list[dict]:
    """Per batch and node count N > 1: greedy and chain sampling on a chain of N nodes (K = N - 1 ≤ the draft depth
    limit), greedy and tree sampling on a random tree of N nodes."""
    from jaxspec.config import MAX_DRAFT_DEPTH

    cases = []
    for b in shapes.batch:
        for n in shapes.tokens:
            if n < 2:
                continue
            if n - 1 <= MAX_DRAFT_DEPTH:
                cases += [{"B": b, "N": n, "mode": m, "draft": f"chain K={n - 1}"} for m in ("greedy", "chain")]
            depth = min(n - 1, TREE_DEPTH)
            cases += [{"B": b, "N": n, "mode": m, "draft": f"tree of {n}, depth ≤ {depth}"} for m in ("greedy", "tree")]
    return cases


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _tree(rng, b: int, n: int, depth: int):
    import jax.numpy as jnp
    import numpy as np

    from jaxspec.engine.tree import random_parents, tree_from_parents

    parents = jnp.asarray(np.stack([random_parents(rng, n, depth) for _ in range(b)]))
    return tree_from_parents(jnp.zeros((b, n), jnp.int32), parents, depth)


def attention_inputs(case: dict, shapes: Shapes, key_block: int, sets: int, seed: int = 0) -> list[tuple]:
    """`sets` argument tuples (q, k_cache, v_cache, lengths, positions, ancestors) for one case, as the target's
    Attention passes them: this call's K/V already in the cache at slots L .. L+T-1."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    b, t, length = case["B"], case["T"], case["L"]
    s = _round_up(length + t, key_block)
    lengths = jnp.full((b,), length, jnp.int32)
    if case["kind"] == "tree":
        tree = _tree(np.random.default_rng(seed), b, t, min(t - 1, TREE_DEPTH))
        positions, ancestors = lengths[:, None] + tree.depths, tree.ancestors
    else:
        positions, ancestors = lengths[:, None] + jnp.arange(t, dtype=jnp.int32), None

    @jax.jit
    def draw(key):
        kq, kk, kv = jax.random.split(key, 3)
        q = jax.random.normal(kq, (b, t, shapes.q_heads, shapes.head_dim), jnp.float32)
        k = jax.random.normal(kk, (b, shapes.kv_heads, s, shapes.head_dim), jnp.float32)
        v = jax.random.normal(kv, (b, shapes.kv_heads, s, shapes.head_dim), jnp.float32)
        return tuple(x.astype(shapes.dtype) for x in (q, k, v))

    keys = jax.random.split(jax.random.key(seed), sets)
    return [(*draw(keys[i]), lengths, positions, ancestors) for i in range(sets)]


def verify_inputs(case: dict, vocab: int, sets: int, seed: int = 0) -> tuple[list[tuple], int]:
    """(`sets` argument tuples (tokens, parents, probs, uniforms, noise[, q]), max_depth) for one verification case,
    as `engine/accept.py` and `engine/core.py` build them. Each drafted token is its parent's most likely one (long
    accepted paths: the walk's worst case)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from pallas_kernels.rejection import chain_parents

    b, n, mode = case["B"], case["N"], case["mode"]
    depth = verify_depth(case)
    if case["draft"].startswith("chain"):
        parents = chain_parents(b, n)
    else:
        parents = _tree(np.random.default_rng(seed), b, n, depth).parents

    @jax.jit
    def draw(key):
        kl, kq, ku, kn = jax.random.split(key, 4)
        logits = 3 * jax.random.normal(kl, (b, n, vocab), jnp.float32)
        best = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [B, N]
        tokens = jnp.take_along_axis(best, jnp.maximum(parents, 0), axis=1).at[:, 0].set(0)
        if mode == "greedy":
            return tokens, logits, jnp.zeros((b, n)), jnp.ones((b, 1)), None
        p = jax.nn.softmax(logits, axis=-1)
        uniforms = jax.random.uniform(ku, (b, n))
        noise = jax.random.exponential(kn, (b, vocab), jnp.float32)
        if mode == "tree":
            return tokens, p, uniforms, noise, None
        q = jax.nn.softmax(logits + jax.random.normal(kq, logits.shape), axis=-1).at[:, -1].set(0.0)
        return tokens, p, uniforms.at[:, 0].set(0.0), noise, q

    keys = jax.random.split(jax.random.key(seed + 1), sets)
    out = []
    for i in range(sets):
        tokens, probs, uniforms, noise, q = draw(keys[i])
        out.append((tokens, parents, probs, uniforms, noise) + (() if q is None else (q,)))
    return out, depth


def _nbytes(args) -> int:
    import jax

    return sum(x.nbytes for x in jax.tree.leaves(args))


def rotation_sets(bytes_per_set: int, backend: str) -> int:
    """Input sets per case so that cycling through them misses the caches (one on CPU, where it does not matter)."""
    if backend == "cpu":
        return 1
    return max(1, min(MAX_SETS, math.ceil(ROTATE_BYTES / max(bytes_per_set, 1))))


# --- timing -------------------------------------------------------------------------------------------------------------


def time_per_call(fn, arg_sets: list[tuple], *, repeats: int, stream_s: float) -> float:
    """Seconds per call of `fn`: after a warm-up call (compilation) and one timed call, `repeats` streams of
    back-to-back calls over the sets in turn (as many as fill `stream_s`, at most MAX_CALLS), one sync at each
    stream's end; the median stream's time per call."""
    import jax

    jax.block_until_ready(fn(*arg_sets[0]))
    start = time.perf_counter()
    jax.block_until_ready(fn(*arg_sets[-1]))
    single = time.perf_counter() - start
    calls = max(1, min(MAX_CALLS, math.ceil(stream_s / max(single, 1e-6))))
    per_call, i = [], 0
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            out = fn(*arg_sets[i % len(arg_sets)])
            i += 1
        jax.block_until_ready(out)
        per_call.append((time.perf_counter() - start) / calls)
    return statistics.median(per_call)


def _same(a, b) -> bool:
    import jax
    import numpy as np

    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(
        x.shape == y.shape and x.dtype == y.dtype and np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(la, lb)
    )


def _rel_err(got, want) -> float:
    import numpy as np

    g, w = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(g - w) / max(np.linalg.norm(w), 1e-30))


def _error(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:200]}" if text else type(e).__name__


def _measure(fns: dict, arg_sets, floor_bytes, gb_per_s, *, repeats, stream_s, rel_err=None) -> dict:
    """fns: {"kernel": f, "reference": f}, each a callable (a compiled program) or the exception that kept it from
    compiling. Both on the same inputs: µs per call, the ratio, the floor and how near each gets to it, and whether
    they agree (bit for bit; `rel_err` for outputs that may differ in rounding)."""
    import jax

    row: dict = {"floor_bytes": floor_bytes, "floor_us": round(floor_us(floor_bytes, gb_per_s), 3)}
    outputs = {}
    for name in ("kernel", "reference"):
        fn = fns[name]
        try:
            if isinstance(fn, BaseException):
                raise fn
            outputs[name] = jax.block_until_ready(fn(*arg_sets[0]))
            seconds = time_per_call(fn, arg_sets, repeats=repeats, stream_s=stream_s)
            row[f"{name}_us"] = round(seconds * 1e6, 3)
            row[f"{name}_pct_of_floor"] = round(100 * row["floor_us"] / row[f"{name}_us"], 2)
        except Exception as e:  # noqa: BLE001 - a kernel that does not lower on this backend is a result, not a crash
            row[f"{name}_us"] = None
            row[f"{name}_error"] = _error(e)
    if row.get("kernel_us") and row.get("reference_us"):
        row["kernel_over_reference"] = round(row["kernel_us"] / row["reference_us"], 3)
    if len(outputs) == 2:
        row["same_bits"] = _same(outputs["kernel"], outputs["reference"])
        if not row["same_bits"] and rel_err is not None:
            row["rel_err"] = rel_err(outputs["kernel"], outputs["reference"])
    return row


@dataclasses.dataclass
class _Job:
    section: str  # "attention" or "verification"
    row: dict  # the case, as the table's row starts
    floor_bytes: int
    make_inputs: object  # sets -> list of argument tuples
    lower: dict  # {"kernel": abstract args -> jax.stages.Lowered, "reference": ...}
    rel_err: object = None


def compile_all(jobs: list[_Job], workers: int, log) -> list[dict]:
    """Every job's kernel and reference, lowered here (tracing holds the GIL) from abstract inputs and compiled on
    `workers` threads (XLA compiles outside the GIL: the references at long contexts take minutes each), all done
    before any timing starts. → per job {"kernel": compiled or the exception, "reference": ...}."""
    from concurrent.futures import ThreadPoolExecutor

    import jax

    pending = []
    with ThreadPoolExecutor(max_workers=workers) as pool:
        for job in jobs:
            abstract = jax.eval_shape(lambda job=job: job.make_inputs(1)[0])
            futures = {}
            for name, lower in job.lower.items():
                try:
                    futures[name] = pool.submit(lower(abstract).compile)
                except Exception as e:  # noqa: BLE001 - reported in the row
                    futures[name] = e
            pending.append(futures)
        log(f"lowered {len(jobs)} cases; compiling them on {workers} threads")
    return [{name: f if isinstance(f, BaseException) else _outcome(f) for name, f in futures.items()}
            for futures in pending]


def _outcome(future):
    try:
        return future.result()
    except Exception as e:  # noqa: BLE001 - reported in the row
        return e


def verify_depth(case: dict) -> int:
    """max_depth as the engine passes it: K for a chain of K + 1 nodes, the tree's configured depth."""
    return case["N"] - 1 if case["draft"].startswith("chain") else min(case["N"] - 1, TREE_DEPTH)


# --- the run ------------------------------------------------------------------------------------------------------------


def run_micro(shapes: Shapes, gb_per_s: float, *, interpret: bool, backend: str, repeats: int | None = None,
              stream_s: float | None = None, attention: list[dict] | None = None,
              verification: list[dict] | None = None, workers: int | None = None, log=None) -> dict:
    """The cases given (default: all of `shapes`, `attention_cases` and `verify_cases`), compiled first
    (`compile_all`), then timed one at a time. → {"shapes", "key_block", "kernels", "timings_meaningful",
    "bandwidth_gb_per_s", "timing", "attention": [rows], "verification": [rows]}; rows: the case, kernel_us,
    reference_us, kernel_over_reference, floor_bytes, floor_us, kernel_pct_of_floor, reference_pct_of_floor,
    same_bits (*_error where one failed)."""
    import os

    import jax
    import jax.numpy as jnp

    from jaxspec.models.numerics import Numerics
    from pallas_kernels.invariant_attention import invariant_attention, invariant_attention_reference
    from pallas_kernels.rejection import verify, verify_reference

    cpu = backend == "cpu"
    repeats = repeats or (3 if cpu else 5)
    stream_s = 0.02 if stream_s is None else stream_s
    key_block = Numerics().key_block
    itemsize = jnp.dtype(shapes.dtype).itemsize
    say = log or (lambda msg: None)
    result: dict = {
        "shapes": dataclasses.asdict(shapes),
        "key_block": key_block,
        "kernels": "interpret" if interpret else "compiled",
        "timings_meaningful": not interpret,
        "bandwidth_gb_per_s": round(gb_per_s, 2),
        "timing": f"median of {repeats} streams of back-to-back calls, one sync per stream, dispatch included"
        + ("" if cpu else f"; inputs rotated over sets of up to {ROTATE_BYTES >> 20} MiB in all, past the caches"),
        "attention": [],
        "verification": [],
    }

    jobs = []
    reference = jax.jit(functools.partial(invariant_attention_reference, key_block=key_block, num_blocks=None))
    for case in attention_cases(shapes) if attention is None else attention:
        jobs.append(_Job(
            "attention", {**case}, attention_floor_bytes(case["B"], case["T"], case["L"], shapes.q_heads,
                                                         shapes.kv_heads, shapes.head_dim, itemsize),
            functools.partial(attention_inputs, case, shapes, key_block),
            {"kernel": lambda a: invariant_attention.lower(*a, key_block=key_block, num_blocks=None,
                                                           interpret=interpret),
             "reference": lambda a: reference.lower(*a)},
            _rel_err,
        ))
    for case in verify_cases(shapes) if verification is None else verification:
        opts = {"mode": case["mode"], "max_depth": verify_depth(case)}
        jobs.append(_Job(
            "verification", {**case, "V": shapes.vocab, "max_depth": opts["max_depth"]},
            verify_floor_bytes(case["mode"], case["B"], case["N"], shapes.vocab),
            lambda sets, case=case: verify_inputs(case, shapes.vocab, sets)[0],
            {"kernel": lambda a, opts=opts: verify.lower(*a, **opts, interpret=interpret),
             "reference": lambda a, opts=opts: jax.jit(functools.partial(verify_reference, **opts)).lower(*a)},
        ))

    compiled = compile_all(jobs, workers or min(8, os.cpu_count() or 1), say)
    for job, fns in zip(jobs, compiled):
        one = job.make_inputs(1)
        sets = rotation_sets(_nbytes(one[0]), backend)
        arg_sets = one if sets == 1 else job.make_inputs(sets)
        row = {**job.row, "input_sets": len(arg_sets),
               **_measure(fns, arg_sets, job.floor_bytes, gb_per_s, repeats=repeats, stream_s=stream_s,
                          rel_err=job.rel_err)}
        result[job.section].append(row)
        say(f"{job.section} {job.row}: kernel {row.get('kernel_us')} µs, reference {row.get('reference_us')} µs")
        del arg_sets, one, fns
    return result


# --- the table ----------------------------------------------------------------------------------------------------------


def _cell(row: dict, key: str, fmt: str = "{:.1f}") -> str:
    value = row.get(key)
    if value is None:
        error = row.get(key.replace("_us", "_error").replace("_pct_of_floor", "_error"))
        return f"failed ({error})" if error and key.endswith("_us") else ""
    return fmt.format(value)


def _agree(row: dict) -> str:
    if "same_bits" not in row:
        return ""
    if row["same_bits"]:
        return "yes"
    return f"NO (rel err {row['rel_err']:.1e})" if "rel_err" in row else "NO"


ATTENTION_COLUMNS = ("B", "L", "T", "kind", "kernel µs", "reference µs", "kernel / reference", "floor µs",
                     "kernel % of floor", "reference % of floor", "same bits")
VERIFY_COLUMNS = ("B", "N", "mode", "draft", "kernel µs", "reference µs", "kernel / reference", "floor µs",
                  "kernel % of floor", "reference % of floor", "same result")


def _timed_cells(row: dict) -> list[str]:
    return [_cell(row, "kernel_us"), _cell(row, "reference_us"), _cell(row, "kernel_over_reference", "{:.2f}"),
            _cell(row, "floor_us", "{:.2f}"), _cell(row, "kernel_pct_of_floor"),
            _cell(row, "reference_pct_of_floor"), _agree(row)]


def _md_row(cells) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def markdown(r: dict, machine: str = "", probe: str = "") -> str:
    s = r["shapes"]
    kernel_label = (
        "compiled Pallas kernels" if r["kernels"] == "compiled"
        else "Pallas INTERPRET mode: XLA runs the kernel bodies as ordinary ops, so the kernel timings are NOT "
        "meaningful here (they show that the kernels run and agree with the references)"
    )
    lines = [
        f"kernel micro-benchmark, {s['name']} shapes" + (f"; machine: {machine}" if machine else ""),
        f"kernels: {kernel_label}",
        f"bandwidth: {r['bandwidth_gb_per_s']} GB/s (read + written)" + (f" from the probe: {probe}" if probe else "")
        + "; floor = the bytes a call must move / that bandwidth",
        f"timing: {r['timing']}; kernel / reference < 1: the kernel is faster; % of floor = floor / time "
        + "(100: at the floor)",
    ]
    if r["attention"]:
        lines += [
            "",
            (f"attention, invariant_attention vs invariant_attention_reference: {s['q_heads']} query / "
             f"{s['kv_heads']} KV heads, head_dim {s['head_dim']}, {s['dtype']}, key block {r['key_block']}; floor "
             "bytes: K and V of slots 0 .. L+T-1, q and out"),
            "",
            _md_row(ATTENTION_COLUMNS),
            _md_row(["---"] * len(ATTENTION_COLUMNS)),
        ]
        lines += [_md_row([row["B"], row["L"], row["T"], row["kind"], *_timed_cells(row)]) for row in r["attention"]]
    if r["verification"]:
        lines += [
            "",
            (f"draft verification, verify vs verify_reference: vocabulary {s['vocab']}, float32; floor bytes: "
             "greedy B·N·V·4 (every row's argmax), tree B·V·8 (final p row, noise), chain B·V·12 (p, q rows, noise)"),
            "",
            _md_row(VERIFY_COLUMNS),
            _md_row(["---"] * len(VERIFY_COLUMNS)),
        ]
        lines += [_md_row([row["B"], row["N"], row["mode"], row["draft"], *_timed_cells(row)])
                  for row in r["verification"]]
    return "\n".join(lines)


def run_from_args(args, gb_per_s: float, machine: str, probe: str) -> int:
    """The `--kernels-micro` mode of `python -m jaxspec.bench`: print the table (or --json)."""
    import json
    import sys

    import jax

    backend = jax.default_backend()
    shapes = shapes_from_args(args, backend)
    interpret = backend == "cpu" or getattr(args, "kernels", None) == "interpret"
    result = run_micro(shapes, gb_per_s, interpret=interpret, backend=backend,
                       log=lambda msg: print(msg, file=sys.stderr, flush=True))
    result = {"machine": machine, "jax": jax.__version__, "bandwidth_probe": probe, **result}
    print(json.dumps(result, indent=2) if args.json else markdown(result, machine, probe))
    return 0
