"""Files written whole, with their mode from the first byte: the one home of writing a file that holds a secret
or must never be seen half-written (exports of the log, the logs of a local run, keys, passwords, certificates,
the node agent's journal).

A file is created mode 0600 (or the ``mode`` asked for) and a directory 0700 from the first byte, whatever the
umask (the temporary file is made 0600, then ``fchmod`` sets the mode: the umask can neither narrow nor widen
it); a file is written to a new name beside it and, when complete, either renamed over it (replace, the default)
or linked to its name only if nothing is there (``exclusive``: an existing file, or a link, is refused and left
as it was), so no reader sees a half-written file and a failed write leaves no temporary behind. A symbolic link
at the name is refused, never written through (an export to a name another user planted as a link to their own
file, or to ``~/.bashrc``), unless the caller asks to replace the link itself. ``durable`` flushes the file and
its directory to disk before returning.
"""

from __future__ import annotations

import errno
import os
import stat
import tempfile
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
def private_file(
    path: str | os.PathLike[str],
    *,
    mode: int = FILE_MODE,
    exclusive: bool = False,
    durable: bool = False,
    replace_link: bool = False,
) -> Iterator[BinaryIO]:
    """A binary file to write that becomes ``path``, with ``mode``, when the block ends without an exception (a
    temporary name in the same directory, then renamed over ``path``, or linked to it when ``exclusive``); on an
    exception it is removed and ``path`` is left as it was.

    Args:
        mode: the file's permission bits, exactly (the umask does not change them).
        exclusive: create ``path`` only if nothing is there; never replace a file or a link.
        durable: ``fsync`` the file before it takes the name, and the directory after.
        replace_link: a symbolic link at ``path`` is replaced (never written through) instead of refused.

    Raises:
        FileExistsError: ``exclusive`` and ``path`` exists (a file, a directory or a link, even a dangling one).
        OSError: ``path`` is a symbolic link (``ELOOP``), or it cannot be written.
    """
    p = Path(path)
    if exclusive and os.path.lexists(p):
        raise FileExistsError(errno.EEXIST, "exists: never overwritten", str(p))
    if not (exclusive or replace_link):
        _refuse_link(p)
    fd, name = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=p.parent)  # O_EXCL | O_NOFOLLOW, 0600
    tmp = Path(name)
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), mode)
            yield f
            if durable:
                f.flush()
                os.fsync(f.fileno())
        if exclusive:
            try:
                os.link(tmp, p)  # atomic, and fails when anything (a link too) took the name meanwhile
            except FileExistsError:
                raise FileExistsError(errno.EEXIST, "exists: never overwritten", str(p)) from None
            tmp.unlink()
        else:
            os.replace(tmp, p)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        _sync_dir(p.parent)


def _sync_dir(path: Path) -> None:
    """``fsync`` the directory ``path``: a rename or a link in it is on disk when this returns."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_private(
    path: str | os.PathLike[str],
    data: bytes,
    *,
    mode: int = FILE_MODE,
    exclusive: bool = False,
    durable: bool = False,
    replace_link: bool = False,
) -> None:
    """Write ``data`` to ``path`` as :func:`private_file` does (same arguments)."""
    with private_file(path, mode=mode, exclusive=exclusive, durable=durable, replace_link=replace_link) as f:
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
