"""python -m jaxspec.bench: tokens/s of jaxspec target-only and speculative generation, side by side (and with
Hugging Face transformers on the same checkpoint, prompts and lengths), in one process, plus the roofline.

Examples:
  python -m jaxspec.bench --prompts-file mt_bench.jsonl --limit 10 --max-new-tokens 64 --compare-hf
  python -m jaxspec.bench --draft HEAD_DIR --prompts-file mt_bench.jsonl --num-speculative-tokens 5 --tree 24,5,6
  python -m jaxspec.bench --suite mt_bench --batch-sizes 1,4,16 --chain-lengths 3,5 --tree 16,5,4 --compare-hf
      (writes results.json, results.md and PNG plots to bench-results/mt_bench/)
  python -m jaxspec.bench --load-time TARGET_ORBAX_DIR --target TARGET_DIR --dtype bfloat16 --mesh data=2,model=4
  python -m jaxspec.bench --kernels-micro [--json]
      (the attention and verification kernels vs their references vs the bytes floor; Llama-3.1-8B shapes on a
      GPU/TPU, tiny ones on CPU, where the kernels run in interpret mode and their timings mean nothing)
  python -m jaxspec.bench --kernels-micro --kernel-batch 1 --kernel-tokens 6 --kernel-lengths 4096
  python -m jaxspec.bench --compiled-cost [--cost-platforms h100,v5e] [--cost-batch 1,8] [--cost-lengths 1024,8192]
      (no chip needed: the target's forward compiled for an H100 and a TPU v5e on this machine; kernels per step
      and per layer, bytes accessed against the weights + KV a step must read, flops, temporaries, top kernels)

The roofline is weights-only: batch x bandwidth / weight bytes tokens/s, each decode step reading every weight once,
at the bandwidth of a device copy (bytes read + written, 1 GiB on accelerators, 128 MiB on CPU).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import sys
import time
from pathlib import Path

from jaxspec.bench.bandwidth import decode_weight_bytes, measure_bandwidth_gbs, probe_description, weights_roofline
from jaxspec.bench.suite import (
    auto_line,
    holds_suite_report,
    identical,
    measure,
    measure_interleaved,
    rejection_table,
    speculative_row,
)
from jaxspec.bench.transformers_runs import NEEDS_TORCH, assisted_acceptance, assisted_steps, time_hf
from jaxspec.cli.args import (
    AUTO,
    OneLineParser,
    add_draft_args,
    add_step_cost_args,
    add_structured_output_args,
    add_target_args,
    check_generation_args,
    count_list,
    integer,
    method_name,
    on_off_list,
    parse_tree,
    positive_int_list,
    prompt_lookup,
)
from jaxspec.cli.loading import (
    check_before_loading,
    head_aux_layer_ids,
    kernels_impl,
    load_draft_for,
    load_draft_model,
    load_target_and_tokenizer,
    ngram_proposer,
    resolve_draft,
    resolve_target,
    draft_generator,
    step_cost_store,
)
from jaxspec.cli.mesh import add_mesh_args, resolve_mesh
from jaxspec.cli.outputs import check_output_dir
from jaxspec.cli.program import main_guard, use_compile_cache
from jaxspec.config import MAX_DRAFT_DEPTH
from jaxspec.errors import JaxspecError
from jaxspec.memory import MemoryReport
from jaxspec.prompts import SUITES


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="python -m jaxspec.bench",
        description="Measure generation speed (greedy) against transformers and the weights-only memory roofline, or "
        "the Pallas kernels alone (--kernels-micro).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n", 3)[3],
    )
    add_target_args(parser)
    add_step_cost_args(parser)
    add_draft_args(parser)
    add_mesh_args(parser)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--prompts-file", metavar="FILE.jsonl", help="one run: target-only, the chain and --tree budgets"
    )
    source.add_argument(
        "--suite", metavar="NAME|FILE",
        help=f"the suite: {', '.join(SUITES)} (shipped with jaxspec or its dependencies) or a prompts file; "
        "every method at every --batch-sizes, written as JSON, Markdown and PNG plots to --out",
    )
    source.add_argument(
        "--load-time", metavar="ORBAX_DIR",
        help="time loading --target from its safetensors against ORBAX_DIR, its `jaxspec.convert target` copy "
        "(onto --mesh when given; median of --repeats)",
    )
    source.add_argument(
        "--serve-load", metavar="FILE.jsonl",
        help="load test of python -m jaxspec.serve, started here with --slots and --max-model-len, once with the "
        "draft and once target-only: the prompts (chat, streamed) at each --concurrency; requests/s, time to first "
        "token, tokens/s per request (jaxspec/bench/serve_load.py)",
    )
    source.add_argument(
        "--kernels-micro", action="store_true",
        help="kernel micro-benchmark, no model: the attention and draft-verification Pallas kernels vs their jax.numpy "
        "references vs the bytes floor at the probe's bandwidth, at --kernel-shapes (GPU: compiled; CPU, or --kernels "
        "interpret: interpret mode, whose timings are not meaningful); --dtype sets the attention dtype",
    )
    source.add_argument(
        "--compiled-cost", action="store_true",
        help="no chip, no weights: compile the target's forward (bfloat16, --numerics, --kernels) for each "
        "--cost-platforms chip here and report kernels per step and per layer, bytes accessed vs the weights + KV a "
        "step must read, flops, temporaries and the largest kernels (jaxspec/bench/compiled_cost.py); installs the "
        "CUDA plugin and libtpu wheels into the user cache on first use",
    )
    parser.add_argument("--repeats", type=integer(1), default=5, metavar="N",
                        help="--load-time: loads of each (default: 5)")
    parser.add_argument("--batch-sizes", type=positive_int_list, default=[1, 4, 16], metavar="B,...",
                        help="suite: batch sizes (default: 1,4,16)")
    parser.add_argument("--chain-lengths", type=positive_int_list, metavar="K,...",
                        help="suite: chain lengths to measure (default: 3,5)")
    parser.add_argument("--out", metavar="DIR", help="suite: output directory: new, empty, or a suite's report "
                        "written before (default: bench-results/SUITE)")
    parser.add_argument("--overwrite", action="store_true",
                        help="suite: write into a non-empty --out that holds no suite report")
    parser.add_argument("--limit", type=integer(None), default=0, metavar="N",
                        help="use the first N prompts (default: 0, all)")
    parser.add_argument("--max-new-tokens", type=integer(None), default=64, metavar="N", help="per prompt (default: 64)")
    parser.add_argument("--batch-size", type=integer(None), default=1, metavar="B",
                        help="one run's batch size (default: 1)")
    parser.add_argument(
        "--tree", type=parse_tree, action="append", default=[], metavar="TOTAL,DEPTH,TOPK",
        help="also measure EAGLE-2 dynamic trees with this budget, next to the chain (repeatable)",
    )
    parser.add_argument(
        "--accept-prob", type=float, metavar="P",
        help="benchmark only: chains accept each draft with probability P whatever the target says, so speed can be "
        "read at a chosen mean accepted length (1 + P + ... + P^K) with any head, even random weights; the output "
        "is NOT the target's",
    )
    parser.add_argument(
        "--quantization-drift", action="store_true",
        help="with --quantize: also load the float target and report, on these prompts, how far the quantized one's "
        "auxiliary hidden states (cosine, relative error per layer the head reads) and next-token distributions (KL, "
        "argmax agreement) drift from it (jaxspec/bench/drift.py; the float target's memory too)",
    )
    parser.add_argument("--compare-hf", action="store_true", help="also time transformers generate (needs torch)")
    parser.add_argument(
        "--components", action="store_true",
        help="also time each fixed chain's or tree's parts alone: a target decode, the verify of its K+1 tokens and "
        "one head step (three more programs compile: ~1-2 minutes at 8B shapes on a GPU, so off by default)",
    )
    parser.add_argument(
        "--memory-report", action="store_true",
        help="also print each method's device memory (parameters, KV caches, the compiled step's peak; per device "
        "on a mesh) on stderr; the JSON always has it under `memory`",
    )
    parser.add_argument(
        "--compare-numerics", action="store_true",
        help="also time every method with the other --numerics (invariant vs plain), side by side in this run",
    )
    parser.add_argument(
        "--kernel-shapes", choices=("llama-8b", "tiny"), metavar="llama-8b|tiny",
        help="--kernels-micro preset: llama-8b (32/8 heads, head_dim 128, bfloat16, B 1,8, T 1,6,16,64, L "
        "1024,4096,16384, vocabulary 128256; default on GPU/TPU) or tiny (4/2 heads, head_dim 32, float32, B 1, T "
        "1,6, L 100, vocabulary 3000: under a minute on a CPU, the default there)",
    )
    parser.add_argument("--kernel-batch", type=positive_int_list, metavar="B,...", help="--kernels-micro: batch sizes")
    parser.add_argument("--kernel-tokens", type=positive_int_list, metavar="T,...",
                        help="--kernels-micro: tokens per attention call (1: decode; more: chain and tree) and "
                        "nodes per verification (> 1)")
    parser.add_argument("--kernel-lengths", type=positive_int_list, metavar="L,...",
                        help="--kernels-micro: committed cache lengths")
    parser.add_argument("--kernel-vocab", type=integer(None), metavar="V", help="--kernels-micro: verification vocabulary")
    parser.add_argument("--cost-platforms", default="h100,v5e", metavar="P,...",
                        help="--compiled-cost: chips to compile for, of h100, v5e (default: h100,v5e)")
    parser.add_argument("--cost-shape", default="llama3.1-8b", metavar="SHAPE",
                        help="--compiled-cost: the model shape (jaxspec/reference_shapes.py; default: llama3.1-8b)")
    parser.add_argument("--cost-steps", default="decode,chain,tree", metavar="S,...",
                        help="--compiled-cost: decode (T=1), chain (a verify of 6 tokens), tree (16 nodes) "
                        "(default: decode,chain,tree)")
    parser.add_argument("--cost-batch", type=positive_int_list, metavar="B,...",
                        help="--compiled-cost: batch sizes (default: 1,8)")
    parser.add_argument("--cost-lengths", type=positive_int_list, metavar="L,...",
                        help="--compiled-cost: committed cache lengths (default: 1024,8192)")
    add_structured_output_args(parser)
    parser.add_argument("--concurrency", type=positive_int_list, default=[1, 4, 16], metavar="C,...",
                        help="--serve-load: clients at once, one level after another (default: 1,4,16)")
    parser.add_argument("--slots", type=integer(1), metavar="N",
                        help="--serve-load: the server's slots (default: the highest --concurrency)")
    parser.add_argument("--max-model-len", type=integer(1), default=1024, metavar="N",
                        help="--serve-load: prompt + new tokens one request may hold (default: 1024)")
    parser.add_argument("--prefill-chunk", type=count_list, default=[512], metavar="N,...",
                        help="--serve-load: the server's --prefill-chunk, one run of each method per value (0: "
                        "whole prefills) (default: 512)")
    parser.add_argument("--step-buckets", type=on_off_list, metavar="on,off",
                        help="--serve-load: on, the server's steps on the live rows alone; off, its "
                        "--no-step-buckets (every step runs all slots); one run of each method per value "
                        "(default: on)")
    parser.add_argument("--raw", action="store_true", help="no chat template")
    parser.add_argument("--json", action="store_true", help="print the results as one JSON object")
    return parser


def check_bench_args(args) -> None:
    """The benchmark's own flags, checked before anything loads (a bad value must not cost a benchmark pass)."""
    kernel_flags = [f"--kernel-{name}" for name in ("shapes", "batch", "tokens", "lengths", "vocab")
                    if getattr(args, f"kernel_{name}", None) is not None]
    if kernel_flags and not getattr(args, "kernels_micro", False):
        raise JaxspecError(f"{', '.join(kernel_flags)}: for --kernels-micro only")
    if args.limit < 0:
        raise JaxspecError(f"--limit must be 0 (all prompts) or more, got {args.limit}")
    if args.accept_prob is not None and not 0.0 <= args.accept_prob <= 1.0:
        raise JaxspecError(f"--accept-prob is a probability, between 0 and 1; got {args.accept_prob}")
    if args.accept_prob is not None and args.tree:
        raise JaxspecError("--accept-prob applies to chains only; drop --tree")
    if args.compare_numerics and args.suite:
        raise JaxspecError("--compare-numerics applies to single runs (--prompts-file), not --suite")
    if (args.regex or args.json_schema or args.choice) and args.suite:
        raise JaxspecError("--regex/--json-schema/--choice apply to single runs (--prompts-file), not --suite")
    if args.quantization_drift and (not args.quantize or args.suite):
        raise JaxspecError("--quantization-drift compares a --quantize target with its float original in a single run "
                           "(--prompts-file): add --quantize int8|fp8")
    if args.compare_hf and importlib.util.find_spec("torch") is None:
        raise JaxspecError(NEEDS_TORCH)
    for k in args.chain_lengths or []:
        if k > MAX_DRAFT_DEPTH:
            raise JaxspecError(f"--chain-lengths: {k} is more than {MAX_DRAFT_DEPTH} drafts per verify step")


