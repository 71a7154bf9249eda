"""User-facing errors.

A `JaxspecError` names a problem the user can fix (a path, a flag, a checkpoint) and how. The CLIs print it as one
line and exit with code 2, as they do an OSError (the machine's state: a full disk, a path under a file; reading
the user's files goes through jaxspec/files.py, which names the file); anything else is a bug and keeps its
traceback.
"""


class JaxspecError(Exception):
    """A problem with the user's input, reported as one line by the command-line tools."""
