"""A job's disk on the node (``docs/security.md``, "Disk"): what the agent's measuring charges
(:func:`services.node_agent.sandbox.disk_use`), exactly at the limit and one byte past it, hard links once, links
not followed, a directory it cannot list over; which replicas a pass looks at and the limit it gives them
(:func:`services.node_agent.logic.disk_checks`); the reason their exit is reported with."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from apportion.events import JobFailed
from services.node_agent import logic
from services.node_agent.logic import Workload
from services.node_agent.sandbox import ENTRY_FLOOR_BYTES, DiskUse, disk_mb_per_gpu, disk_use, entry_bytes

MIB = 1 << 20
T0 = datetime(2026, 1, 5, tzinfo=UTC)


@dataclass
class FakeStat:
    st_mode: int
    st_ino: int
    st_size: int
    st_blocks: int = 0
    st_dev: int = 1


@dataclass
class Tree:
    """A file system of its own: path -> stat; a directory's entries are the paths one level below it. Listing a
    path of ``unreadable`` raises ``PermissionError`` (the job took its permissions away, the agent not root)."""

    stats: dict[str, FakeStat]
    unreadable: set[str] = field(default_factory=set)
    listed: list[str] = field(default_factory=list)

    def lstat(self, path: str) -> Any:
        if path not in self.stats:
            raise FileNotFoundError(path)
        return self.stats[path]

    def listdir(self, path: str, key: tuple[int, int]) -> Iterator[Any]:
        """As :func:`services.node_agent.sandbox.list_dir`: a path that no longer leads to ``key`` is gone."""
        if path in self.unreadable:
            raise PermissionError(13, "Permission denied", path)
        st = self.stats.get(path)
        if st is None or (st.st_dev, st.st_ino) != key:
            raise FileNotFoundError(path)
        self.listed.append(path)
        tree = self

        class Entry:
            def __init__(self, p: str) -> None:
                self.name = os.path.basename(p)
                self.full = p

            def stat(self, follow_symlinks: bool = True) -> Any:
                assert not follow_symlinks, "a link must never be followed"
                return tree.lstat(self.full)

        yield from [Entry(p) for p in sorted(self.stats) if os.path.dirname(p) == path]

    def use(self, roots: list[str], limit: int) -> DiskUse:
        return disk_use(roots, limit, listdir=self.listdir, lstat=self.lstat)


def d(ino: int) -> FakeStat:
    return FakeStat(stat.S_IFDIR | 0o700, ino, 4096, 8)


def f(ino: int, size: int, blocks: int | None = None) -> FakeStat:
    return FakeStat(stat.S_IFREG | 0o600, ino, size, size // 512 if blocks is None else blocks)


def test_an_inode_is_charged_its_size_its_blocks_or_one_block() -> None:
    assert entry_bytes(10_000, 24) == 12_288  # 10,000 bytes in three 4 KiB blocks
    assert entry_bytes(1 << 30, 0) == 1 << 30  # sparse: the room it may take
    assert entry_bytes(0, 0) == ENTRY_FLOOR_BYTES == 4096  # an empty file still takes an inode
    assert entry_bytes(1, 8) == 4096


def test_exactly_the_limit_is_within_it_and_one_byte_more_is_over() -> None:
    """Root 4,096 (a directory), a subdirectory 4,096, files 1 MiB and 100,000 bytes (sparse: charged its size):
    1,048,576 + 100,000 + 8,192 = 1,156,768 bytes. A limit of exactly that holds; one byte less is over."""
    tree = Tree({"/r": d(1), "/r/a": f(2, MIB), "/r/s": d(3), "/r/s/b": f(4, 100_000, 0)})
    total = 4096 + MIB + 4096 + 100_000
    assert total == 1_156_768
    within = tree.use(["/r"], total)
    assert (within.used_bytes, within.complete, within.over(total), within.entries) == (total, True, False, 4)
    assert tree.use(["/r"], total - 1).over(total - 1)
    assert DiskUse(total + 1, True).over(total) and not DiskUse(total, True).over(total)


def test_hard_links_are_charged_once_within_and_across_the_roots() -> None:
    """A 1 MiB file with three names: two in the checkpoint directory, one in the output directory (inode 2 each)."""
    tree = Tree({"/c": d(1), "/c/w": f(2, MIB), "/c/w2": f(2, MIB), "/o": d(3), "/o/tmp": d(4), "/o/tmp/w3": f(2, MIB)})
    use = tree.use(["/c", "/o"], 10 * MIB)
    assert (use.used_bytes, use.entries) == (3 * 4096 + MIB, 4)
    assert tree.use(["/c", "/c"], 10 * MIB).used_bytes == 4096 + MIB  # a root named twice: once


def test_a_symbolic_link_is_charged_as_a_link_and_never_followed() -> None:
    tree = Tree({"/r": d(1), "/r/l": FakeStat(stat.S_IFLNK | 0o777, 2, 5), "/big": d(3), "/big/x": f(4, 100 * MIB)})
    use = tree.use(["/r"], MIB)
    assert (use.used_bytes, use.complete, tree.listed) == (2 * 4096, True, ["/r"])


def test_a_directory_that_cannot_be_listed_is_over_whatever_the_rest_weighs() -> None:
    tree = Tree({"/r": d(1), "/r/hidden": d(2), "/r/hidden/x": f(3, MIB)}, unreadable={"/r/hidden"})
    use = tree.use(["/r"], 100 * MIB)
    assert (use.unreadable, use.complete, use.over(100 * MIB)) == ("/r/hidden", False, True)


def test_a_missing_root_weighs_nothing_and_the_walk_stops_once_over() -> None:
    """1,000 files of 8 KiB against a 40,000-byte limit: the walk stops at the sixth inode (root + 5 x 8,192 =
    45,056 > 40,000, where root + 4 files was 36,864), never looking at the rest."""
    stats = {"/r": d(1)} | {f"/r/{i:04d}": f(10 + i, 8192) for i in range(1000)}
    use = Tree(stats).use(["/gone", "/r"], 40_000)
    assert (use.used_bytes, use.entries, use.complete) == (4096 + 5 * 8192, 6, False)
    assert Tree({}).use(["/gone"], 0) == DiskUse(0, True, None, 0)


def test_a_real_hard_link_and_a_link_out_of_the_roots_change_nothing(tmp_path: Path) -> None:
    """On the machine's file system: a second name of a file, and a symbolic link to a 4 MiB file outside the
    job's directory, leave the charge as it was."""
    job = tmp_path / "job"
    job.mkdir()
    (job / "w").write_bytes(b"x" * 300_000)
    before = disk_use([str(job)], 100 * MIB)
    os.link(job / "w", job / "w-again")
    (tmp_path / "outside").write_bytes(b"y" * (4 * MIB))
    os.symlink(tmp_path / "outside", job / "l")
    after = disk_use([str(job)], 100 * MIB)
    assert after.used_bytes - before.used_bytes == entry_bytes(os.lstat(job / "l").st_size, 0) == 4096
    assert before.used_bytes >= 300_000 and after.complete