def component_timings(model, head, k: int, batch: int, capacity: int = 256) -> dict:
    """Milliseconds of one target forward over 1 and K+1 tokens, and of one head step, at a half-full cache."""
    from jaxspec.engine.auto.step_costs import time_forwards

    seconds, draft, _ = time_forwards(model, head, batch, capacity, [1, k + 1], repeats=10)
    decode, verify = seconds[1], seconds[k + 1]
    return {
        "verified_tokens": k + 1,
        "target_decode_ms": round(decode * 1e3, 2),
        "target_verify_ms": round(verify * 1e3, 2),
        "verify_over_decode": round(verify / decode, 3),
        "head_step_ms": round(draft * 1e3, 2),
        "head_step_over_decode": round(draft / decode, 3),
    }


def _say(what: str) -> None:
    """What the bench is doing now, on stderr with the elapsed time: a run at 8B shapes spends minutes compiling."""
    print(f"bench [{time.perf_counter() - _START:.0f}s]: {what}", file=sys.stderr, flush=True)


_START = time.perf_counter()


def _machine() -> str:
    import jax

    return f"{platform.machine()} {jax.devices()[0].device_kind}, {jax.device_count()} device(s), JAX {jax.__version__}"


@main_guard
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.compiled_cost:
        return run_compiled_cost(args)  # before jax starts here: each chip compiles in a subprocess
    check_cost_args(args)
    from jaxspec.engine.generation import Generator
    from jaxspec.processors import LogitProcessors
    from jaxspec.prompts import read_prompts_file, suite_prompts

    if args.load_time:
        return run_load_time(args)
    if args.kernels_micro:
        return run_kernels_micro(args)
    check_generation_args(args, tree_sets_depth=False)
    check_bench_args(args)
    if args.serve_load:
        return run_serve_load(args)
    use_compile_cache(args)
    prompts = suite_prompts(args.suite) if args.suite else read_prompts_file(args.prompts_file)
    if args.limit:
        prompts = prompts[: args.limit]
    if args.suite:
        # written after each run: a bad path must fail first, and a directory of other files is not written over
        check_output_dir(suite_out(args), holds_own=holds_suite_report, what="suite report", overwrite=args.overwrite)
    mesh = resolve_mesh(args)
    draft = resolve_draft(args)  # first: with --draft alone, the head's config may name the target
    target_dir = resolve_target(args.target)
    ngram = ngram_proposer(args)
    if draft is None and (args.accept_prob is not None or args.tree):
        raise JaxspecError("--accept-prob and --tree need a draft head (--draft HEAD_DIR)")
    if draft is None and args.chain_lengths and getattr(args, "proposer", "eagle3") != "draft-model":
        raise JaxspecError("--chain-lengths needs a draft head (--draft HEAD_DIR) or --proposer draft-model")
    aux_ids = head_aux_layer_ids(draft, target_dir)
    checked = check_before_loading(args, target_dir, draft, mesh, [text for _, text in prompts],
                                   args.batch_sizes if args.suite else [args.batch_size])
    encoded, stops, automaton = checked.encoded, checked.stop_ids, checked.grammar
    model, tokenizer = load_target_and_tokenizer(
        target_dir, args.dtype, aux_layer_ids=aux_ids, mesh=mesh, numerics=args.numerics, kernels=kernels_impl(args),
        tokenizer=checked.tokenizer, quantize=args.quantize,
    )
    # an EAGLE-3 head or a DFlash drafter (--draft), or a small draft model (--proposer draft-model)
    head = load_draft_for(draft, model, args.dtype, args.allow_pickle, mesh) if draft else load_draft_model(
        args, model, tokenizer)
    draft = draft or (str(Path(args.draft_model).expanduser()) if head is not None else None)
    from jaxspec.models.dflash import DFlashDrafter

    if args.suite:
        return run_suite(args, model, head, draft, target_dir, encoded, stops, mesh, ngram)

    # Every method runs in one interleaved pass (`measure_interleaved`): batch by batch, in rotating order, so that
    # the machine's drift over minutes does not read as a speed-up or a slow-down.
    gen = Generator(model, batch_size=args.batch_size, mesh=mesh)
    # (name, generator, depth, draft path or proposer name, drafted tokens per verify to time the components of:
    # a fixed EAGLE-3 chain or tree; None for auto, which records its own step costs, and for n-gram)
    methods = []
    if head is not None:
        for tree in [None, *args.tree]:
            spec = draft_generator(
                model, head, draft, args.num_speculative_tokens, tree, batch_size=args.batch_size, mesh=mesh,
                kernels=kernels_impl(args), forced_accept_prob=args.accept_prob, store=step_cost_store(args),
                lookup=prompt_lookup(args),
            )
            name = drafter_method_name(head, args.num_speculative_tokens, tree, args.accept_prob)
            if tree is not None:  # a head's tree: its verify's width; a DFlash tree's draft is not a chain's
                drafted = None if isinstance(head, DFlashDrafter) else tree.total_tokens - 1
            else:
                drafted = None if args.num_speculative_tokens == AUTO else args.num_speculative_tokens
                longer = getattr(args, "prompt_lookup_tokens", None)  # every step verifies lookup's longer chain
                drafted = None if drafted is None else max(drafted, longer or 0)
            methods.append((name, spec, spec.num_draft, str(draft), drafted))
    if ngram is not None:
        spec = Generator(model, proposer=ngram, batch_size=args.batch_size, mesh=mesh, kernels=kernels_impl(args))
        methods.append((method_name(ngram.num_draft, None, proposer=ngram), spec, ngram.depth, ngram.name, None))
    label = "target-only" + "".join(f" | {name}" for name, *_ in methods)
    _say(f"generating, interleaved: {label} ({len(encoded)} prompts, batch {args.batch_size})")
    processors = None if automaton is None else LogitProcessors(grammar=automaton)
    measured = measure_interleaved([gen] + [m[1] for m in methods], encoded, args.max_new_tokens, stops, label,
                                   processors)
    completions, tokens, seconds = measured[0]
    weight_bytes = decode_weight_bytes(model)
    _say("measuring the memory bandwidth (copy probe)")
    bandwidth = measure_bandwidth_gbs()
    result = {
        "machine": _machine(),
        "target": target_dir.name,
        "dtype": str(model.dtype),
        "kernels": kernels_impl(args),
        "prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "batch_size": args.batch_size,
        "timing": "interleaved: each batch of prompts runs every method in turn, the order rotated by one each batch",
        "jaxspec": {"tokens": tokens, "seconds": round(seconds, 3), "tokens_per_second": round(tokens / seconds, 2)},
        "roofline": weights_roofline(weight_bytes, args.batch_size, bandwidth),
        "memory": {"target-only": gen.memory.as_dict()},
    }
    if automaton is not None:  # every answer that ended follows the grammar (one cut by the budget may not yet)
        ended = [c for c in completions if c.finished_by_eos]
        result["structured_output"] = {
            "grammar": next(k for k in ("regex", "json_schema", "choice") if getattr(args, k)),
            "ended": len(ended), "cut_by_budget": len(completions) - len(ended),
            "ended_and_matching": sum(automaton.matches(c.token_ids) for c in ended),
        }
    for (method, spec, depth, source, drafted), m in zip(methods, measured[1:]):
        row = speculative_row(*m, depth, completions, tokens / seconds)
        if drafted is not None and args.components:
            _say(f"timing {method}'s components: target forwards over 1 and {drafted + 1} tokens, one head step "
                 "(three programs compile)")
            row.update(component_timings(model, head, drafted, args.batch_size))
        result.setdefault("speculative", []).append({"method": method, "draft": source, **row})
        result["memory"][method] = spec.memory.as_dict()
    if args.quantization_drift:
        from jaxspec.bench.drift import quantization_drift

        _say("loading the float target to measure the quantized one's drift from it")
        float_model, _ = load_target_and_tokenizer(
            target_dir, args.dtype, log=False, aux_layer_ids=aux_ids, mesh=mesh, numerics=args.numerics,
            kernels=kernels_impl(args), tokenizer=tokenizer,
        )
        result["quantization_drift"] = {"quantize": args.quantize, **quantization_drift(float_model, model, encoded)}
        del float_model
    if args.compare_numerics:
        _say(f"every method again with {'plain' if args.numerics == 'invariant' else 'invariant'} numerics")
        result["numerics_cost"] = numerics_cost(args, model, head, draft, encoded, stops, mesh, result)
    if args.compare_hf:
        hf_seconds, hf_tokens, hf_outputs = time_hf(target_dir, encoded, args.max_new_tokens, stops)
        result["transformers"] = {
            "tokens": hf_tokens, "seconds": round(hf_seconds, 3), "tokens_per_second": round(hf_tokens / hf_seconds, 2),
            "identical_outputs": identical(hf_outputs, completions),
        }
        result["speedup_vs_transformers"] = round((tokens / seconds) / (hf_tokens / hf_seconds), 3)
        if is_draft_model(head):  # the same pair in transformers, K drafts a step as jaxspec's chain
            k = None if args.num_speculative_tokens == AUTO else args.num_speculative_tokens
            _say(f"transformers assisted generation with the draft model ({k or 'its own schedule of'} drafts a step)")
            a_seconds, a_tokens, a_outputs = time_hf(target_dir, encoded, args.max_new_tokens, stops, Path(draft), k)
            result["transformers_assisted"] = {
                "tokens": a_tokens, "seconds": round(a_seconds, 3),
                "tokens_per_second": round(a_tokens / a_seconds, 2),
                "identical_outputs": identical(a_outputs, completions),
            }
            if k is not None and prompt_lookup(args) is not None:
                _say("transformers assisted generation step by step: skipped, jaxspec's chains had prompt lookup "
                     "beside the draft model (compare with --prompt-lookup off)")
            elif k is not None:  # step for step against jaxspec's chain (the first method)
                _say("transformers assisted generation again, step by step")
                chain = measured[1][0]
                runs = assisted_steps(target_dir, Path(draft), encoded, [(c.token_ids or [None])[0] for c in chain],
                                      k, args.max_new_tokens, stops)
                result["transformers_assisted"].update(assisted_acceptance(runs, chain, k))
    if args.memory_report:
        for method, report in result["memory"].items():
            print(f"{method}: " + "\n".join(MemoryReport(**report).lines()), file=sys.stderr)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(_table(result))
    return 0


