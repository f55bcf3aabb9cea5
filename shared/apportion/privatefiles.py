"""Files only their owner may read: exports of the log and the logs of a local run hold every job's command and
``--env`` values.

A file is created mode 0600 and a directory 0700 from the first byte, whatever the umask (``open`` with the mode,
then ``fchmod``: the umask can only narrow the mode, never widen it); a file is written to a new name beside it and
renamed over it when complete, so no reader sees a half-written export; a symbolic link at the name is refused,
never written through (an export to a name another user planted as a link to their own file, or to ``~/.bashrc``).
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

FILE_MODE = 0o600
DIR_MODE = 0o700


def _refuse_link(path: Path) -> None:
    """Raise ``OSError(ELOOP)`` when ``path`` is a symbolic link."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(st.st_mode):
        raise OSError(errno.ELOOP, "a symbolic link: not written through", str(path))


def private_dir(path: str | os.PathLike[str]) -> Path:
    """Make ``path`` (and missing parents, with the default mode) a directory of mode 0700; an existing one is
    narrowed to 0700.

    Raises:
        OSError: ``path`` is a symbolic link (``ELOOP``) or not a directory, or it cannot be made.
    """
    p = Path(path)
    _refuse_link(p)
    p.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.mkdir(p, DIR_MODE)
    except FileExistsError:
        pass
    fd = os.open(p, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        os.fchmod(fd, DIR_MODE)
    finally:
        os.close(fd)
    return p


@contextmanager
def private_file(path: str | os.PathLike[str]) -> Iterator[BinaryIO]:
    """A binary file to write that becomes ``path``, mode 0600, when the block ends without an exception (a
    temporary name in the same directory, renamed over ``path``); on an exception it is removed and ``path`` is
    left as it was.

    Raises:
        OSError: ``path`` is a symbolic link (``ELOOP``), or it cannot be written.
    """
    p = Path(path)
    _refuse_link(p)
    tmp = p.with_name(f".{p.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE)
    try:
        os.fchmod(fd, FILE_MODE)
        with os.fdopen(fd, "wb") as f:
            yield f
        os.replace(tmp, p)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_private(path: str | os.PathLike[str], data: bytes) -> None:
    """Write ``data`` to ``path`` as :func:`private_file` does."""
    with private_file(path) as f:
        f.write(data)


def open_private_append(path: str | os.PathLike[str]) -> BinaryIO:
    """``path`` opened to append (created if missing), mode 0600 (an existing file is narrowed to it); for a log
    a child process writes as it runs.

    Raises:
        OSError: ``path`` is a symbolic link (``ELOOP``), or it cannot be opened.
    """
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE)
    try:
        os.fchmod(fd, FILE_MODE)
    except BaseException:
        os.close(fd)
        raise
    return os.fdopen(fd, "ab")
