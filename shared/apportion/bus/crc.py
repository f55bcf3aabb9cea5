"""Compiled CRC-32C for kafka-python, from a dependency we already ship.

Every Kafka record batch (message format v2) carries a CRC-32C of its
bytes: a producer computes it for each batch it builds, a consumer with
``check_crcs`` (the default) recomputes it for each batch it receives.
kafka-python uses the C extension of the ``crc32c`` package when that is
installed and otherwise a pure-Python loop over the bytes. Without it, the
CRC was the largest single item of the dispatcher's profile (about 1.3 s of
CPU for the 3,300 batches of one ``bench_live`` run, plus the producer side
in the sender thread): a byte-at-a-time table lookup in Python.

aiokafka, a dependency already (faust runs on it), ships a Cython
CRC-32C. :func:`use_compiled_crc32c` points kafka-python's record codec at
it after checking that both give the same checksums. The checksums, and so
the bytes on the wire, do not change; only the CPU spent on them does.

Scope: a process calls it explicitly: every service does at start, in
:func:`apportion.bus.service.wire` (the dispatcher and the node agent did
before; accounting and the policy as well,
which cut accounting's rebuild CPU the most). Nothing here runs at import
time. It changes a module global of kafka-python for the whole calling
process, so it is *not* called from the shared producer or consumer
wrappers: a process that did not ask keeps kafka-python as shipped (the
``bench_live`` raw-consume baseline is one; it also measures a raw consume
with the compiled CRC, the stricter baseline).
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

#: Inputs on which the two implementations must agree before the swap (incl. the RFC 3720 check value).
_VECTORS: tuple[bytes, ...] = (b"", b"123456789", bytes(range(256)) * 3, b"\xff" * 1031)


def use_compiled_crc32c() -> str:
    """Make kafka-python compute record-batch CRC-32C in compiled code.

    Returns:
        ``"crc32c"`` when kafka-python already uses the ``crc32c`` package's
        C extension (nothing to do); ``"aiokafka"`` when it now uses
        aiokafka's Cython CRC-32C; ``"python"`` when neither is available or
        they disagree on a test vector (kafka-python's pure-Python CRC stays;
        slower, equally correct).

    Idempotent; affects the calling process only.
    """
    import kafka.record.default_records as records
    import kafka.record.util as util

    if util.crc32c_c is not None:
        return "crc32c"
    try:
        from aiokafka.record._crecords import crc32c_cython
    except ImportError:  # aiokafka built without its extensions
        return "python"
    for v in _VECTORS:
        if crc32c_cython(memoryview(v)) != util.crc32c_py(v):
            log.warning("aiokafka's CRC-32C disagrees with kafka-python's on %d bytes: not used", len(v))
            return "python"
    records.calc_crc32c = crc32c_cython
    return "aiokafka"
