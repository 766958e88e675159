"""Importers of real agent logs into the session format (``replay.trace``).

Each importer is ``import_x(src, skip_bad=False) -> ImportResult``: with ``skip_bad`` a bad
record is skipped and reported in ``ImportResult.skipped`` (a ``TraceFormatError`` naming
file, line and field); without, the first one raises.

| name | source |
|---|---|
| ``weka`` (alias ``kv-cache-tester``) | Claude Code sessions, kv-cache-tester JSON (``replay.importers.weka``) |
| ``mooncake`` | Mooncake request JSONL (``replay.importers.mooncake``) |
| ``claude-code`` | raw Claude Code transcripts, ``~/.claude/projects/**/*.jsonl`` (``replay.importers.claude_code``) |
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from replay.importers._common import ImportResult

_MODULES = {
    "weka": ("replay.importers.weka", "import_weka"),
    "kv-cache-tester": ("replay.importers.weka", "import_weka"),
    "mooncake": ("replay.importers.mooncake", "import_mooncake"),
    "claude-code": ("replay.importers.claude_code", "import_claude_code"),
}
FORMATS: tuple[str, ...] = tuple(_MODULES)


def get_importer(fmt: str) -> Callable[..., ImportResult]:
    """The import function for ``fmt`` (one of ``FORMATS``)."""
    if fmt not in _MODULES:
        raise KeyError(f"unknown trace format {fmt!r}; known: {', '.join(FORMATS)}")
    mod, fn = _MODULES[fmt]
    return getattr(importlib.import_module(mod), fn)


__all__ = ["FORMATS", "ImportResult", "get_importer"]