def w(
    job: str, replica: int, gpus: tuple[int, ...], *, command: tuple[str, ...] | None = ("x",), **kw: Any
) -> Workload:
    return Workload("n1", job, 1, replica, gpus, command, None, **kw)


def test_a_pass_looks_at_each_job_with_a_process_replica_and_none_stopping() -> None:
    """Job a: two replicas of 2 and 1 GPUs, their limit 3 x 10 MiB together; b stopping: not measured; c simulated:
    no files of its own."""
    running = [w("a", 0, (0, 1)), w("a", 1, (2,)), w("b", 0, (3,), stopping=True), w("c", 0, (4,), command=None)]
    state = logic.initial_state([logic.NodeSpec("n1", ())], "")
    for x in running:
        state = logic.with_launched(state, x)
    checks = logic.disk_checks(state, "/ck", "/out", 10)
    assert checks == [logic.DiskCheck("a", ("/ck/a", "/out/a"), (("n1", "a", 1, 0), ("n1", "a", 1, 1)), 3 * 10 * MIB)]
    assert logic.job_roots("/ck", None, "a") == ("/ck/a",)
    assert logic.disk_limit_bytes(0, 10) == 10 * MIB  # a replica always holds at least one GPU


def test_a_replica_stopped_at_its_disk_limit_is_reported_disk_quota() -> None:
    state = logic.with_launched(logic.initial_state([logic.NodeSpec("n1", ())], ""), w("a", 0, (0,)))
    state, stopped = logic.with_limit_reached(state, ("n1", "a", 1, 0), logic.DISK_QUOTA)
    assert stopped is not None and stopped.stopping and stopped.limit_reached == "disk_quota"
    failed = logic.exit_event(stopped, -15, T0)
    assert isinstance(failed, JobFailed) and (failed.reason, failed.exit_code) == ("disk_quota", -15)
    again, none = logic.with_limit_reached(state, ("n1", "a", 1, 0), logic.TIME_LIMIT)  # already stopping
    assert (again, none) == (state, None)


