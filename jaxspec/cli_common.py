"""Pieces shared by the command-line tools: the target flags, model loading, one-line errors."""

from __future__ import annotations

import argparse
import functools
import os
import signal
import sys
import threading
import time
from pathlib import Path

from jaxspec.config import MAX_DRAFT_DEPTH
from jaxspec.errors import JaxspecError


def positive_int_list(text: str) -> list[int]:
    """argparse type: positive integers separated by commas (1,4,16)."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas, got {text!r}")
    return values


AUTO = "auto"


def speculative_tokens(text: str) -> int | str:
    """argparse type of --num-speculative-tokens: a whole number of drafts, or `auto`."""
    if text.strip().lower() == AUTO:
        return AUTO
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of drafts or 'auto', got {text!r}") from None


NUMERICS_HELP = {
    "invariant": "invariant: each token's logits are the same bits whether it is decoded, verified or batched, so "
    "greedy speculation equals target-only output in any dtype",
    "plain": "plain: XLA's own numerics, faster prefill, verify and batched decoding, but bfloat16 speculation can "
    "then change the text",
}


def add_target_args(parser: argparse.ArgumentParser, numerics: str = "invariant", numerics_why: str = "") -> None:
    """--target, --dtype, --numerics (default `numerics`; `numerics_why` says why a command changes it), --kernels,
    --no-compile-cache."""
    parser.add_argument(
        "--target",
        metavar="DIR",
        help="Hugging Face model directory (config.json + *.safetensors + tokenizer); "
        "default: the built-in SmolLM2-135M-Instruct, built on first use",
    )
    parser.add_argument(
        "--dtype", choices=("float32", "bfloat16"), help="parameter dtype (default: float32 on CPU, bfloat16 on GPU/TPU)"
    )
    parser.add_argument(
        "--numerics", choices=tuple(NUMERICS_HELP), default=numerics,
        help="; ".join(text + (" (default)" if name == numerics else "") for name, text in NUMERICS_HELP.items())
        + numerics_why,
    )
    parser.add_argument(
        "--kernels", choices=("auto", "pallas", "reference", "interpret"), default="auto",
        help="Pallas kernels or jax.numpy references for attention and draft verification (same output either way); "
        "auto (default): the kernels on backends where they have been validated on the chip (none yet), else the "
        "references; pallas on CPU runs them in interpret mode (slow), as interpret does anywhere. JAXSPEC_KERNELS sets "
        "what auto means",
    )
    parser.add_argument(
        "--no-compile-cache", action="store_true",
        help="do not keep compiled programs on disk (default: kept under the user's cache directory, "
        "$XDG_CACHE_HOME/jaxspec/jax-compile-cache, or JAXSPEC_COMPILE_CACHE=DIR|off, so a second run of the same "
        "shapes skips compilation)",
    )


def add_step_cost_args(parser: argparse.ArgumentParser) -> None:
    """--no-stored-step-costs (generate and bench: the commands that run automatic speculation)."""
    parser.add_argument(
        "--no-stored-step-costs", action="store_true",
        help="automatic speculation (--num-speculative-tokens auto) times its step costs in this run and keeps "
        "nothing (default: costs and their calibration are kept per machine and shape in "
        "$XDG_CACHE_HOME/jaxspec/step-costs.json, or JAXSPEC_STEP_COSTS=FILE|off, so that later runs skip the timing)",
    )


def step_cost_store(args):
    """The store of timed step costs for automatic speculation (`jaxspec.spec.step_cost_store`), or None."""
    from jaxspec.spec.step_cost_store import default_store

    return None if getattr(args, "no_stored_step_costs", False) else default_store()


COMPILE_CACHE_ENV = "JAXSPEC_COMPILE_CACHE"
COMPILE_CACHE_MAX_BYTES = 8 << 30  # least recently used entries go beyond this


def use_compile_cache(args) -> Path | None:
    """Turn on JAX's persistent compilation cache before anything compiles, so a second run of the same shapes
    loads the programs instead of compiling them (SmolLM2's step takes ~20 s to compile on CPU, 8B models longer).
    Entries are keyed by the program, backend, versions and flags, so a stale one is never used; XLA:CPU also checks
    the CPU features an entry was compiled for when loading it (on some CPUs it rejects every entry, logging why, and
    recompiles: correct, only not faster; jax-ml/jax#38445). Where: the
    JAXSPEC_COMPILE_CACHE directory ("off" disables it; the tests set that), else the user's cache directory;
    `--no-compile-cache` disables it for one run. Returns the directory in use, or None."""
    import jax

    from jaxspec.checkpoints.builtin import cache_root

    where = os.environ.get(COMPILE_CACHE_ENV, "")
    if getattr(args, "no_compile_cache", False) or where == "off":
        return None
    path = Path(where) if where else cache_root() / "jax-compile-cache"
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)  # every program: the small ones add up
    jax.config.update("jax_compilation_cache_max_size", COMPILE_CACHE_MAX_BYTES)
    return path


def kernels_impl(args) -> str:
    """The implementation `--kernels` (or JAXSPEC_KERNELS under auto) resolves to here: reference, pallas or
    interpret (`pallas_kernels.dispatch`)."""
    from pallas_kernels.dispatch import resolve_kernels

    try:
        return resolve_kernels(getattr(args, "kernels", "auto"))
    except ValueError as e:
        raise JaxspecError(str(e)) from None


def resolve_target(target: str | None) -> Path:
    from jaxspec.checkpoints.builtin import ensure_default_target

    if target is None:
        return ensure_default_target(log=lambda msg: print(msg, file=sys.stderr))
    return Path(target)


PROPOSERS = ("eagle3", "ngram")


def add_draft_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--draft",
        metavar="PATH",
        help="EAGLE-3 head directory (EAGLE, SpecForge/SGLang or vLLM speculators layout); default: the shipped "
        "head for the built-in target, none (target-only) for other targets",
    )
    parser.add_argument(
        "--no-draft", action="store_true",
        help="target-only generation (with the built-in target, its shipped head is the default draft)",
    )
    parser.add_argument(
        "--num-speculative-tokens", type=speculative_tokens, metavar="K|auto",
        help=f"drafts per verify step, 1..{MAX_DRAFT_DEPTH}, or auto (default with an EAGLE-3 head): before each "
        "batch, the chain length, a tree the head's record measured, or target-only with the most expected "
        "tokens/s, from this machine's timed step costs and the head's acceptance (its recorded profile, refined by "
        f"the counts so far); --tree names a tree instead (--proposer ngram: default {DEFAULT_SPECULATIVE_TOKENS})",
    )
    parser.add_argument(
        "--allow-pickle", action="store_true", help="allow loading a head stored as pickled .bin (runs code on load)"
    )
    parser.add_argument(
        "--proposer", choices=PROPOSERS, default="eagle3",
        help="how drafts are made: eagle3 (an EAGLE-3 head, --draft, chains or --tree) or ngram (prompt lookup: "
        "the K tokens that followed the latest earlier occurrence of the text's last n tokens; no model) "
        "(default: eagle3)",
    )
    parser.add_argument(
        "--ngram-min", type=int, default=1, metavar="N", help="--proposer ngram: shortest suffix matched (default: 1)"
    )
    parser.add_argument(
        "--ngram-max", type=int, default=3, metavar="N",
        help="--proposer ngram: longest suffix matched, tried first (default: 3)",
    )


def parse_tree(text: str):
    """argparse type for --tree TOTAL,DEPTH,TOPK (a clean one-line error on bad input)."""
    from jaxspec.errors import JaxspecError
    from jaxspec.spec.tree import TreeConfig

    try:
        return TreeConfig.parse(text)
    except JaxspecError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def resolve_draft(args) -> str | None:
    """The head to draft with: --draft; else, for the built-in target, the head shipped with jaxspec; else none.
    With --draft and no --target, a head whose config names its verifier picks the target: a local directory
    (absolute, or relative to the head) becomes args.target, the built-in target's name keeps the default; a
    verifier named but not found here is an error that says to pass --target. Call it before `resolve_target`."""
    from jaxspec.checkpoints.builtin import default_head_dir
    from jaxspec.checkpoints.heads import read_head_config
    from jaxspec.checkpoints.verifier import locate_verifier

    if args.no_draft:
        if args.draft:
            raise JaxspecError("--draft and --no-draft contradict each other; pass one")
        return None
    if getattr(args, "proposer", "eagle3") != "eagle3":
        return None  # drafts without a head
    if args.draft:
        raw = read_head_config(args.draft)  # a missing head fails here, before any target is built
        if args.target is None:
            verifier = locate_verifier(raw, args.draft)
            if verifier is not None:
                print(f"target: {verifier} (the verifier the head's config names)", file=sys.stderr)
                args.target = str(verifier)
        return args.draft
    if args.target is None and (default_head_dir() / "config.json").is_file():
        print(f"draft: the built-in EAGLE-3 head ({default_head_dir().name}); --no-draft for target-only",
              file=sys.stderr)
        return str(default_head_dir())
    return None


def load_head_for(draft: str, target, dtype: str | None, allow_pickle: bool):
    from jaxspec.checkpoints.heads import load_head
    from jaxspec.generation import default_dtype

    return load_head(draft, target.config, dtype=dtype or default_dtype(), allow_pickle=allow_pickle)


def speculative_generator(model, head, draft: str, num_draft: int | str, tree, *, batch_size: int, mesh=None,
                          kernels: str | None = None, forced_accept_prob: float | None = None, store=None):
    """The EAGLE-3 generator the flags ask for: a tree, a fixed chain, or (num_draft == "auto") the chain length or
    recorded tree chosen per batch, whose prior is the acceptance profile recorded in the head's config (if any),
    with step costs from `store` (`step_cost_store`; None: timed in this process)."""
    from jaxspec.spec.generator import SpeculativeGenerator

    if tree is None and num_draft == AUTO:
        from jaxspec.checkpoints.heads import read_head_config
        from jaxspec.checkpoints.verifier import check_acceptance, head_record
        from jaxspec.spec.auto_config import profile_from_record, trees_from_record
        from jaxspec.spec.auto_generator import AutoSpeculativeGenerator

        record = head_record(read_head_config(draft))[1]
        record = check_acceptance(record) if record else None  # a bad record: one-line error
        return AutoSpeculativeGenerator(model, head, prior=profile_from_record(record), trees=trees_from_record(record),
                                        batch_size=batch_size, mesh=mesh, kernels=kernels, store=store)
    return SpeculativeGenerator(
        model, head, num_draft=num_draft if tree is None else 1, tree=tree, batch_size=batch_size, mesh=mesh,
        kernels=kernels, forced_accept_prob=forced_accept_prob,
    )


def head_aux_layer_ids(draft: str | None, target_dir: Path):
    """The target layers a head reads (None: the target's default), read from the two config.json files and checked
    (the verifier the head was exported for, vocabulary, hidden sizes, layer ids) before any weights are loaded."""
    if draft is None:
        return None
    from jaxspec.checkpoints.heads import head_config_from_hf, read_head_config, validate_head
    from jaxspec.checkpoints.verifier import head_record
    from jaxspec.config import load_target_config

    raw = read_head_config(draft)
    head = head_config_from_hf(raw)[1]
    validate_head(head, load_target_config(target_dir), head_record(raw)[0])
    return head.aux_layer_ids


DEFAULT_SPECULATIVE_TOKENS = 5


def method_name(num_draft: int | str, tree, accept_prob: float | None = None, proposer=None) -> str:
    """How the CLIs and the bench report name a speculative method: `chain K=5`, `tree 12,5,3`, `ngram K=5 n=1..3`."""
    if proposer is not None and proposer.name == "ngram":
        return f"ngram K={num_draft} n={proposer.min_n}..{proposer.max_n}"
    if tree is None and num_draft == AUTO:
        return "auto"
    name = f"chain K={num_draft}" if tree is None else f"tree {tree.spec}"
    return name if accept_prob is None else f"{name} (forced p={accept_prob})"


def ngram_proposer(args):
    """The n-gram proposer of `--proposer ngram`, or None."""
    if getattr(args, "proposer", "eagle3") != "ngram":
        return None
    from jaxspec.spec.ngram import NgramProposer

    return NgramProposer(args.num_speculative_tokens, args.ngram_min, args.ngram_max)


def check_generation_args(args, *, tree_sets_depth: bool) -> None:
    """Cheap flag checks, run right after parsing so that a bad value fails before a model loads. Fills the default
    of --num-speculative-tokens (None on the command line means "not given"). tree_sets_depth: --tree replaces the
    chain (generate) rather than being measured beside it (bench)."""
    for flag in ("max_new_tokens", "batch_size"):
        value = getattr(args, flag, None)
        if value is not None and value < 1:
            raise JaxspecError(f"--{flag.replace('_', '-')} must be at least 1, got {value}")
    k = args.num_speculative_tokens
    if k is not None and k != AUTO and not 1 <= k <= MAX_DRAFT_DEPTH:
        raise JaxspecError(f"--num-speculative-tokens must be between 1 and {MAX_DRAFT_DEPTH}, got {k}")
    if args.no_draft and (k is not None or args.tree):
        given = "--num-speculative-tokens" if k is not None else "--tree"
        raise JaxspecError(f"--no-draft runs the target alone, {given} drafts; pass one of them")
    if getattr(args, "proposer", "eagle3") == "ngram":
        if args.no_draft or args.draft:
            given = "--no-draft" if args.no_draft else "--draft"
            raise JaxspecError(f"--proposer ngram drafts from the prompt itself; drop {given}")
        if args.tree:
            raise JaxspecError("--proposer ngram drafts chains; drop --tree")
        if k == AUTO:
            raise JaxspecError(
                "--num-speculative-tokens auto chooses from an EAGLE-3 head's acceptance; give --proposer ngram a "
                f"number (default {DEFAULT_SPECULATIVE_TOKENS})"
            )
        if not 1 <= args.ngram_min <= args.ngram_max:
            raise JaxspecError(
                f"--ngram-min and --ngram-max need 1 <= min <= max, got {args.ngram_min} and {args.ngram_max}"
            )
    if tree_sets_depth and args.tree and k is not None:  # auto included: --tree fixes every batch's method
        raise JaxspecError(
            f"--tree {args.tree.spec} drafts {args.tree.depth} levels (its DEPTH); drop --num-speculative-tokens"
        )
    if k is None:
        ngram = getattr(args, "proposer", "eagle3") == "ngram"
        forced = getattr(args, "accept_prob", None) is not None  # bench's forced acceptance: a fixed chain
        args.num_speculative_tokens = DEFAULT_SPECULATIVE_TOKENS if ngram or forced else AUTO
    elif k == AUTO and getattr(args, "accept_prob", None) is not None:
        raise JaxspecError("--accept-prob forces acceptance of a fixed chain; give --num-speculative-tokens a number")


def load_target_and_tokenizer(
    target_dir: Path, dtype: str | None, log=True, aux_layer_ids=None, mesh=None, numerics: str = "invariant",
    kernels: str | None = None,
):
    """(model, tokenizer) from a directory, with a note on stderr of how long loading took (an orbax target is
    restored straight into the mesh's shardings) and of the kernels it runs. numerics: "invariant" (the model's
    default) or "plain"; kernels: `--kernels` resolved (`kernels_impl`), None for auto."""
    from jaxspec.checkpoints.hf import load_target
    from jaxspec.generation import default_dtype
    from jaxspec.prompts import load_tokenizer
    from pallas_kernels.dispatch import describe, resolve_kernels

    start = time.perf_counter()
    model = load_target(target_dir, dtype=dtype or default_dtype(), aux_layer_ids=aux_layer_ids, mesh=mesh)
    model.numerics = None if numerics == "plain" else model.invariant_numerics(kernels)
    tokenizer = load_tokenizer(target_dir)
    if log:
        cfg = model.config
        print(
            f"loaded {target_dir.name} ({cfg.model_type}, {cfg.num_layers} layers, hidden {cfg.hidden_size}, "
            f"{model.dtype}) in {time.perf_counter() - start:.1f}s",
            file=sys.stderr,
        )
        print(describe(kernels or resolve_kernels()), file=sys.stderr)
    return model, tokenizer


def main_guard(main):
    """Run a CLI main: a JaxspecError becomes one line on stderr and exit code 2."""

    @functools.wraps(main)
    def wrapper(argv=None):
        try:
            return main(argv)
        except JaxspecError as e:
            print(f"error: {e}", file=sys.stderr)
            sys.exit(2)
        except KeyboardInterrupt:
            sys.exit(130)

    return wrapper


SAME_SIGNAL_SECONDS = 1.0  # signals this close to the first are one request (`exit_on_interrupt`)


def exit_on_interrupt(stop: threading.Event | None = None) -> None:
    """Make Ctrl-C end this program with exit code 130 and a one-line note, at any stage. Python's C-level handler
    writes each signal to a wakeup pipe the moment it arrives, in whichever thread the kernel picked; a waiting
    thread reads it and leaves with os._exit. So the exit neither waits for a compile to return to Python nor tears
    the interpreter down around XLA's running compile threads (a sys.exit from a KeyboardInterrupt there died by
    SIGSEGV). The main thread's own handler does nothing: no KeyboardInterrupt is raised anywhere.

    stop: a program with work to save (training) gets the first Ctrl-C, or a SIGTERM (a preempted cloud VM, a
    scheduler's or `timeout`'s stop), as this event, to stop at its next safe point and save; a second one exits
    at once, unless it comes within SAME_SIGNAL_SECONDS of the first: a signal sent to the whole process group
    (`timeout` without --foreground, `kill -INT -PGID`) reaches the program twice at once, and that is one
    request, not a second. Call this in a program's entry point (the main thread), never in library code or
    under pytest."""
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    handled = (signal.SIGINT, signal.SIGTERM) if stop is not None else (signal.SIGINT,)
    for signum in handled:
        signal.signal(signum, lambda signum, frame: None)
    signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)

    def say(note: str) -> None:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os.write(2, f"\n{note}\n".encode())

    def wait() -> None:
        first = None  # when the stop was asked for
        while True:
            for signum in os.read(read_end, 64):
                if signum not in handled:
                    continue
                if first is None and stop is not None:
                    stop.set()
                    say("interrupted: stopping after this step to save a checkpoint (Ctrl-C again: quit, unsaved)")
                    first = time.monotonic()
                    continue
                if first is not None and time.monotonic() - first < SAME_SIGNAL_SECONDS:
                    continue  # the same request, delivered twice
                say("interrupted")
                os._exit(130)

    threading.Thread(target=wait, name="sigint", daemon=True).start()


def run_program(main, stop: threading.Event | None = None) -> None:
    """A CLI module's `__main__` entry: Ctrl-C exits 130 (exit_on_interrupt; `stop` for programs that save first),
    otherwise main's return code."""
    exit_on_interrupt(stop)
    sys.exit(main())


def add_mesh_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--mesh", metavar="data=D,model=M",
        help="shard over a device mesh: batch rows over D devices, attention heads, MLP width and vocabulary over "
        "M (tensor parallel); D*M devices are used; M must divide the query heads and divide, or be a multiple of, the "
        "KV heads (then each KV head is repeated so every device holds the one it reads)",
    )
    parser.add_argument(
        "--distributed", action="store_true",
        help="multi-host: call jax.distributed.initialize() first, which finds the coordinator on TPU pods, SLURM and "
        "Open MPI by itself (else give --coordinator); the mesh then spans every process's devices and only "
        "process 0 prints results",
    )
    parser.add_argument("--coordinator", metavar="HOST:PORT",
                        help="--distributed without a cluster environment: process 0's address (with the two below)")
    parser.add_argument("--num-processes", type=int, metavar="N", help="--distributed: how many processes in all")
    parser.add_argument("--process-id", type=int, metavar="I", help="--distributed: this process's index, 0..N-1")


def resolve_mesh(args):
    """The (data, model) mesh the flags ask for, or None for one device (joining the multi-host job first)."""
    import jax

    from jaxspec.sharding import MeshConfig, make_mesh

    explicit = (args.coordinator, args.num_processes, args.process_id)
    if any(x is not None for x in explicit) and not args.distributed:
        raise JaxspecError("--coordinator, --num-processes and --process-id go with --distributed")
    if args.distributed:
        if any(x is not None for x in explicit) and not all(x is not None for x in explicit):
            raise JaxspecError("--distributed without a cluster environment needs all of --coordinator HOST:PORT, "
                               "--num-processes N and --process-id I")
        if args.num_processes is not None and not 0 <= args.process_id < args.num_processes:
            raise JaxspecError(f"--process-id must be in 0..{args.num_processes - 1}, got {args.process_id}")
        # CPU collectives (Gloo) print connection notices on the C-level stdout: send file descriptor 1 to stderr
        # and keep Python's stdout, where the results go, on the real one.
        results = os.fdopen(os.dup(1), "w", buffering=1)
        sys.stdout.flush()
        os.dup2(2, 1)
        sys.stdout = results
        jax.distributed.initialize(
            coordinator_address=args.coordinator, num_processes=args.num_processes, process_id=args.process_id
        )
        if jax.process_index() != 0:  # every process computes the same results: one prints them
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 (lives as long as the process)
    if not args.mesh:
        if jax.process_count() > 1:
            raise JaxspecError("--distributed needs --mesh data=D,model=M spanning every process's devices")
        return None
    return make_mesh(MeshConfig.parse(args.mesh))
