"""The worked example of docs/traces.md parses, validates and replays as the doc says."""

from __future__ import annotations

import re
from pathlib import Path

from events.catalog import BranchEnded, BranchOpened, ContextCompacted, RequestSubmitted
from replay.traces.format import decode_session, session_events

DOC = Path(__file__).resolve().parents[4] / "docs" / "traces.md"


def test_worked_example():
    block = re.search(r"```json\n(.*?)```", DOC.read_text(), re.DOTALL).group(1)
    s = decode_session(" ".join(block.split("\n")), str(DOC))
    got = []
    for e in session_events(s, 1.0):
        match e:
            case RequestSubmitted():
                got.append((e.ts, e.request, e.prompt_tokens, e.version))
            case BranchOpened() | BranchEnded():
                got.append((e.ts, type(e).__name__, e.branch))
            case ContextCompacted():
                got.append((e.ts, "ContextCompacted", e.version, e.blocks))
    assert got == [
        (0.0, "BranchOpened", "demo/main"), (0.0, "demo/main/0", 212, 0),
        (1.5, "BranchOpened", "demo/explore"), (1.5, "demo/explore/0", 168, 0),
        (5.5, "demo/explore/1", 259, 0), (6.5, "BranchEnded", "demo/explore"),
        (8.5, "demo/main/2", 327, 0), (9.5, "ContextCompacted", 1, [11, 90]),
        (21.5, "demo/main/4", 192, 1),
        (22.5, "BranchOpened", "demo/try"), (22.5, "BranchEnded", "demo/main"),
        (23.5, "demo/try/0", 266, 0), (24.5, "BranchEnded", "demo/try"),
    ]
