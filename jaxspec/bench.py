"""python -m jaxspec.bench: tokens/s of jaxspec target-only generation, side by side with Hugging Face
transformers on the same checkpoint, prompts and lengths, in one process, plus the memory-bandwidth roofline.

Example:
  python -m jaxspec.bench --prompts-file mt_bench.jsonl --limit 10 --max-new-tokens 64 --compare-hf
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time


from jaxspec.cli_common import add_target_args, load_target_and_tokenizer, main_guard, resolve_target


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m jaxspec.bench",
        description="Measure generation speed (greedy) against transformers and the memory roofline.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n", 3)[3],
    )
    add_target_args(parser)
    parser.add_argument("--prompts-file", required=True, metavar="FILE.jsonl")
    parser.add_argument("--limit", type=int, default=0, metavar="N", help="use the first N prompts (0 = all)")
    parser.add_argument("--max-new-tokens", type=int, default=64, metavar="N")
    parser.add_argument("--batch-size", type=int, default=1, metavar="B")
    parser.add_argument("--compare-hf", action="store_true", help="also time transformers generate (needs torch)")
    parser.add_argument("--raw", action="store_true", help="no chat template")
    parser.add_argument("--json", action="store_true", help="print the results as one JSON object")
    return parser


def measure_bandwidth_gbs(nbytes: int = 1 << 29) -> float:
    """Read bandwidth of the default device: best of a few full reductions over a large float32 array."""
    import jax
    import jax.numpy as jnp

    x = jnp.ones((nbytes // 4,), jnp.float32)
    total = jax.jit(jnp.sum)
    total(x).block_until_ready()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        total(x).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return nbytes / best / 1e9


def time_hf(target_dir, prompts, max_new_tokens, stops) -> tuple[float, int, list[list[int]]]:
    try:
        import torch
        import transformers
    except ImportError:
        from jaxspec.errors import JaxspecError

        raise JaxspecError("--compare-hf needs torch and transformers (pip install 'jaxspec[test]')") from None
    model = transformers.AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    outputs, seconds = [], 0.0
    with torch.inference_mode():
        model.generate(torch.tensor([prompts[0]]), max_new_tokens=4, do_sample=False, pad_token_id=stops[0])  # warm-up
        for p in prompts:
            start = time.perf_counter()
            out = model.generate(
                torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=stops, pad_token_id=stops[0],
            )
            seconds += time.perf_counter() - start
            ids = out[0, len(p) :].tolist()
            outputs.append(ids[: next((i + 1 for i, t in enumerate(ids) if t in stops), len(ids))])
    return seconds, sum(len(o) for o in outputs), outputs


@main_guard
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import jax

    from jaxspec.generation import TargetGenerator
    from jaxspec.prompts import encode_prompt, read_prompts_file, stop_token_ids

    prompts = read_prompts_file(args.prompts_file)
    if args.limit:
        prompts = prompts[: args.limit]
    target_dir = resolve_target(args.target)
    model, tokenizer = load_target_and_tokenizer(target_dir, args.dtype)
    stops = stop_token_ids(tokenizer, target_dir, model.config.eos_token_ids)
    encoded = [encode_prompt(tokenizer, text, args.raw) for _, text in prompts]

    gen = TargetGenerator(model, batch_size=args.batch_size)
    gen.generate(encoded[: args.batch_size], max_new_tokens=args.max_new_tokens, stop_ids=stops)  # compile + warm
    completions = gen.generate(encoded, max_new_tokens=args.max_new_tokens, stop_ids=stops)
    seconds = sum(c.seconds for i, c in enumerate(completions) if i % args.batch_size == 0)
    tokens = sum(c.num_generated for c in completions)

    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(gen.params))
    bandwidth = measure_bandwidth_gbs()
    result = {
        "machine": f"{platform.machine()} {jax.devices()[0].device_kind}, {jax.device_count()} device(s), "
        f"JAX {jax.__version__}",
        "target": target_dir.name,
        "dtype": str(model.dtype),
        "prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "batch_size": args.batch_size,
        "jaxspec": {"tokens": tokens, "seconds": round(seconds, 3), "tokens_per_second": round(tokens / seconds, 2)},
        "roofline": {
            "weight_bytes": weight_bytes,
            "measured_read_gb_per_s": round(bandwidth, 2),
            "tokens_per_second": round(args.batch_size * bandwidth * 1e9 / weight_bytes, 2),
        },
    }
    if args.compare_hf:
        hf_seconds, hf_tokens, hf_outputs = time_hf(target_dir, encoded, args.max_new_tokens, stops)
        same = sum(o == c.token_ids for o, c in zip(hf_outputs, completions))
        result["transformers"] = {
            "tokens": hf_tokens, "seconds": round(hf_seconds, 3), "tokens_per_second": round(hf_tokens / hf_seconds, 2),
            "identical_outputs": f"{same}/{len(prompts)}",
        }
        result["speedup_vs_transformers"] = round((tokens / seconds) / (hf_tokens / hf_seconds), 3)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(_table(result))
    return 0


def _table(r: dict) -> str:
    rows = [("jaxspec target-only", r["jaxspec"])]
    if "transformers" in r:
        rows.append(("transformers generate", r["transformers"]))
    lines = [
        f"{r['target']} ({r['dtype']}), {r['prompts']} prompts, {r['max_new_tokens']} new tokens, batch {r['batch_size']}",
        f"machine: {r['machine']}",
        "",
        "| method | tokens | seconds | tokens/s |",
        "|---|---|---|---|",
    ]
    lines += [f"| {name} | {m['tokens']} | {m['seconds']} | {m['tokens_per_second']} |" for name, m in rows]
    roof = r["roofline"]
    lines.append(
        f"| roofline (weights {roof['weight_bytes'] / 1e6:.0f} MB / {roof['measured_read_gb_per_s']} GB/s) | | | "
        f"{roof['tokens_per_second']} |"
    )
    if "speedup_vs_transformers" in r:
        lines += ["", f"jaxspec / transformers: {r['speedup_vs_transformers']}x "
                  f"(identical outputs: {r['transformers']['identical_outputs']})"]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