@pytest.mark.parametrize(
    ("free", "gpus", "mb"),
    [(1000 * MIB, [8], 112), (100 * (1 << 30), [8] * 8, 1440), (MIB, [8], 1), (0, [], 1)],
)
def test_the_default_disk_limit_shares_nine_tenths_of_the_free_space_among_every_gpu(
    free: int, gpus: list[int], mb: int
) -> None:
    """1,000 MiB over 8 GPUs: 900 // 8 = 112 MiB; 100 GiB over 64: 92,160 // 64 = 1,440 MiB; at least 1 MiB."""
    assert disk_mb_per_gpu(free, gpus) == mb


def test_the_agents_limit_reasons_are_the_contracts_and_explain_says_what_they_mean() -> None:
    from apportion.audit.explain import _ended
    from apportion.events import FAILURE_REASONS
    from services.node_agent.service import OOM

    assert sorted(FAILURE_REASONS) == sorted([logic.DISK_QUOTA, logic.TIME_LIMIT, OOM])
    failed = JobFailed(job_id="j", attempt=1, replica=0, node_id="n1", exit_code=-15, reason="disk_quota", ts=T0)
    assert (
        _ended(failed, "t", "w").summary == "replica 0 failed: disk_quota (its files on the node passed its disk limit)"
    )


def test_the_free_space_is_read_above_a_root_not_made_yet_and_nothing_is_made(tmp_path: Path) -> None:
    from services.node_agent.sandbox import free_bytes

    st = os.statvfs(tmp_path)
    missing = tmp_path / "state" / "checkpoints"
    assert abs(free_bytes([missing]) - st.f_bavail * st.f_frsize) < 64 * MIB  # the same file system, moments apart
    assert not (tmp_path / "state").exists()
    assert free_bytes([]) == 0


def test_the_disk_settings_are_flags_of_the_agent() -> None:
    from services.node_agent.__main__ import parse_args
    from services.node_agent.config import NodeAgentSettings

    args = parse_args(["--sandbox-disk-mb-per-gpu", "7", "--sandbox-disk-poll-wall-s", "0.5"])
    assert args == {"sandbox_disk_mb_per_gpu": 7, "sandbox_disk_poll_wall_s": 0.5}
    defaults = NodeAgentSettings()
    assert (defaults.sandbox_disk_mb_per_gpu, defaults.sandbox_disk_poll_wall_s) == (None, 5.0)


def test_a_directory_swapped_for_a_link_or_another_directory_is_not_listed(tmp_path: Path) -> None:
    """:func:`list_dir` lists a directory only while its name leads, without a link, to the inode its parent's
    listing gave: a link put at its name (to a directory of 4 MiB elsewhere), or another directory moved there, is
    passed over (gone), never listed."""
    from services.node_agent.sandbox import list_dir

    job, elsewhere = tmp_path / "job", tmp_path / "elsewhere"
    (job / "sub").mkdir(parents=True)
    elsewhere.mkdir()
    (elsewhere / "big").write_bytes(b"y" * (4 * MIB))
    st = os.lstat(job / "sub")
    key = (st.st_dev, st.st_ino)
    assert list(list_dir(str(job / "sub"), key)) == []
    (job / "sub").rmdir()
    os.symlink(elsewhere, job / "sub")
    with pytest.raises(FileNotFoundError):
        list(list_dir(str(job / "sub"), key))
    (job / "sub").unlink()
    os.rename(elsewhere, job / "sub")
    with pytest.raises(FileNotFoundError):
        list(list_dir(str(job / "sub"), key))
    moved = Tree({"/r": d(1), "/r/s": d(2), "/r/s/x": f(3, MIB)})
    moved.stats["/r/s"] = d(9)  # between the listing of /r and that of /r/s, another directory took the name
    original = moved.lstat

    def stale(path: str) -> Any:  # the root's listing still reports the old inode for /r/s
        return d(2) if path == "/r/s" else original(path)

    moved.lstat = stale  # type: ignore[method-assign]
    assert moved.use(["/r"], 100 * MIB).used_bytes == 2 * 4096  # /r and /r/s charged, /r/s not listed
