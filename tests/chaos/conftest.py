"""Fixtures of the chaos tests: the campaign module (``bench/chaos.py``, not a package) loaded once."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "chaos.py"


@pytest.fixture(scope="module")
def chaos() -> ModuleType:
    """``bench/chaos.py`` as a module (registered in ``sys.modules``: its dataclasses look their module up)."""
    spec = importlib.util.spec_from_file_location("chaos_campaign", BENCH)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod
