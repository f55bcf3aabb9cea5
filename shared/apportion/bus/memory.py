"""Keep a long-running service's resident memory flat: fewer malloc arenas, free pages handed back.

What grew. ``bench/bench_rss.py --trace accounting`` showed the Python
allocations of accounting flat over the second half of a 15-minute run (tracemalloc: +0.6 MiB of live
blocks, most of it the bounded signature caches), while its resident set had grown by 10.4% (75 -> 83 MiB)
over the same half of a 20-minute run. The difference is the C allocator: glibc
gives each thread that allocates its own arena (up to 8 per core), a service runs several threads
(``asyncio.to_thread`` workers, kafka-python's, the metrics server's), and the large short-lived buffers of
a checkpoint or a snapshot (a pickle of the whole state, its checksum and the Redis command built from it,
a few MiB every 10 wall seconds) leave freed pages inside those arenas that ``free`` does not return.

Two calls, both of glibc's documented interface (``mallopt(3)``, ``malloc_trim(3)``), through
:mod:`ctypes`; each is a no-op where the C library does not have it (musl, macOS), so nothing else
depends on them:

* :func:`limit_arenas` at start (every service, :func:`apportion.bus.service.wire`): at most
  :data:`ARENAS` arenas, the usual setting for threaded Python servers (``MALLOC_ARENA_MAX=2``), so a
  freed page in one arena is reused by the next allocation of any thread.
* :func:`trim` after each checkpoint or snapshot write (accounting, the dispatcher): hands the free pages
  of every arena back to the kernel (``madvise`` of whole free pages; about a millisecond).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
from typing import Any

log = logging.getLogger(__name__)

#: Arenas a service may use (glibc's default is 8 per core).
ARENAS = 2
#: ``mallopt`` parameter number of the arena limit (glibc ``malloc.h``).
_M_ARENA_MAX = -8

_libc: Any = None


def _c_library() -> Any:
    """The process's C library when it is glibc (it has ``malloc_trim``), else ``None``."""
    global _libc
    if _libc is None:
        name = ctypes.util.find_library("c")
        try:
            lib = ctypes.CDLL(name) if name else None
        except OSError:
            lib = None
        _libc = lib if lib is not None and hasattr(lib, "malloc_trim") and hasattr(lib, "mallopt") else False
    return _libc or None


def limit_arenas(arenas: int = ARENAS) -> bool:
    """Cap the C allocator's arenas at ``arenas`` for the whole process (call before threads start).

    Returns:
        True when the C library took the setting; False when it is not glibc or refused it.
    """
    lib = _c_library()
    return bool(lib is not None and lib.mallopt(_M_ARENA_MAX, int(arenas)) == 1)


def trim() -> bool:
    """Hand the C allocator's free pages back to the kernel (``malloc_trim(0)``).

    Returns:
        True when memory was released; False when there was none to release or the C library is not glibc.
    """
    lib = _c_library()
    return bool(lib is not None and lib.malloc_trim(0) == 1)
