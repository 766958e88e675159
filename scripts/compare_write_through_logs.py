"""Two event logs of the same run, before and after one ``KvStored`` for both tiers:
is the new one the old one with each L1, L2 pair merged, and nothing else changed?

    python scripts/compare_write_through_logs.py OLD.duckdb NEW.duckdb

Prints each log's event count and digest (tests/replay/test_golden_log.py's), the counts by
type that differ, then three checks: expanding every write-through ``KvStored`` of the new
log into its L1, L2 pair gives the old log exactly (type, ts, src, subject, payload of every
event; sequence numbers renumbered); the decision events are identical in order; every event
that is not a ``KvStored`` is identical in order. Exit status 0 when all three hold.
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections import Counter

import duckdb

DECISIONS = {"RouteDecided", "KvStageOrdered", "ModelFitted", "PlanEvaluated", "RoleSwitchOrdered",
             "AnomalyReported", "SwitchRole", "RoleSwitched"}


def _rows(path: str) -> list[tuple]:
    con = duckdb.connect(path, read_only=True)
    try:
        return con.execute("SELECT seq, ts, type, src, subject, payload::VARCHAR FROM events ORDER BY seq").fetchall()
    finally:
        con.close()


def _digest(rows: list[tuple]) -> str:
    h = hashlib.sha256()
    for row in rows:
        h.update(repr(row).encode())
    return h.hexdigest()


def _canon(p: dict) -> str:
    return json.dumps(p, separators=(",", ":"))


def _expanded(rows: list[tuple]) -> list[tuple]:
    """The rows without seq, a write-through store as the pair an older producer wrote."""
    out = []
    for _, ts, ty, src, subject, payload in rows:
        p = json.loads(payload)
        if ty == "KvStored" and p.pop("write_through", None) is True:
            out.append((ts, ty, src, subject, _canon(p)))
            p = dict(p, tier="L2")
        out.append((ts, ty, src, subject, _canon(p)))
    return out


def main(old_path: str, new_path: str) -> int:
    old, new = _rows(old_path), _rows(new_path)
    print(f"old: {len(old)} events, digest {_digest(old)}")
    print(f"new: {len(new)} events, digest {_digest(new)}")
    co, cn = Counter(r[2] for r in old), Counter(r[2] for r in new)
    for t in sorted(set(co) | set(cn)):
        if co[t] != cn[t]:
            print(f"  {t}: {co[t]} -> {cn[t]}")
    merged = sum(1 for r in new if r[2] == "KvStored" and json.loads(r[5]).get("write_through") is True)
    same = _expanded(new) == [(ts, ty, src, subj, _canon(json.loads(p))) for _, ts, ty, src, subj, p in old]
    do, dn = [r[1:] for r in old if r[2] in DECISIONS], [r[1:] for r in new if r[2] in DECISIONS]
    oo, on = [r[1:] for r in old if r[2] != "KvStored"], [r[1:] for r in new if r[2] != "KvStored"]
    print(f"write-through KvStored in new: {merged}; {len(old) - len(new)} events fewer")
    print(f"new expanded == old (every event but seq): {same}")
    print(f"decision events identical, in order: {do == dn} ({len(do)} of them)")
    print(f"every other non-KvStored event identical, in order: {oo == on} ({len(oo)} of them)")
    return 0 if same and do == dn and oo == on else 1


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    raise SystemExit(main(sys.argv[1], sys.argv[2]))
