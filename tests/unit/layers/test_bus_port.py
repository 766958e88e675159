"""Drivers talk to the bus through its port only (docs/architecture.md, The ports).

No module under ``services/drivers/`` or ``engine/worker/`` reaches behind a bus for its NATS
client or JetStream context: no attribute ``.nc`` / ``.js`` (``bus.nc``, ``self.bus.js``,
``b.nc.publish``), and no ``getattr`` / ``hasattr`` of those names. What a driver needs is a
method of ``Bus`` / ``Consumer`` (services/adapters/bus/port.py, held by tests/contract/test_bus.py
to the in-process twin's behaviour) or an adapter built from a bus (``NatsTokens.from_bus``,
``NatsTokenMux.from_bus``, ``NatsPromptStore.from_bus``). The ``nats`` package's own modules
(``nats.js.api``) are not a bus and stay allowed.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
FOLDERS = ("services/drivers", "engine/worker")
INTERNALS = frozenset({"nc", "js"})

#: "path:line" -> why it cannot go through the port. Empty: every driver uses the port.
ALLOWED: dict[str, str] = {}


def reaches_behind(source: str) -> list[tuple[int, str]]:
    """(line, expression) of every access to a bus's internals in ``source``."""
    hits = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in INTERNALS:
            if isinstance(node.value, ast.Name) and node.value.id == "nats":
                continue  # nats.js: the package's module, not a bus's attribute
            hits.append((node.lineno, ast.unparse(node)))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "hasattr", "setattr") and len(node.args) >= 2
              and isinstance(node.args[1], ast.Constant) and node.args[1].value in INTERNALS):
            hits.append((node.lineno, ast.unparse(node)))
    return sorted(hits)


def test_the_check_finds_each_way_of_reaching_behind_the_port():
    src = ("import nats.js.api\n"
           "x = nats.js.api.AckPolicy\n"
           "await bus.nc.flush()\n"
           "await self.bus.js.consumers_info(s)\n"
           "ok = getattr(bus, 'js', None) is not None\n"
           "hasattr(b, 'nc')\n"
           "bus.stream_info()\n")
    assert [line for line, _ in reaches_behind(src)] == [3, 4, 5, 6]


def test_no_driver_reaches_behind_the_bus_port():
    found = []
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            for line, expr in reaches_behind(path.read_text(encoding="utf-8")):
                if f"{rel}:{line}" not in ALLOWED:
                    found.append(f"{rel}:{line}: {expr}")
    assert not found, "use the Bus port (services/adapters/bus/port.py) instead:\n" + "\n".join(found)


def test_every_allowance_still_names_an_access_and_says_why():
    for where, why in ALLOWED.items():
        rel, line = where.rsplit(":", 1)
        assert why.strip(), where
        lines = [n for n, _ in reaches_behind((ROOT / rel).read_text(encoding="utf-8"))]
        assert int(line) in lines, f"{where} is allowed but no longer reaches behind the port"
