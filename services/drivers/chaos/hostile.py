"""The hostile suite's attacker (docs/security.md "The hostile suite"): for each account
of a secured stack, every kind of bad message on every subject of the partition.

For each account (its own NATS credentials, as ``evolving up`` writes them) and each subject of
:func:`attack_subjects`, one core-NATS publication of each of:

============================  ===========================================================
payload                       what a consumer must do
============================  ===========================================================
``junk``                      ``\\xc1junk``: not msgpack; dead-lettered, the consumer goes on
``schema-9``                  a valid event with ``Ei-Schema: 9.0``: refused (newer major)
``one-megabyte``              1 MiB of junk (under the server's 8 MB max_payload)
``forged-<Type>``             every event type, about *another* node / branch than the
                              account's own (a SwitchRole, a NodeRemoved, a RouteDecided, ...)
``nan-ts``, ``future-ts``     a NodeHeartbeat whose ts is NaN or an hour ahead, a Tick an
                              hour ahead (but the planner's on its own clock subject)
============================  ===========================================================

The server stores only what the account may publish on that subject (the rest is answered with
a permissions error, counted as ``denied``); what it stores must then be refused by every
consumer (events/authority.py), dead-lettered and counted, never folded. An event sent on its
own subject is not a forgery (only its producer may publish there, and that one is obeyed: the
planner's SwitchRole on ``cmd.<n>``) and is not sent. The admin account is not attacked: it may
do everything by design.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field
from pathlib import Path

import nats

from events import codec
from events.authority import check_subject
from events.catalog import (
    AnomalyReported,
    BranchEnded,
    BranchOpened,
    ContextCompacted,
    Event,
    FirstToken,
    IterationDone,
    KvEvicted,
    KvFetched,
    KvMoved,
    KvStageOrdered,
    KvStored,
    ModelFitted,
    NodeHeartbeat,
    NodeRegistered,
    NodeRemoved,
    PlanEvaluated,
    RequestCancelled,
    RequestFinished,
    RequestStarted,
    RequestSubmitted,
    RoleSwitched,
    RoleSwitchOrdered,
    RouteDecided,
    Split,
    SwitchRole,
    Tick,
)
from events.subjects import token
from services.adapters.bus.security import Credentials

JUNK = b"\xc1junk"
MEGABYTE = b"\xc1" + b"x" * (1 << 20)


def forged_events(ts: float, node: str, branch: str = "hostile-branch") -> list[Event]:
    """One event of every type, about ``node`` (another node than the sender's) and ``branch``."""
    r = "hostile-req"
    return [
        BranchOpened(ts=ts, src=node, branch=branch), RequestSubmitted(ts=ts, src=node, request=r, branch=branch),
        ContextCompacted(ts=ts, src=node, branch=branch, version=9), BranchEnded(ts=ts, src=node, branch=branch),
        RequestCancelled(ts=ts, src=node, request=r, branch=branch),
        KvStored(ts=ts, src=node, node=node, tier="L1", blocks=[1, 2, 3]),
        KvEvicted(ts=ts, src=node, node=node, tier="L1", blocks=[1]),
        KvMoved(ts=ts, src=node, src_node="elsewhere", dst_node=node, blocks=[1]),
        KvFetched(ts=ts, src=node, request=r, src_node="elsewhere", dst_node=node),
        NodeRegistered(ts=ts, src=node, node=node, role="prefill"),
        NodeHeartbeat(ts=ts, src=node, node=node, role="prefill"), NodeRemoved(ts=ts, src="liveness", node=node),
        IterationDone(ts=ts, src=node, node=node, phase="prefill", duration_s=1.0),
        RequestStarted(ts=ts, src=node, request=r, node=node, phase="prefill"),
        FirstToken(ts=ts, src=node, request=r, node=node), RequestFinished(ts=ts, src=node, request=r, node=node),
        RouteDecided(ts=ts, src="router", request=r, prefill_node=node, decode_node=node),
        ModelFitted(ts=ts, src="planner", node=node, phase="prefill", coefficients=[1.0, 1.0, 1.0, 1.0]),
        PlanEvaluated(ts=ts, src="planner", window_start=ts - 1, window_end=ts, current=Split(prefill=1, decode=1)),
        RoleSwitchOrdered(ts=ts, src="planner", node=node, from_role="collocated", to_role="prefill"),
        AnomalyReported(ts=ts, src="hostile", component="hostile", kind="forged"),
        SwitchRole(ts=ts, src="planner", node=node, to_role="prefill"), RoleSwitched(ts=ts, src=node, node=node,
                                                                                   role="prefill"),
        Tick(ts=ts, src="planner"),
        KvStageOrdered(ts=ts, src="router", request=r, src_node=node, dst_node=node),
    ]


def attack_subjects(partition: str, nodes: list[str]) -> list[str]:
    """Every family of the partition, with each node's subjects and one foreign branch."""
    p = token(partition)
    out = [f"ei.{p}.agent.hostile-branch", f"ei.{p}.route", f"ei.{p}.plan", f"ei.{p}.clock",
           f"ei.{p}.anomaly.hostile", f"ei.{p}.shadow.hostile.routedecided"]
    for n in nodes:
        out += [f"ei.{p}.kv.{n}", f"ei.{p}.node.{n}", f"ei.{p}.cmd.{n}"]
    return out


@dataclass
class AttackReport:
    sent: dict[str, int] = field(default_factory=dict)  # account -> publications
    errors: dict[str, int] = field(default_factory=dict)  # account -> server errors (permission denials)
    kinds: set[str] = field(default_factory=set)

    def as_dict(self) -> dict:
        return {"sent": self.sent, "denied": self.errors, "kinds": sorted(self.kinds)}


def _payloads(account: str, own_node: str | None, subject: str, nodes: list[str], ts: float) -> list[tuple]:
    """(kind, data, headers) for one subject; forged events name a node other than the account's."""
    other = next((n for n in nodes if n != own_node), nodes[0])
    hdr = codec.headers()
    out: list[tuple] = [("junk", JUNK, hdr), ("one-megabyte", MEGABYTE, hdr),
                        ("schema-9", codec.encode(Tick(ts=ts)), {codec.SCHEMA_HEADER: "9.0"}),
                        ("nan-ts", codec.encode(NodeHeartbeat(ts=math.nan, node=own_node or other, role="prefill")),
                         hdr),
                        ("future-ts", codec.encode(NodeHeartbeat(ts=ts + 3600.0, node=own_node or other,
                                                                 role="prefill")), hdr)]
    if not (account == "planner" and subject.split(".")[2] == "clock"):  # the planner's clock is its own
        out.append(("future-ts", codec.encode(Tick(ts=ts + 3600.0)), hdr))
    for ev in forged_events(ts, other):
        if check_subject(ev, subject) is None:
            continue  # its own subject: the server lets only its producer publish it, and that one is obeyed
        out.append((f"forged-{type(ev).__name__}", codec.encode(ev), hdr))
    return out


async def attack(url: str, partition: str, credentials_dir: str | Path, nodes: list[str], ts: float,
                 accounts: list[str] | None = None) -> AttackReport:
    """Run the attack (module docstring) with every account's credentials file in
    ``credentials_dir`` but the admin's; returns what was sent and what the server denied."""
    rep = AttackReport()
    files = sorted(Path(credentials_dir).glob("*.json"))
    for path in files:
        account = path.stem
        if account == "admin" or (accounts is not None and account not in accounts):
            continue
        creds = Credentials.from_file(str(path))
        own_node = account.removeprefix("engine-") if account.startswith("engine-") else None
        errors = 0

        async def on_error(_exc, _a=account) -> None:
            nonlocal errors
            errors += 1

        nc = await nats.connect(url, error_cb=on_error, allow_reconnect=False, **creds.connect_options())
        try:
            n = 0
            for subject in attack_subjects(partition, nodes):
                for kind, data, hdrs in _payloads(account, own_node, subject, nodes, ts):
                    await nc.publish(subject, data, headers=hdrs)
                    rep.kinds.add(kind)
                    n += 1
                await nc.flush()
            await asyncio.sleep(0.2)  # the server's permission errors arrive after the flush
            rep.sent[account], rep.errors[account] = n, errors
        finally:
            await nc.close()
    return rep

