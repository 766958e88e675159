"""Mooncake importer: every request kept, sessions inferred from prefix continuation and timing
(never chained on a shared prefix), open-loop times, and the 512-token blocks charged as such."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.profiles import load_profile
from events.catalog import RequestStarted
from events.hashing import namespaced_hash
from replay.sim.simulation import SimConfig, Simulation
from replay.sim.stacks import get_stack
from replay.traces.format import Request, TraceFormatError, reblock, validate_session
from replay.traces.importers.mooncake import MAX_GAP_S, import_mooncake, infer_sessions
from tests.hyp import examples

MOON = Path(__file__).resolve().parents[3] / "fixtures" / "traces" / "mooncake" / "synthetic_trace_head300.jsonl"
NS = "mooncake:synthetic_trace_head300"


def _write(tmp_path, recs) -> Path:
    p = tmp_path / "m.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return p


def _line(ts_ms, ids, tail=100, out=10):
    return {"timestamp": ts_ms, "input_length": len(ids) * 512 + tail, "output_length": out,
            "hash_ids": list(ids) + ([10**9 + ts_ms] if tail else [])}


def test_every_request_kept_with_its_blocks_and_arrival():
    lines = [json.loads(x) for x in MOON.read_text().splitlines()]
    res = import_mooncake(MOON)
    assert not res.skipped
    got = []
    for s in res.sessions:
        assert validate_session(s) == [] and s.block_tokens == 512
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


def test_sessions_follow_the_continuation_rule():
    res = import_mooncake(MOON)
    sizes = sorted(sum(1 for _ in s.requests()) for s in res.sessions)
    # the head of the synthetic trace: repeated prompts over shared documents, one real next turn
    assert len(res.sessions) == 299 and sizes[-2:] == [1, 2]
    for s in res.sessions:
        reqs = [r for _b, _i, r in s.requests()]
        for prev, r in itertools.pairwise(reqs):
            # every later request strictly extends the whole prompt of the previous one
            assert prev.blocks and r.blocks[: len(prev.blocks)] == prev.blocks and len(r.blocks) > len(prev.blocks)
            assert prev.at_s < r.at_s <= prev.at_s + MAX_GAP_S
            assert r.pause_s == pytest.approx(r.at_s - prev.at_s)


def test_a_shared_prefix_never_chains_sessions(tmp_path):
    """A bug once seen: 300 requests opening with the same system prompt (blocks 0-2), one of
    them *exactly* the system prompt, made one giant session. Only real next turns may join."""
    recs = [_line(0, [0, 1, 2])]  # a prompt that is only the shared system prompt
    for u in range(100):  # 100 users, 3 turns each, interleaved; private blocks per user
        base = 1000 * (u + 1)
        for turn in range(3):
            recs.append(_line(1000 + 7 * u + 60_000 * turn, [0, 1, 2] + list(range(base, base + 2 + 3 * turn))))
    recs.append(_line(500_000, [0, 1, 2, 1000, 1001]))  # user 0's first prompt asked again: a new session
    res = import_mooncake(_write(tmp_path, recs))
    sizes = sorted(sum(1 for _ in s.requests()) for s in res.sessions)
    assert sizes == [1, 1] + [3] * 100
    assert max(sizes) == 3


def test_an_idle_gap_starts_a_new_session(tmp_path):
    recs = [_line(0, [5, 6]), _line(10_000, [5, 6, 7]), _line(10_000 + int(MAX_GAP_S * 1000) + 1, [5, 6, 7, 8])]
    assert [sum(1 for _ in s.requests()) for s in import_mooncake(_write(tmp_path, recs)).sessions] == [2, 1]
    res = import_mooncake(_write(tmp_path, recs), max_gap_s=2 * MAX_GAP_S)
    assert [sum(1 for _ in s.requests()) for s in res.sessions] == [3]


@settings(max_examples=examples(60), deadline=None)
@given(st.lists(st.tuples(st.integers(0, 1), st.lists(st.integers(1, 4), min_size=1, max_size=5),
                          st.lists(st.floats(1.0, 600.0), min_size=5, max_size=5), st.floats(0.0, 300.0)),
                min_size=1, max_size=12))
def test_conversations_are_recovered_exactly(convs):
    """Conversations over one of two shared system prompts, each turn extending the previous
    one by whole blocks within the idle timeout, interleaved in time: inferred sessions are
    exactly the conversations."""
    recs, truth = [], []
    for c, (system, growth, gaps, start) in enumerate(convs):
        prefix = [system * 100 + b for b in range(3)]
        private = iter(range(10_000 * (c + 1), 10_000 * (c + 2)))
        ids = prefix + [next(private)]
        t = start
        mine = []
        for g, gap in zip(growth, gaps):
            mine.append(len(recs))
            recs.append((round(t, 3), tuple(ids)))
            ids = ids + [next(private) for _ in range(g)]
            t += gap
        truth.append(mine)
    order = sorted(range(len(recs)), key=lambda i: (recs[i][0], i))
    got = infer_sessions([recs[i] for i in order])
    assert sorted(sorted(order[i] for i in s) for s in got) == sorted(truth)
    assert sorted(i for s in got for i in s) == list(range(len(recs)))


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


# --------------------------------------------------------------------------- block size
def test_reblock_keeps_every_token_and_the_prefix_relation(tmp_path):
    recs = [_line(0, [1, 2, 3, 4], tail=300), _line(20_000, [1, 2, 3, 4, 5, 6], tail=0)]
    (s,) = import_mooncake(_write(tmp_path, recs)).sessions
    r = reblock(s, 64)
    assert r.block_tokens == 64 and validate_session(r) == []
    (a, b) = [q for _b, _i, q in r.requests()]
    assert len(a.blocks) * 64 + a.tail_tokens == 4 * 512 + 300  # 4 blocks -> 32, tail 300 -> 4 + 44
    assert (len(a.blocks), a.tail_tokens) == (36, 44)
    assert b.blocks[:32] == a.blocks[:32] and b.blocks[32] != a.blocks[32] and len(b.blocks) == 48
    assert reblock(s, 512) is s
    back = reblock(r, 128)  # merge 64 -> 128 keeps the prompt length
    assert [len(q.blocks) * 128 + q.tail_tokens for _b, _i, q in back.requests()] == [2348, 3072]
    with pytest.raises(ValueError, match="cannot be re-cut"):
        reblock(s, 96)


def test_simulator_charges_cached_tokens_in_the_traces_own_block_size(tmp_path):
    """A 512-token-block trace: the second turn's cached prefix is the first turn's 4 full
    blocks = 2,048 tokens (at 64 tokens a block it was wrongly 4 x 64 = 256)."""
    recs = [_line(0, [1, 2, 3, 4], tail=300, out=50), _line(5_000, [1, 2, 3, 4, 5, 6], tail=100, out=50)]
    sessions = import_mooncake(_write(tmp_path, recs)).sessions
    prof = load_profile("gb300-glm52")
    assert prof.block_tokens == 64
    cfg = SimConfig(nodes=2, duration_s=60.0, warmup_s=0.0, seed=0, agents=1, stagger_s=0.0)
    res = Simulation(prof, get_stack("static:1P1D"), sessions, cfg).run()
    started = {e.request: e for e in res.log if isinstance(e, RequestStarted) and e.phase == "prefill"}
    first = next(k for k in started if k.endswith("/main/0"))
    second = first[: -len("/main/0")] + "/main/1"
    assert started[first].cached_tokens == 0
    assert started[second].cached_tokens == 2048
