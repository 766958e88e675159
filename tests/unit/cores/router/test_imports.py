"""The router cores are pure: they import only the standard library (no clock, randomness,
I/O or concurrency modules), numpy, msgspec, events and pure service modules."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[4]
PURE = ["services/cores/router/state.py", "services/cores/router/base.py", "services/cores/router/least_ttft.py",
        "services/cores/router/cache_aware.py", "services/cores/router/load_balancing.py",
        "services/cores/router/dynamo.py", "services/drivers/bench/scenario.py", "services/cores/router/__init__.py"]
ALLOWED_PREFIXES = ("events", "services.cores.contract", "services.cores.directory", "services.cores.costmodel",
                    "services.cores.router")
ALLOWED_TOP = {"__future__", "collections", "typing", "dataclasses", "math", "itertools", "functools",
               "bisect", "heapq", "numpy", "msgspec", "enum"}
FORBIDDEN = {"time", "random", "asyncio", "uuid", "os", "socket", "threading", "datetime", "nats",
             "duckdb", "secrets", "subprocess"}


def imported(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names.append(node.module or "")
    return names


@pytest.mark.parametrize("rel", PURE)
def test_core_imports_are_pure(rel):
    for name in imported(ROOT / rel):
        top = name.split(".")[0]
        assert top not in FORBIDDEN, f"{rel} imports {name}"
        assert top in ALLOWED_TOP or name.startswith(ALLOWED_PREFIXES), f"{rel} imports {name}"


def test_the_check_can_fail(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import time\nfrom random import random\n")
    assert {n.split('.')[0] for n in imported(bad)} & FORBIDDEN == {"time", "random"}
