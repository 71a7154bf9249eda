"""python -m jaxspec.serve: an OpenAI-compatible server over the speculative engine, with continuous batching.

Examples:
  python -m jaxspec.serve                                  # the built-in SmolLM2 target and its head, port 8000
  python -m jaxspec.serve --target DIR --draft HEAD_DIR --num-speculative-tokens 5 --slots 16 --max-model-len 4096
  python -m jaxspec.serve --no-draft --port 9000
  python -m jaxspec.serve --target DIR --proposer draft-model --draft-model SMALL_DIR   # a small draft model
  python -m jaxspec.serve --target DIR --draft HEAD_DIR --mesh data=2,model=4 --slots 16   # 8 devices of one host

Then any OpenAI client: base_url http://127.0.0.1:8000/v1 (README, "Serve").
"""

from __future__ import annotations

import argparse
import importlib.util
import sys

from jaxspec.cli.args import (
    OneLineParser,
    add_draft_args,
    add_step_cost_args,
    add_target_args,
    check_generation_args,
    integer,
    parse_tree,
    prompt_lookup,
)
from jaxspec.cli.mesh import add_mesh_args, resolve_mesh
from jaxspec.cli.program import main_guard, run_program, use_compile_cache
from jaxspec.errors import JaxspecError



def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="python -m jaxspec.serve",
        description="Serve a Llama-family target over HTTP (OpenAI's completions and chat APIs), speculating with "
        "a draft, continuously batched.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n", 2)[2],
    )
    add_target_args(parser)
    add_mesh_args(parser)
    add_step_cost_args(parser)
    add_draft_args(parser)
    parser.add_argument("--tree", type=parse_tree, metavar="TOTAL,DEPTH,TOPK",
                        help="draft EAGLE-2 dynamic trees instead of chains (default: none, chains)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    parser.add_argument("--port", type=integer(1, 65535), default=8000,
                        help="port to listen on (default: %(default)s)")
    parser.add_argument("--slots", type=integer(1), default=4, metavar="N",
                        help="requests generated at once (the compiled batch; more wait in a queue) "
                        "(default: %(default)s)")
    parser.add_argument("--max-model-len", type=integer(1), default=2048, metavar="N",
                        help="prompt + new tokens one request may hold (each slot's cache; at most the model's "
                        "context) (default: %(default)s)")
    parser.add_argument("--chunk-steps", type=integer(1), default=2, metavar="N",
                        help="engine steps between two chances for waiting requests to join (default: %(default)s)")
    parser.add_argument("--prefill-chunk", type=integer(0), default=512, metavar="N",
                        help="a prompt longer than this joining while others run is prefilled N tokens at a time, "
                        "a chunk before each step, so the running requests keep streaming; 0: whole prefills "
                        "(default: %(default)s)")
    parser.add_argument("--no-step-buckets", action="store_true",
                        help="run every chunk of steps on all slots; by default each runs on the live requests' rows "
                        "alone (the smallest compiled batch of a power of two that holds them), so a lone request "
                        "does not pay for idle slots, and with --num-speculative-tokens auto speculation is chosen "
                        "per bucket")
    parser.add_argument("--max-logprobs", type=integer(-1, 20), default=5, metavar="N",
                        help="the most alternatives per token a request may ask with logprobs (each step keeps "
                        "this many for every slot); -1: logprobs off, nothing computed (default: %(default)s)")
    parser.add_argument("--default-max-tokens", type=integer(1), default=256, metavar="N",
                        help="new tokens for a chat request that names no max_tokens (default: %(default)s)")
    parser.add_argument("--served-model-name", metavar="NAME",
                        help="the model id clients name (default: the target directory's name)")
    parser.add_argument("--temperature", type=float, default=0.0, metavar="T",
                        help="the sampling temperature of requests that name none (default: 0.0, greedy)")
    parser.add_argument("--top-p", type=float, default=1.0, metavar="P",
                        help="the nucleus mass of requests that name none, (0, 1] (default: 1.0, off)")
    parser.add_argument("--top-k", type=integer(0), default=0, metavar="K",
                        help="the top-k of requests that name none (default: 0, off)")
    parser.add_argument("--max-grammar-states", type=integer(0), default=2048, metavar="S",
                        help="structured output: automaton states one request's grammar may have; every slot holds "
                        "tables of this size, so any grammar up to it runs the compiled step (0: structured output "
                        "off) (default: %(default)s)")
    parser.add_argument("--max-grammar-classes", type=integer(1), default=256, metavar="C",
                        help="structured output: token classes (tokens alike in every state) one request's grammar "
                        "may have (default: %(default)s)")
    parser.add_argument("--seed", type=integer(0), default=0,
                        help="where the seeds of requests that name none come from (default: 0)")
    return parser


