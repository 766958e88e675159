"""Mooncake importer on the real fixture slice: sessions from shared prefixes, open-loop times."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from events.hashing import namespaced_hash
from replay.importers.mooncake import import_mooncake
from replay.trace import Request, TraceFormatError, validate_session

MOON = Path(__file__).resolve().parents[2] / "fixtures" / "traces" / "mooncake" / "synthetic_trace_head300.jsonl"
NS = "mooncake:synthetic_trace_head300"


def test_every_request_kept_with_its_blocks_and_arrival():
    lines = [json.loads(x) for x in MOON.read_text().splitlines()]
    res = import_mooncake(MOON)
    assert not res.skipped
    got = []
    for s in res.sessions:
        assert validate_session(s) == []
        for _b, _i, r in s.requests():
            got.append((s.start_s + r.at_s, r))
    assert len(got) == len(lines) == 300
    # each source line appears once, with the full-block prefix of its hash_ids
    want = sorted((round(x["timestamp"] / 1000, 6), tuple(namespaced_hash(NS, h) for h in x["hash_ids"][: x["input_length"] // 512]),
                   x["input_length"], x["output_length"]) for x in lines)
    have = sorted((round(t, 6), tuple(r.blocks), len(r.blocks) * 512 + r.tail_tokens, r.output_tokens)
                  for t, r in got)
    assert [(w[1], w[2], w[3]) for w in want] == [(h[1], h[2], h[3]) for h in have]
    assert [w[0] for w in want] == [h[0] for h in have]


def test_sessions_follow_the_prefix_rule():
    res = import_mooncake(MOON)
    sizes = sorted(sum(1 for _ in s.requests()) for s in res.sessions)
    assert len(res.sessions) == 293 and sizes[-4:] == [2, 2, 3, 4]
    for s in res.sessions:
        reqs = [r for _b, _i, r in s.requests()]
        for k, r in enumerate(reqs[1:], start=1):
            # every later request extends the whole prompt of some earlier one of its session
            assert any(r.blocks[: len(q.blocks)] == q.blocks and q.blocks for q in reqs[:k])
            assert r.at_s >= reqs[k - 1].at_s
            assert r.pause_s == pytest.approx(r.at_s - reqs[k - 1].at_s)


def test_start_times_are_open_loop():
    res = import_mooncake(MOON)
    starts = [s.start_s for s in res.sessions]
    assert starts == sorted(starts) and starts[0] == 0.0 and starts[-1] <= 86.790


@pytest.mark.parametrize(("line", "field"), [
    ('{"timestamp": 5, "input_length": 1000, "output_length": 3, "hash_ids": [1, 2', "(json)"),
    ('{"timestamp": 5, "input_length": 1000, "hash_ids": [1, 2]}', "output_length"),
    ('{"timestamp": 5, "input_length": 1000, "output_length": 3, "hash_ids": [1, 2, 3, 4]}', "hash_ids"),
])
def test_malformed_lines(tmp_path, line, field):
    p = tmp_path / "m.jsonl"
    head = MOON.read_text().splitlines()[:3]
    p.write_text("\n".join(head[:2] + [line] + head[2:]) + "\n")
    with pytest.raises(TraceFormatError) as ei:
        import_mooncake(p)
    assert (ei.value.file, ei.value.line, ei.value.field) == (str(p), 3, field)
    res = import_mooncake(p, skip_bad=True)
    assert [(e.line, e.field) for e in res.skipped] == [(3, field)]
    assert sum(1 for s in res.sessions for _ in s.requests()) == 3
    assert all(isinstance(r, Request) for s in res.sessions for _b, _i, r in s.requests())
