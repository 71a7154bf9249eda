"""python -m jaxspec.bench: tokens/s of jaxspec target-only and speculative generation, side by side (and with
Hugging Face transformers on the same checkpoint, prompts and lengths), in one process, plus the roofline.

Examples:
  python -m jaxspec.bench --prompts-file mt_bench.jsonl --limit 10 --max-new-tokens 64 --compare-hf
  python -m jaxspec.bench --draft HEAD_DIR --prompts-file mt_bench.jsonl --num-speculative-tokens 5 --tree 24,5,6
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time

import numpy as np


from jaxspec.cli_common import (
    add_draft_args,
    add_target_args,
    head_aux_layer_ids,
    load_head_for,
    load_target_and_tokenizer,
    main_guard,
    parse_tree,
    resolve_draft,
    resolve_target,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m jaxspec.bench",
        description="Measure generation speed (greedy) against transformers and the memory roofline.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n", 3)[3],
    )
    add_target_args(parser)
    add_draft_args(parser)
    parser.add_argument("--prompts-file", required=True, metavar="FILE.jsonl")
    parser.add_argument("--limit", type=int, default=0, metavar="N", help="use the first N prompts (0 = all)")
    parser.add_argument("--max-new-tokens", type=int, default=64, metavar="N")
    parser.add_argument("--batch-size", type=int, default=1, metavar="B")
    parser.add_argument(
        "--tree", type=parse_tree, action="append", default=[], metavar="TOTAL,DEPTH,TOPK",
        help="also measure EAGLE-2 dynamic trees with this budget, next to the chain (repeatable)",
    )
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


def _best_time(fn, *args, repeats: int = 10) -> float:
    import jax

    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - start)
    return best


def component_timings(model, head, k: int, batch: int, capacity: int = 256) -> dict:
    """Milliseconds of one target forward over 1 and K+1 tokens, and of one head step, at a half-full cache."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxspec.models import kv_cache as kvc

    tg, tp = nnx.split(model)
    hg, hp = nnx.split(head)

    def target_forward(params, cache, tokens):
        m = nnx.merge(tg, params)
        pos = cache.lengths[:, None] + jnp.arange(tokens.shape[1])
        return m(tokens, pos, cache, return_aux=True).logits

    def head_forward(params, cache, tokens, state):
        h = nnx.merge(hg, params)
        return h(tokens, state, cache.lengths[:, None], cache, model.embed_tokens[...])[0]

    cache = kvc.advance(model.init_cache(batch, capacity), capacity // 2)
    hcache = kvc.advance(head.init_cache(batch, capacity), capacity // 2)
    tf = jax.jit(target_forward)
    decode = _best_time(tf, tp, cache, jnp.zeros((batch, 1), jnp.int32))
    verify = _best_time(tf, tp, cache, jnp.zeros((batch, k + 1), jnp.int32))
    state = jnp.zeros((batch, 1, head.config.hidden_size), head.dtype)
    draft = _best_time(jax.jit(head_forward), hp, hcache, jnp.zeros((batch, 1), jnp.int32), state)
    return {
        "verified_tokens": k + 1,
        "target_decode_ms": round(decode * 1e3, 2),
        "target_verify_ms": round(verify * 1e3, 2),
        "verify_over_decode": round(verify / decode, 3),
        "head_step_ms": round(draft * 1e3, 2),
        "head_step_over_decode": round(draft / decode, 3),
    }


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
    draft = resolve_draft(args)
    model, tokenizer = load_target_and_tokenizer(target_dir, args.dtype, aux_layer_ids=head_aux_layer_ids(draft))
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
    if draft:
        from jaxspec.spec.generator import SpeculativeGenerator

        head = load_head_for(draft, model, args.dtype, args.allow_pickle)
        result["speculative"] = []
        for tree in [None, *args.tree]:
            spec = SpeculativeGenerator(
                model, head, num_draft=args.num_speculative_tokens, tree=tree, batch_size=args.batch_size
            )
            spec.generate(encoded[: args.batch_size], max_new_tokens=args.max_new_tokens, stop_ids=stops)
            spec_out = spec.generate(encoded, max_new_tokens=args.max_new_tokens, stop_ids=stops)
            s_seconds = sum(c.seconds for i, c in enumerate(spec_out) if i % args.batch_size == 0)
            s_tokens = sum(c.num_generated for c in spec_out)
            calls = sum(c.stats["target_calls"] - 1 for c in spec_out)
            per_row = [np.asarray(c.stats["acceptance_per_position"]) * (c.stats["target_calls"] - 1) for c in spec_out]
            verified = args.num_speculative_tokens + 1 if tree is None else tree.total_tokens
            result["speculative"].append({
                "method": f"chain K={args.num_speculative_tokens}" if tree is None else f"tree {tree.spec}",
                "draft": str(draft),
                "tokens": s_tokens,
                "seconds": round(s_seconds, 3),
                "tokens_per_second": round(s_tokens / s_seconds, 2),
                "speedup_vs_target_only": round((s_tokens / s_seconds) / (tokens / seconds), 3),
                "mean_accepted_length": round((s_tokens - len(spec_out)) / calls, 3),
                "acceptance_per_position": [round(float(a) / calls, 3) for a in np.sum(per_row, 0)],
                "identical_outputs": f"{sum(a.token_ids == b.token_ids for a, b in zip(spec_out, completions))}/{len(prompts)}",
                **component_timings(model, head, verified - 1, args.batch_size),
            })
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
    for sp in r.get("speculative", []):
        rows.append((f"jaxspec EAGLE-3 {sp['method']}", sp))
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
    for sp in r.get("speculative", []):
        lines += [
            "",
            f"{sp['method']}: {sp['speedup_vs_target_only']}x target-only; mean accepted length "
            f"{sp['mean_accepted_length']}; acceptance per position {sp['acceptance_per_position']}; identical "
            f"outputs {sp['identical_outputs']}",
            f"  one target decode {sp['target_decode_ms']} ms; verify of {sp['verified_tokens']} tokens "
            f"{sp['target_verify_ms']} ms ({sp['verify_over_decode']}x); one head step {sp['head_step_ms']} ms "
            f"({sp['head_step_over_decode']}x)",
        ]
    if "speedup_vs_transformers" in r:
        lines += ["", f"jaxspec / transformers: {r['speedup_vs_transformers']}x "
                  f"(identical outputs: {r['transformers']['identical_outputs']})"]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
