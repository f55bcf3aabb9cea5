"""apportion.bus.crc: kafka-python with aiokafka's compiled CRC-32C builds and checks the same batches."""

from __future__ import annotations

import pytest


def _batch() -> bytes:
    from kafka.record.default_records import DefaultRecordBatchBuilder

    b = DefaultRecordBatchBuilder(
        magic=2,
        compression_type=0,
        is_transactional=False,
        producer_id=-1,
        producer_epoch=-1,
        base_sequence=-1,
        batch_size=1 << 20,
    )
    for i in range(50):
        b.append(i, timestamp=1_700_000_000_000 + i, key=b"k%d" % i, value=b'{"event_id":"x"}' * i, headers=[])
    return bytes(b.build())


def test_compiled_crc32c_builds_byte_identical_batches_that_validate(monkeypatch: pytest.MonkeyPatch) -> None:
    import kafka.record.default_records as records
    import kafka.record.util as util

    from apportion.bus.crc import use_compiled_crc32c

    monkeypatch.setattr(util, "crc32c_c", None)  # as without the crc32c package
    monkeypatch.setattr(records, "calc_crc32c", lambda data: util.crc32c_py(data))
    slow = _batch()
    assert use_compiled_crc32c() == "aiokafka"
    assert records.calc_crc32c is not util.calc_crc32c
    fast = _batch()
    assert fast == slow
    assert records.DefaultRecordBatch(bytearray(fast)).validate_crc() is True
    corrupt = bytearray(fast)
    corrupt[-1] ^= 0x01
    assert records.DefaultRecordBatch(corrupt).validate_crc() is False


def test_rfc3720_check_value() -> None:
    from aiokafka.record._crecords import crc32c_cython

    assert crc32c_cython(memoryview(b"123456789")) == 0xE3069283


def test_nothing_to_do_when_kafka_python_has_the_c_package(monkeypatch: pytest.MonkeyPatch) -> None:
    import kafka.record.default_records as records
    import kafka.record.util as util

    from apportion.bus.crc import use_compiled_crc32c

    before = records.calc_crc32c
    monkeypatch.setattr(util, "crc32c_c", lambda data: 0)  # stands for the crc32c package's function
    assert use_compiled_crc32c() == "crc32c"
    assert records.calc_crc32c is before