def numerics_cost(args, model, head, draft, encoded, stops, mesh, result: dict) -> list[dict]:
    """Every method of this run again with the other numerics, tokens/s both ways. The
    ratio is plain / invariant, i.e. how much faster dropping invariance would be."""
    from jaxspec.engine.generation import Generator

    measured = [("target-only", None, result["jaxspec"])] + [
        (sp["method"], tree, sp) for tree, sp in zip([None, *args.tree], result.get("speculative", []))
    ]
    other = "plain" if args.numerics == "invariant" else "invariant"
    saved = model.numerics
    model.numerics = None if other == "plain" else model.invariant_numerics(kernels_impl(args))
    rows = []
    try:
        for method, tree, first in measured:
            if method == "target-only":
                gen = Generator(model, batch_size=args.batch_size, mesh=mesh)
            else:
                gen = draft_generator(
                    model, head, draft, args.num_speculative_tokens, tree,
                    batch_size=args.batch_size, mesh=mesh, kernels=kernels_impl(args),
                    forced_accept_prob=args.accept_prob, store=step_cost_store(args), lookup=prompt_lookup(args),
                )
            out, tokens, seconds = measure(gen, encoded, args.max_new_tokens, stops, label=f"{method} ({other})")
            tps = {args.numerics: first["tokens_per_second"], other: round(tokens / seconds, 2)}
            rows.append({
                "method": method,
                "invariant_tokens_per_second": tps["invariant"],
                "plain_tokens_per_second": tps["plain"],
                "plain_over_invariant": round(tps["plain"] / tps["invariant"], 3),
            })
    finally:
        model.numerics = saved
    return rows


