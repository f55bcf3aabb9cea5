"""apportion.bus.memory: glibc's arena limit and trim through ctypes, and no-ops without glibc."""

from __future__ import annotations

import platform

import pytest

from apportion.bus import memory


def test_glibc_takes_the_arena_limit_and_trims() -> None:
    assert memory.limit_arenas() is (platform.libc_ver()[0] == "glibc")  # this machine's CI: glibc, True
    junk = [bytes(200_000) for _ in range(50)]  # about 10 MiB of freed pages to hand back
    del junk
    assert isinstance(memory.trim(), bool)  # 1 or 0 from malloc_trim, never an error


def test_without_glibc_both_are_no_ops(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(memory, "_libc", False)  # as on musl or macOS: no malloc_trim
    assert (memory.limit_arenas(), memory.trim()) == (False, False)


def test_an_arena_limit_glibc_refuses_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    class Refusing:
        def mallopt(self, param: int, value: int) -> int:
            assert (param, value) == (-8, 2)  # M_ARENA_MAX, ARENAS
            return 0

        def malloc_trim(self, pad: int) -> int:
            return 0

    monkeypatch.setattr(memory, "_libc", Refusing())
    assert (memory.limit_arenas(), memory.trim()) == (False, False)
