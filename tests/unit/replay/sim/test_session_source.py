"""A recorded session's later passes (replay/sim/sessions.py): every block list is the elementwise
salt of the original's, whatever prefix of the previous list it reuses."""

from __future__ import annotations

from pathlib import Path

from replay.sim.sessions import SessionSource, _salt_blocks
from replay.traces.format import Compact, Fork, Request
from replay.traces.importers.weka import import_weka

WEKA = Path(__file__).resolve().parents[3] / "fixtures" / "traces" / "weka-claude-code"


def test_a_later_pass_salts_every_list_as_a_whole(monkeypatch):
    monkeypatch.setenv("EVOLVING_CACHE_DIR", "")
    sessions = import_weka(WEKA).sessions
    steps = [st for s in sessions for b in s.branches for st in b.steps]
    assert any(isinstance(st, Fork) for st in steps) and any(isinstance(st, Compact) for st in steps)  # resumes, rewrites
    src = SessionSource(sessions)
    for k in range(len(sessions), 3 * len(sessions)):
        orig, got = sessions[k % len(sessions)], src.get(k)
        c = k // len(sessions)
        assert got.id == f"{orig.id}~{c}"
        for bo, bg in zip(orig.branches, got.branches, strict=True):
            for so, sg in zip(bo.steps, bg.steps, strict=True):
                if isinstance(so, (Request, Compact)):
                    assert sg.blocks == _salt_blocks(so.blocks, c)
                    assert sg.blocks is not so.blocks
                else:
                    assert sg == so
