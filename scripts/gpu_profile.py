"""Where a decode step's device time goes: a profile summary of target-only generation (top ops by time).

    python scripts/gpu_profile.py TARGET_DIR [--kernels auto|pallas|reference] [--numerics invariant|plain]
                                  [--batch B] [--new-tokens N] [--json OUT.json]

Generates N tokens for B rows of a fixed random prompt twice (the first compiles and warms up), the second under
`jax.profiler.trace`, then reads the trace back with `jax.profiler.ProfileData` (public API) and sums the device's
events by name: the XLA ops line of each GPU (fusions, custom calls, Triton kernels) where the trace has one, else
every event of the device's planes; on CPU, the host threads' XLA op events. Per decode step: device busy time,
op launches, and the top ops by time with their share, so a reader sees which fusions and kernels a step is made of
(the weights' matmuls should dominate; anything else is overhead to remove). Why a script and not a bench flag: it
is what the GPU sitting (`scripts/gpu_sitting.sh`) runs on a lent machine; the numbers are that machine's.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import sys
import tempfile
import time


def summarize(xspace_path: str, steps: int, top: int = 25) -> dict:
    """{device_ms_per_step, ops_per_step, top: [{name, ms_per_step, share, count_per_step}], lines} from a trace."""
    from jax.profiler import ProfileData

    data = ProfileData.from_file(xspace_path)
    device_planes = [p for p in data.planes if p.name.startswith("/device:")]
    chosen = []  # (plane, line) pairs whose events are the device's ops
    for plane in device_planes:
        lines = list(plane.lines)
        ops = [ln for ln in lines if ln.name == "XLA Ops"]
        chosen += [(plane.name, ln) for ln in (ops or [ln for ln in lines if ln.name.startswith("Stream")])]
    if not chosen:  # CPU: XLA's thunks run on host threads, traced as events named after the HLO ops
        for plane in data.planes:
            if plane.name.startswith("/host:"):
                chosen += [(plane.name, ln) for ln in plane.lines if "XLA" in ln.name or "tf_" in ln.name]
    total_ns, counts, times = 0, collections.Counter(), collections.Counter()
    for plane, line in chosen:
        for ev in line.events:
            if plane.startswith("/host:") and "::" in ev.name:  # the CPU runtime's own spans (ThunkExecutor::...)
                continue
            counts[ev.name] += 1
            times[ev.name] += ev.duration_ns
            total_ns += ev.duration_ns
    steps = max(1, steps)
    return {
        "lines": sorted({f"{plane}: {line.name}" for plane, line in chosen}),
        "steps": steps,
        "device_ms_per_step": round(total_ns / 1e6 / steps, 4),
        "ops_per_step": round(sum(counts.values()) / steps, 1),
        "top": [
            {
                "name": name[:160],
                "ms_per_step": round(ns / 1e6 / steps, 4),
                "share": round(ns / max(total_ns, 1), 4),
                "count_per_step": round(counts[name] / steps, 2),
            }
            for name, ns in times.most_common(top)
        ],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("target")
    parser.add_argument("--kernels", default="auto")
    parser.add_argument("--numerics", choices=("invariant", "plain"), default="invariant")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--dtype")
    parser.add_argument("--json", metavar="OUT")
    args = parser.parse_args(argv)

    import jax
    import numpy as np

    from jaxspec.bench.bandwidth import decode_weight_bytes
    from jaxspec.checkpoints.hf import load_target
    from jaxspec.engine.generation import Generator, default_dtype
    from pallas_kernels.dispatch import resolve_kernels

    model = load_target(args.target, dtype=args.dtype or default_dtype())
    kernels = resolve_kernels(args.kernels)
    model.numerics = None if args.numerics == "plain" else model.invariant_numerics(kernels)
    gen = Generator(model, batch_size=args.batch)
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(10, 1000, args.prompt_tokens)) for _ in range(args.batch)]
    gen.generate(prompts, max_new_tokens=args.new_tokens)  # compile, warm up
    start = time.perf_counter()
    gen.generate(prompts, max_new_tokens=args.new_tokens)
    untraced = time.perf_counter() - start
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            gen.generate(prompts, max_new_tokens=args.new_tokens)  # returns host token lists: the steps are done
        paths = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)
        if not paths:
            print("no trace written", file=sys.stderr)
            return 1
        steps = args.new_tokens - 1  # the prefill emits the first token; each further one is a decode step
        result = {
            "machine": f"{jax.devices()[0].device_kind}, JAX {jax.__version__}",
            "target": args.target.rstrip("/").split("/")[-1],
            "numerics": args.numerics,
            "kernels": kernels if args.numerics == "invariant" else "n/a",
            "batch": args.batch,
            "new_tokens": args.new_tokens,
            "untraced_ms_per_token": round(untraced * 1e3 / args.new_tokens, 3),
            "note": "per step = the traced generate (prefill included) / (new tokens - 1)",
            **summarize(paths[0], steps),
        }
        # the weights a step reads, over the device time of a step: what to hold against the copy bandwidth
        result["weight_bytes"] = decode_weight_bytes(model)
        result["weights_tb_per_s"] = round(result["weight_bytes"] / (result["device_ms_per_step"] * 1e9), 3)
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
