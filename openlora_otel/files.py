"""Reading a file that someone else may have put there: only a regular file, and only so much of it.

A path a run or a command reads (a progress file, the demo's ``run.json`` and ``checkpoint.pt``, a
history file) can name something that is not a file at all: a FIFO, whose ``open()`` waits for a
writer forever; a character device (a link to ``/dev/zero`` never ends); a directory. Every reader of
such a path goes through :func:`open_regular_file` (a stream, for files read line by line) or
:func:`read_regular_file` (the whole file, up to a bound), which refuse anything else with one line
that says what the path is.
"""

from __future__ import annotations

import os
import stat
from typing import BinaryIO

__all__ = ["NotARegularFile", "open_regular_file", "read_regular_file"]

_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


class NotARegularFile(OSError):
    """The path is not a regular file, or one larger than the reader takes; ``str()`` says which, in one line."""


def open_regular_file(path: str | os.PathLike[str]) -> BinaryIO:
    """``path`` opened for reading in binary, when it is a regular file (a symbolic link to one is fine).

    Never blocks on a FIFO: it is opened without waiting for a writer, then refused.
    Raises :class:`NotARegularFile` for anything else, ``FileNotFoundError`` when it is missing and
    ``OSError`` when it cannot be opened.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = next((name for test, name in _KINDS if test(mode)), "not a regular file")
            raise NotARegularFile(f"{os.fspath(path)} is {kind}, not a regular file")
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_regular_file(path: str | os.PathLike[str], *, max_bytes: int) -> bytes:
    """The content of the regular file at ``path``, which must be at most ``max_bytes`` long.

    Raises as :func:`open_regular_file` does, and :class:`NotARegularFile` for a longer file (read no
    further than one byte past the bound, whatever its size says).
    """
    with open_regular_file(path) as handle:
        data = handle.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise NotARegularFile(f"{os.fspath(path)} is larger than {_size(max_bytes)}, the most read from it")
    return data


def _size(count: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if count >= scale and count % scale == 0:
            return f"{count // scale} {unit}"
    return f"{count:,} bytes"
