"""A submission's environment: checked where it is written and where it is read, carried to every replica."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from apportion import events as ev
from apportion.cli.main import app
from apportion.client import parse_env
from apportion.domain.budgets import BudgetTree
from apportion.domain.dispatch import DispatchConfig, DispatchState, Tick, fold, step
from apportion.timeutil import from_us, to_us
from services.dispatcher.logic import resend_starts
from tests.kit.builders import T0, m, submitted
from tests.kit.narrowing import narrow

TREE = BudgetTree.from_mapping({"lab": 1.0, "lab/b": 1.0})
CFG = DispatchConfig(heartbeat_timeout_s=None)


def test_env_file_and_pairs_are_parsed_with_the_pairs_winning() -> None:
    text = "# run settings\n\nexport WANDB_PROJECT=\"robotics\"\nSEED=7\nNOTE='a b'\nEMPTY=\n"
    assert parse_env(["SEED=8", "LR=3e-4"], text) == {
        "WANDB_PROJECT": "robotics",
        "SEED": "8",
        "NOTE": "a b",
        "EMPTY": "",
        "LR": "3e-4",
    }


@pytest.mark.parametrize(
    "pairs,text,message",
    [
        (["A"], None, "--env 'A' is not KEY=VALUE"),
        ([], "A=1\nnot a pair\n", "env file, line 2: 'not a pair' is not KEY=VALUE"),
        ([], "# c\nexport BAD NAME=1\n", "env file, line 2: env name 'BAD NAME' is not a variable name"),
        ([], "A=1\nPATH=/x\n", "env file, line 2: env name 'PATH' is reserved"),
        (["1A=x"], None, "env name '1A' is not a variable name ([A-Za-z_][A-Za-z0-9_]*)"),
        (["A-B=x"], None, "env name 'A-B' is not a variable name ([A-Za-z_][A-Za-z0-9_]*)"),
        (["APPORTION_JOB_ID=x"], None, "env name 'APPORTION_JOB_ID' is reserved"),
        (["CUDA_VISIBLE_DEVICES=0"], None, "env name 'CUDA_VISIBLE_DEVICES' is reserved"),
        (["LD_PRELOAD=/tmp/x.so"], None, "env name 'LD_PRELOAD' is reserved"),
        ([f"V{i}=x" for i in range(129)], None, "env sets 129 variables, at most 128 are allowed"),
        (["BIG=" + "x" * (32 * 1024)], None, "env is 32771 bytes (names and values), at most 32768 are allowed"),
    ],
)
def test_bad_env_is_refused_naming_the_variable(pairs: list[str], text: str | None, message: str) -> None:
    with pytest.raises(ValueError) as err:
        parse_env(pairs, text)
    assert str(err.value).startswith(message)


def test_a_record_with_a_reserved_name_is_refused_by_the_reader_naming_the_field() -> None:
    """A producer that skips the client: the decoder refuses the record (so it is dead-lettered, never queued)."""
    obj = json.loads(ev.encode(submitted("j1", budget="lab/b")))
    obj["env"] = {"PATH": "/tmp/evil"}
    with pytest.raises(ev.DecodeError) as err:
        ev.decode(json.dumps(obj))
    assert err.value.field == "env"
    assert "env name 'PATH' is reserved" in err.value.reason


def test_cli_submit_refuses_bad_env_before_publishing_exit_2() -> None:
    res = CliRunner().invoke(
        app,
        ["submit", "--dry-run", "-b", "lab/b", "-g", "1", "-m", "1h", "--duration", "1h", "-u", "bob", "-e", "PATH=/x"],
    )
    assert res.exit_code == 2
    assert "invalid submission: env name 'PATH' is reserved" in res.output


def test_cli_submit_carries_a_topology_bound_and_refuses_an_unknown_one_exit_2() -> None:
    args = ["submit", "--dry-run", "-b", "lab/b", "-g", "8", "-k", "2", "-m", "1h", "--duration", "1h", "-u", "bob"]
    res = CliRunner().invoke(app, [*args, "--topology", "rack", "--json"])
    assert res.exit_code == 0 and json.loads(res.stdout)["topology_bound"] == "rack"
    res = CliRunner().invoke(app, [*args, "--topology", "row"])
    assert res.exit_code == 2 and "--topology: Input should be 'block' or 'rack'" in res.stderr


def test_every_replica_of_a_gang_gets_the_env_and_a_fold_agrees() -> None:
    env = {"WANDB_PROJECT": "robotics", "SEED": "7"}
    state = DispatchState(TREE)
    log: list[ev.Event] = []
    regs = [
        ev.NodeRegistered(node_id=n, gpu_count=4, ts=from_us(T0), event_id=ev.det_id("reg", n)) for n in ("n0", "n1")
    ]
    sub = submitted("j1", budget="lab/b", user="bob", gpus=4, replicas=2).model_copy(update={"env": env})
    plain = submitted("j2", budget="lab/b", user="bob", gpus=1, at=m(1))
    for e in (*regs, sub, plain):
        log += [e, *step(state, e, to_us(e.ts), CFG)]
    assert narrow(ev.JobQueued, log[3]).env == env
    out = step(state, Tick(m(2)), m(2), CFG)
    starts = [e for e in out if isinstance(e, ev.StartWorkload)]
    assert [(s.job_id, s.replica, s.env) for s in starts] == [("j1", 0, env), ("j1", 1, env)]
    # what a rebuild sends again (a leader that died before its StartWorkload) carries it too
    resent = resend_starts(fold([*log, *(e for e in out if not isinstance(e, ev.StartWorkload))], TREE), m(3), CFG)
    assert [(narrow(ev.StartWorkload, s).replica, narrow(ev.StartWorkload, s).env) for s in resent] == [
        (0, env),
        (1, env),
    ]
    # a job without env: the start carries none
    state2 = DispatchState(TREE)
    for e in (regs[0], plain):
        step(state2, e, to_us(e.ts), CFG)
    only = [e for e in step(state2, Tick(m(2)), m(2), CFG) if isinstance(e, ev.StartWorkload)]
    assert [s.env for s in only] == [{}]


@pytest.mark.parametrize(
    "command,message",
    [
        ((), "command needs a program name as its first argument"),
        (("",), "command needs a program name as its first argument"),
        (("python", "a\x00b"), "command argument 1 contains a NUL character"),
        (("py\x00",), "command argument 0 contains a NUL character"),
        (("echo", "\udc80"), "command argument 1 is not valid UTF-8 text"),
        (("true",) * 4097, "command has 4097 arguments, at most 4096 are allowed"),
        # 2 + 131,071 bytes: one over 128 KiB
        (("sh", "x" * (128 * 1024 - 1)), "command is 131073 bytes, at most 131072 are allowed"),
    ],
)
def test_a_command_no_agent_can_run_is_refused_naming_the_argument(command: tuple[str, ...], message: str) -> None:
    with pytest.raises(ValueError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        ev.check_command(command)


def test_a_command_at_the_bounds_is_accepted() -> None:
    assert ev.check_command(("true",) * 4096) == ("true",) * 4096
    assert ev.check_command(("sh", "x" * (128 * 1024 - 2))) == ("sh", "x" * (128 * 1024 - 2))
    assert ev.check_command(("echo", "café")) == ("echo", "café")


def test_a_record_whose_command_holds_a_nul_is_refused_by_the_reader_naming_the_field() -> None:
    """Any producer can write one; the decoder refuses it (dead-lettered with the reason, never queued), so no
    node agent is handed an argv ``exec`` cannot take."""
    obj = json.loads(ev.encode(submitted("j1", budget="lab/b")))
    obj["command"] = ["python", "train\u0000.py"]
    obj.pop("duration_s", None)
    with pytest.raises(ev.DecodeError) as err:
        ev.decode(json.dumps(obj))
    assert err.value.field == "command"
    assert "command argument 1 contains a NUL character" in err.value.reason


def test_the_client_refuses_a_command_it_cannot_encode_with_a_clear_error() -> None:
    from apportion.client import InvalidSubmission, build_submission

    with pytest.raises(InvalidSubmission) as err:
        build_submission(budget="lab/b", user="bob", gpus=1, min_runtime="1h", command=["echo", "\udc80"])
    assert err.value.field == "command"
    assert str(err.value.message) == "command argument 1 is not valid UTF-8 text"


@pytest.mark.parametrize(
    "args,message",
    [
        (["--time", "0", "--duration", "1h"], "error: invalid submission: --time: Input should be greater than 0"),
        (["--duration", "0"], "error: invalid submission: --duration: Input should be greater than 0"),
        (
            ["--duration", "1h", "--checkpoint-interval", "0"],
            "error: invalid submission: --checkpoint-interval: Input should be greater than 0",
        ),
        ([], "error: invalid submission: a job needs a command (real workload) or --duration (simulated workload)"),
    ],
)
def test_cli_submit_errors_name_the_option_not_the_field(args: list[str], message: str) -> None:
    base = ["submit", "--dry-run", "-b", "lab/b", "-g", "1", "-m", "1h", "-u", "bob"]
    res = CliRunner().invoke(app, [*base, *args], env={"COLUMNS": "300"})
    assert res.exit_code == 2
    assert res.stderr.strip() == message
