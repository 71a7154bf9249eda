"""The benchmark, `python -m jaxspec.bench` (__main__.py):

    cli.py        the command: its flags (build_parser) and main, one run or --suite
    suite.py      the measurement (one method per pass for the suite; all methods interleaved batch by batch for a
                  single run), speculative statistics, Markdown table and matplotlib plots
    bandwidth.py  the device's copy bandwidth and the weights-only roofline
    kernels.py    --kernels-micro: each Pallas kernel vs its reference vs the bytes floor
    load.py       --load-time: safetensors vs orbax load times
    compiled_cost.py  --compiled-cost: the forward compiled for an H100 and a TPU v5e without either chip
"""

from jaxspec.bench.cli import build_parser, main

__all__ = ["build_parser", "main"]
