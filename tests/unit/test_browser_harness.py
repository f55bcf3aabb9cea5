"""The browser harness fed "chromium missing": the lookup fails the test with one clear line, never a skip."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from tests.kit.browser import INSTALL, require_browser


def _exe(folder: Path, name: str) -> str:
    path = folder / name
    path.write_text("#!/bin/sh\nexit 0\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def _failure(path: str) -> str:
    with pytest.raises(pytest.fail.Exception) as info:
        require_browser(path)
    assert not isinstance(info.value, pytest.skip.Exception)
    assert info.value.pytrace is False
    msg = str(info.value.msg)
    assert "\n" not in msg
    return msg


def test_a_path_without_either_names_both_and_how_to_install_them(tmp_path: Path) -> None:
    msg = _failure(str(tmp_path))
    assert msg.startswith("chromium and chromedriver not found on PATH: ")
    assert f"`sudo {INSTALL}`" in msg and INSTALL == "apt-get install -y chromium chromium-driver"


def test_a_path_with_only_the_driver_names_chromium_alone(tmp_path: Path) -> None:
    _exe(tmp_path, "chromedriver")
    assert _failure(str(tmp_path)).startswith("chromium not found on PATH: ")


def test_a_path_with_only_the_browser_names_the_driver_alone(tmp_path: Path) -> None:
    _exe(tmp_path, "chromium-browser")
    assert _failure(str(tmp_path)).startswith("chromedriver not found on PATH: ")


def test_both_on_the_path_are_found_there(tmp_path: Path) -> None:
    chromium, driver = _exe(tmp_path, "chromium"), _exe(tmp_path, "chromedriver")
    assert require_browser(os.pathsep.join(["/nonexistent", str(tmp_path)])) == (chromium, driver)
