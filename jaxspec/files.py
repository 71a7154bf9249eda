"""Reading the user's files and text as one-line errors: a missing path, a directory where a file belongs, a `.gz`
that is not gzip (or is cut short), bytes that are not UTF-8, a JSON file of the wrong type, an unreadable file.

Why: each of these was a traceback (exit 1) from wherever the file happened to be read (a prompts file, a model's
config.json, a head's acceptance record). They are the user's to fix, so every reader goes through here and gets a
`JaxspecError` that names the file, what is wrong with it and what to do.
"""

from __future__ import annotations

import errno
import gzip
import json
import os
import zlib
from pathlib import Path
from typing import Any

from jaxspec.errors import JaxspecError


def read_text(path: str | Path, what: str) -> str:
    """The UTF-8 text of a file (decompressed when its name ends in .gz). `what` names it in errors ("prompts
    file", "config.json of the target")."""
    path = Path(path)
    where = f"{what} {str(path)!r}"
    if path.is_dir():
        raise JaxspecError(f"{where} is a directory; pass a file")
    if not path.exists():
        raise JaxspecError(f"{where} does not exist")
    try:
        data = path.read_bytes()
    except OSError as e:
        raise JaxspecError(f"cannot read {where}: {e.strerror or e}; check its permissions") from None
    if path.suffix == ".gz":
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError, zlib.error) as e:  # gzip.BadGzipFile is an OSError; a cut file: EOFError
            raise JaxspecError(
                f"{where} is not a whole gzip file ({e}); recompress it, or drop the .gz from a plain file's name"
            ) from None
    return utf8_text(data, where)


def utf8_text(data: bytes | str, where: str) -> str:
    """`data` as text after checking it is UTF-8: bytes are decoded; a str from argv may carry undecodable bytes
    as surrogate escapes (Python's os.fsdecode), which are found here, before a tokenizer chokes on them."""
    try:
        if isinstance(data, bytes):
            return data.decode("utf-8")
        data.encode("utf-8")
        return data
    except UnicodeError as e:
        bad = data[e.start] if isinstance(data, bytes) else ord(data[e.start]) & 0xFF  # a surrogate escape's byte
        raise JaxspecError(f"{where} is not valid UTF-8 (byte 0x{bad:02x} at offset {e.start}); give UTF-8 "
                           "text") from None


def read_json(path: str | Path, what: str, expect: type = dict) -> Any:
    """A JSON file's value, which must be an `expect` (a dict: a JSON object; a list: an array)."""
    path = Path(path)
    text = read_text(path, what)
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise JaxspecError(f"{what} {str(path)!r} is not valid JSON ({e.msg} at line {e.lineno})") from None
    if not isinstance(value, expect):
        kind = {dict: "a JSON object", list: "a JSON array"}.get(expect, expect.__name__)
        raise JaxspecError(f"{what} {str(path)!r} holds {type(value).__name__} {_short(value)}, not {kind}")
    return value


def _short(value: Any, limit: int = 40) -> str:
    text = json.dumps(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


FIXES = {
    errno.ENOSPC: "free some space or choose another location",
    errno.EDQUOT: "free some space or choose another location",
    errno.EACCES: "check the permissions or choose another location",
    errno.EPERM: "check the permissions or choose another location",
    errno.EROFS: "choose a writable location",
    errno.ENOTDIR: "a part of the path is a file; choose another location",
    errno.EEXIST: "a part of the path is a file; choose another location",
    errno.EISDIR: "pass a file, not a directory",
    errno.ENOENT: "check the path",
    errno.EPIPE: "the reader of the output went away",
}


def describe_os_error(e: OSError) -> str:
    """One line for an OSError: what failed, where, and the usual fix (for the CLIs' last-resort handler and for
    callers that add what the path was)."""
    where = f" {str(e.filename)!r}" if e.filename is not None else " (the output stream)"
    fix = FIXES.get(e.errno, "check the path and the disk")
    return f"{e.strerror or e}:{where}; {fix}"


def make_dir(path: str | Path, what: str) -> Path:
    """`path` created (with its parents) as a directory, or a one-line error naming `what` it is for: a path under
    a file, an existing file, a read-only or full disk."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise JaxspecError(f"{what} {str(path)!r} is an existing file; pass a directory path")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise JaxspecError(f"cannot create {what} {str(path)!r}: {describe_os_error(e)}") from None
    return path


def check_writable_dir(path: str | Path, what: str) -> Path:
    """`path` as a Path after checking, without creating anything, that it is or can become a directory this
    process may write: an existing file, a path under a file and a read-only parent are one-line errors here,
    before the work whose results would go there (a suite of benchmarks, a conversion, a training run)."""
    path = Path(path)
    where = f"{what} {str(path)!r}"
    if path.exists() and not path.is_dir():
        raise JaxspecError(f"{where} is an existing file; pass a directory path")
    existing = path
    while not existing.exists():  # the nearest ancestor that exists is where the first mkdir happens
        existing = existing.parent
    if not existing.is_dir():
        raise JaxspecError(f"{where} is under {str(existing)!r}, which is a file; choose another location")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise JaxspecError(f"{where} cannot be written ({str(existing)!r} is not writable); choose another "
                           "location or fix its permissions")
    return path
