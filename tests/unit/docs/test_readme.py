"""The README is the front door: the two commands come first, its command table names every
`evolving` subcommand (and every `bench`), and it names no tool that setup does not install."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from services.drivers.cli import build_parser

ROOT = Path(__file__).resolve().parents[3]
README = (ROOT / "README.md").read_text()


def _choices(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


def _table() -> str:
    return README[README.index("## Commands"):].split("\n## ", 1)[0]


def test_the_two_commands_are_within_the_first_40_lines():
    head = README.splitlines()[:40]
    for cmd in ("bash scripts/demo.sh", "bash scripts/test.sh"):
        assert any(line.startswith(cmd) for line in head), cmd


def test_the_command_table_names_every_subcommand():
    table = _table()
    named = set(re.findall(r"`evolving ([a-z-]+)", table)) | set(re.findall(r"(?<=` / `)([a-z-]+)(?=`)", table))
    commands = _choices(build_parser())
    assert set(commands) - named == set()
    bench_row = re.search(r"`evolving bench ([a-z|\\-]+)`", table)
    assert bench_row, "a row for evolving bench"
    assert set(_choices(commands["bench"])) == set(bench_row.group(1).split("\\|"))


def test_the_table_check_can_fail():
    table = _table()
    assert "`evolving verify" in table
    assert "verify" not in set(re.findall(r"`evolving ([a-z-]+)", table.replace("`evolving verify", "`x")))


def test_just_is_named_only_if_setup_installs_it():
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    if "rust-just" not in setup:
        assert not re.search(r"\bjust\b [a-z]", README), "README names `just`, which setup does not install"
