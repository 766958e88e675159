"""The recorder's core is pure: it imports the standard library's harmless parts and events only."""

from __future__ import annotations

import ast
from pathlib import Path

from services.cores import recording as core

FORBIDDEN = {"asyncio", "nats", "duckdb", "time", "random", "uuid", "os", "socket", "threading"}


def test_recorder_core_imports_nothing_impure():
    tree = ast.parse(Path(core.__file__).read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module.split(".")[0])
    assert names <= {"__future__", "events"}, names
    assert not names & FORBIDDEN
