"""Deterministic log replay: fold a recorded log through fresh cores and check that every
recorded decision is reproduced bit for bit.

How it works (docs/recorder.md has the long form):

1. The cores are built from the log's ``run_config`` table (plug-in name or class path and
   constructor kwargs, one key per core) by the recipes of the services table
   (services/drivers/services.py: ``CORES``, which also resolves the class paths of logs
   recorded before the folders had layers), through a registry of :class:`CoreSpec` so any
   core can be verified (tests use a fake one).
2. Every recorded event is folded, in seq order, through every core - exactly what the live
   adapters do, echoes of a core's own decisions included. What a core emits is *not* folded:
   the recorded copy is.
3. A core's emitted decisions (the types its spec ``checks``) queue up, in order, as
   predictions. When the log holds a decision owned by that core, it is compared with the head
   of the queue *before* being folded: equal msgpack bytes, or a divergence. An owned decision
   with nothing predicted is a divergence too ("not reproduced"). A decision equal byte for
   byte to a later prediction in the queue is reproduced too, counted as ``reordered``: the
   bus stores a batch's decisions out of their emission order when one publication of the
   batch is lost and retried (a killed stream leader). Only exact bytes match, and the
   recorded order is what the fresh cores fold: if the order changed a later decision, that
   one diverges and is reported.
4. Predictions still queued when the log ends are reported (the run stopped before they were
   published); they fail the check only with ``strict=True``.

A core that leaves ``src`` empty gets the recorded ``src`` before the comparison: adapters stamp
the publisher id, cores do not.

The log is the stream, refused events included, so verify applies the event authority the live
consumers apply (events/authority.py): one :class:`~events.authority.Admission` over
the rows in seq order, each checked with its recorded subject. A refused row is not folded into
any core, not compared as a decision (a forged ``RouteDecided`` on the gateway's subject is no
decision of the router's), counted, and listed with its reason; refusals do not fail the check.

And :func:`verify_log` checks that the log is whole: every seq from 1 to its applied position
is a row, or one its writer noted it was not handed (``EventLog.skipped()``: messages the
recorder's consumer dead-lettered, the stream's beginning it started after). Any other missing
seq (rows deleted from the file) is a **gap**, named by range; a row that does not decode is
named by seq and not folded. Either makes the log **incomplete**: not OK, whatever the decisions.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from events.authority import Admission
from events.catalog import Event, KvStageOrdered, RouteDecided
from events.codec import encode, to_json
from services.adapters.eventlog.port import SeqHoles, Skipped
from services.adapters.recipes import CORES, VERIFIED_CORES

Row = tuple[int, str, Event]

PLANNER_DECISIONS = frozenset({"PlanEvaluated", "RoleSwitchOrdered", "ModelFitted", "SwitchRole"})


def _checks_planner(event: Event) -> bool:
    return type(event).__name__ in PLANNER_DECISIONS


def _checks_router(event: Event) -> bool:
    return (isinstance(event, RouteDecided) and not event.shadow) or isinstance(event, KvStageOrdered)


def _checks_nothing(event: Event) -> bool:
    return False


@dataclass(frozen=True)
class CoreSpec:
    """How to build one core from its ``run_config`` entry and which recorded events are its
    decisions."""

    name: str
    factory: Callable[[Mapping[str, Any]], Any]
    checks: Callable[[Event], bool] = _checks_nothing


#: which recorded events are each verified core's decisions (the others' are checked by none)
CHECKS: dict[str, Callable[[Event], bool]] = {"planner": _checks_planner, "router": _checks_router}
DEFAULT_REGISTRY: dict[str, CoreSpec] = {
    name: CoreSpec(name, CORES[name].build, CHECKS.get(name, _checks_nothing)) for name in VERIFIED_CORES
}
DEFAULT_CORES = VERIFIED_CORES


@dataclass
class Divergence:
    seq: int  # the recorded event's position (0: after the end of the log)
    core: str
    kind: str  # "mismatch" | "not_reproduced" | "core_error" | "not_recorded"
    recorded: Event | None = None
    predicted: Event | None = None
    predicted_after_seq: int = 0  # the event whose fold produced the prediction
    detail: str = ""

    def to_dict(self) -> dict[str, Any]:
        def js(e):
            return None if e is None else msgspec.json.decode(to_json(e))

        return {
            "seq": self.seq,
            "core": self.core,
            "kind": self.kind,
            "predicted_after_seq": self.predicted_after_seq,
            "recorded": js(self.recorded),
            "predicted": js(self.predicted),
            "detail": self.detail,
        }


#: How many refusals, gaps, undecodable rows and skipped ranges a report lists (all are counted).
LISTED = 1000


@dataclass(frozen=True)
class Refusal:
    """A recorded event the authority rule refuses: never folded, never compared."""

    seq: int
    subject: str
    type: str
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return {"seq": self.seq, "subject": self.subject, "type": self.type, "reason": self.reason}


@dataclass(frozen=True)
class BadRow:
    """A row of the log that does not decode (an edited or damaged file): never folded."""

    seq: int
    subject: str
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return {"seq": self.seq, "subject": self.subject, "reason": self.reason}


def _count(ranges: Sequence[tuple[int, int]]) -> int:
    return sum(b - a + 1 for a, b in ranges)


@dataclass
class VerifyReport:
    events: int = 0  # rows read and decoded (folded + refused)
    checked: Counter = field(default_factory=Counter)  # decision type -> reproduced count
    divergences: list[Divergence] = field(default_factory=list)
    not_recorded: list[Divergence] = field(default_factory=list)
    strict: bool = False
    #: decisions reproduced byte for byte but recorded after a later one of the same core (the
    #: bus stored them out of emission order: a publication retried after a lost ack)
    reordered: int = 0
    refused: int = 0
    refusals: list[Refusal] = field(default_factory=list)  # the first LISTED
    # set by verify_log (the log's own record; verify_rows sees rows only)
    applied_seq: int = 0
    gaps: list[tuple[int, int]] = field(default_factory=list)  # missing seq ranges: rows deleted
    undecodable: list[BadRow] = field(default_factory=list)
    skipped: list[tuple[int, int]] = field(default_factory=list)  # seqs the writer noted it was not handed
    #: where a log written before skipped seqs were noted begins after seq 1: unknown, not a gap
    start_unknown: tuple[int, int] | None = None
    skipped_noted: bool = True  # False: a log written before: a gap may be a message it was not handed

    @property
    def folded(self) -> int:
        return self.events - self.refused

    @property
    def complete(self) -> bool:
        """Every seq up to the applied position is a readable row or a noted skip."""
        return not self.gaps and not self.undecodable

    @property
    def ok(self) -> bool:
        return self.complete and not self.divergences and not (self.strict and self.not_recorded)

    def refuse(self, seq: int, subject: str, event: Event, reason: str) -> None:
        self.refused += 1
        if len(self.refusals) < LISTED:
            self.refusals.append(Refusal(seq, subject, type(event).__name__, reason))

    @property
    def first_divergence(self) -> Divergence | None:
        if self.divergences:
            return self.divergences[0]
        return self.not_recorded[0] if self.strict and self.not_recorded else None

    def to_dict(self) -> dict[str, Any]:
        first = self.first_divergence
        return {
            "ok": self.ok,
            "complete": self.complete,
            "events": self.events,
            "folded": self.folded,
            "reproduced": dict(sorted(self.checked.items())),
            "divergences": len(self.divergences),
            "reordered": self.reordered,
            "not_recorded": len(self.not_recorded),
            "first_divergence": first.to_dict() if first else None,
            "refused": self.refused,
            "refusals": [r.to_dict() for r in self.refusals],
            "applied_seq": self.applied_seq,
            "missing": _count(self.gaps),
            "gaps": [list(g) for g in self.gaps[:LISTED]],
            "undecodable": len(self.undecodable),
            "undecodable_rows": [b.to_dict() for b in self.undecodable[:LISTED]],
            "skipped": _count(self.skipped),
            "skipped_ranges": [list(r) for r in self.skipped[:LISTED]],
            "skipped_noted": self.skipped_noted,
            "start_unknown": list(self.start_unknown) if self.start_unknown else None,
        }


def verify_rows(
    rows: Iterable[Row],
    cores: Sequence[tuple[CoreSpec, Any]],
    *,
    keep_going: bool = False,
    strict: bool = False,
) -> VerifyReport:
    """Fold ``rows`` through ``cores`` (fresh ones) and compare every recorded decision; a row
    the event authority refuses is neither (see the module's docstring)."""
    report = VerifyReport(strict=strict)
    pending: dict[str, deque[tuple[int, Event]]] = {spec.name: deque() for spec, _ in cores}
    overtaken: dict[int, int] = {}  # id(pending entry) -> seq of the later decision recorded before it
    # A row recorded without a subject (a log written in process, by hand or a test: the
    # recorder and the simulator write every row's subject) gets the timestamp rule only, as
    # Admission does for a trusted driver: a non-finite or far-future ts is no event from anyone.
    admission = Admission()
    for seq, subject, recorded in rows:
        report.events += 1
        why = admission.reason(recorded, subject or None)
        if why is not None:
            report.refuse(seq, subject, recorded, why)
            continue
        for spec, _core in cores:
            if not spec.checks(recorded):
                continue
            queue = pending[spec.name]
            if not queue:
                report.divergences.append(Divergence(seq, spec.name, "not_reproduced", recorded=recorded,
                                                     detail="the fresh core emitted no pending decision"))
                continue
            after, predicted = queue[0]
            if not predicted.src and recorded.src:
                predicted = msgspec.structs.replace(predicted, src=recorded.src)
            want = encode(recorded)
            if encode(predicted) == want:
                overtaken.pop(id(queue.popleft()), None)
                report.checked[type(recorded).__name__] += 1
                continue
            later = _find_equal(queue, want, recorded.src)
            if later is not None:  # stored out of emission order (a publish retried): same bytes
                for i in range(later):  # each one it overtook must still come, or it diverged here
                    overtaken.setdefault(id(queue[i]), seq)
                overtaken.pop(id(queue[later]), None)
                del queue[later]
                report.checked[type(recorded).__name__] += 1
                report.reordered += 1
                continue
            overtaken.pop(id(queue.popleft()), None)
            report.divergences.append(Divergence(seq, spec.name, "mismatch", recorded, predicted, after))
        if report.divergences and not keep_going:
            return report
        for spec, core in cores:
            try:
                out = core.apply(recorded)
            except Exception as exc:  # noqa: BLE001 - a core that raises on recorded input is a divergence
                report.divergences.append(Divergence(seq, spec.name, "core_error", recorded=recorded,
                                                     detail=f"{type(exc).__name__}: {exc}"))
                if not keep_going:
                    return report
                continue
            pending[spec.name].extend((seq, e) for e in out if spec.checks(e))
    for spec, _ in cores:
        for entry in pending[spec.name]:
            after, predicted = entry
            if id(entry) in overtaken:  # a later decision was recorded, this one never: dropped
                report.divergences.append(Divergence(overtaken[id(entry)], spec.name, "mismatch",
                                                     predicted=predicted, predicted_after_seq=after,
                                                     detail="a later decision was recorded, this one never"))
                continue
            report.not_recorded.append(Divergence(0, spec.name, "not_recorded", predicted=predicted,
                                                  predicted_after_seq=after,
                                                  detail="predicted, but the log ends before it"))
    report.divergences.sort(key=lambda d: d.seq)
    return report


def _find_equal(queue: deque[tuple[int, Event]], want: bytes, src: str) -> int | None:
    """Index of a pending prediction whose bytes equal ``want`` (``src`` stamped as above)."""
    for i, (_after, predicted) in enumerate(queue):
        if not predicted.src and src:
            predicted = msgspec.structs.replace(predicted, src=src)
        if encode(predicted) == want:
            return i
    return None


def build_cores(
    run_config: Mapping[str, Any],
    names: Sequence[str],
    registry: Mapping[str, CoreSpec] | None = None,
) -> list[tuple[CoreSpec, Any]]:
    """Fresh cores named ``names``, each built from ``run_config[name]`` (empty if absent)."""
    registry = DEFAULT_REGISTRY if registry is None else registry
    out = []
    for name in names:
        if name not in registry:
            raise KeyError(f"no core named {name!r} to verify (known: {', '.join(sorted(registry))})")
        spec = registry[name]
        cfg = run_config.get(name) or {}
        if not isinstance(cfg, Mapping):
            raise TypeError(f"run_config[{name!r}] must be an object, got {cfg!r}")
        out.append((spec, spec.factory(cfg)))
    return out


def verify_log(
    event_log,
    names: Sequence[str] | None = None,
    registry: Mapping[str, CoreSpec] | None = None,
    *,
    keep_going: bool = False,
    strict: bool = False,
) -> VerifyReport:
    """Verify an :class:`~services.adapters.eventlog.port.EventLog` against fresh cores, and
    that it is whole: gaps in its seqs and rows that do not decode are named in the report."""
    config = event_log.run_config()
    if names is None:
        names = config.get("cores") or DEFAULT_CORES
    cores = build_cores(config, names, registry)
    holes = SeqHoles()
    bad: list[BadRow] = []

    def undecodable(seq: int, subject: str, reason: str) -> None:
        holes.see(seq)
        bad.append(BadRow(seq, subject, reason))

    def rows() -> Iterator[Row]:
        for row in event_log.read(1, undecodable=undecodable):
            holes.see(row[0])
            yield row

    it = rows()
    report = verify_rows(it, cores, keep_going=keep_going, strict=strict)
    for _ in it:  # stopped at the first divergence: the rest is still checked for gaps
        pass
    report.undecodable = bad
    report.applied_seq = event_log.last_seq()
    skipped = event_log.skipped() if hasattr(event_log, "skipped") else Skipped((), None)
    report.skipped, report.skipped_noted = list(skipped.ranges), skipped.since is not None
    for first, last in holes.end(report.applied_seq):
        for a, b in skipped.covers(first, last):
            if a == 1 and b == holes.first - 1 and skipped.untracked(a, b):
                report.start_unknown = (a, b)  # a log that never said where it began
            else:
                report.gaps.append((a, b))
    return report
