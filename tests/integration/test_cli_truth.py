"""Operations tell the truth (design D11), on a live stack started by `apportion stack up`.

One stack for the module: the four services as processes (8 simulated 8-GPU nodes, as the README's) started by
``stack up`` on the session's Kafka and Redis. Every command is run through typer's CliRunner and its exit code
and message are asserted exactly; waits poll with bounded deadlines. The README test runs the README's "Using
it" block under bash exactly as written, on a stack of its own that `make up` starts (Kafka and Redis included)
and `make down` stops. The last test runs the CLI from an unrelated folder with nothing but the per-user state
file, then `stack down`, and checks that no process it started is left.
"""

from __future__ import annotations

import json
import pwd
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from apportion.settings import topic_name
from tests.kit.kafka_clients import closing_kafka_clients
from tests.kit.livestack import Stack
from tests.kit.narrowing import narrow
from tests.kit.node_boundary import ALICE, job_accounts  # noqa: F401 - a fixture

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
DEADLINE_S = 60.0


def _error(res: Any) -> str:
    """The one stderr line of a refused command."""
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, res.stderr
    return lines[0]


@pytest.fixture(scope="module")
def stack(kafka_bootstrap: str, redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """`stack up` of the services on the session's Kafka and Redis (a fresh namespace and Redis db)."""
    from tests.kit.livestack import live_stack

    with live_stack(
        kafka_bootstrap, redis_url, tmp_path_factory, name="truth", db=11, sim_nodes=8, gpus_per_node=8
    ) as (info, env, _):
        yield Stack(info, dict(env))


@pytest.fixture(scope="module")
def budgets(stack: Stack) -> Stack:
    stack.run("budget", "apply", str(ROOT / "infra/budgets/example.yaml"))
    return stack


def _tree(stack: Stack) -> dict[str, float]:
    return {r["path"]: r["share"] for r in stack.json("budget", "show")}


def test_budget_set_that_overfills_the_siblings_is_refused_before_publishing(budgets: Stack) -> None:
    res = budgets.run("budget", "set", "lab/vision", "--share", "0.7", code=1)
    assert _error(res) == "error: refused: over_allocated: shares under 'lab' would sum to 1.3 > 1"
    assert _tree(budgets)["lab/vision"] == 0.4


def test_budget_set_says_when_a_limit_is_above_the_parents(budgets: Stack) -> None:
    res = budgets.run("budget", "set", "lab/vision", "--max-min-runtime", "1d")  # lab: 12h, vision: 8h
    assert res.stderr.strip() == (
        "note: lab/vision's max min runtime 1d is above its parent lab's effective 12h: it overrides the parent's "
        "for lab/vision and below"
    )
    assert res.stdout.strip() == "budget lab/vision set: max min runtime 1d"  # what it set, not the share
    res = budgets.run("budget", "set", "lab/vision", "--max-min-runtime", "8h")
    assert res.stderr == ""
    assert res.stdout.strip() == "budget lab/vision set: max min runtime 8h"


def test_budget_set_waits_for_the_policy_and_reports_accepted(budgets: Stack) -> None:
    doc = budgets.json("budget", "set", "lab/prior/language", "--share", "0.4")
    [v] = doc["verdicts"]
    assert (v["path"], v["verdict"]) == ("lab/prior/language", "accepted")
    assert _tree(budgets)["lab/prior/language"] == 0.4
    assert doc["read_model"] is True  # `share` shows it as soon as the command returns
    budgets.run("budget", "set", "lab/prior/language", "--share", "0.5")
    same = budgets.json("budget", "set", "lab/prior/language", "--share", "0.5")  # nothing for the read model to fold
    assert ([v["verdict"] for v in same["verdicts"]], same["read_model"]) == (["accepted"], None)


def test_a_change_the_policy_rejects_is_reported_as_rejected(budgets: Stack) -> None:
    """The verdict reader on the real policy: a change published behind the CLI's back is rejected by id."""
    from datetime import UTC, datetime

    from apportion import client, events
    from apportion.cli.verdicts import budget_verdicts

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("APPORTION_TOPIC_PREFIX", budgets.env["APPORTION_TOPIC_PREFIX"] or "")
        ev = events.BudgetSet(path="lab/vision", share=0.9, ts=datetime.now(UTC), producer="test")
        [offset] = client.publish(ev, bootstrap=budgets.info.bootstrap)
        [v] = budget_verdicts(budgets.info.bootstrap, [(ev, offset)], timeout_s=DEADLINE_S)
    assert (v.state, v.reason) == ("rejected", "over_allocated")
    assert _tree(budgets)["lab/vision"] == 0.4


def _moved(tmp_path: Path) -> Path:
    """example.yaml with lab/prior 0.6 -> 0.7 and lab/vision 0.4 -> 0.3: valid only as a whole."""
    moved = tmp_path / "moved.yaml"
    text = (ROOT / "infra/budgets/example.yaml").read_text()
    moved.write_text(text.replace("lab/prior: 0.6", "lab/prior: 0.7").replace("share: 0.4", "share: 0.3"))
    return moved


def _budget_records(stack: Stack) -> list[Any]:
    from apportion import topics
    from apportion.bus.reader import read_log

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("APPORTION_TOPIC_PREFIX", stack.env["APPORTION_TOPIC_PREFIX"] or "")
        return [r.event for r in read_log(stack.info.bootstrap, [topic_name(topics.BUDGETS)]) if r.event is not None]


def test_apply_of_a_file_valid_only_as_a_whole_is_one_batch_applied_whole(budgets: Stack, tmp_path: Path) -> None:
    moved = _moved(tmp_path)
    dry = budgets.run("budget", "apply", str(moved), "--dry-run")
    assert dry.stdout.splitlines() == [
        "  ~ lab/prior share: 0.6 -> 0.7",
        "  ~ lab/vision share: 0.4 -> 0.3",
        "2 budget change(s) (dry run: nothing published)",
    ]
    assert _tree(budgets)["lab/prior"] == 0.6  # the dry run published nothing
    before = len(_budget_records(budgets))
    doc = budgets.json("budget", "apply", str(moved))
    [v] = doc["verdicts"]
    assert (v["type"], v["paths"], v["verdict"]) == ("BudgetBatch", ["lab/prior", "lab/vision"], "accepted")
    assert doc["read_model"] is True
    # one record on the log, and no reader ever sees a tree with only one of the two changes
    [batch] = _budget_records(budgets)[before:]
    assert batch.type == "BudgetBatch" and [(s.path, s.share) for s in batch.sets] == [
        ("lab/prior", 0.7),
        ("lab/vision", 0.3),
    ]
    tree = _tree(budgets)
    assert (tree["lab/prior"], tree["lab/vision"]) == (0.7, 0.3)
    shown = {r["path"]: r["share"] for r in budgets.json("share")["budgets"]}  # the read model, right after
    assert (shown["lab/prior"], shown["lab/vision"]) == (0.7, 0.3)
    res = budgets.run("budget", "apply", str(ROOT / "infra/budgets/example.yaml"))
    assert res.stdout.strip() == f"applied {ROOT / 'infra/budgets/example.yaml'}: 2 budget change(s) in one batch"
    assert _tree(budgets)["lab/prior"] == 0.6


def test_a_batch_the_policy_rejects_changes_nothing_and_names_each_failing_path(
    budgets: Stack, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As if someone changed the tree between the check and the publish: the CLI checked the file against a
    tree where lab/prior/language is 0.3 (it is 0.5), so robotics 0.5 -> 0.7 overfills lab/prior; the policy
    rejects the whole batch, the valid moves of lab/prior and lab/vision included."""
    from apportion.cli import budgets as main
    from apportion.domain.budgets import Budget

    real = main._tree_in_force
    monkeypatch.setattr(main, "_tree_in_force", lambda b: real(b).with_budget(Budget("lab/prior/language", 0.3)))
    f = tmp_path / "partial.yaml"
    f.write_text(
        "budgets:\n  lab/prior: 0.7\n  lab/vision: 0.3\n  lab/prior/robotics: {share: 0.7, members: [alice, bob]}\n"
    )
    res = budgets.run("budget", "apply", str(f), code=1)
    assert _error(res) == (
        "error: refused by the policy: lab/prior/robotics: over_allocated: shares under 'lab/prior' would sum "
        "to 1.2 > 1"
    )
    monkeypatch.setattr(main, "_tree_in_force", real)
    tree = _tree(budgets)
    assert (tree["lab/prior"], tree["lab/vision"], tree["lab/prior/robotics"]) == (0.6, 0.4, 0.5)


def test_an_invalid_batch_on_the_log_is_rejected_whole_with_one_rejection(budgets: Stack) -> None:
    """The verdict reader on the real policy, for a batch published behind the CLI's back."""
    from datetime import UTC, datetime

    from apportion import client, events
    from apportion.cli.verdicts import budget_verdicts

    bad = events.BudgetBatch(
        sets=(
            events.BudgetSpec(path="lab/vision", share=0.3),  # valid alone
            events.BudgetSpec(path="lab/ghost/x", share=0.5),  # no parent
        ),
        removes=("lab/nothing",),
        ts=datetime.now(UTC),
        producer="test",
    )
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("APPORTION_TOPIC_PREFIX", budgets.env["APPORTION_TOPIC_PREFIX"] or "")
        [offset] = client.publish(bad, bootstrap=budgets.info.bootstrap)
        [v] = budget_verdicts(budgets.info.bootstrap, [(bad, offset)], timeout_s=DEADLINE_S)
    assert v.state == "rejected"
    assert [(f.path, f.reason) for f in v.failures] == [("lab/nothing", "unknown_budget"), ("lab/ghost/x", "no_parent")]
    rejections = [e for e in _budget_records(budgets) if getattr(e, "rejected_event_id", None) == bad.event_id]
    assert len(rejections) == 1
    assert _tree(budgets)["lab/vision"] == 0.4


def test_apply_that_cannot_fit_beside_budgets_kept_in_force_is_refused(budgets: Stack, tmp_path: Path) -> None:
    budgets.run("budget", "set", "lab/vision/extra", "--share", "0.5")
    f = tmp_path / "f.yaml"
    f.write_text("budgets:\n  lab/vision/a: 0.6\n")  # partial: lab and lab/vision come from the tree in force
    res = budgets.run("budget", "apply", str(f), code=1)
    assert _error(res) == (
        f"error: refused: {f} against the tree in force: lab/vision/a: over_allocated: shares under 'lab/vision' "
        "would sum to 1.1 > 1"
    )
    assert "lab/vision/a" not in _tree(budgets)
    f.write_text("budgets:\n  lab/vision/a: 0.5\n")
    budgets.run("budget", "apply", str(f))
    assert _tree(budgets)["lab/vision/a"] == 0.5
    for p in ("lab/vision/a", "lab/vision/extra"):
        budgets.run("budget", "rm", p)
        assert p not in _tree(budgets)  # budget show: the log's fold
        # share: the read model, right after the command returned (it waits until accounting folded the change)
        assert p not in {r["path"] for r in budgets.json("share")["budgets"]}


def test_apply_prune_removes_what_the_file_does_not_name_in_the_same_batch(budgets: Stack) -> None:
    example = str(ROOT / "infra/budgets/example.yaml")
    budgets.run("budget", "set", "lab/vision/tmp", "--share", "0.5")
    dry = budgets.run("budget", "apply", example, "--prune", "--dry-run")
    assert dry.stdout.splitlines() == [
        "  - lab/vision/tmp: in force, not in the file (removed: --prune)",
        "1 budget change(s) (dry run: nothing published)",
    ]
    budgets.run(
        "submit", "-b", "lab/vision/tmp", "-g", "1", "-m", "1h", "--duration", "1h", "-u", "pr", "--job-id", "pr1"
    )
    budgets.until(lambda: budgets.json("queue", "--user", "pr"), "pr1 in the queue")
    dry = budgets.run("budget", "apply", example, "--prune", "--dry-run", code=1)
    assert dry.stdout.splitlines() == ["  - lab/vision/tmp: in force, not in the file (removed: --prune)"]
    assert _error(dry) == (
        f"error: refused: {example} against the tree in force: lab/vision/tmp: in_use: 'lab/vision/tmp' has queued "
        "or running jobs (dry run: nothing published)"
    )
    res = budgets.run("budget", "apply", example, "--prune", code=1)
    assert _error(res) == (
        f"error: refused: {example} against the tree in force: lab/vision/tmp: in_use: 'lab/vision/tmp' has queued "
        "or running jobs"
    )
    budgets.run("cancel", "pr1", "-u", "pr")
    budgets.until(lambda: not budgets.json("queue", "--user", "pr"), "pr1 gone from the queue")
    doc = budgets.json("budget", "apply", example, "--prune")
    [v] = doc["verdicts"]
    assert (v["type"], v["paths"], v["verdict"], doc["read_model"]) == (
        "BudgetBatch",
        ["lab/vision/tmp"],
        "accepted",
        True,
    )
    assert "lab/vision/tmp" not in _tree(budgets)
    assert "lab/vision/tmp" not in {r["path"] for r in budgets.json("share")["budgets"]}


def test_budget_rm_of_nothing_or_of_a_budget_in_use_is_refused(budgets: Stack) -> None:
    res = budgets.run("budget", "rm", "lab/nothing", code=1)
    assert _error(res) == "error: refused: unknown_budget: no budget 'lab/nothing'"
    res = budgets.run("budget", "rm", "lab/prior", code=1)
    assert _error(res).startswith("error: refused: has_children: 'lab/prior' has children")
    budgets.run("submit", "-b", "lab/vision", "-g", "1", "-m", "1h", "--duration", "1h", "-u", "rm", "--job-id", "rm1")
    budgets.until(lambda: budgets.json("queue", "--user", "rm"), "rm1 in the queue")
    res = budgets.run("budget", "rm", "lab/vision", code=1)
    assert _error(res) in (
        "error: refused: in_use: 'lab/vision' has 1 running job(s)",
        "error: refused: in_use: 'lab/vision' has 1 pending job(s)",
        "error: refused: in_use: 'lab/vision' has 1 placed job(s)",
    )
    assert "lab/vision" in _tree(budgets)
    budgets.run("cancel", "rm1", "-u", "rm")


def test_submit_reports_the_dispatchers_rejection(budgets: Stack) -> None:
    res = budgets.run(
        "submit", "-b", "lab/prior/robotics", "-g", "1", "-m", "1h", "--duration", "1h", "-u", "mallory", code=1
    )
    assert _error(res).startswith("error: rejected: not_a_member: ")
    assert res.stdout == ""  # not "submitted ..." first: the job was not taken
    res = budgets.run("submit", "-b", "lab/prior", "-g", "1", "-m", "1h", "--duration", "1h", "-u", "bob", code=1)
    assert _error(res).startswith("error: rejected: not_a_leaf: ")


def test_cancel_waits_for_the_dispatcher_and_refuses_what_is_not_there(budgets: Stack) -> None:
    res = budgets.run("cancel", "no-such-job", code=1)
    assert _error(res) == "error: no job no-such-job in the log"
    budgets.run("submit", "-b", "lab/vision", "-g", "2", "-m", "1h", "--duration", "2h", "-u", "cx", "--job-id", "cx1")
    rows = budgets.until(
        lambda: [r for r in budgets.json("queue", "--user", "cx") if r["state"] == "running" and r["started_at"]],
        "cx1 started",
    )
    assert rows[0]["position"] is None and rows[0]["started_at"] and len(rows[0]["nodes"]) == 1
    table = budgets.run("queue", "--user", "cx").stdout
    assert "None" not in table
    res = budgets.run("cancel", "cx1", "--reason", "wrong data", "-u", "cx")
    assert res.stdout.strip() == "cancelled cx1"
    res = budgets.run("cancel", "cx1", code=1)
    assert _error(res) == "error: job cx1 already cancelled (wrong data): nothing to cancel"
    assert budgets.json("queue", "--user", "cx") == []


def test_a_user_cannot_cancel_another_users_job_and_the_owner_can(budgets: Stack) -> None:
    """Rule D10.proven-user on the real stack: eve's signed cancel of own1's job is refused, the job goes on."""
    budgets.run(
        "submit", "-b", "lab/vision", "-g", "1", "-m", "1h", "--duration", "2h", "-u", "own1", "--job-id", "ow1"
    )
    budgets.until(lambda: [r for r in budgets.json("queue", "--user", "own1") if r["job_id"] == "ow1"], "ow1 queued")
    res = budgets.run("cancel", "ow1", "-u", "eve", code=1)
    assert _error(res) == "error: refused: not_owner: job 'ow1' belongs to 'own1'; 'eve' may cancel only their own jobs"
    doc = json.loads(budgets.run("cancel", "ow1", "-u", "eve", "--json", code=1).stdout)
    assert (doc["ok"], doc["verdict"], doc["reason"]) == (False, "refused", "not_owner")
    assert [r["job_id"] for r in budgets.json("queue", "--user", "own1")] == ["ow1"]
    assert budgets.run("cancel", "ow1", "-u", "own1").stdout.strip() == "cancelled ow1"


def test_a_researcher_cannot_drain_a_node_and_the_refusal_is_shown(budgets: Stack, tmp_path: Path) -> None:
    """Rule D10.authentication on the real stack: a drain signed by a researcher's registered key is refused, node ready."""
    from apportion import client
    from apportion.identity.keys import Identity

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("APPORTION_TOPIC_PREFIX", budgets.env["APPORTION_TOPIC_PREFIX"] or "")
        [eve] = client.enrol(["dr-eve"], bootstrap=budgets.info.bootstrap)  # registered, role user
    own = Identity("dr-eve", "user", eve.private_key).save(tmp_path / "eve.json")
    node = sorted(n["node_id"] for n in budgets.json("nodes"))[-1]
    env = dict(budgets.env, APPORTION_IDENTITY=str(own))
    res = budgets.run("drain", node, "--timeout", "4", "--json", code=1, env=env)
    doc = json.loads(res.stdout)
    assert (doc["ok"], doc["verdict"], doc["reason"], doc["node_id"]) == (False, "rejected", "unauthenticated", node)
    assert f"NodeDrainRequested of node '{node}': signed with the key of 'dr-eve' (role 'user')" in doc["message"]
    assert {n["node_id"]: n for n in budgets.json("nodes")}[node]["state"] == "ready"


def test_node_commands_refuse_unknown_nodes_and_show_the_reason(budgets: Stack) -> None:
    nodes = budgets.json("nodes")
    ids = sorted(n["node_id"] for n in nodes)
    assert ids == [f"sim-{i}" for i in range(8)]
    res = budgets.run("cordon", "nosuch", code=1)
    assert _error(res) == f"error: no node nosuch (known: {', '.join(ids)})"
    for cmd in ("drain", "undrain"):
        assert _error(budgets.run(cmd, "nosuch", code=1)).startswith("error: no node nosuch")
    node = ids[0]
    res = budgets.run("drain", node, "--reason", "fan swap")
    assert res.stdout.startswith(f"{node} is drain")
    row = {n["node_id"]: n for n in budgets.json("nodes")}[node]
    assert row["state"] in ("draining", "drained") and row["reason"] == "fan swap"
    assert row["heartbeat_age_s"] is not None and row["heartbeat_age_s"] < 30
    assert budgets.run("undrain", node).stdout.strip() == f"{node} is ready"
    assert budgets.run("undrain", node).stdout.strip() == f"node {node} is already ready: nothing to do"
    assert budgets.run("cordon", node, "--reason", "bios").stdout.strip() == f"cordoned {node}"
    assert {n["node_id"]: n for n in budgets.json("nodes")}[node]["reason"] == "bios"
    budgets.run("undrain", node)


def test_a_job_submitted_held_waits_until_its_owner_releases_it(budgets: Stack) -> None:
    """hold/release on the real stack: the held job shows pending reason held, eve may not release it, the owner
    does and it starts; a second release is refused by the dispatcher (not held)."""
    res = budgets.run(
        "submit", "-b", "lab/vision", "-g", "1", "-m", "1h", "--duration", "1h", "-u", "hd", "--job-id", "hd1", "--hold"
    )
    assert res.stdout.splitlines()[-1] == "queued, held until `apportion release hd1`"
    row = budgets.until(
        lambda: [r for r in budgets.json("queue", "--user", "hd") if r.get("reason", "").startswith("held: ")],
        "hd1 held",
    )[0]
    assert (row["state"], row["position"], row["reason_detail"]["by"]) == ("pending", None, "hd")
    res = budgets.run("release", "hd1", "-u", "eve", code=1)
    assert _error(res) == "error: refused: not_owner: job 'hd1' belongs to 'hd'; 'eve' may release only their own jobs"
    assert budgets.run("release", "hd1", "-u", "hd").stdout.strip() == "released hd1"
    budgets.until(
        lambda: [r for r in budgets.json("queue", "--user", "hd") if r["state"] == "running" and r["started_at"]],
        "hd1 started",
    )
    res = budgets.run("hold", "hd1", "-u", "hd", code=1)
    assert _error(res) == (
        "error: refused: invalid: job 'hd1' is running: only a pending job can be held (cancel stops a running one)"
    )
    budgets.run("cancel", "hd1", "-u", "hd")


def test_history_lists_finished_jobs_like_sacct(budgets: Stack) -> None:
    budgets.run("submit", "-b", "lab/vision", "-g", "2", "-m", "0", "--duration", "2s", "-u", "hx", "--job-id", "hx1")
    rows = budgets.until(lambda: budgets.json("history", "--user", "hx"), "hx1 finished")
    [row] = rows
    assert (row["job_id"], row["state"], row["attempts"], row["preemptions"]) == ("hx1", "completed", 1, 0)
    assert 1.5 <= row["run_s"] <= 10 and row["gpu_hours"] == pytest.approx(row["run_s"] * 2 / 3600)
    assert row["wait_s"] is not None and row["wait_s"] >= 0
    assert budgets.json("history", "--user", "hx", "--budget", "lab/prior") == []
    assert budgets.json("history", "--user", "hx", "--since", "2999-01-01T00:00:00Z") == []
    assert [r["job_id"] for r in budgets.json("history", "--user", "hx", "--until", "2999-01-01T00:00:00Z")] == ["hx1"]
    assert [r["job_id"] for r in budgets.json("queue", "--all", "--user", "hx")] == ["hx1"]
    res = budgets.run("history", "--state", "lost", code=2)
    assert _error(res) == "error: --state must be one of completed, failed, cancelled, rejected, got 'lost'"


def test_cancel_of_a_completed_job_is_refused_at_once_by_the_cli_and_by_the_dispatcher(budgets: Stack) -> None:
    import time

    from apportion import client, events
    from apportion.cli import verdicts

    budgets.run("submit", "-b", "lab/vision", "-g", "1", "-m", "0", "--duration", "1s", "-u", "fx", "--job-id", "fx1")
    budgets.until(lambda: budgets.json("history", "--user", "fx"), "fx1 finished")
    t0 = time.monotonic()
    res = budgets.run("cancel", "fx1", "-u", "fx", "--timeout", "60", code=1)
    assert _error(res) == "error: job fx1 already completed: nothing to cancel"
    assert time.monotonic() - t0 < 20  # the log's answer, not the 60 s timeout
    # a client that skips the check (or races the end) gets the dispatcher's refusal of its request
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("APPORTION_TOPIC_PREFIX", budgets.env["APPORTION_TOPIC_PREFIX"] or "")
        watcher = verdicts.JobWatcher(budgets.info.bootstrap, "fx1", ["JobCancelled"])
        req = client.cancel("fx1", user="fx", bootstrap=budgets.info.bootstrap)
        got = watcher.wait(DEADLINE_S, request_id=req.event_id)
    assert isinstance(got, events.JobRejected)
    assert (got.request, got.reason.value, got.message) == (
        "JobCancelRequested", "invalid", "job 'fx1' already finished: nothing to cancel"
    )  # fmt: skip


def test_logs_shows_a_jobs_output(budgets: Stack, job_accounts: dict[str, pwd.struct_passwd]) -> None:
    # a command runs as its user's Unix account (docs/security.md, "Node boundary"): submit as a test account
    budgets.run(
        "submit", "-b", "lab/vision", "-g", "1", "-m", "0", "-u", ALICE, "--job-id", "lx1",
        "--", "sh", "-c", "echo hello from lx1; echo oops >&2",
    )  # fmt: skip
    budgets.until(lambda: budgets.json("history", "--user", ALICE), "lx1 finished")
    assert budgets.run("logs", "lx1").stdout == "hello from lx1\n"
    assert budgets.run("logs", "lx1", "--stderr").stdout == "oops\n"
    res = budgets.run("logs", "lx1", "--attempt", "2", code=1)
    assert _error(res) == "error: job lx1 has no attempt 2 here (attempts: 1)"
    res = budgets.run("logs", "nobody-ran-this", code=1)
    said = res.stderr.splitlines()
    assert (said[0], said[2]) == (
        "error: no output of job nobody-ran-this (replica 0) in",
        "  only a started command has output (`apportion audit explain nobody-ran-this`)",
    )
    assert len(said) == 3 and said[1].endswith("/nobody-ran-this"), said


def test_unreachable_or_unprovisioned_stack_is_one_line_and_exit_3(stack: Stack) -> None:
    env = dict(stack.env, APPORTION_TOPIC_PREFIX=f"never{uuid.uuid4().hex[:6]}.")
    res = stack.run("submit", "-b", "lab/vision", "-g", "1", "-m", "0", "--duration", "1s", code=3, env=env)
    assert "is not provisioned" in _error(res) and _error(res).startswith("error: topic ")
    res = stack.run("queue", "--redis", "redis://127.0.0.1:1/0", code=3)
    assert _error(res).startswith("error: cannot reach Redis at redis://127.0.0.1:1/0")
    with closing_kafka_clients():  # the command's client that cannot bootstrap: its network thread is stopped
        res = stack.run("budget", "show", "--bootstrap", "127.0.0.1:1", code=3)
    assert _error(res).startswith("error: cannot reach Kafka at 127.0.0.1:1")


def test_deadletter_lists_what_a_service_could_not_decode(budgets: Stack) -> None:
    from apportion.bus.producer import EventProducer

    topic = f"{budgets.env['APPORTION_TOPIC_PREFIX']}apportion.submissions"
    with EventProducer(budgets.info.bootstrap, client_id="truth-test") as p:
        meta = p.send_raw(topic, b"not json at all", key=b"garbage-1").get(timeout=10)
    rows = budgets.until(
        lambda: [r for r in budgets.json("deadletter") if r["key"] == "garbage-1"], "the dead letter of garbage-1"
    )
    assert (rows[0]["topic"], rows[0]["partition"], rows[0]["offset"]) == (topic, meta.partition, meta.offset)
    assert rows[0]["error"]
    assert [r for r in budgets.json("deadletter", "--topic", "apportion.jobs") if r["key"] == "garbage-1"] == []


def _console(tool: str, stack: Stack, topic: str, lines: list[str], *args: str) -> str:
    """Kafka's own console producer or consumer (infra/kafka/console-TOOL.sh, the kafka-tools jar); its stdout."""
    import subprocess
    import tempfile

    from apportion.bus.security import kafka_auth

    auth = kafka_auth()  # a secured broker: the tool authenticates as the session's principal (docs/security.md)
    config: list[str] = []
    if auth:
        props = tempfile.NamedTemporaryFile("w", suffix=".properties", delete=False)
        props.write(
            f"security.protocol={auth['security_protocol']}\nsasl.mechanism={auth['sasl_mechanism']}\n"
            "sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required "
            f'username="{auth["sasl_plain_username"]}" password="{auth["sasl_plain_password"]}";\n'
        )
        props.close()
        config = [f"--{tool}.config", props.name]
    done = subprocess.run(
        ["bash", str(ROOT / f"infra/kafka/console-{tool}.sh"), "--bootstrap-server", stack.info.bootstrap]
        + ["--topic", topic, *config, *args],
        input="".join(ln + "\n" for ln in lines),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def _console_produce(stack: Stack, topic: str, lines: list[str], *props: str) -> None:
    args = ["--producer-property", "acks=all"]
    for p in props:
        args += ["--property", p]
    _console("producer", stack, topic, lines, *args)


def _identity(stack: Stack, user: str):
    """The dev keyring's identity of ``user``, registered in the stack's namespace (before the request's time)."""
    from apportion.client import identity_for

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("APPORTION_TOPIC_PREFIX", stack.env["APPORTION_TOPIC_PREFIX"] or "")
        return identity_for(user, bootstrap=stack.info.bootstrap)


def _signed(ident, line: str) -> str:
    """``line`` with ``signer_key`` and ``signature`` added as docs/producing.md ("Signing") says."""
    import base64

    from apportion.identity.canonical import canonical_bytes

    obj = json.loads(line)
    obj["signer_key"] = ident.public_key
    obj["signature"] = base64.b64encode(ident.private_key.sign(canonical_bytes(obj))).decode()
    return json.dumps(obj)


def test_a_hand_written_json_line_from_kafkas_console_producer_is_placed(budgets: Stack) -> None:
    """docs/producing.md as another language would follow it: topic, key = job id, the JSON of the schema."""
    from datetime import UTC, datetime

    topic = f"{budgets.env['APPORTION_TOPIC_PREFIX']}apportion.submissions"
    signer = _identity(budgets, "console")  # its key is registered before the request's event time
    now = datetime.now(UTC).isoformat().replace("+00:00", "Z")
    job = f"cp-{uuid.uuid4().hex[:8]}"
    line = (
        f'{{"event_id": "{uuid.uuid4()}", "type": "JobSubmitted", "schema_version": 4, "ts": "{now}", '
        f'"producer": "console", "job_id": "{job}", "budget": "lab/vision", "user": "console", '
        f'"gpus_per_replica": 1, "min_runtime_s": 60, "duration_s": 3600, "submitted_at": "{now}"}}'
    )
    line = _signed(signer, line)  # docs/producing.md, "Signing"
    _console_produce(budgets, topic, [f"{job}|{line}"], "parse.key=true", "key.separator=|")
    rows = budgets.until(
        lambda: [r for r in budgets.json("queue", "--user", "console") if r["state"] in ("placed", "running")],
        f"{job} placed",
    )
    assert [r["job_id"] for r in rows] == [job]
    # the verdict, read as docs/producing.md says: the job's records on apportion.jobs (key = job id)
    jobs_topic = f"{budgets.env['APPORTION_TOPIC_PREFIX']}apportion.jobs"
    read = _console(
        "consumer",
        budgets,
        jobs_topic,
        [],
        *("--from-beginning", "--timeout-ms", "15000", "--property", "print.key=true", "--property", "key.separator=|"),
    )
    mine = [json.loads(ln.split("|", 1)[1])["type"] for ln in read.splitlines() if ln.startswith(f"{job}|")]
    assert mine[:2] == ["JobQueued", "JobPlaced"], mine

    # a record keyed otherwise (or not at all) is dead-lettered with that reason, and never queued
    wrong, keyless = f"{job}-wrong-key", f"{job}-no-key"
    _console_produce(budgets, topic, [f"not-{wrong}|{line.replace(job, wrong)}"], "parse.key=true", "key.separator=|")
    _console_produce(budgets, topic, [line.replace(job, keyless)])
    want = {
        (f"not-{wrong}", f"key: record key 'not-{wrong}' is not the event's key '{wrong}'"),
        (None, f"key: record key missing, the event's key is '{keyless}'"),
    }
    budgets.until(
        lambda: want <= {(r["key"], r["error"]) for r in budgets.json("deadletter")},
        f"the dead letters of the mis-keyed records: {want}",
    )
    assert [r["job_id"] for r in budgets.json("queue", "--user", "console", "--all")] == [job]
    budgets.run("cancel", job, "-u", "console")


def test_top_json_is_one_frame_of_budgets_queue_head_and_nodes(budgets: Stack) -> None:
    frame = budgets.json("top", "--head", "3")
    assert {b["path"] for b in frame["budgets"]} >= {"lab", "lab/vision"}
    assert len(frame["nodes"]) == 8 and isinstance(frame["queue_head"], list)
    assert all({"pending", "running"} <= set(b) for b in frame["budgets"])


def test_readme_using_it_block_runs_as_written(tmp_path: Path) -> None:
    """The README's "Using it" block, line by line under bash from the checkout, exactly as written: `make up`
    starts a stack of its own (Kafka and Redis included), every command exits 0 on it, `make down` leaves no
    process. Only the environment differs from a person's shell: ``RUN_DIR`` (the Makefile's, default ``.run``),
    ``APPORTION_STACK_DIR`` and ``XDG_STATE_HOME`` point into a temp dir, so a stack of the developer's is not
    touched."""
    import os
    import re
    import subprocess

    from apportion.cli import stack as stack_mod

    text = (ROOT / "README.md").read_text()
    block = re.search(r"## Using it\n\n```sh\n(.*?)```", text, re.S)
    assert block is not None
    lines = [ln for ln in block.group(1).splitlines() if ln.strip()]
    assert lines[0].split("#")[0].split() == ["make", "up", "SIM_NODES=8"]
    assert lines[-1].split("#")[0].split() == ["make", "down"]
    run_dir = tmp_path / "run"
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("APPORTION_") and k not in ("KAFKA_BOOTSTRAP", "REDIS_URL")
    }
    env |= {"RUN_DIR": str(run_dir), "APPORTION_STACK_DIR": str(run_dir), "XDG_STATE_HOME": str(tmp_path / "state")}

    def sh(line: str) -> str:
        done = subprocess.run(["bash", "-c", line], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, f"{line}: exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        return done.stdout

    outputs: dict[str, str] = {}
    info = None
    try:
        outputs[lines[0]] = sh(lines[0])
        info = stack_mod.StackInfo.read(run_dir)
        assert info is not None and info.infra == "local"
        infra_pids = [int((run_dir / d / f"{d}.pid").read_text()) for d in ("kafka", "redis")]
        assert "already running from" in sh('.venv/bin/apportion stack up --dir "$RUN_DIR"')  # idempotent
        import urllib.request

        with urllib.request.urlopen(info.web_url + "nodes", timeout=30) as resp:  # the dashboard, as `web`
            assert resp.status == 200 and 'id="principal" data-value="web"' in resp.read().decode()
        for ln in lines[1:-1]:
            outputs[ln] = sh(ln)
        outputs[lines[-1]] = sh(lines[-1])
    finally:
        if info is not None and (run_dir / "stack.env").exists():  # a failed line: still stop what was started
            subprocess.run(["make", "down"], cwd=ROOT, env=env, capture_output=True, timeout=300)
    assert len(outputs) == len(lines) == 13
    apply, gang = lines[1], lines[4]
    assert outputs[apply].strip() == "applied infra/budgets/example.yaml: 5 budget change(s) in one batch"
    assert "budget tree (5 budgets)" in outputs[lines[2]]  # budget show
    assert "4x8 GPUs" in outputs[gang]
    assert "sim-7" in outputs[lines[7]]  # nodes
    assert "Kafka    127.0.0.1:" in outputs[lines[0]] and "logs     " in outputs[lines[0]]
    assert "dashboard http://127.0.0.1:" in outputs[lines[0]]  # `make up` starts the web dashboard too
    # (make run from make, as CI does, adds its own "Entering/Leaving directory" lines)
    down = [ln for ln in outputs[lines[-1]].splitlines() if not ln.startswith("make[")]
    assert down[-1].startswith("stopped Kafka 127.0.0.1:")
    left = [p for p in [*info.pids.values(), *infra_pids] if stack_mod.alive(p)]
    assert left == []
    assert not (run_dir / "stack.env").exists()


def test_stack_restart_starts_a_crashed_service_again_as_up_did(budgets: Stack) -> None:
    import os
    import signal

    from apportion.cli import stack as stack_mod

    run_dir = str(budgets.info.run_dir)
    old = narrow(stack_mod.StackInfo, stack_mod.StackInfo.read(budgets.info.run_dir)).pids["policy"]
    os.killpg(old, signal.SIGKILL)
    budgets.until(lambda: not stack_mod.alive(old), "policy gone")
    doc = json.loads(budgets.run("stack", "status", "--dir", run_dir, "--json", code=1).stdout)
    assert (doc["services"]["policy"]["running"], doc["services"]["policy"]["ready"]["ok"]) == (False, False)
    res = budgets.run("stack", "restart", "policy", "--dir", run_dir)
    new = narrow(stack_mod.StackInfo, stack_mod.StackInfo.read(budgets.info.run_dir)).pids["policy"]
    assert new != old and res.stdout.strip() == f"restarted policy (pid {new}), ready"
    assert (budgets.info.run_dir / "services" / "policy.pid").read_text().strip() == str(new)
    doc = json.loads(budgets.run("stack", "status", "--dir", run_dir, "--json").stdout)
    assert doc["services"]["policy"] == dict(doc["services"]["policy"], pid=new, running=True)
    assert doc["services"]["policy"]["ready"]["ok"] is True
    # the restarted policy gives verdicts again (same namespace, principal and Redis as `up` gave it)
    budgets.run("budget", "set", "lab/vision", "--max-min-runtime", "8h", "--timeout", "60")
    res = budgets.run("stack", "restart", "nosuch", "--dir", run_dir, code=2)
    assert _error(res).startswith("error: no service 'nosuch': use one of ")
    budgets.info.pids["policy"] = new  # the module's `down` finds it by the pid files anyway


def test_zz_stack_serves_any_folder_and_stops_leaving_no_process(
    budgets: Stack, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stack = budgets
    from apportion.cli import stack as stack_mod

    elsewhere = tmp_path / "somewhere" / "else"
    elsewhere.mkdir(parents=True)
    monkeypatch.chdir(elsewhere)
    bare: dict[str, str | None] = {
        "APPORTION_KAFKA_BOOTSTRAP": None,
        "APPORTION_REDIS_URL": None,
        "KAFKA_BOOTSTRAP": None,
        "REDIS_URL": None,
        "APPORTION_TOPIC_PREFIX": None,
        "APPORTION_STACK_DIR": None,
        "XDG_STATE_HOME": stack.env["XDG_STATE_HOME"],
    }
    assert len(json.loads(stack.run("nodes", "--json", env=bare).stdout)) == 8
    assert isinstance(json.loads(stack.run("queue", "--json", env=bare).stdout), list)
    share = stack.until(lambda: json.loads(stack.run("share", "--json", env=bare).stdout)["budgets"], "a snapshot")
    assert {b["path"] for b in share} >= {"lab", "lab/vision"}
    status = stack.run("stack", "status", env=bare).stdout
    assert f"Kafka    {stack.info.bootstrap}" in status and "metrics http://127.0.0.1:" in status
    doc = json.loads(stack.run("stack", "status", "--json", env=bare).stdout)
    assert (doc["kafka_bootstrap"], doc["infra"]) == (stack.info.bootstrap, "external")
    assert sorted(doc["services"]) == ["accounting", "dispatcher", "node_agent", "policy", "web"]
    assert all(s["running"] and s["metrics"].startswith("http://127.0.0.1:") for s in doc["services"].values())
    assert (doc["kafka"]["ok"], doc["redis"]["ok"]) == (True, True)  # asked, not only the pids checked
    assert {n: s["ready"]["ok"] for n, s in doc["services"].items()} == dict.fromkeys(doc["services"], True)
    assert " answers" in status.splitlines()[0] and " ready" in [ln for ln in status.splitlines() if "policy" in ln][0]
    import urllib.request

    with urllib.request.urlopen(doc["services"]["dispatcher"]["metrics"], timeout=10) as resp:
        assert "apportion_dispatcher_pending_jobs" in resp.read().decode()
    # the dashboard: on the 127.0.0.1 port `status` prints, serving the tree `share` prints
    web = doc["web"]
    assert web == stack.info.web_url and web.startswith("http://127.0.0.1:") and f"dashboard {web}" in status
    assert doc["services"]["web"]["metrics"] == web + "metrics"
    with urllib.request.urlopen(web, timeout=30) as resp:
        page = resp.read().decode()
    assert resp.status == 200 and 'data-budget="lab/vision"' in page
    web_pid = stack.info.pids["web"]
    assert f"--port {web.rsplit(':', 1)[1].rstrip('/')} --host 127.0.0.1" in " ".join(
        Path(f"/proc/{web_pid}/cmdline").read_text().split("\0")
    )
    pids = dict(stack.info.pids)
    assert sorted(pids) == sorted(stack_mod.SERVICES) and all(stack_mod.alive(p) for p in pids.values())
    down = stack.run("stack", "down", env=bare).stdout
    assert [ln.split(" (pid")[0] for ln in down.splitlines()][:5] == [
        "stopped web",
        "stopped node_agent",
        "stopped dispatcher",
        "stopped accounting",
        "stopped policy",
    ]
    assert [n for n, p in pids.items() if stack_mod.alive(p)] == []
    assert not (stack.info.run_dir / "stack.env").exists()
    assert not (Path(stack.env["XDG_STATE_HOME"] or "") / "apportion" / "stack.env").exists()
    res = stack.run("stack", "status", env=bare, code=3)
    assert _error(res).startswith("error: no stack started from")
    # other users' stack.env: a marker of the stopped stack, read as such at once, not an address to wait on
    researcher = dict(bare, APPORTION_STACK_DIR=str(stack.info.run_dir / "researcher"))
    res = stack.run("queue", env=researcher, code=3)
    assert _error(res).startswith(f"error: no stack running: the stack of {stack.info.run_dir} was stopped at ")
