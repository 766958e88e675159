"""A restarted gateway's branch table, rebuilt from the harness events the first one published
(``BranchTable.fold``): the same state, so the next requests decide the same events."""

from __future__ import annotations

import random

from events.catalog import BranchEnded, BranchOpened, ContextCompacted, RequestSubmitted
from services.cores.branches import BranchSignals, BranchTable


def _state(t: BranchTable) -> dict:
    return {"open": {b: (s.session, s.eid, s.version, list(s.blocks), s.last_ts) for b, s in t.open.items()},
            "order": list(t.open), "ended": list(t.ended), "expired": dict(t.expired)}


def _drive(t: BranchTable, rng: random.Random, steps: int, log: list, t0: float = 0.0) -> float:
    """Random agent traffic: roots, children (fork / subagent), growing and rewritten prompts,
    ends, headerless requests, idle expiry; every event the table decides goes to ``log``."""
    branches: list[str] = []
    now = t0
    for i in range(steps):
        now += rng.choice([1.0, 5.0, 400.0])
        for x in t.expire(now):
            log.append(x.event)
        r = rng.random()
        if r < 0.1:
            sig, name = BranchSignals(branch=None), f"gw-old-{i}"
        elif r < 0.3 or not branches:
            name = f"b{len(branches)}" + ("~2" if rng.random() < 0.1 else "")  # an id that contains "~"
            branches.append(name)
            sig = BranchSignals(branch=name, source="ei")
        elif r < 0.4:
            parent = rng.choice(branches)
            name = f"{parent}.c{i}"
            branches.append(name)
            sig = BranchSignals(branch=name, parent=parent, mode=rng.choice(["fork", "subagent"]), source="ei")
        else:
            name = rng.choice(branches)
            sig = BranchSignals(branch=name, end=rng.random() < 0.1, compacted=rng.random() < 0.1, source="ei")
        if name in t.ended:
            continue
        st = t.open.get(name)
        prev = list(st.blocks) if st else []
        blocks = prev + [rng.randrange(1 << 60) for _ in range(rng.randrange(0, 3))]
        if rng.random() < 0.1:
            blocks = blocks[:1]  # shrank: an inferred compaction
        adm = t.admit(sig, name, f"{name}/r{i}", blocks, 64 * len(blocks) + 5, 8, 64, now)
        log += [*adm.before, adm.request]
        if adm.end_after:
            ev = t.end(name, now)
            if ev is not None:
                log.append(ev)
    return now


def test_a_table_folded_from_the_events_equals_the_table_that_made_them():
    for seed in range(20):
        rng = random.Random(seed)
        first, log = BranchTable(ttl_s=1000.0), []
        now = _drive(first, rng, 200, log)
        second = BranchTable(ttl_s=1000.0)
        for ev in log:
            second.fold(ev)
        assert _state(second) == _state(first), seed
        # and both decide the same events from here on
        a, b = [], []
        _drive(first, random.Random(seed + 100), 50, a, now)
        _drive(second, random.Random(seed + 100), 50, b, now)
        assert a == b, seed


def test_continuation_after_a_rebuild_opens_nothing_and_compacts_nothing():
    t = BranchTable()
    for ev in [BranchOpened(ts=1.0, branch="a", session="a"),
               RequestSubmitted(ts=1.0, request="a/x-1", branch="a", blocks=[1, 2], prompt_tokens=130, max_tokens=8),
               ContextCompacted(ts=2.0, branch="a", version=1, blocks=[7]),
               RequestSubmitted(ts=2.0, request="a/x-2", branch="a", version=1, blocks=[7], prompt_tokens=70,
                                max_tokens=8),
               BranchOpened(ts=3.0, branch="e", session="e"),
               BranchEnded(ts=4.0, branch="e"),
               BranchOpened(ts=3.0, branch="gw-dead0001-1", session="gw-dead0001-1")]:
        t.fold(ev)
    adm = t.admit(BranchSignals(branch="a", source="ei"), "a", "a/y-1", [7, 8], 130, 8, 64, 5.0)
    assert adm.before == [] and not adm.opened and not adm.compaction
    assert (adm.request.branch, adm.request.version) == ("a", 1)
    assert "e" in t.ended and "e" not in t.open
    assert t.orphans("gw-", "live0001") == ["gw-dead0001-1"]
    assert t.orphans("gw-", "dead0001") == []


def test_generations_of_an_expired_branch_keep_counting():
    t = BranchTable(ttl_s=10.0)
    log = []
    adm = t.admit(BranchSignals(branch="s", source="ei"), "s", "s/1", [1], 70, 8, 64, 0.0)
    log += [*adm.before, adm.request]
    log += [x.event for x in t.expire(100.0)]
    adm = t.admit(BranchSignals(branch="s", source="ei"), "s", "s/2", [1], 70, 8, 64, 101.0)
    log += [*adm.before, adm.request]
    assert adm.request.branch == "s~2"
    r = BranchTable(ttl_s=10.0)
    for ev in log:
        r.fold(ev)
    assert r.open["s"].eid == "s~2" and r.expired == {"s": 1}
    log2 = [x.event for x in r.expire(300.0)]
    adm = r.admit(BranchSignals(branch="s", source="ei"), "s", "s/3", [1], 70, 8, 64, 301.0)
    assert [e.branch for e in log2] == ["s~2"] and adm.request.branch == "s~3"
