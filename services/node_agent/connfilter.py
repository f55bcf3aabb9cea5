"""The control plane's ports, closed to a replica on loopback and on the control plane's own addresses:
``BPF_PROG_TYPE_CGROUP_SOCK_ADDR`` programs on its cgroup (cgroup v2), for ``connect`` and for ``bind``.

A job shares the node's network. Its credentials keep it from signing in to Redis or Kafka, not from taking
their connection slots (Redis counts a client before it signs in), nor, while a server is down (a restart), from
binding its port first and answering its clients itself. The agent attaches four programs to each replica's v2
cgroup (``connect4``, ``connect6``, ``bind4``, ``bind6``) that refuse (``EPERM``) a ``connect`` or a ``bind``
from any process of the replica to one of the closed ports on a loopback address: ``127.0.0.0/8``,
``0.0.0.0``, ``::1``, ``::`` and the IPv4-mapped ``::ffff:127.0.0.0/104`` and ``::ffff:0.0.0.0``; and on each
address the control plane's hosts resolved to when the agent started (:func:`resolve`: the node's own
non-loopback address, or another machine's; an IPv4 one in its IPv4-mapped form too). Any other address, and
every other port, is let through. A ``bind`` to port 0 is let through: the kernel then picks a port of its
ephemeral range (``net.ipv4.ip_local_port_range``), so a closed port outside that range is never handed out.
:func:`program` builds the instructions (pure, testable as bytes); :func:`attach` loads and attaches them (root).

The context (``struct bpf_sock_addr``), the same for the connect and the bind hooks (the kernel lets ``connect4``
and ``bind4`` read ``user_ip4``, ``connect6`` and ``bind6`` ``user_ip6``, each ``user_port``): ``user_ip4``
(u32 at 4), ``user_ip6`` (4 x u32 at 8), ``user_port`` (u32 at 24): the destination of a connect, the local
address of a bind; addresses and port in network byte order, as the bytes lie in memory (read here on a
little-endian machine: x86_64, aarch64).
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
from collections.abc import Iterable, Sequence

from services.node_agent.devfilter import attach_program, insn, load_program

log = logging.getLogger(__name__)

#: ``linux/bpf.h``: the program type and the attach points of ``connect`` on IPv4 and IPv6 sockets.
BPF_PROG_TYPE_CGROUP_SOCK_ADDR = 18
BPF_CGROUP_INET4_CONNECT, BPF_CGROUP_INET6_CONNECT = 10, 11
#: ``linux/bpf.h``: the attach points of ``bind`` on IPv4 and IPv6 sockets (the same context and fields).
BPF_CGROUP_INET4_BIND, BPF_CGROUP_INET6_BIND = 8, 9

#: The comparisons are 32-bit (``BPF_JMP32``, Linux 5.1+): an immediate of 2**31 or more, sign-extended to 64
#: bits, would never equal a zero-extended 32-bit load.
_LDX_W, _AND_K, _MOV_K, _JEQ_K, _JNE_K, _JA, _EXIT = 0x61, 0x57, 0xB7, 0x16, 0x56, 0x05, 0x95

#: One instruction before assembly: ``(code, dst, src, off, imm)``, ``off`` a label to jump to or a number;
#: or a label's name alone, marking where it lies.
_Asm = tuple[int, int, int, int | str, int] | str


def _word(raw: bytes) -> int:
    """The value a 32-bit load of the 4 bytes ``raw`` gives on a little-endian machine, as a signed immediate."""
    value = int.from_bytes(raw, "little")
    return value - (1 << 32) if value >= 1 << 31 else value


def _assemble(items: Sequence[_Asm]) -> bytes:
    """The instructions of ``items``, each jump's label turned into its offset (forward jumps only)."""
    where: dict[str, int] = {}
    n = 0
    for item in items:
        if isinstance(item, str):
            where[item] = n
        else:
            n += 1
    out, n = [], 0
    for item in items:
        if isinstance(item, str):
            continue
        code, dst, src, off, imm = item
        out.append(insn(code, dst, src, where[off] - n - 1 if isinstance(off, str) else off, imm))
        n += 1
    return b"".join(out)


