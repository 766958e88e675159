"""One dispatch style in the cores (docs/architecture.md, "A core"): a core picks what to do with
an event by ``match`` on its type (``case KvStored(): ...``), as msgspec's examples do, not by a
table from event type to method name (``_FOLDS[type(event)]``) or a chain of ``type(event) is X``
tests. A single ``isinstance`` guard ("only a RouteDecided updates this") is not a dispatch and
stays allowed."""

from __future__ import annotations

import ast
from pathlib import Path

CORES = Path(__file__).resolve().parents[3] / "services" / "cores"
EVENT_NAMES = frozenset({"event", "ev", "e"})  # what the cores call the event they fold


def other_dispatch(source: str) -> list[int]:
    """Lines that dispatch on an event's type without ``match``: ``type(event) is/== C`` or a
    lookup keyed by it (``table[type(event)]``, ``table.get(type(event))``)."""

    def is_type_call(n: ast.AST) -> bool:  # type(event) / type(ev): an event's, not a container's
        return (isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "type" and len(n.args) == 1
                and isinstance(n.args[0], ast.Name) and n.args[0].id in EVENT_NAMES)

    def dispatches(n: ast.AST) -> bool:
        if isinstance(n, ast.Compare):  # type(e) is Tick
            return is_type_call(n.left) and any(isinstance(o, ast.Is | ast.Eq) for o in n.ops)
        if isinstance(n, ast.Subscript):  # TABLE[type(e)]
            return is_type_call(n.slice)
        return (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "get"
                and bool(n.args) and is_type_call(n.args[0]))  # TABLE.get(type(e))

    return sorted({n.lineno for n in ast.walk(ast.parse(source)) if dispatches(n)})


def test_the_check_finds_a_table_or_a_type_chain():
    assert other_dispatch("def apply(self, e):\n    if type(e) is Tick:\n        pass\n") == [2]
    assert other_dispatch("def apply(self, e):\n    getattr(self, _FOLDS.get(type(e)))(e)\n") == [2]
    assert other_dispatch("def apply(self, e):\n    _FOLDS[type(e)](self, e)\n") == [2]
    assert other_dispatch("def apply(self, e):\n    match e:\n        case Tick():\n            pass\n") == []
    assert other_dispatch("def f(e):\n    return f'{type(e).__name__}'\n") == []
    assert other_dispatch("def f(pins):\n    return type(pins) is BlockCounts\n") == []  # not an event


def test_every_core_dispatches_with_match():
    found = [f"{path.relative_to(CORES.parents[1]).as_posix()}:{line}"
             for path in sorted(CORES.rglob("*.py")) for line in other_dispatch(path.read_text(encoding="utf-8"))]
    assert not found, "dispatch on the event's type with match:\n" + "\n".join(found)
