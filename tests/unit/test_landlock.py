"""The Landlock ABI a kernel tells, and the scopes each replica's domain gets from it (``docs/security.md``,
"Node boundary"). The domain itself is fed the attacks in ``tests/service/test_node_agent_boundary.py``."""

from __future__ import annotations

import ctypes
import errno

import pytest

from services.node_agent import landlock

ABI_ANSWERS = [
    # id, what landlock_create_ruleset(NULL, 0, VERSION) returned, its errno, the ABI
    ("Linux 6.12: ABI 6", 6, 0, 6),
    ("Linux 5.13: ABI 1", 1, 0, 1),
    ("built without Landlock", -1, errno.ENOSYS, 0),
    ("not enabled at boot", -1, errno.EOPNOTSUPP, 0),
    ("a container's seccomp filter refuses it", -1, errno.EPERM, 0),
]


@pytest.mark.parametrize("case_id,rc,err,abi", ABI_ANSWERS, ids=[c[0] for c in ABI_ANSWERS])
def test_the_abi_the_kernel_tells(case_id, rc, err, abi):
    assert landlock.abi_from(rc, err) == abi


def test_any_other_refusal_of_the_probe_is_an_error():
    with pytest.raises(OSError, match="landlock_create_ruleset") as info:
        landlock.abi_from(-1, errno.EFAULT)
    assert info.value.errno == errno.EFAULT


SCOPES = [
    # id, ABI, scopes (bits of linux/landlock.h: abstract Unix sockets 1, signals 2), in words
    ("no Landlock", 0, 0, "none"),
    ("ABI 4: TCP rules, no scopes", 4, 0, "none"),
    ("ABI 5", 5, 0, "none"),
    ("ABI 6: both scopes", 6, 1 | 2, "abstract Unix sockets and signals"),
    ("a later ABI: the same two", 9, 1 | 2, "abstract Unix sockets and signals"),
]


@pytest.mark.parametrize("case_id,abi,scopes,words", SCOPES, ids=[c[0] for c in SCOPES])
def test_the_scopes_of_each_abi(case_id, abi, scopes, words):
    assert landlock.scopes_for(abi) == scopes
    assert landlock.scope_names(scopes) == words


def test_the_ruleset_attribute_is_the_kernels_three_words():
    """``struct landlock_ruleset_attr`` of ABI 6: ``handled_access_fs``, ``handled_access_net``, ``scoped``, 8 bytes
    each; a replica's domain handles no file system or TCP access, only the scopes."""
    names = ("handled_access_fs", "handled_access_net", "scoped")
    assert [getattr(landlock._RulesetAttr, name).offset for name in names] == [0, 8, 16]
    assert ctypes.sizeof(landlock._RulesetAttr) == 24
