"""What the command-line tools share, by what it does (the tools themselves are `jaxspec.generate`,
`jaxspec.convert`, `jaxspec.bench` and `train.*`):

    args.py     the target / draft / step-cost flags and their checks before anything loads
    loading.py  the target, head, tokenizer, generator or proposer, and kernels the flags ask for
    program.py  one-line errors, Ctrl-C / SIGTERM (exit 130), the persistent compilation cache
    mesh.py     --mesh and --distributed: the device mesh
"""
