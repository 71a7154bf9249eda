"""The flags the command-line tools share (target, draft, step costs) and their checks, all run right after
parsing, before anything loads, so that a bad value is a one-line error in a second."""

from __future__ import annotations

import argparse
import sys

from jaxspec.config import MAX_DRAFT_DEPTH
from jaxspec.errors import JaxspecError


class OneLineParser(argparse.ArgumentParser):
    """argparse with the CLIs' error format: a bad flag is one line, `error: ...`, and exit code 2. argparse's own
    format prints the whole usage first (dozens of lines for generate and bench) above the line that matters."""

    def error(self, message: str):
        self.exit(2, f"error: {message} (`{self.prog} --help` lists the flags)\n")

    def print_help(self, file=None) -> None:
        """The help, written so that a failed write is an error (`main_guard`): argparse's own printing drops
        write errors, and `--help` into a full disk exited 0 with nothing written."""
        (file or sys.stdout).write(self.format_help())


MAX_COUNT = 2**31 - 1  # token counts, batch rows and sizes are int32 on the device
SEED_RANGE = (-(2**63), 2**63 - 1)  # jax.random.key takes a C long


def integer(minimum: int | None, maximum: int = MAX_COUNT):
    """argparse type: an integer in minimum..maximum. A value past what the device's int32 shapes (or the seed's C
    long) hold was an OverflowError after the model had loaded. minimum None: the flag's lower bound is checked
    after parsing, beside the flags it goes with (`check_generation_args`, `check_bench_args`)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if minimum is not None and value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        if value > maximum:
            raise argparse.ArgumentTypeError(f"must be at most {maximum}, got {value}")
        return value

    return parse


def _int_list(text: str, minimum: int, what: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or min(values) < minimum or max(values) > MAX_COUNT:
        raise argparse.ArgumentTypeError(f"expected {what} (up to {MAX_COUNT}) separated by commas, got {text!r}")
    return values


def positive_int_list(text: str) -> list[int]:
    """argparse type: positive integers separated by commas (1,4,16)."""
    return _int_list(text, 1, "positive integers")


def count_list(text: str) -> list[int]:
    """argparse type: integers >= 0 separated by commas (0,512)."""
    return _int_list(text, 0, "integers >= 0")


def on_off_list(text: str) -> list[bool]:
    """argparse type: `on` and `off` separated by commas (on,off)."""
    values = [part.strip().lower() for part in text.split(",")]
    if not values or any(v not in ("on", "off") for v in values):
        raise argparse.ArgumentTypeError(f"expected on, off or on,off, got {text!r}")
    return [v == "on" for v in values]


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


def add_target_args(
    parser: argparse.ArgumentParser, numerics: str = "invariant", numerics_why: str = "", generates: bool = True
) -> None:
    """--target, --dtype, --quantize, --numerics (default `numerics`; `numerics_why` says why a command changes it), --kernels,
    --no-compile-cache; generates=False (a command that only runs the target's forward in a dtype of its own, such as
    `train.data features`): --target, --quantize and --no-compile-cache alone, so that no flag is accepted and ignored."""
    parser.add_argument(
        "--target",
        metavar="DIR",
        help="Hugging Face model directory (config.json + *.safetensors + tokenizer); "
        "default: the built-in SmolLM2-135M-Instruct, built on first use",
    )
    if generates:
        parser.add_argument(
            "--dtype", choices=("float32", "bfloat16"),
            help="parameter dtype (default: float32 on CPU, bfloat16 on GPU/TPU)",
        )
    parser.add_argument(
        "--quantize", choices=("int8", "fp8"),
        help="the decoder's matmul weights as int8 or fp8 (e4m3) with one scale per output channel, quantized at load "
        "(embeddings and LM head stay in their dtype; a compressed-tensors FP8 checkpoint is read as it is, without "
        "this flag); speculation stays exact against the quantized target (default: none, the checkpoint's weights)",
    )
    if generates:
        _add_numerics_args(parser, numerics, numerics_why)
    parser.add_argument(
        "--no-compile-cache", action="store_true",
        help="do not keep compiled programs on disk (default: kept under the user's cache directory, "
        "$XDG_CACHE_HOME/jaxspec/jax-compile-cache, or JAXSPEC_COMPILE_CACHE=DIR|off, so a second run of the same "
        "shapes skips compilation)",
    )


def _add_numerics_args(parser: argparse.ArgumentParser, numerics: str, numerics_why: str) -> None:
    parser.add_argument(
        "--numerics", choices=tuple(NUMERICS_HELP), default=numerics,
        help="; ".join(text + (" (default)" if name == numerics else "") for name, text in NUMERICS_HELP.items())
        + numerics_why,
    )
    parser.add_argument(
        "--kernels", choices=("auto", "pallas", "reference", "interpret"), default="auto",
        help="Pallas kernels or jax.numpy references for attention and draft verification (same output either way); "
        "auto (default): the kernels on backends where they have been validated on the chip (GPU), else the "
        "references; pallas on CPU runs them in interpret mode (slow), as interpret does anywhere. JAXSPEC_KERNELS sets "
        "what auto means",
    )


def add_step_cost_args(parser: argparse.ArgumentParser) -> None:
    """--no-stored-step-costs (generate and bench: the commands that run automatic speculation)."""
    parser.add_argument(
        "--no-stored-step-costs", action="store_true",
        help="automatic speculation (--num-speculative-tokens auto) times its step costs in this run and keeps "
        "nothing (default: costs and their calibration are kept per machine and shape in "
        "$XDG_CACHE_HOME/jaxspec/step-costs.json, or JAXSPEC_STEP_COSTS=FILE|off, so that later runs skip the timing)",
    )


PROPOSERS = ("eagle3", "ngram", "draft-model")


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
        help="how drafts are made: eagle3 (an EAGLE-3 head or a DFlash drafter, --draft), ngram (prompt lookup: "
        "the K tokens that followed the latest earlier occurrence of the text's last n tokens; no model) or "
        "draft-model (an independent small model with the target's tokenizer, --draft-model) (default: eagle3)",
    )
    parser.add_argument(
        "--draft-model", metavar="DIR",
        help="--proposer draft-model: a Hugging Face model directory of any supported architecture whose tokenizer "
        "is the target's (e.g. Llama-3.2-1B for Llama-3.1-8B); it drafts K tokens per step with its own KV cache",
    )
    parser.add_argument(
        "--ngram-min", type=integer(None), default=1, metavar="N",
        help="--proposer ngram: shortest suffix matched (default: 1)",
    )
    parser.add_argument(
        "--ngram-max", type=integer(None), default=3, metavar="N",
        help="--proposer ngram: longest suffix matched, tried first (default: 3)",
    )
    parser.add_argument(
        "--prompt-lookup", choices=("on", "off"), default=None,
        help="chains of a drafter (an EAGLE-3 head, a DFlash drafter, a draft model): each row drafts from prompt "
        "lookup (the tokens that followed the latest earlier occurrence of its text's last 1-3 tokens) where that "
        "has been beating the drafter on that row's text, and from the drafter elsewhere; the same output either "
        "way (default: on for chains; trees draft from the drafter alone)",
    )
    parser.add_argument(
        "--prompt-lookup-tokens", type=integer(None), default=None, metavar="N",
        help="with prompt lookup beside a drafter: the chain a row that looks up drafts, when longer than the "
        "drafter's (default: the drafter's); every step then verifies that many tokens plus one, which pays where a "
        "few more verified tokens cost little (an accelerator at small batch), not on a CPU",
    )


def parse_tree(text: str):
    """argparse type for --tree TOTAL,DEPTH,TOPK (a clean one-line error on bad input)."""
    from jaxspec.errors import JaxspecError
    from jaxspec.engine.tree import TreeConfig

    try:
        return TreeConfig.parse(text)
    except JaxspecError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


DEFAULT_SPECULATIVE_TOKENS = 5


def prompt_lookup(args):
    """The prompt lookup beside a drafter's chains that --prompt-lookup asks for (`proposers.lookup.PromptLookup`;
    a tree is drafted by its drafter alone), or None: off, --proposer ngram (lookup is then the drafter), or the
    bench's forced acceptance (--accept-prob: whichever chain ran would win every comparison, and the drafts
    do not matter there)."""
    from jaxspec.engine.proposers.lookup import PromptLookup

    if (getattr(args, "prompt_lookup", None) == "off" or getattr(args, "proposer", "eagle3") == "ngram"
            or getattr(args, "accept_prob", None) is not None):
        return None
    return PromptLookup(num_draft=getattr(args, "prompt_lookup_tokens", None))


def method_name(num_draft: int | str, tree, accept_prob: float | None = None, proposer=None) -> str:
    """How the CLIs and the bench report name a speculative method: `chain K=5`, `tree 12,5,3`, `ngram K=5 n=1..3`."""
    if proposer is not None and proposer.name == "ngram":
        return f"ngram K={num_draft} n={proposer.min_n}..{proposer.max_n}"
    if proposer is not None and proposer.name == "draft-model":
        return f"draft model K={num_draft}" if tree is None else f"draft model tree {tree.spec}"
    if tree is None and num_draft == AUTO:
        return "auto"
    name = f"chain K={num_draft}" if tree is None else f"tree {tree.spec}"
    return name if accept_prob is None else f"{name} (forced p={accept_prob})"


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
    if getattr(args, "prompt_lookup", None) == "on" and getattr(args, "tree", None) and tree_sets_depth:
        raise JaxspecError("--prompt-lookup on drafts beside a drafter's chains, --tree drafts a tree from the "
                           "drafter alone; drop one")
    if args.no_draft and getattr(args, "prompt_lookup", None) == "on":
        raise JaxspecError("--prompt-lookup on drafts beside a drafter, --no-draft runs the target alone (prompt "
                           "lookup alone is --proposer ngram); drop one")
    tokens = getattr(args, "prompt_lookup_tokens", None)
    if tokens is not None:
        if not 1 <= tokens <= MAX_DRAFT_DEPTH:
            raise JaxspecError(f"--prompt-lookup-tokens must be between 1 and {MAX_DRAFT_DEPTH}, got {tokens}")
        off = getattr(args, "prompt_lookup", None) == "off" or getattr(args, "proposer", "eagle3") == "ngram"
        tree = bool(getattr(args, "tree", None)) and tree_sets_depth
        if tree or getattr(args, "accept_prob", None) is not None:
            given = "--tree" if tree else "--accept-prob"
            raise JaxspecError(f"--prompt-lookup-tokens sets the chains of prompt lookup beside a drafter's chains, "
                               f"which {given} runs without; drop one")
        if args.no_draft or off:
            raise JaxspecError("--prompt-lookup-tokens sets the chains of prompt lookup beside a drafter, which "
                               "--no-draft, --prompt-lookup off and --proposer ngram leave out; drop one (--proposer "
                               "ngram's chains are --num-speculative-tokens)")
    if args.no_draft and (k is not None or args.tree):
        given = "--num-speculative-tokens" if k is not None else "--tree"
        raise JaxspecError(f"--no-draft runs the target alone, {given} drafts; pass one of them")
    if getattr(args, "proposer", "eagle3") == "ngram":
        if args.no_draft or args.draft:
            given = "--no-draft" if args.no_draft else "--draft"
            raise JaxspecError(f"--proposer ngram drafts from the prompt itself; drop {given}")
        if args.tree:
            raise JaxspecError("--proposer ngram drafts chains; drop --tree")
        if getattr(args, "prompt_lookup", None) == "on":
            raise JaxspecError("--proposer ngram is prompt lookup alone; drop --prompt-lookup (it pairs lookup "
                               "with a drafter)")
        if k == AUTO:
            raise JaxspecError(
                "--num-speculative-tokens auto chooses from an EAGLE-3 head's acceptance; give --proposer ngram a "
                f"number (default {DEFAULT_SPECULATIVE_TOKENS})"
            )
        if not 1 <= args.ngram_min <= args.ngram_max:
            raise JaxspecError(
                f"--ngram-min and --ngram-max need 1 <= min <= max, got {args.ngram_min} and {args.ngram_max}"
            )
    proposer = getattr(args, "proposer", "eagle3")
    if proposer == "draft-model":
        if args.no_draft or args.draft:
            given = "--no-draft" if args.no_draft else "--draft"
            raise JaxspecError(f"--proposer draft-model drafts with --draft-model DIR; drop {given}")
        if not args.draft_model:
            raise JaxspecError("--proposer draft-model needs --draft-model DIR (a small model with the target's "
                               "tokenizer)")
    elif getattr(args, "draft_model", None):
        raise JaxspecError("--draft-model drafts with --proposer draft-model; add it")
    if tree_sets_depth and args.tree and k is not None:  # auto included: --tree fixes every batch's method
        raise JaxspecError(
            f"--tree {args.tree.spec} drafts {args.tree.depth} levels (its DEPTH); drop --num-speculative-tokens"
        )
    if k is None:
        fixed = getattr(args, "proposer", "eagle3") == "ngram"  # nothing to price (its drafts cost ~nothing)
        forced = getattr(args, "accept_prob", None) is not None  # bench's forced acceptance: a fixed chain
        args.num_speculative_tokens = DEFAULT_SPECULATIVE_TOKENS if fixed or forced else AUTO
    elif k == AUTO and getattr(args, "accept_prob", None) is not None:
        raise JaxspecError("--accept-prob forces acceptance of a fixed chain; give --num-speculative-tokens a number")


def add_structured_output_args(parser: argparse.ArgumentParser) -> None:
    """--regex / --json-schema / --choice (at most one): generate's and bench's structured output."""
    structured = parser.add_argument_group(
        "structured output", "the answer must match a pattern: a token automaton masks the logits at every position, "
        "drafted ones included (jaxspec/grammar.py), so greedy output stays the constrained target's own",
    ).add_mutually_exclusive_group()
    structured.add_argument("--regex", metavar="PATTERN", help="a regular expression the whole answer matches")
    structured.add_argument("--json-schema", metavar="JSON|FILE",
                            help="a JSON schema the answer follows: inline JSON or a file holding it")
    structured.add_argument("--choice", action="append", metavar="TEXT",
                            help="one of the answers allowed (repeatable): the answer is exactly one of them")


def structured_output(args, tokenizer, vocab_size: int, stop_ids):
    """The automaton of --regex / --json-schema / --choice for this tokenizer and vocabulary (None: none given); a
    pattern or schema it cannot compile is a one-line error."""
    from jaxspec.grammar import GrammarCompiler, grammar_of

    grammar = grammar_of(args.regex, args.json_schema, args.choice)
    return None if grammar is None else GrammarCompiler(tokenizer, vocab_size, stop_ids)(grammar)
