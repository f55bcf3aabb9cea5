"""The domain core and each service's logic are pure (STYLE rules 1 and 7; rules D6.event-time and D13.pure-logic).

Modules under ``shared/apportion/domain/`` plus ``events.py``,
``timeutil.py``, ``topics.py``, ``logrecord.py`` and ``arrays.py``, and every ``services/<name>/logic.py``, must not import
I/O libraries (Kafka,
Redis, faust, NVML, sockets), must not read the wall clock and must not read
the environment (the topic namespace is read at the settings edge,
``apportion.settings.topic_prefix``). Checked statically with ``ast``, so a
lazy import inside a function is caught too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "shared" / "apportion"
PURE = (
    sorted((PKG / "domain").rglob("*.py"))
    + [PKG / "events.py", PKG / "timeutil.py", PKG / "topics.py", PKG / "logrecord.py", PKG / "arrays.py"]
    + sorted((ROOT / "services").glob("*/logic.py"))
)

FORBIDDEN_MODULES = {
    "kafka",
    "aiokafka",
    "faust",
    "redis",
    "pynvml",
    "socket",
    "mode",
    "requests",
    "httpx",
    "subprocess",
    "threading",
    "asyncio",
}
# (object, attribute) calls that read the clock
CLOCK_CALLS = {
    ("time", "time"),
    ("time", "time_ns"),
    ("time", "monotonic"),
    ("time", "perf_counter"),
    ("datetime", "now"),
    ("datetime", "utcnow"),
    ("datetime", "today"),
    ("date", "today"),
}
CLOCK_NAMES = {"time", "time_ns", "monotonic", "perf_counter", "now", "utcnow", "today"}
# names of os that read the process environment
ENV_NAMES = {"environ", "environb", "getenv", "getenvb"}


def _attr_chain(node: ast.AST) -> list[str]:
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return parts[::-1]


def violations(source: str) -> list[str]:
    """Forbidden imports and clock reads in ``source``, as readable strings."""
    tree = ast.parse(source)
    out: list[str] = []
    clock_aliases: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] in FORBIDDEN_MODULES:
                    out.append(f"line {node.lineno}: import {a.name}")
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] in FORBIDDEN_MODULES:
                out.append(f"line {node.lineno}: from {node.module} import ...")
            if node.module == "os":
                out.extend(f"line {node.lineno}: from os import {a.name}" for a in node.names if a.name in ENV_NAMES)
            if node.module in ("time", "datetime"):
                for a in node.names:
                    if a.name in CLOCK_NAMES:
                        clock_aliases.add(a.asname or a.name)
        elif isinstance(node, ast.Attribute) and node.attr in ENV_NAMES and _attr_chain(node)[:1] == ["os"]:
            out.append(f"line {node.lineno}: os.{node.attr}")
        elif isinstance(node, ast.Call):
            chain = _attr_chain(node.func)
            if len(chain) >= 2 and (chain[-2], chain[-1]) in CLOCK_CALLS:
                out.append(f"line {node.lineno}: {'.'.join(chain)}()")
            elif len(chain) == 1 and chain[0] in clock_aliases:
                out.append(f"line {node.lineno}: {chain[0]}()")
    return out


@pytest.mark.parametrize("path", PURE, ids=[str(p.relative_to(ROOT)) for p in PURE])
def test_module_is_pure(path: Path) -> None:
    assert violations(path.read_text(encoding="utf-8")) == []


def test_every_service_logic_is_checked() -> None:
    services = {p.name for p in (ROOT / "services").iterdir() if (p / "__main__.py").is_file()}
    assert {p.parent.name for p in PURE if p.name == "logic.py"} == services


@pytest.mark.parametrize(
    "snippet",
    [
        "import kafka",
        "from aiokafka import AIOKafkaConsumer",
        "import redis.asyncio",
        "def f():\n    import pynvml",
        "import socket",
        "import faust",
        "import time\nx = time.time()",
        "from datetime import datetime\nx = datetime.now()",
        "import datetime\nx = datetime.datetime.utcnow()",
        "from time import time as clock\nx = clock()",
        "import os\nx = os.environ.get('APPORTION_TOPIC_PREFIX', '')",
        "import os\nx = os.getenv('HOME')",
        "from os import environ",
    ],
    ids=[
        "kafka",
        "aiokafka",
        "redis",
        "lazy pynvml",
        "socket",
        "faust",
        "time.time",
        "datetime.now",
        "datetime.datetime.utcnow",
        "aliased time",
        "os.environ",
        "os.getenv",
        "from os import environ",
    ],
)
def test_checker_catches(snippet: str) -> None:
    assert violations(snippet), snippet


def test_checker_allows_pure_code() -> None:
    ok = (
        "from datetime import datetime, timezone\n"
        "from apportion.timeutil import to_us\n"
        "x = datetime(2024, 1, 1, tzinfo=timezone.utc)\n"
    )
    assert violations(ok) == []
