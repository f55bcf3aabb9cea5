"""Device filtering on cgroup v2: a ``BPF_PROG_TYPE_CGROUP_DEVICE`` program attached to a replica's cgroup.

cgroup v2 has no ``devices.allow``: the kernel asks the BPF programs attached to the task's cgroup (and its
ancestors) whether an open or mknod of a device may proceed. This module turns the same rules the v1 driver
writes (``c 195:0 rwm``, ``c *:* m``: :func:`services.node_agent.sandbox.device_rules`) into such a program
(:func:`program`: pure, testable as bytes) and loads and attaches it (:func:`attach`: the ``bpf(2)`` system call
through ctypes; needs root). The program answers 1 (allow) for the first rule that matches the device's type,
major, minor and requested access, else 0 (``EPERM``), as runc's device filter does.

The program's context (``struct bpf_cgroup_dev_ctx``): ``access_type`` (u32 at 0: the device type in the
low 16 bits, 1 block, 2 char; the access in the high 16: 1 mknod, 2 read, 4 write), ``major`` (u32 at 4),
``minor`` (u32 at 8).
"""

from __future__ import annotations

import ctypes
import os
import platform
import struct
from collections.abc import Iterable, Sequence

#: ``bpf(2)`` commands, program and attach types, flags (``linux/bpf.h``).
BPF_PROG_LOAD, BPF_PROG_ATTACH = 5, 8
BPF_PROG_TYPE_CGROUP_DEVICE = 15
BPF_CGROUP_DEVICE = 6
BPF_F_ALLOW_MULTI = 2

_TYPES = {"a": None, "b": 1, "c": 2}
_ACCESS = {"m": 1, "r": 2, "w": 4}
_SYSCALL = {"x86_64": 321, "aarch64": 280}

Rule = tuple[int | None, int | None, int | None, int]
"""``(type, major, minor, access mask)``; ``None``: any."""


def parse(rule: str) -> Rule:
    """A v1 device rule (``c 195:0 rwm``, ``b *:* m``, ``a``) as a :data:`Rule`.

    Raises:
        ValueError: not a device rule.
    """
    words = rule.split()
    if not words or words[0] not in _TYPES:
        raise ValueError(f"not a device rule: {rule!r}")
    if words[0] == "a":
        return (None, None, None, 7)
    if len(words) != 3 or ":" not in words[1] or not set(words[2]) <= set(_ACCESS):
        raise ValueError(f"not a device rule: {rule!r}")
    major, minor = words[1].split(":", 1)
    access = sum(_ACCESS[c] for c in set(words[2]))
    return (_TYPES[words[0]], None if major == "*" else int(major), None if minor == "*" else int(minor), access)


def insn(code: int, dst: int = 0, src: int = 0, off: int = 0, imm: int = 0) -> bytes:
    return struct.pack("<BBhi", code, (src << 4) | dst, off, imm)


_LDX_W, _AND_K, _RSH_K, _MOV_K, _MOV_X, _JNE_K, _EXIT = 0x61, 0x57, 0x77, 0xB7, 0xBF, 0x55, 0x95


def program(rules: Iterable[str]) -> bytes:
    """The eBPF instructions allowing exactly ``rules`` (v1 syntax), first match wins, anything else denied.

    Registers: r2 the device type, r3 the requested access, r4 the major, r5 the minor. Each rule is a block
    of tests that jump to the next block on a mismatch and ends in ``r0 = 1; exit``; after the last block
    ``r0 = 0; exit``.
    """
    out = [
        insn(_LDX_W, 2, 1, 0),
        insn(_AND_K, 2, imm=0xFFFF),
        insn(_LDX_W, 3, 1, 0),
        insn(_RSH_K, 3, imm=16),
        insn(_LDX_W, 4, 1, 4),
        insn(_LDX_W, 5, 1, 8),
    ]
    for kind, major, minor, access in (parse(r) for r in rules):
        tests: list[tuple[int, int] | bytes] = []  # (register, value) for "jump to the next block unless equal"
        if kind is not None:
            tests.append((2, kind))
        if access != 7:  # the access asked must be within the rule's: (asked & ~allowed) == 0
            tests += [insn(_MOV_X, 1, 3), insn(_AND_K, 1, imm=~access), (1, 0)]
        if major is not None:
            tests.append((4, major))
        if minor is not None:
            tests.append((5, minor))
        size = len(tests) + 2  # then r0 = 1; exit
        for i, t in enumerate(tests):
            out.append(insn(_JNE_K, t[0], off=size - i - 1, imm=t[1]) if isinstance(t, tuple) else t)
        out += [insn(_MOV_K, 0, imm=1), insn(_EXIT)]
    out += [insn(_MOV_K, 0, imm=0), insn(_EXIT)]
    return b"".join(out)


def _bpf(cmd: int, attr: bytes) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    nr = _SYSCALL.get(platform.machine())
    if nr is None:
        raise OSError(f"bpf(2): no system call number known for {platform.machine()}")
    buf = ctypes.create_string_buffer(attr, 128)
    fd = libc.syscall(nr, cmd, buf, 128)
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"bpf({cmd}): {os.strerror(err)}")
    return int(fd)


def load_program(prog_type: int, attach_type: int, code: bytes, name: bytes) -> int:
    """Load the eBPF instructions ``code`` as a program of ``prog_type`` for ``attach_type``; its file
    descriptor (the caller closes it).

    Raises:
        OSError: the kernel refused it (no BPF, not root); the verifier's log is in the message.
    """
    insns = ctypes.create_string_buffer(code, len(code))
    licence = ctypes.create_string_buffer(b"Apache-2.0")
    verifier = ctypes.create_string_buffer(16384)
    attr = struct.pack(
        "<IIQQIIQII16sII",
        prog_type,
        len(code) // 8,
        ctypes.addressof(insns),
        ctypes.addressof(licence),
        1,
        len(verifier),
        ctypes.addressof(verifier),
        0,
        0,
        name,
        0,
        attach_type,
    )
    try:
        return _bpf(BPF_PROG_LOAD, attr)
    except OSError as exc:
        log = verifier.value.decode(errors="replace").strip()
        raise OSError(exc.errno, f"{exc.strerror}{': ' + log[-400:] if log else ''}") from None


def attach_program(cgroup_dir: str, prog: int, attach_type: int) -> None:
    """Attach the loaded program ``prog`` to the v2 cgroup ``cgroup_dir`` at ``attach_type``; it stays attached
    until the cgroup is removed (``BPF_F_ALLOW_MULTI``: programs of an ancestor, systemd's for one, still apply).

    Raises:
        OSError: the cgroup cannot be opened, or the kernel refused.
    """
    cg = os.open(cgroup_dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        _bpf(BPF_PROG_ATTACH, struct.pack("<IIII", cg, prog, attach_type, BPF_F_ALLOW_MULTI))
    finally:
        os.close(cg)


def load(rules: Sequence[str]) -> int:
    """Load the program of ``rules``; its file descriptor (the caller closes it).

    Raises:
        OSError: the kernel refused it (no BPF, not root); the verifier's log is in the message.
    """
    return load_program(BPF_PROG_TYPE_CGROUP_DEVICE, BPF_CGROUP_DEVICE, program(rules), b"apportion_dev")


def attach(cgroup_dir: str, rules: Sequence[str]) -> None:
    """Let the processes of the v2 cgroup ``cgroup_dir`` open only the devices of ``rules``.

    Raises:
        OSError: it could not be loaded or attached.
    """
    prog = load(rules)
    try:
        attach_program(cgroup_dir, prog, BPF_CGROUP_DEVICE)
    finally:
        os.close(prog)
