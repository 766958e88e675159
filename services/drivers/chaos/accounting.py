"""What each scenario cost: events lost, duplicated, decisions diverged, from the final stream."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

from events.catalog import RequestFinished, RequestSubmitted
from services.adapters.bus import MSG_ID, Delivery
from services.drivers.chaos.load import Load
from services.drivers.up.testing import acting_route_counts


@dataclass
class ScenarioResult:
    name: str
    fault: str
    survived: bool = False
    lost: int = 0
    #: with ``--engines``: requests of the window decided but never finished (no RequestFinished,
    #: not even one with an error): left in flight for good
    hung: int = 0
    duplicated: int = 0
    diverged: int = 0
    recover_s: float | None = None
    detail: str = ""
    #: the numbers behind lost/duplicated (which kind of loss or duplicate)
    counts: dict[str, int] = field(default_factory=dict)
    window: tuple[int, int] = (0, 0)  # stream sequences (first, last] of the scenario
    published: tuple[int, int] = (0, 0)  # index range of the load generator's publications

    @property
    def all_zero(self) -> bool:
        return self.survived and not (self.lost or self.hung or self.duplicated or self.diverged)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["recover_s"] = None if self.recover_s is None else round(self.recover_s, 2)
        d["window"], d["published"] = list(self.window), list(self.published)
        return d


@dataclass
class ChaosReport:
    results: list[ScenarioResult]
    events: int = 0
    requests: int = 0
    verify: dict[str, Any] = field(default_factory=dict)
    publish_retries: int = 0
    unplanned_exits: list[str] = field(default_factory=list)
    rejoins: list[str] = field(default_factory=list)  # nodes removed for silence, registered again
    elapsed_s: float = 0.0
    quick: bool = False
    engines: bool = False
    engine_backend: str = ""  # "sim" or "torch" with engines
    #: the final drain: seconds, how it ended ("settled", "stalled: ...", "cap: ..."), and with
    #: engines the work events seen meanwhile
    drain: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return all(r.all_zero for r in self.results) and bool(self.verify.get("ok"))

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "quick": self.quick, "engines": self.engines, "engine_backend": self.engine_backend,
                "elapsed_s": round(self.elapsed_s, 1), "events": self.events,
                "requests": self.requests, "publish_retries": self.publish_retries, "drain": self.drain,
                "unplanned_exits": self.unplanned_exits, "rejoins": self.rejoins, "verify": self.verify,
                "scenarios": [r.to_dict() for r in self.results]}


def finished_requests(stream: list[Delivery]) -> dict[str, str]:
    """request -> error of its last ``RequestFinished`` ("" when it completed)."""
    return {d.event.request: d.event.error for d in stream if isinstance(d.event, RequestFinished)}


def account(results: list[ScenarioResult], load: Load, stream: list[Delivery], recorded_seqs: set[int] | None,
            divergence_seqs: list[int], engines: bool = False) -> None:
    """Fill lost / hung / duplicated / diverged of every result from the final stream (hung:
    only with engines, the load generator's nodes run nothing)."""
    ids = Counter(d.headers.get(MSG_ID) for d in stream if d.headers and d.headers.get(MSG_ID))
    decisions = acting_route_counts(stream)
    finished = finished_requests(stream) if engines else {}
    for res in results:
        lo, hi = res.published
        pubs = load.published[lo:hi]
        mids = {p.msg_id for p in pubs}
        requests = [p.event.request for p in pubs if isinstance(p.event, RequestSubmitted)]
        s0, s1 = res.window
        c = {
            "ids_missing": sum(1 for m in mids if ids[m] == 0),
            "requests_undecided": sum(1 for r in requests if decisions[r] == 0),
            "not_recorded": 0 if recorded_seqs is None else sum(
                1 for d in stream if s0 < d.seq <= s1 and d.seq not in recorded_seqs),
            "ids_twice": sum(ids[m] - 1 for m in mids if ids[m] > 1),
            "requests_decided_twice": sum(decisions[r] - 1 for r in requests if decisions[r] > 1),
        }
        if engines:
            c["requests_unfinished"] = sum(1 for r in requests if decisions[r] and r not in finished)
            c["requests_failed"] = sum(1 for r in requests if finished.get(r))  # a clear error: not a loss
        res.counts = c
        res.lost = c["ids_missing"] + c["requests_undecided"] + c["not_recorded"]
        res.hung = c.get("requests_unfinished", 0)
        res.duplicated = c["ids_twice"] + c["requests_decided_twice"]
        res.diverged = sum(1 for s in divergence_seqs if s0 < s <= s1)