def build_server(args):
    """(FastAPI app, Scheduler) for parsed arguments: the target and draft loaded, the engine thread started."""
    from jaxspec.cli.loading import (
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
    from jaxspec.engine.auto.generator import AutoSpeculativeGenerator
    from jaxspec.engine.generation import Generator, capacity_bucket
    from jaxspec.engine.slots import SlotBatcher, row_buckets
    from pallas_kernels.mesh_axes import DATA
    from jaxspec.grammar import GrammarCompiler
    from jaxspec.prompts import stop_token_ids
    from jaxspec.sampling import SamplingConfig
    from jaxspec.serve.app import ServedModel, make_app
    from jaxspec.serve.scheduler import Scheduler

    sampling = SamplingConfig(args.temperature, args.top_k, args.top_p)
    if args.distributed:
        raise JaxspecError("the server runs in one process; drop --distributed (--mesh shards over this host's "
                           "devices)")
    mesh = resolve_mesh(args)
    kernels = kernels_impl(args)
    draft = resolve_draft(args)
    target_dir = resolve_target(args.target)
    check_serving_before_loading(args, target_dir, draft, mesh)
    model, tokenizer = load_target_and_tokenizer(
        target_dir, args.dtype, aux_layer_ids=head_aux_layer_ids(draft, target_dir), mesh=mesh,
        numerics=args.numerics, kernels=kernels, quantize=args.quantize,
    )
    context = model.config.context_length
    say = lambda msg: print(msg, file=sys.stderr)  # noqa: E731
    # an EAGLE-3 head or a DFlash drafter (--draft), or a small draft model (--proposer draft-model)
    drafter = load_draft_for(draft, model, args.dtype, args.allow_pickle, mesh) if draft else load_draft_model(
        args, model, tokenizer)
    drafting_rows = None  # every step drafts (with a proposer)
    if drafter is not None:
        generator = draft_generator(model, drafter, draft or args.draft_model, args.num_speculative_tokens,
                                    args.tree, batch_size=args.slots, mesh=mesh, kernels=kernels,
                                    store=step_cost_store(args), lookup=prompt_lookup(args))
        if isinstance(generator, AutoSpeculativeGenerator):
            # auto: the method for the slots' state, drafting in the buckets of live rows where it pays (priced at
            # each bucket's batch size and a full cache); without step buckets, one choice for all the slots
            generator.on_compile = say
            capacity = generator.cost_capacity([[0]], args.max_model_len - 1)
            data = mesh.shape[DATA] if mesh is not None else 1
            buckets = [args.slots] if args.no_step_buckets else row_buckets(args.slots, data)
            plan = generator.live_batch_plan(capacity, buckets)
            say(f"auto: {plan.describe()} ({args.slots} slots)")
            generator, drafting_rows = generator.generator_for(plan.method), plan.drafting_rows
            if plan.method == 0 or drafting_rows == frozenset(buckets):
                drafting_rows = None  # one kind of step everywhere
        generator.chunk_steps = args.chunk_steps
    else:
        generator = Generator(model, proposer=ngram_proposer(args), batch_size=args.slots, mesh=mesh,
                              chunk_steps=args.chunk_steps, kernels=kernels)
    generator.on_compile = say
    generator.keep_logprobs(None if args.max_logprobs < 0 else args.max_logprobs)
    capacity = capacity_bucket(args.max_model_len + generator.extra_capacity, context + generator.extra_capacity)
    stops = stop_token_ids(tokenizer, target_dir, model.config.eos_token_ids)
    grammar_shape = (args.max_grammar_states, args.max_grammar_classes) if args.max_grammar_states else None
    batcher = SlotBatcher(generator, capacity=capacity, stop_ids=stops, seed=args.seed, max_tokens=args.max_model_len,
                          grammar_shape=grammar_shape, prefill_chunk=args.prefill_chunk or None,
                          step_buckets=not args.no_step_buckets, drafting_rows=drafting_rows)
    print(f"compiled the engine in {batcher.warm_up():.1f}s (cache {capacity} slots per request)", file=sys.stderr)
    scheduler = Scheduler(batcher)
    name = args.served_model_name or target_dir.name
    grammars = GrammarCompiler(tokenizer, model.config.vocab_size, stops) if grammar_shape else None
    served = ServedModel(scheduler, tokenizer, name, sampling, args.default_max_tokens, model.config.vocab_size,
                         grammars, generator.logprobs)
    return make_app(served), scheduler


def check_serving_before_loading(args, target_dir, draft: str | None, mesh=None) -> None:
    """The one-line errors a server can give before any weights load: --max-model-len past the target's context,
    a mesh that does not fit the model's heads or the --slots, weight files that are not whole safetensors (the
    target's and the draft's), a JAXSPEC_STEP_COSTS that is no store (with a draft: automatic speculation reads
    it)."""
    from jaxspec.cli.loading import check_files_before_loading, check_mesh_fits
    from jaxspec.config import load_target_config

    config = load_target_config(target_dir)
    if args.max_model_len > config.context_length:
        raise JaxspecError(f"--max-model-len {args.max_model_len} exceeds the model's context length "
                           f"{config.context_length}; lower it")
    check_mesh_fits(mesh, config, draft, [args.slots], "--slots")
    check_files_before_loading(args, target_dir, draft)


def check_port_free(host: str, port: int) -> None:
    """Listening must work before the model loads and compiles (uvicorn's own error came after both, exit 3)."""
    import socket

    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: a closing port is free
            probe.bind((host, port))
    except OSError as e:
        raise JaxspecError(f"cannot listen on {host}:{port} ({e.strerror or e}); choose another --port or --host") \
            from None


@main_guard
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    check_generation_args(args, tree_sets_depth=True)
    missing = [name for name in ("fastapi", "uvicorn", "prometheus_client") if importlib.util.find_spec(name) is None]
    if missing:
        raise JaxspecError(f"the server needs {', '.join(missing)}: pip install 'jaxspec[serve]'")
    import uvicorn

    check_port_free(args.host, args.port)
    use_compile_cache(args)
    app, scheduler = build_server(args)
    scheduler.start()
    print(f"serving on http://{args.host}:{args.port}/v1 ({args.slots} slots)", file=sys.stderr)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    finally:
        scheduler.stop()
    return 0


if __name__ == "__main__":
    run_program(main)