def cost_cases(args) -> list:
    """The --compiled-cost cases of the flags, checked before anything compiles."""
    from jaxspec.bench.compiled_cost import PLATFORMS, STEPS, CostCase
    from jaxspec.reference_shapes import SHAPES

    platforms, steps = args.cost_platforms.split(","), args.cost_steps.split(",")
    for flag, values, known in (("--cost-platforms", platforms, PLATFORMS), ("--cost-steps", steps, STEPS),
                                ("--cost-shape", [args.cost_shape], SHAPES)):
        unknown = [v for v in values if v not in known]
        if unknown:
            raise JaxspecError(f"{flag}: unknown {', '.join(unknown)}; known: {', '.join(known)}")
    if args.kernels == "interpret":
        raise JaxspecError("--compiled-cost compiles for chips: --kernels auto, pallas or reference")
    return [
        CostCase(p, args.cost_shape, s, b, n, args.numerics, args.kernels, quantize=args.quantize)
        for p in platforms for s in steps for b in args.cost_batch or [1, 8] for n in args.cost_lengths or [1024, 8192]
    ]


def check_cost_args(args) -> None:
    """The --cost-* flags belong to --compiled-cost."""
    cost_flags = [f"--cost-{name}" for name in ("batch", "lengths") if getattr(args, f"cost_{name}") is not None]
    cost_flags += [f"--cost-{name}" for name, default in (("platforms", "h100,v5e"), ("shape", "llama3.1-8b"),
                   ("steps", "decode,chain,tree")) if getattr(args, f"cost_{name}") != default]
    if cost_flags:
        raise JaxspecError(f"{', '.join(cost_flags)}: for --compiled-cost only")