def program(ports: Iterable[int], ipv6: bool, addresses: Iterable[str] = ()) -> bytes:
    """The instructions refusing a connect to any of ``ports`` on a loopback address or on one of ``addresses``
    (IPv4 or IPv6 literals; an IPv4 one also in its IPv4-mapped form) (``ipv6``: the ``connect6`` program, else
    ``connect4``), allowing anything else.

    Registers: r2 the port; r3 (and r4, r5, r6 on IPv6) the destination address's words.

    Raises:
        ValueError: no port, or one outside 1-65535; an address that is not an IP literal.
    """
    wanted = sorted(set(ports))
    if not wanted or not all(0 < p < 65536 for p in wanted):
        raise ValueError(f"closed ports must be 1-65535, at least one: {wanted}")
    ips = sorted({ipaddress.ip_address(a) for a in addresses}, key=lambda ip: (ip.version, int(ip)))
    v4 = [ip.packed for ip in ips if ip.version == 4]
    v6 = [ip.packed for ip in ips if ip.version == 6] + [b"\0" * 10 + b"\xff\xff" + raw for raw in v4]
    asm: list[_Asm] = [(_LDX_W, 2, 1, 24, 0)]
    asm += [(_JEQ_K, 2, 0, "address", _word(p.to_bytes(2, "big") + b"\0\0")) for p in wanted]
    asm += [(_JA, 0, 0, "allow", 0), "address"]
    if not ipv6:
        asm += [(_LDX_W, 3, 1, 4, 0)]
        asm += [(_JEQ_K, 3, 0, "deny", _word(raw)) for raw in v4]
        asm += [
            (_JEQ_K, 3, 0, "deny", 0),  # 0.0.0.0
            (_AND_K, 3, 0, 0, 0xFF),
            (_JEQ_K, 3, 0, "deny", 127),  # 127.0.0.0/8
        ]
    else:
        asm += [(_LDX_W, r, 1, off, 0) for r, off in ((3, 8), (4, 12), (5, 16), (6, 20))]
        for i, raw in enumerate(v6):  # each address: all four words equal
            words = [_word(raw[k : k + 4]) for k in range(0, 16, 4)]
            asm += [(_JNE_K, r, 0, f"other{i}", w) for r, w in zip((3, 4, 5), words)]
            asm += [(_JEQ_K, 6, 0, "deny", words[3]), f"other{i}"]
        asm += [
            (_JNE_K, 3, 0, "allow", 0),
            (_JNE_K, 4, 0, "allow", 0),
            (_JNE_K, 5, 0, "mapped", 0),
            (_JEQ_K, 6, 0, "deny", 0),  # ::
            (_JEQ_K, 6, 0, "deny", _word(b"\0\0\0\1")),  # ::1
            (_JA, 0, 0, "allow", 0),
            "mapped",
            (_JNE_K, 5, 0, "allow", _word(b"\0\0\xff\xff")),  # not ::ffff:a.b.c.d
            (_JEQ_K, 6, 0, "deny", 0),  # ::ffff:0.0.0.0
            (_AND_K, 6, 0, 0, 0xFF),
            (_JEQ_K, 6, 0, "deny", 127),  # ::ffff:127.0.0.0/104
        ]
    asm += [
        (_JA, 0, 0, "allow", 0),
        "deny",
        (_MOV_K, 0, 0, 0, 0),
        (_EXIT, 0, 0, 0, 0),
        "allow",
        (_MOV_K, 0, 0, 0, 1),
        (_EXIT, 0, 0, 0, 0),
    ]
    return _assemble(asm)


_ATTACH = (
    (BPF_CGROUP_INET4_CONNECT, False, b"apportion_conn4"),
    (BPF_CGROUP_INET6_CONNECT, True, b"apportion_conn6"),
    (BPF_CGROUP_INET4_BIND, False, b"apportion_bind4"),
    (BPF_CGROUP_INET6_BIND, True, b"apportion_bind6"),
)


def resolve(hosts: Iterable[str]) -> tuple[str, ...]:
    """Every address (each A and AAAA record) of ``hosts`` but the loopback ones, which the programs close
    anyway, ascending; a host that does not resolve is left out and logged (the agent cannot reach it either).
    """
    found: set[ipaddress.IPv4Address | ipaddress.IPv6Address] = set()
    for host in hosts:
        try:
            infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
        except OSError as exc:
            log.warning("the control plane's host %s does not resolve (%s): jobs are not kept off it", host, exc)
            continue
        for info in infos:
            ip = ipaddress.ip_address(str(info[4][0]).split("%", 1)[0])
            mapped = ip.ipv4_mapped if isinstance(ip, ipaddress.IPv6Address) else None
            ip = mapped or ip
            if not (ip.is_loopback or ip.is_unspecified):
                found.add(ip)
    return tuple(str(ip) for ip in sorted(found, key=lambda ip: (ip.version, int(ip))))


def load(ports: Sequence[int], addresses: Sequence[str] = ()) -> list[int]:
    """Load the four programs for ``ports`` (on loopback and ``addresses``): their file descriptors, in the
    order of the attach points (``connect4``, ``connect6``, ``bind4``, ``bind6``; the caller closes them).

    Raises:
        OSError: the kernel refused one (no BPF, not root; the verifier's log in the message); none is left open.
        ValueError: as :func:`program`.
    """
    fds: list[int] = []
    try:
        for attach_type, ipv6, name in _ATTACH:
            code = program(ports, ipv6, addresses)
            fds.append(load_program(BPF_PROG_TYPE_CGROUP_SOCK_ADDR, attach_type, code, name))
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return fds


def attach(cgroup_dir: str, ports: Sequence[int], addresses: Sequence[str] = ()) -> None:
    """Refuse the processes of the v2 cgroup ``cgroup_dir`` a connect to, and a bind of, ``ports`` on loopback
    and on ``addresses`` (IPv4 and IPv6), for as long as the cgroup exists.

    Raises:
        OSError: the programs could not be loaded or attached.
    """
    fds = load(ports, addresses)
    try:
        for fd, (attach_type, _, _) in zip(fds, _ATTACH):
            attach_program(cgroup_dir, fd, attach_type)
    finally:
        for fd in fds:
            os.close(fd)
