"""The directory name of a job on a node: the one mapping the node agent writes under and every reader looks in.

The node agent keeps each job's checkpoint and working directory, and its output files, under a directory named
by :func:`job_dir_name` of the job id (``docs/security.md``, "Node boundary"); ``apportion logs`` reads there.
"""

from __future__ import annotations

import hashlib
import re

_SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")
_HASHED_TAIL = re.compile(r".*-[0-9A-Fa-f]{16}")


def job_dir_name(job_id: str) -> str:
    """A directory name for ``job_id``: the id itself when it is a plain file name, else a hashed form.

    Plain: 1-100 characters of ``[A-Za-z0-9._-]`` not starting with ``.`` or ``-``, and not ending in ``-``
    and 16 hex digits. Anything else (slashes, ``..``, spaces, non-ASCII, empty, long, or a name that looks
    hashed) maps to its safe characters (``_`` for the others, at most 60) plus ``-`` and 16 hex digits of the
    id's SHA-256. Every hashed name ends in ``-`` and 16 hex digits and no plain name does, so an id chosen
    equal to another id's hashed name is hashed itself: distinct ids never share a directory, and the same id
    always gets the same one.
    """
    if _SAFE_NAME.fullmatch(job_id) and not _HASHED_TAIL.fullmatch(job_id):
        return job_id
    digest = hashlib.sha256(job_id.encode("utf-8", "surrogatepass")).hexdigest()[:16]
    stem = re.sub(r"[^A-Za-z0-9._-]", "_", job_id)[:60].lstrip(".-")
    return f"{stem}-{digest}" if stem else f"job-{digest}"
