"""The package's metadata builds without setuptools' deprecation warnings: ``project.license`` is an SPDX expression
(PEP 639; a TOML table is deprecated from setuptools 77), so the build requires a setuptools that reads it."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def test_the_license_is_an_spdx_expression_and_the_build_requires_a_setuptools_that_reads_it() -> None:
    doc = tomllib.loads(PYPROJECT.read_text())
    assert doc["project"]["license"] == "Apache-2.0"
    [setuptools] = [r for r in doc["build-system"]["requires"] if r.startswith("setuptools")]
    floor = re.fullmatch(r"setuptools>=(\d+)(?:\.\d+)*", setuptools)
    assert floor is not None and int(floor.group(1)) >= 77, setuptools
