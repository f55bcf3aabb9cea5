"""The browser the dashboard tests drive: Debian's chromium and its chromedriver, found on ``PATH``.

Nothing is downloaded at run time (selenium is handed the system chromedriver). When either is missing the
browser tests fail, never skip, with one line naming what is missing and how to install it
(``tests/unit/test_browser_harness.py`` runs the lookup with a ``PATH`` that lacks them).
"""

from __future__ import annotations

import shutil

import pytest

#: Names the browser has on Debian (``chromium``) and on older Debian/Ubuntu packages (``chromium-browser``).
CHROMIUM_NAMES = ("chromium", "chromium-browser")
CHROMEDRIVER_NAMES = ("chromedriver",)
INSTALL = "apt-get install -y chromium chromium-driver"


class BrowserMissing(RuntimeError):
    """chromium or chromedriver is not on the ``PATH`` searched (the message is one line)."""


def _which(names: tuple[str, ...], path: str | None) -> str | None:
    return next((found for n in names if (found := shutil.which(n, path=path))), None)


def find_browser(path: str | None = None) -> tuple[str, str]:
    """``(chromium, chromedriver)``: the executables found on ``path`` (default: ``$PATH``).

    Raises:
        BrowserMissing: one or both are not found; the one-line message names which and the install command.
    """
    chromium, driver = _which(CHROMIUM_NAMES, path), _which(CHROMEDRIVER_NAMES, path)
    missing = [name for name, got in (("chromium", chromium), ("chromedriver", driver)) if got is None]
    if chromium is None or driver is None:
        raise BrowserMissing(
            f"{' and '.join(missing)} not found on PATH: the dashboard's browser tests need Debian's chromium "
            f"and its driver (`sudo {INSTALL}`; `make test` installs them as root); no browser is downloaded"
        )
    return chromium, driver


def require_browser(path: str | None = None) -> tuple[str, str]:
    """:func:`find_browser`, or fail the calling test (not skip) with its one-line message and no traceback."""
    try:
        return find_browser(path)
    except BrowserMissing as exc:
        pytest.fail(str(exc), pytrace=False)
