"""What batch-invariant numerics cost target-only decoding: tokens/s with the invariant path (the default) and with
plain XLA numerics, side by side in one process, on a random-weight target of a real shape.

    python scripts/invariance_cost.py [--shape llama3.1-8b|llama3.2-1b|smollm2-135m] [--dtype bfloat16]
        [--batch 1 8] [--new-tokens 64] [--prompt-len 100]

Random weights give real speed (not real text). Each configuration is compiled first and timed on a second run.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jaxspec.engine.generation import Generator
from jaxspec.models.llama import LlamaModel
from jaxspec.reference_shapes import SHAPES, reference_config


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="llama3.1-8b", choices=sorted(SHAPES))
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=100)
    args = ap.parse_args()
    cfg = reference_config(args.shape)
    model = LlamaModel(cfg, dtype=jnp.dtype(args.dtype), rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    rows = []
    for batch in args.batch:
        prompts = [rng.integers(0, cfg.vocab_size, args.prompt_len).tolist() for _ in range(batch)]
        ids = {}
        for name in ("invariant", "plain"):
            model.numerics = model.invariant_numerics() if name == "invariant" else None
            gen = Generator(model, batch_size=batch, chunk_steps=16)
            gen.generate(prompts, max_new_tokens=args.new_tokens)  # compile
            start = time.perf_counter()
            out = gen.generate(prompts, max_new_tokens=args.new_tokens)
            seconds = time.perf_counter() - start
            ids[name] = [c.token_ids for c in out]
            tokens = sum(c.num_generated for c in out)
            rows.append({
                "shape": args.shape, "dtype": args.dtype, "batch": batch, "numerics": name,
                "tokens_per_second": round(tokens / seconds, 1), "prefill_seconds": round(out[0].prefill_seconds, 4),
                "compile_seconds": round(gen.compile_seconds, 1),
            })
            print(json.dumps(rows[-1]), flush=True)
        same = sum(a == b for a, b in zip(ids["invariant"], ids["plain"]))
        print(json.dumps(dict(batch=batch, identical_rows_invariant_vs_plain=f"{same}/{batch}")), flush=True)
    print(json.dumps(dict(device=jax.devices()[0].device_kind, jax=jax.__version__)))
    for r in rows:
        print(f"{r['shape']} {r['dtype']} batch {r['batch']:>2} {r['numerics']:>9}: {r['tokens_per_second']:>8} tok/s "
              f"(prefill {r['prefill_seconds']} s)")


if __name__ == "__main__":
    main()
