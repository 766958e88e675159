"""Options are parsed once (docs/architecture.md): argparse's ``Namespace`` stays in the command
modules (``__main__.py``, ``cli.py``, a module that calls ``parse_args`` itself) and the
``options.py`` beside them, which turn it into a typed value; nothing below reads ``args.*``.

Checked where it holds today: the engine (``engine/``) and the gateway. The simulator
(``replay/sim``) and ``evolving up`` / bench helpers (``services/drivers/up``, ``.../bench``)
still pass the Namespace down; add their folders to ``CHECKED`` as they are moved.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
CHECKED = ("engine", "services/drivers/gateway")
COMMAND_MODULES = frozenset({"__main__.py", "cli.py", "options.py"})


def reads_args(source: str) -> list[int]:
    """Lines below a command that see the Namespace: ``args.<name>`` or ``argparse.Namespace``.
    A module that calls ``parse_args`` is a command itself (``python -m engine.backends.vllm.fake``)."""
    tree = ast.parse(source)
    if any(isinstance(n, ast.Attribute) and n.attr == "parse_args" for n in ast.walk(tree)):
        return []
    return sorted({n.lineno for n in ast.walk(tree) if isinstance(n, ast.Attribute)
                   and ((isinstance(n.value, ast.Name) and n.value.id == "args") or n.attr == "Namespace")})


def test_the_check_finds_a_module_that_reads_args():
    assert reads_args("def f(args: argparse.Namespace):\n    return args.url\n") == [1, 2]
    assert reads_args("def main(argv):\n    args = p.parse_args(argv)\n    return args.url\n") == []
    assert reads_args("def f(cfg):\n    return cfg.url\n") == []


def test_nothing_below_the_commands_reads_args():
    found = []
    for folder in CHECKED:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path.name in COMMAND_MODULES:
                continue
            found += [f"{path.relative_to(ROOT).as_posix()}:{line}"
                      for line in reads_args(path.read_text(encoding="utf-8"))]
    assert not found, "turn the options into a typed value in options.py / the command module:\n" + "\n".join(found)