def run_compiled_cost(args) -> int:
    """--compiled-cost: jaxspec/bench/compiled_cost.py, one subprocess per chip; one table (or JSON) of all."""
    from jaxspec.bench.compiled_cost import machine_versions, markdown, run_platforms

    cases = cost_cases(args)
    rows = run_platforms(cases, say=_say)
    result = {"machine": f"{platform.machine()} CPU, {os.cpu_count()} cores", **machine_versions(), "cases": rows}
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        versions = ", ".join(f"{k} {v}" for k, v in machine_versions().items())
        print(f"{args.cost_shape} (bfloat16), compiled on {result['machine']}, {versions}\n\n{markdown(rows)}")
    return 0


def serve_argv(args, draft: bool, prefill_chunk: int, step_buckets: bool = True) -> list[str]:
    """The server's arguments for --serve-load, from the benchmark's own (target, numerics, the draft or none)."""
    argv = ["--slots", str(args.slots or max(args.concurrency)), "--max-model-len", str(args.max_model_len),
            "--prefill-chunk", str(prefill_chunk), *([] if step_buckets else ["--no-step-buckets"])]
    for flag in ("target", "dtype", "quantize", "numerics", "kernels"):
        value = getattr(args, flag, None)
        if value is not None:
            argv += [f"--{flag}", str(value)]
    if not draft:
        return argv + ["--no-draft"]
    proposer = getattr(args, "proposer", "eagle3")
    if proposer != "eagle3":
        argv += ["--proposer", proposer]
    if proposer == "draft-model":
        argv += ["--draft-model", args.draft_model]
    if proposer == "ngram":
        argv += ["--ngram-min", str(args.ngram_min), "--ngram-max", str(args.ngram_max)]
    if args.draft:
        argv += ["--draft", args.draft]
    if args.num_speculative_tokens is not None:
        argv += ["--num-speculative-tokens", str(args.num_speculative_tokens)]
    if args.tree:
        argv += ["--tree", args.tree[0].spec]
    if getattr(args, "prompt_lookup", None) is not None and not (args.tree and args.prompt_lookup == "on"):
        argv += ["--prompt-lookup", args.prompt_lookup]  # (a served tree drafts from the drafter alone)
    if getattr(args, "prompt_lookup_tokens", None) is not None:
        argv += ["--prompt-lookup-tokens", str(args.prompt_lookup_tokens)]
    return argv + (["--allow-pickle"] if args.allow_pickle else [])


