"""Mooncake rows in the delta convention (aiperf's ``mooncake_trace``, Dynamo's
``--trace-format mooncake-delta``): a session's later rows carry only the new input. Exact rows
for a hand-built session, the restart a compaction forces, and the round trip through
``import_mooncake_delta`` against the cumulative export of the same sessions."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from replay.traces.export import delta_rows, export_sessions, mooncake_rows
from replay.traces.format import Branch, Compact, End, Request, Session
from replay.traces.importers import get_importer
from replay.traces.importers.mooncake import import_mooncake, import_mooncake_delta

BT = 4


def _session(sid: str, steps: list, start_s: float | None = 0.0) -> Session:
    return Session(id=sid, block_tokens=BT, start_s=start_s, branches=[Branch(id="main", steps=[*steps, End()])])


# prompts of 10, 10+3+5=18 and 18+2+7=27 tokens, each extending the previous prompt and answer
GROWING = _session("s", [
    Request(blocks=[1, 2], tail_tokens=2, output_tokens=3),
    Request(blocks=[1, 2, 3, 4], tail_tokens=2, output_tokens=2, pause_s=1.5),
    Request(blocks=[1, 2, 3, 4, 5, 6], tail_tokens=3, output_tokens=4, pause_s=0.5),
])


def test_later_rows_carry_only_the_new_input():
    res = delta_rows([GROWING])
    assert res.rows == [
        {"session_id": "s", "timestamp": 0.0, "input_length": 10, "output_length": 3, "hash_ids": [0, 1, 2]},
        {"session_id": "s", "delay": 1500.0, "input_length": 5, "output_length": 2, "hash_ids": [4, 5]},
        {"session_id": "s", "delay": 500.0, "input_length": 7, "output_length": 4, "hash_ids": [7, 8]},
    ]
    cum = mooncake_rows([GROWING]).rows
    assert [r["input_length"] for r in cum] == [10, 18, 27]  # the cumulative rows, for comparison
    assert res.notes == []


def test_a_shrunk_history_starts_a_new_session_and_a_short_answer_is_clamped():
    s = _session("c", [
        Request(blocks=[1, 2, 3], output_tokens=8),
        Request(blocks=[1, 2, 3, 4], output_tokens=1, pause_s=1.0),  # 16 < 12 + 8: the answer was cut
        Compact(blocks=[9]),
        Request(blocks=[9, 10], output_tokens=1, pause_s=2.0),  # the history was rewritten
        Request(blocks=[9, 10, 11], output_tokens=1, pause_s=3.0),
    ])
    rows = delta_rows([s])
    assert [(r["session_id"], r["input_length"], r.get("delay")) for r in rows.rows] == [
        ("c", 12, None), ("c", 1, 1000.0), ("c#2", 8, None), ("c#2", 3, 3000.0)]
    assert any("1 turn(s) whose prompt kept less" in n and "5 token(s) more" in n for n in rows.notes)
    assert any(n.startswith("1 turn(s) whose prompt does not extend") for n in rows.notes)


@pytest.mark.parametrize("bt", [4, 2, 8])
def test_round_trip_against_the_cumulative_export(tmp_path, bt):
    """Exported as deltas and imported as deltas: the same prompt lengths, outputs and timing as
    the cumulative export read back, and every turn extends the previous prompt."""
    other = _session("t", [Request(blocks=[7], tail_tokens=1, output_tokens=6),
                           Request(blocks=[7, 8, 9], tail_tokens=3, output_tokens=1, pause_s=2.0)], start_s=5.0)
    export_sessions(tmp_path / "d.jsonl", [GROWING, other], "mooncake-delta", bt)
    export_sessions(tmp_path / "c.jsonl", [GROWING, other], "mooncake", bt)
    back = import_mooncake_delta(tmp_path / "d.jsonl", block_tokens=bt).sessions
    ref = import_mooncake(tmp_path / "c.jsonl", block_tokens=bt).sessions
    assert get_importer("mooncake-delta") is import_mooncake_delta

    def shape(ss):
        return [(s.id, s.start_s, [(len(r.blocks) * bt + r.tail_tokens, r.output_tokens, r.pause_s)
                                   for r in s.branches[0].steps if isinstance(r, Request)]) for s in ss]

    assert shape(back) == shape(ref)
    for s in back:
        reqs = [r for r in s.branches[0].steps if isinstance(r, Request)]
        for a, b in itertools.pairwise(reqs):
            assert b.blocks[: len(a.blocks)] == a.blocks  # the next turn extends the prompt: cache hits


def test_the_cli_writes_and_reads_both_on_the_bundled_sessions(tmp_path, capsys):
    """The bundled real sessions: every delta row is positive, and reading the file back as deltas
    gives the cumulative export's prompt lengths wherever no turn was clamped or restarted."""
    from services.drivers.cli import main
    src = str(Path(__file__).resolve().parents[4] / "deploy" / "traces" / "calibration")
    for fmt in ("mooncake", "mooncake-delta"):
        assert main(["trace", "export", fmt, src, "-o", str(tmp_path / f"{fmt}.jsonl")]) == 0
    out = capsys.readouterr().out
    assert "wrote 2610 mooncake-delta row(s) of 34 session(s)" in out
    delta = [json.loads(x) for x in (tmp_path / "mooncake-delta.jsonl").read_text().splitlines()]
    cum = [json.loads(x) for x in (tmp_path / "mooncake.jsonl").read_text().splitlines()]
    assert all(r["input_length"] >= 1 for r in delta) and len(delta) == len(cum)
    assert sum(r["input_length"] for r in delta) < sum(r["input_length"] for r in cum) / 10
    assert main(["trace", "import", "mooncake-delta", str(tmp_path / "mooncake-delta.jsonl"),
                 "-o", str(tmp_path / "s.jsonl"), "--block-tokens", "64"]) == 0
    assert "request(s)" in capsys.readouterr().out
    back = import_mooncake_delta(tmp_path / "mooncake-delta.jsonl", block_tokens=64).sessions
    lengths = {s.id: [len(r.blocks) * 64 + r.tail_tokens for r in s.branches[0].steps if isinstance(r, Request)]
               for s in back}
    seen: dict[str, int] = {}  # rows in file order: a session's k-th row is its k-th request
    for d, c in zip(delta, cum, strict=True):
        i = seen[d["session_id"]] = seen.get(d["session_id"], -1) + 1
        got = lengths[d["session_id"]][i]
        # a clamped turn grows this and every later replayed prompt of its session; a first turn is exact
        assert got >= c["input_length"] and (i > 0 or got == c["input_length"])
