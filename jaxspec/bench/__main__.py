"""python -m jaxspec.bench (the command: cli.py)."""

from jaxspec.bench.cli import main
from jaxspec.cli.program import run_program

if __name__ == "__main__":
    run_program(main)