def run_serve_load(args) -> int:
    """--serve-load: jaxspec/bench/serve_load.py, speculative then target-only (or target-only alone)."""
    from jaxspec.bench.serve_load import run_load
    from jaxspec.prompts import read_prompts_file

    if importlib.util.find_spec("uvicorn") is None or importlib.util.find_spec("fastapi") is None:
        raise JaxspecError("--serve-load starts the server, which needs fastapi and uvicorn: "
                           "pip install 'jaxspec[serve]'")
    if len(args.tree) > 1:
        raise JaxspecError("--serve-load serves one --tree; give at most one")
    prompts = [text for _, text in read_prompts_file(args.serve_load)]
    prompts = prompts[: args.limit] if args.limit else prompts
    use_compile_cache(args)
    methods = []
    for chunk in args.prefill_chunk:
        on_off = args.step_buckets or [True]
        for buckets in on_off:
            suffix = "" if len(args.prefill_chunk) == 1 else f", prefill chunk {chunk}" if chunk else ", whole prefills"
            if len(on_off) > 1:
                suffix += ", steps on the live rows" if buckets else ", steps on all slots"
            if not args.no_draft:
                methods.append(("speculative" + suffix, serve_argv(args, True, chunk, buckets)))
            methods.append(("target-only" + suffix, serve_argv(args, False, chunk, buckets)))
    rows = run_load(methods, prompts, args.max_new_tokens, args.concurrency, say=_say)
    result = {"machine": _machine(), "prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
              "max_model_len": args.max_model_len, "load": rows}
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print("| method | concurrency | requests/s | TTFT mean / p50 / p90 (ms) | tokens/s per request | tokens/s | "
          "longest gap mean / p90 / max (ms) | tokens per verify |\n|---|---|---|---|---|---|---|---|")
    for r in rows:
        t, g = r["time_to_first_token_ms"], r["longest_gap_ms"]
        print(f"| {r['method']} | {r['concurrency']} | {r['requests_per_second']} | {t['mean']} / {t['p50']} / "
              f"{t['p90']} | {r['tokens_per_second_per_request']} | {r['tokens_per_second']} | {g['mean']} / "
              f"{g['p90']} / {g['max']} | {r['mean_accepted_length'] or ''} |")
    return 0


def run_kernels_micro(args) -> int:
    """--kernels-micro: jaxspec/bench/kernels.py at the probe's bandwidth."""
    import jax

    from jaxspec.bench.kernels import run_from_args, shapes_from_args

    shapes_from_args(args, jax.default_backend())  # bad flags fail before the probe
    return run_from_args(args, measure_bandwidth_gbs(), _machine(), probe_description())


