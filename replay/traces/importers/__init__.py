"""Importers of real agent logs into the session format (``replay.traces.format``).

Each importer is ``import_x(src, skip_bad=False) -> ImportResult``: with ``skip_bad`` a bad
record is skipped and reported in ``ImportResult.skipped`` (a ``TraceFormatError`` naming
file, line and field); without, the first one raises.

| name | source |
|---|---|
| ``weka`` (alias ``kv-cache-tester``) | Claude Code sessions, kv-cache-tester JSON (``replay.traces.importers.weka``) |
| ``mooncake`` | Mooncake request JSONL (``replay.traces.importers.mooncake``) |
| ``mooncake-delta`` | the same, later turns of a session giving only their new input (aiperf's reading) |
| ``agentic-mooncake`` | Dynamo's agentic Mooncake rows: ``wait_for``, ``branches``, ... (``replay.traces.importers.agentic``) |
| ``claude-code`` | raw Claude Code transcripts, ``~/.claude/projects/**/*.jsonl`` (``replay.traces.importers.claude_code``) |
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from replay.traces.importers._common import ImportResult

_MODULES = {
    "weka": ("replay.traces.importers.weka", "import_weka"),
    "kv-cache-tester": ("replay.traces.importers.weka", "import_weka"),
    "mooncake": ("replay.traces.importers.mooncake", "import_mooncake"),
    "mooncake-delta": ("replay.traces.importers.mooncake", "import_mooncake_delta"),
    "agentic-mooncake": ("replay.traces.importers.agentic", "import_agentic_mooncake"),
    "claude-code": ("replay.traces.importers.claude_code", "import_claude_code"),
}
FORMATS: tuple[str, ...] = tuple(_MODULES)
#: Formats whose hash_ids have no block size of their own: the importer takes ``block_tokens``.
BLOCK_TOKENS_FORMATS = ("mooncake", "mooncake-delta", "agentic-mooncake")


def get_importer(fmt: str) -> Callable[..., ImportResult]:
    """The import function for ``fmt`` (one of ``FORMATS``)."""
    if fmt not in _MODULES:
        raise KeyError(f"unknown trace format {fmt!r}; known: {', '.join(FORMATS)}")
    mod, fn = _MODULES[fmt]
    return getattr(importlib.import_module(mod), fn)


__all__ = ["BLOCK_TOKENS_FORMATS", "FORMATS", "ImportResult", "get_importer"]
