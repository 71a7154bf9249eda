"""A command-line program's process: one-line errors (exit 2), Ctrl-C and SIGTERM (exit 130, or a stop event for a
program that saves first), and JAX's persistent compilation cache, turned on before anything compiles."""

from __future__ import annotations

import functools
import os
import signal
import sys
import threading
import time
from pathlib import Path

from jaxspec.errors import JaxspecError
from jaxspec.files import describe_os_error, make_dir


def main_guard(main):
    """Run a CLI main: a JaxspecError becomes one line on stderr and exit code 2; so does an OSError that reaches
    here (a full disk, a path under a file, a closed pipe: the machine's state, not a bug), with what failed and
    where. Standard output is flushed inside, so that a write that fails at the end (stdout on a full disk) is
    reported the same way rather than as a traceback at exit."""

    @functools.wraps(main)
    def wrapper(argv=None):
        try:
            code = main(argv)
            sys.stdout.flush()
            return code
        except JaxspecError as e:
            print(f"error: {e}", file=sys.stderr)
            sys.exit(2)
        except OSError as e:
            print(f"error: {describe_os_error(e)}", file=sys.stderr)
            _drop_unwritable_stdout()
            sys.exit(2)
        except KeyboardInterrupt:
            sys.exit(130)
        except SystemExit:  # argparse's --help and its own exits: what they printed must reach stdout too
            try:
                sys.stdout.flush()
            except OSError as e:
                print(f"error: {describe_os_error(e)}", file=sys.stderr)
                _drop_unwritable_stdout()
                sys.exit(2)
            raise

    return wrapper


def _drop_unwritable_stdout() -> None:
    """Output that could not be written stays in stdout's buffer, and Python's exit would try it again and print a
    second error ("Exception ignored ..."): point the stream's file descriptor at /dev/null so that the retry
    succeeds silently (the recipe of Python's documentation for SIGPIPE)."""
    try:
        sys.stdout.flush()
    except OSError:
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError, AttributeError):  # no file descriptor (a test's capture): nothing retries
            pass


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
    try:
        make_dir(path, "the compile cache directory")
    except JaxspecError as e:  # JAX would only log a warning per program, and compile every one again
        raise JaxspecError(f"{e} (it is {COMPILE_CACHE_ENV} or under $XDG_CACHE_HOME; --no-compile-cache or "
                           f"{COMPILE_CACHE_ENV}=off runs without it)") from None
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)  # every program: the small ones add up
    jax.config.update("jax_compilation_cache_max_size", COMPILE_CACHE_MAX_BYTES)
    return path