def run_load_time(args) -> int:
    from pathlib import Path

    from jaxspec.bench.load import load_table, time_loads
    from jaxspec.engine.generation import default_dtype

    mesh = resolve_mesh(args)
    target_dir = resolve_target(args.target)
    result = time_loads(
        target_dir, Path(args.load_time), dtype=args.dtype or default_dtype(), mesh=mesh, repeats=args.repeats
    )
    result = {"machine": _machine(), "target": target_dir.name, **result}
    print(json.dumps(result, indent=2) if args.json else f"{result['machine']}, {result['target']}\n{load_table(result)}")
    return 0


def suite_name(args) -> str:
    """The name a --suite run reports under: a built-in suite's, or its prompts file's stem."""
    from pathlib import Path

    return Path(args.suite).stem.split(".")[0] if args.suite not in SUITES else args.suite


def suite_out(args):
    """Where a --suite run writes its report: --out, else bench-results/SUITE."""
    from pathlib import Path

    return Path(args.out or Path("bench-results") / suite_name(args))


def is_draft_model(drafter) -> bool:
    """Whether the loaded drafter is an independent draft model (`--proposer draft-model`)."""
    from jaxspec.models.llama import LlamaModel

    return isinstance(drafter, LlamaModel)


def drafter_method_name(drafter, num_draft, tree, accept_prob) -> str:
    """`method_name`, prefixed `draft model ` for a draft model's chains (`draft model chain K=3`, `draft model
    auto`)."""
    name = method_name(num_draft, tree, accept_prob)
    return f"draft model {name}" if is_draft_model(drafter) else name


def run_suite(args, model, head, draft, target_dir, encoded, stops, mesh, ngram=None) -> int:
    """Every method at every batch size on one prompt set; the report goes to --out, rewritten after each run."""
    import jax
    from tqdm import tqdm

    from jaxspec import compiled_programs
    from jaxspec.bench.suite import write_report
    from jaxspec.engine.generation import Generator
    from jaxspec.engine.tree import TreeConfig

    chains = [(k, None) for k in (args.chain_lengths or [3, 5])] if head is not None else []
    from jaxspec.models.dflash import DFlashDrafter
    from jaxspec.models.gemma4_assistant import Gemma4Assistant

    # an EAGLE-3 head's trees: --tree, else a default one; a DFlash drafter's (from its block's slots) only with
    # --tree, whose depth must fit its block; a Gemma 4 assistant and a draft model draft chains here
    drafts_trees = (head is not None and not isinstance(head, (DFlashDrafter, Gemma4Assistant))
                    and not is_draft_model(head))
    trees = [] if not drafts_trees or args.accept_prob is not None else args.tree or [TreeConfig(16, 5, 4)]
    if isinstance(head, DFlashDrafter) and args.accept_prob is None:
        trees = list(args.tree)
    methods = chains + [(1, t) for t in trees]  # (num_draft, tree); a tree sets its own depth
    if head is not None and args.accept_prob is None:
        methods.append((AUTO, None))
    if ngram is not None:
        methods.append((ngram.num_draft, "ngram"))
    suite = suite_name(args)
    runs, baselines = [], {}  # baselines: batch size → (target-only completions, tokens/s)
    result = {
        "suite": suite, "machine": _machine(), "target": target_dir.name, "dtype": str(model.dtype),
        "kernels": kernels_impl(args), "draft": Path(draft).name if draft else (ngram.name if ngram else ""),
        "prompts": len(encoded),
        "max_new_tokens": args.max_new_tokens, "mesh": args.mesh or "", "jax": jax.__version__, "runs": runs,
    }
    out_dir = suite_out(args)
    paths = []  # what the last report wrote

    def finish_run() -> None:
        """After each run: the report so far goes to disk, so a suite cut short (hours on a CPU) keeps what it
        measured; and the run's compiled programs are released (`compiled_programs.release`): a suite that kept
        every method's programs ran into Linux's per-process memory-map limit and died in LLVM after ~75 minutes
        (compiled_programs.py says why). The next run recompiles, from the on-disk compile cache when it is on,
        outside its timed pass."""
        bar.update()
        if jax.process_index() == 0:  # multi-host: every process has the same results; one writes them
            paths[:] = write_report(result, out_dir)
        compiled_programs.release()

    bar = tqdm(total=len(args.batch_sizes) * (1 + len(methods)) + args.compare_hf * (1 + is_draft_model(head)),
               desc="bench", unit="run")
    for b in args.batch_sizes:
        name = f"batch {b} target-only"
        bar.set_postfix_str(name)
        gen = Generator(model, batch_size=b, mesh=mesh)
        base, tokens, seconds = measure(gen, encoded, args.max_new_tokens, stops, name)
        baselines[b] = (base, tokens / seconds)
        runs.append({"batch_size": b, "method": "target-only", "tokens": tokens, "seconds": round(seconds, 3),
                     "tokens_per_second": round(tokens / seconds, 2), "speedup_vs_target_only": 1.0,
                     "memory": gen.memory.as_dict()})
        first = args.batch_sizes[0]
        if b != first:  # invariant numerics: the other rows of a batch never change a row's tokens
            runs[-1]["identical_outputs"] = f"{identical(base, baselines[first][0])} (to batch {first})"
        del gen
        finish_run()
        for num_draft, tree in methods:
            if tree == "ngram":
                name = method_name(num_draft, None, proposer=ngram)
                spec = Generator(model, proposer=ngram, batch_size=b, mesh=mesh, kernels=kernels_impl(args))
                depth = ngram.depth
            else:
                name = drafter_method_name(head, num_draft, tree, args.accept_prob)
                spec = draft_generator(model, head, draft, num_draft, tree, batch_size=b, mesh=mesh,
                                             kernels=kernels_impl(args), forced_accept_prob=args.accept_prob,
                                             store=step_cost_store(args), lookup=prompt_lookup(args))
                depth = spec.num_draft
            bar.set_postfix_str(f"batch {b} {name}")
            measured = measure(spec, encoded, args.max_new_tokens, stops, f"batch {b} {name}")
            runs.append({"batch_size": b, "method": name, **speculative_row(*measured, depth, *baselines[b]),
                         "memory": spec.memory.as_dict()})
            del spec
            finish_run()
    hf_methods = [("transformers generate", None)] if args.compare_hf else []
    if hf_methods and is_draft_model(head):  # the same pair in transformers
        hf_methods.append(("transformers generate, assistant_model = the draft model", Path(draft)))
    for method, assistant_dir in hf_methods:
        bar.set_postfix_str(f"batch 1 {method}")
        hf_seconds, hf_tokens, hf_outputs = time_hf(target_dir, encoded, args.max_new_tokens, stops, assistant_dir)
        row = {"batch_size": 1, "method": method, "tokens": hf_tokens, "seconds": round(hf_seconds, 3),
               "tokens_per_second": round(hf_tokens / hf_seconds, 2)}
        if 1 in baselines:
            base, base_tps = baselines[1]
            row["speedup_vs_target_only"] = round(hf_tokens / hf_seconds / base_tps, 3)
            row["identical_outputs"] = identical(hf_outputs, base)
        runs.append(row)
        finish_run()
    bar.close()
    if jax.process_index() == 0:  # the report after the last run is the whole report
        print(json.dumps(result, indent=2) if args.json else (out_dir / "results.md").read_text())
        print("wrote " + ", ".join(str(p) for p in paths), file=sys.stderr)
    return 0


