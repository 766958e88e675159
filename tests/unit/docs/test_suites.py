"""Every marker the default suite deselects (pyproject's addopts) is a heavy suite that
scripts/test.sh runs after it, and every heavy suite's marker is deselected and declared: a test
moved out of the default suite is never dropped from the test command."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_the_deselected_markers_are_the_heavy_suites():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    deselected = set(re.findall(r"not (\w+)", cfg["addopts"]))
    declared = {m.split(":")[0] for m in cfg["markers"]}
    suites = set(re.findall(r"^heavy (\w+) \d+ ", (ROOT / "scripts" / "test.sh").read_text(), re.MULTILINE))
    assert deselected == suites, (deselected ^ suites)
    assert suites <= declared, suites - declared
