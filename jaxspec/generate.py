"""python -m jaxspec.generate: generate text with a Llama-family target (the main job).

Examples:
  python -m jaxspec.generate --prompt "Explain speculative decoding in one sentence."
  python -m jaxspec.generate --target DIR --draft HEAD_DIR --num-speculative-tokens 5 --prompt "..."
  python -m jaxspec.generate --prompts-file mt_bench.jsonl --batch-size 4 --max-new-tokens 128 --json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from jaxspec.cli.args import (
    AUTO,
    SEED_RANGE,
    OneLineParser,
    add_draft_args,
    add_step_cost_args,
    add_structured_output_args,
    add_target_args,
    check_generation_args,
    integer,
    method_name,
    parse_tree,
    prompt_lookup,
)
from jaxspec.cli.loading import (
    auto_among_drafters,
    check_before_loading,
    draft_generator,
    head_aux_layer_ids,
    kernels_impl,
    load_draft_for,
    load_draft_model,
    load_target_and_tokenizer,
    ngram_proposer,
    resolve_draft,
    resolve_target,
    step_cost_store,
)
from jaxspec.cli.mesh import add_mesh_args, resolve_mesh
from jaxspec.errors import JaxspecError
from jaxspec.cli.program import main_guard, run_program, use_compile_cache


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="python -m jaxspec.generate",
        description="Generate text with a Llama-family target model (greedy unless --temperature > 0).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n", 2)[2],
    )
    add_target_args(parser)
    add_step_cost_args(parser)
    add_draft_args(parser)
    parser.add_argument(
        "--also-draft", metavar="PATH",
        help="another drafter of the same target (an EAGLE-3 head or a DFlash drafter): automatic speculation "
        "then chooses per batch among both drafters' chains and trees and target-only (default: none)",
    )
    add_mesh_args(parser)
    parser.add_argument(
        "--tree", type=parse_tree, metavar="TOTAL,DEPTH,TOPK",
        help="draft EAGLE-2 dynamic trees instead of chains: TOTAL tokens verified per step (root included), "
        "DEPTH levels, TOPK children per expanded node (e.g. 32,6,8)",
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="one prompt")
    source.add_argument(
        "--prompts-file",
        metavar="FILE.jsonl",
        help='JSONL prompts: {"question_id", "turns": [...]} (MT-Bench, first turn) or {"id", "prompt"}',
    )
    parser.add_argument("--max-new-tokens", type=integer(None), default=256, metavar="N",
                        help="new tokens per prompt (default: 256)")
    parser.add_argument(
        "--temperature", type=float, default=0.0, metavar="T", help="sampling temperature (default: 0.0, greedy)"
    )
    parser.add_argument(
        "--top-p", type=float, default=1.0, metavar="P", help="nucleus sampling mass, (0, 1] (default: 1.0, off)"
    )
    parser.add_argument(
        "--top-k", type=integer(None), default=0, metavar="K", help="keep the K most likely tokens (default: 0, off)"
    )
    processors = parser.add_argument_group(
        "logit processors", "applied alike in target-only decoding, drafting and verification, so greedy output stays "
        "exactly the target's and sampling stays lossless (in a tree, each node counts its own ancestors)",
    )
    processors.add_argument(
        "--repetition-penalty", type=float, default=1.0, metavar="F",
        help="divide positive (multiply negative) logits of tokens in the prompt or output by F, as transformers "
        "(default: 1.0, off)",
    )
    processors.add_argument(
        "--presence-penalty", type=float, default=0.0, metavar="F",
        help="subtract F from the logit of every token the output holds, as OpenAI (default: 0.0, off)",
    )
    processors.add_argument(
        "--frequency-penalty", type=float, default=0.0, metavar="F",
        help="subtract F per occurrence in the output, as OpenAI (default: 0.0, off)",
    )
    processors.add_argument(
        "--min-p", type=float, default=0.0, metavar="P",
        help="sampling: drop tokens less likely than P times the most likely one, [0, 1] (default: 0.0, off)",
    )
    processors.add_argument(
        "--logit-bias", metavar="JSON",
        help='add biases to token logits, OpenAI\'s format: \'{"42": -100, "7": 2.5}\' (token id: bias)',
    )
    add_structured_output_args(parser)
    parser.add_argument("--seed", type=integer(*SEED_RANGE), default=0, help="sampling seed (default: 0)")
    parser.add_argument(
        "--batch-size", type=integer(None), default=1, metavar="B", help="prompts generated together (default: 1)"
    )
    parser.add_argument("--raw", action="store_true", help="feed prompts as plain text, without the chat template")
    parser.add_argument("--json", action="store_true", help="print one JSON object per prompt instead of text")
    parser.add_argument(
        "--memory-report", action="store_true",
        help="report device memory: target and head parameters, their KV caches, the compiled step's peak (per "
        "device on a mesh); on stderr, and as a `memory` object in --json records",
    )
    return parser


@main_guard
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from jaxspec.engine.generation import Generator
    from jaxspec.processors import LogitProcessors
    from jaxspec.files import utf8_text
    from jaxspec.prompts import read_prompts_file
    from jaxspec.sampling import SamplingConfig

    check_generation_args(args, tree_sets_depth=True)
    use_compile_cache(args)
    sampling = SamplingConfig(args.temperature, args.top_k, args.top_p)  # validates before any loading
    processors = LogitProcessors(
        repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty, min_p=args.min_p,
        logit_bias=LogitProcessors.parse_bias(args.logit_bias) if args.logit_bias else (),
    )
    if args.prompt is not None:
        prompts = [("0", utf8_text(args.prompt, "--prompt"))]
    else:
        prompts = read_prompts_file(args.prompts_file)
    mesh = resolve_mesh(args)
    kernels = kernels_impl(args)
    draft = resolve_draft(args)
    target_dir = resolve_target(args.target)
    aux_ids = head_aux_layer_ids(draft, target_dir)
    also_aux = _check_also_draft(args, draft, target_dir)
    checked = check_before_loading(
        args, target_dir, draft, mesh, [text for _, text in prompts], [args.batch_size], processors
    )
    encoded, stops = checked.encoded, checked.stop_ids
    model, tokenizer = load_target_and_tokenizer(
        target_dir, args.dtype, aux_layer_ids=aux_ids, mesh=mesh, numerics=args.numerics, kernels=kernels,
        tokenizer=checked.tokenizer, quantize=args.quantize,
    )
    processors = dataclasses.replace(processors, grammar=checked.grammar)
    ngram = ngram_proposer(args)
    drafter = None
    if not args.also_draft:  # an EAGLE-3 head or a DFlash drafter (--draft), or a small draft model
        drafter = load_draft_for(draft, model, args.dtype, args.allow_pickle, mesh) if draft else load_draft_model(
            args, model, tokenizer)
    if args.also_draft:  # auto among both drafters, each over a view of the target with its own feature layers
        generator = auto_among_drafters(
            model, [draft, args.also_draft], [aux_ids, also_aux], dtype=args.dtype, allow_pickle=args.allow_pickle,
            batch_size=args.batch_size, mesh=mesh, kernels=kernels, store=step_cost_store(args),
            lookup=prompt_lookup(args),
        )
    elif drafter is not None:
        generator = draft_generator(
            model, drafter, draft or args.draft_model, args.num_speculative_tokens, args.tree,
            batch_size=args.batch_size, mesh=mesh, kernels=kernels, store=step_cost_store(args),
            lookup=prompt_lookup(args),
        )
    else:  # target-only, or drafts by prompt lookup
        generator = Generator(model, proposer=ngram, batch_size=args.batch_size, mesh=mesh, kernels=kernels)
    generator.on_compile = lambda msg: print(msg, file=sys.stderr)

    stream = not args.json and args.batch_size == 1
    streamer = _Streamer(tokenizer, prompts) if stream else None
    completions = generator.generate(
        encoded,
        max_new_tokens=args.max_new_tokens,
        sampling=sampling,
        stop_ids=stops,
        seed=args.seed,
        processors=processors,
        on_tokens=streamer.on_tokens if streamer else None,
        progress=None if stream or len(encoded) == 1 else "generate",
    )
    if streamer:
        streamer.finish()
    for (pid, text), ids, c in zip(prompts, encoded, completions):
        out_text = tokenizer.decode(c.token_ids, skip_special_tokens=True)
        if args.json:
            record = {
                "id": pid,
                "prompt": text,
                "text": out_text,
                "token_ids": c.token_ids,
                "num_generated": c.num_generated,
                "stats": {
                    "prompt_tokens": c.prompt_tokens,
                    "tokens_per_second": round(c.num_generated / c.seconds, 3),
                    "seconds": round(c.seconds, 4),
                    "prefill_seconds": round(c.prefill_seconds, 4),
                    "batch_size": c.batch_size,
                    "finished_by_eos": c.finished_by_eos,
                    "compile_seconds": round(generator.compile_seconds, 2),
                    **c.stats,
                },
            }
            if args.memory_report:
                record["memory"] = generator.memory.as_dict()
            print(json.dumps(record), flush=True)
        elif not stream:
            print(f"### {pid}\n{out_text}\n", flush=True)
    if args.memory_report:
        print("\n".join(generator.memory.lines()), file=sys.stderr)
    if not args.json:
        total = sum(c.num_generated for c in completions)
        seconds = _wall(completions, args.batch_size)
        method = _method_summary(args, draft or ngram or generator.proposer, completions, ngram or generator.proposer)
        print(f"[{total} tokens in {seconds:.2f}s: {total / seconds:.1f} tokens/s; {method}]", file=sys.stderr)
    return 0


def _method_summary(args, draft, completions, proposer=None) -> str:
    """What ran and, when speculating, how many tokens each target verify step produced (bonus token included):
    the number that says whether speculation paid (1.0 means every draft was rejected)."""
    if not draft:
        return "target-only"
    method = method_name(args.num_speculative_tokens, args.tree, proposer=proposer)
    from jaxspec.engine.generation import tokens_per_verify
    from jaxspec.engine.auto.generator import describe_choices

    if method == "auto" and args.also_draft:
        from jaxspec.engine.auto.among import describe_among

        method = f"auto among {draft} and {args.also_draft}: {describe_among(completions, args.batch_size)}"
    elif method == "auto":
        method = f"auto: {describe_choices(completions, args.batch_size)}"
    per_verify = tokens_per_verify(completions)
    per_verify = f"{per_verify:.2f}" if per_verify is not None else "n/a"
    steps = sum(c.stats.get("verify_calls", 0) for c in completions)
    looked = sum(c.stats.get("lookup_steps", 0) for c in completions)
    lookup = f", prompt lookup drafted {looked / steps:.0%} of them" if steps and any(
        "lookup_steps" in c.stats for c in completions) else ""
    return f"{method}, {per_verify} tokens per verify step{lookup}"


def _check_also_draft(args, draft: str | None, target_dir):
    """--also-draft's one-line errors before anything loads, and the layers it reads (`head_aux_layer_ids`)."""
    if not args.also_draft:
        return None
    if getattr(args, "proposer", "eagle3") != "eagle3" or args.no_draft:
        given = "--no-draft" if args.no_draft else f"--proposer {args.proposer}"
        raise JaxspecError(f"--also-draft adds a second EAGLE-3 head or DFlash drafter to --draft's; drop {given}")
    if draft is None:
        raise JaxspecError("--also-draft adds a second drafter to --draft's (an EAGLE-3 head or a DFlash drafter); "
                           "give --draft too")
    if args.tree or args.num_speculative_tokens not in (None, AUTO):
        raise JaxspecError("--also-draft lets automatic speculation choose between the drafters; drop "
                           + ("--tree" if args.tree else "--num-speculative-tokens"))
    from jaxspec.checkpoints.heads import read_head_config

    read_head_config(args.also_draft)  # a missing drafter fails here
    return head_aux_layer_ids(args.also_draft, target_dir)


def _wall(completions, batch_size: int) -> float:
    """Total wall time: each batch counted once."""
    return sum(c.seconds for i, c in enumerate(completions) if i % batch_size == 0)


class _Streamer:
    """Prints text as tokens arrive, decoding the whole continuation each time so multi-byte characters come out whole."""

    def __init__(self, tokenizer, prompts):
        self.tokenizer = tokenizer
        self.prompts = prompts
        self.current = -1
        self.ids: list[int] = []
        self.printed = ""

    def on_tokens(self, index: int, new_ids: list[int]) -> None:
        if index != self.current:
            self.finish()
            self.current, self.ids, self.printed = index, [], ""
            if len(self.prompts) > 1:
                print(f"### {self.prompts[index][0]}", flush=True)
        self.ids += new_ids
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the rest
            return
        sys.stdout.write(text[len(self.printed) :])
        sys.stdout.flush()
        self.printed = text

    def finish(self) -> None:
        if self.current >= 0:
            print("\n", flush=True)
        self.current = -1


if __name__ == "__main__":
    run_program(main)
