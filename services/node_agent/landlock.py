"""A Landlock domain of its own for each process replica: abstract Unix sockets and signals scoped to it.

A job shares the node's network namespace and its account with its user's other jobs and logins. Landlock
(Linux 5.13+, ABI 6 from Linux 6.12) lets a process enter a domain that it and its children can never leave.
Each replica's child enters a new domain of its own between fork and exec (after ``no_new_privs``:
:func:`services.node_agent.sandbox.child_setup`), with the scopes of ABI 6:

* ``LANDLOCK_SCOPE_ABSTRACT_UNIX_SOCKET``: a ``connect`` (or datagram send) to an abstract Unix socket (``@name``,
  which file permissions do not guard) that a process outside the domain made is refused, ``EPERM``;
* ``LANDLOCK_SCOPE_SIGNAL``: a signal to a process outside the domain is refused, ``EPERM``.

Any domain also keeps its processes from tracing a process outside it (``ptrace``, and reading its
``/proc/<pid>/environ`` or memory), and a ``/proc`` mounted ``hidepid=invisible`` does not list it to them. Every replica's domain is its own, so one job cannot signal, trace or reach
the abstract sockets of another job (of its own account too), of its user's logins or of the agent, while the
processes of one replica (its ranks, its launcher) reach each other as before. The agent, outside every domain,
still signals them.

Not used: Landlock's TCP rules (ABI 4). A ruleset that handles ``LANDLOCK_ACCESS_NET_CONNECT_TCP`` refuses every
port no rule allows, on every address: closing the control plane's ports that way would take a rule for each of
the other 65,533 ports, and would close those ports on every host, not only on loopback. The BPF connect filter
(:mod:`services.node_agent.connfilter`) stays the one layer there.

Two system calls through ``ctypes`` (PyPI's ``landlock`` has development releases only): the ABI in force
(:func:`abi_version`), the scopes it supports (:func:`scopes_for`) and entering a domain (:func:`restrict_self`).
"""

from __future__ import annotations

import ctypes
import errno
import os

#: ``linux/landlock.h``: the scopes (``struct landlock_ruleset_attr.scoped``).
SCOPE_ABSTRACT_UNIX_SOCKET = 1 << 0
SCOPE_SIGNAL = 1 << 1

#: The first ABI with both scopes (Linux 6.12).
SCOPES_ABI = 6

#: ``landlock_create_ruleset`` flag: return the ABI version instead of a ruleset.
_CREATE_RULESET_VERSION = 1 << 0

#: The system call numbers: the same on x86_64 and aarch64 (the generic table).
_CREATE_RULESET, _RESTRICT_SELF = 444, 446

#: Looked up once, at import: a symbol looked up in the child between fork and exec could wait on the dynamic
#: loader's lock that another thread of the agent held at the fork.
_syscall = ctypes.CDLL(None, use_errno=True).syscall


class _RulesetAttr(ctypes.Structure):
    """``struct landlock_ruleset_attr`` of ABI 6 (24 bytes)."""

    _fields_ = [
        ("handled_access_fs", ctypes.c_uint64),
        ("handled_access_net", ctypes.c_uint64),
        ("scoped", ctypes.c_uint64),
    ]


def abi_from(rc: int, err: int) -> int:
    """The ABI version a ``landlock_create_ruleset(NULL, 0, LANDLOCK_CREATE_RULESET_VERSION)`` that returned ``rc``
    (errno ``err``) tells: ``rc`` itself, or 0 when there is no Landlock to use (``ENOSYS``: a kernel built without
    it, or before 5.13; ``EOPNOTSUPP``: not enabled at boot, ``lsm=``; ``EPERM``: a container's seccomp filter
    refuses the call).

    Raises:
        OSError: any other refusal.
    """
    if rc >= 0:
        return rc
    if err in (errno.ENOSYS, errno.EOPNOTSUPP, errno.EPERM):
        return 0
    raise OSError(err, f"landlock_create_ruleset(VERSION): {os.strerror(err)}")


def abi_version() -> int:
    """The Landlock ABI version of this kernel (0: no Landlock)."""
    rc = _syscall(_CREATE_RULESET, None, ctypes.c_size_t(0), ctypes.c_uint32(_CREATE_RULESET_VERSION))
    return abi_from(rc, ctypes.get_errno() if rc < 0 else 0)


def scopes_for(abi: int) -> int:
    """The scopes a replica's domain gets on a kernel of Landlock ABI ``abi``: abstract Unix sockets and signals
    from ABI 6 on; before it none (no domain is entered)."""
    return SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL if abi >= SCOPES_ABI else 0


_NAMES = ((SCOPE_ABSTRACT_UNIX_SOCKET, "abstract Unix sockets"), (SCOPE_SIGNAL, "signals"))


def scope_names(scopes: int) -> str:
    """``scopes`` in words, for the log (``"none"`` for 0)."""
    return " and ".join(name for bit, name in _NAMES if scopes & bit) or "none"


def restrict_self(scopes: int) -> None:
    """Enter a new Landlock domain scoped to ``scopes`` (the calling thread, and every child it makes from now on).
    Needs ``no_new_privs`` (or ``CAP_SYS_ADMIN``). Safe between fork and exec: two system calls, no lock another
    thread could hold.

    Raises:
        OSError: the kernel refused (a scope it does not know: ``EINVAL``).
    """
    attr = _RulesetAttr(0, 0, scopes)
    fd = _syscall(_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(ctypes.sizeof(attr)), ctypes.c_uint32(0))
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"landlock_create_ruleset: {os.strerror(err)}")
    try:
        if _syscall(_RESTRICT_SELF, ctypes.c_int(fd), ctypes.c_uint32(0)) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"landlock_restrict_self: {os.strerror(err)}")
    finally:
        os.close(fd)
