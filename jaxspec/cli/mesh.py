"""The device mesh the flags ask for: --mesh data=D,model=M, and --distributed for a multi-host job (joined before
the mesh is built)."""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING

from jaxspec.cli.args import integer
from jaxspec.errors import JaxspecError

if TYPE_CHECKING:
    from jaxspec.sharding import MeshConfig


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
    parser.add_argument("--num-processes", type=integer(1), metavar="N",
                        help="--distributed: how many processes in all")
    parser.add_argument("--process-id", type=integer(0), metavar="I",
                        help="--distributed: this process's index, 0..N-1")


def check_mesh_args(args) -> MeshConfig | None:
    """The mesh flags checked without touching JAX (so before the multi-host job is joined and any weights load):
    --mesh parsed, the --distributed flags complete and consistent, --coordinator a HOST:PORT. Returns the
    --mesh sizes, or None without --mesh."""
    from jaxspec.sharding import MeshConfig  # (jaxspec.sharding imports jax: not at --help time)

    explicit = (args.coordinator, args.num_processes, args.process_id)
    if any(x is not None for x in explicit) and not args.distributed:
        raise JaxspecError("--coordinator, --num-processes and --process-id go with --distributed")
    if args.distributed and any(x is not None for x in explicit):
        if not all(x is not None for x in explicit):
            raise JaxspecError("--distributed without a cluster environment needs all of --coordinator HOST:PORT, "
                               "--num-processes N and --process-id I")
        if not args.process_id < args.num_processes:
            raise JaxspecError(f"--process-id must be in 0..{args.num_processes - 1}, got {args.process_id}")
        host, sep, port = args.coordinator.rpartition(":")
        if not (sep and host and port.isdigit() and 0 < int(port) < 65536):
            raise JaxspecError(f"--coordinator wants HOST:PORT (process 0's address, a port in 1..65535), got "
                               f"{args.coordinator!r}")
    return MeshConfig.parse(args.mesh) if args.mesh else None


def resolve_mesh(args):
    """The (data, model) mesh the flags ask for, or None for one device (joining the multi-host job first)."""
    import jax

    from jaxspec.sharding import make_mesh

    sizes = check_mesh_args(args)
    if args.distributed:
        # CPU collectives (Gloo) print connection notices on the C-level stdout: send file descriptor 1 to stderr
        # and keep Python's stdout, where the results go, on the real one.
        results = os.fdopen(os.dup(1), "w", buffering=1)
        sys.stdout.flush()
        os.dup2(2, 1)
        sys.stdout = results
        try:
            jax.distributed.initialize(
                coordinator_address=args.coordinator, num_processes=args.num_processes, process_id=args.process_id
            )
        except ValueError as e:  # no cluster environment found, and no --coordinator
            raise JaxspecError(f"--distributed cannot join a job here ({e}); outside TPU pods, SLURM and Open MPI, "
                               "pass --coordinator HOST:PORT, --num-processes N and --process-id I") from None
        if jax.process_index() != 0:  # every process computes the same results: one prints them
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 (lives as long as the process)
    if not args.mesh:
        if jax.process_count() > 1:
            raise JaxspecError("--distributed needs --mesh data=D,model=M spanning every process's devices")
        return None
    return make_mesh(sizes)