def _table(r: dict) -> str:
    rows = [("jaxspec target-only", r["jaxspec"])]
    for sp in r.get("speculative", []):
        rows.append((f"jaxspec {sp['method']}", sp))
    if "transformers" in r:
        rows.append(("transformers generate", r["transformers"]))
    if "transformers_assisted" in r:
        rows.append(("transformers generate, assistant_model = the draft model", r["transformers_assisted"]))
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
        f"| weights-only roofline ({roof['weight_bytes'] / 1e6:.0f} MB per step at {roof['bandwidth_gb_per_s']} GB/s, "
        f"copy probe) | | | {roof['tokens_per_second']} |"
    )
    for sp in r.get("speculative", []):
        lines += [
            "",
            f"{sp['method']}: {sp['speedup_vs_target_only']}x target-only; mean accepted length "
            f"{sp.get('mean_accepted_length', 'n/a (no batch speculated)')}; acceptance per position "
            f"{sp.get('acceptance_per_position', [])}; identical outputs {sp['identical_outputs']}",
        ]
        if "target_decode_ms" in sp:
            lines.append(
                f"  one target decode {sp['target_decode_ms']} ms; verify of {sp['verified_tokens']} tokens "
                f"{sp['target_verify_ms']} ms ({sp['verify_over_decode']}x); one head step {sp['head_step_ms']} ms "
                f"({sp['head_step_over_decode']}x)"
            )
        if "auto_last" in sp:
            lines.append("  " + auto_line(sp))
    assisted = r.get("transformers_assisted", {})
    if "same_steps_as_jaxspec" in assisted:
        lines += ["", f"transformers assisted generation, {assisted['num_assistant_tokens']} drafts a step: mean "
                  f"accepted length {assisted['mean_accepted_length']}; accepted drafts per step "
                  f"{assisted['accepted_drafts_histogram']}; the same steps as jaxspec's chain on "
                  f"{assisted['same_steps_as_jaxspec']} prompts; identical outputs {assisted['identical_outputs']}"]
    lines += rejection_table([{"batch_size": r["batch_size"], **sp} for sp in r.get("speculative", [])])
    if "numerics_cost" in r:
        lines += ["", "| method | invariant numerics tokens/s | plain numerics tokens/s | plain / invariant |",
                  "|---|---|---|---|"]
        lines += [f"| {c['method']} | {c['invariant_tokens_per_second']} | {c['plain_tokens_per_second']} | "
                  f"{c['plain_over_invariant']} |" for c in r["numerics_cost"]]
    if "quantization_drift" in r:
        d = r["quantization_drift"]
        lines += ["", f"{d['quantize']} target against its float original, {d['positions']} prompt positions: "
                  f"next-token KL {d['next_token_kl']:.3g}, argmax agreement {d['argmax_agreement']:.3f}",
                  "| aux layer | cosine | relative error |", "|---|---|---|"]
        lines += [f"| {a['layer']} | {a['cosine']:.5f} | {a['relative_error']:.4f} |" for a in d["aux_layers"]]
    if "speedup_vs_transformers" in r:
        lines += ["", f"jaxspec / transformers: {r['speedup_vs_transformers']}x "
                  f"(identical outputs: {r['transformers']['identical_outputs']})"]
    return "\n".join(lines)
