"""Where a command writes a directory: never over what it did not write, and whole or not at all.

Why: `convert head` and `convert random-head` wrote into any `--out`, replacing a model's config.json and
model.safetensors without a word. A directory that is not empty is now written only when it holds the command's
own earlier output (`holds_own`) or the user passed `--overwrite`; and the new contents are written beside it and
moved into place at the end, so a failure or a kill midway leaves the old directory as it was.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from jaxspec.errors import JaxspecError
from jaxspec.files import check_writable_dir


def check_output_dir(out: str | Path, *, holds_own: Callable[[Path], bool], what: str, overwrite: bool,
                     flag: str = "--out", fix: str = "pass a new or empty directory, or --overwrite to replace what "
                     "it holds") -> Path:
    """`out` as a Path, after refusing a file, or a non-empty directory that holds no `what` (unless overwrite);
    `flag` names where the path came from, `fix` what to do instead (a command without --overwrite says its own)."""
    out = check_writable_dir(out, flag)
    if out.is_dir() and any(out.iterdir()) and not overwrite and not holds_own(out):
        raise JaxspecError(f"{flag} {str(out)!r} is not empty and holds no {what}; {fix}")
    return out


@contextmanager
def written_whole(out: Path) -> Iterator[Path]:
    """Yields a new directory beside `out` to write into; when the block ends without an error it takes `out`'s
    place (the old contents are removed only after that), and on an error it is removed and `out` is untouched."""
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    umask = os.umask(0)
    os.umask(umask)
    staging.chmod(0o777 & ~umask)  # as a plain mkdir makes it (mkdtemp's 0700 would hide it from other users)
    old = None
    try:
        yield staging
        if out.exists():
            old = out.with_name(f".{out.name}.replaced-{os.getpid()}")
            out.rename(old)
        staging.rename(out)
    except BaseException:
        if old is not None and not out.exists():
            old.rename(out)  # the swap failed halfway: the old one back
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
