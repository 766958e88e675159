"""The subject scheme, in one place.

Every event of partition ``p`` lives under ``ei.<p>.>`` (one JetStream stream per partition):

=====================================  ===============================================
subject                                events
=====================================  ===============================================
``ei.<p>.agent.<branch>``              BranchOpened, RequestSubmitted, ContextCompacted, BranchEnded,
                                       RequestCancelled
``ei.<p>.kv.<node>``                   KvStored, KvEvicted, KvMoved, KvFetched
``ei.<p>.node.<node>``                 NodeRegistered, NodeHeartbeat, NodeRemoved, IterationDone,
                                       RequestStarted, FirstToken, RequestFinished, RoleSwitched
``ei.<p>.route``                       RouteDecided, KvStageOrdered
``ei.<p>.plan``                        ModelFitted, PlanEvaluated, RoleSwitchOrdered
``ei.<p>.cmd.<node>``                  SwitchRole (commands to one engine)
``ei.<p>.clock``                       Tick
``ei.<p>.anomaly.<component>``         AnomalyReported
``ei.<p>.shadow.<name>.route``         RouteDecided of a router running in shadow
=====================================  ===============================================

Dead letters go to ``eidlq.<p>.<consumer>`` — deliberately *outside* ``ei.<p>.>`` so a
poisoned message is never folded again; a separate stream keeps them.
"""

from __future__ import annotations

import re

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
    SwitchRole,
    Tick,
)

DEFAULT_PARTITION = "default"
_BAD_TOKEN = re.compile(r"[^A-Za-z0-9_\-=:@+]")


def token(value: str) -> str:
    """Make ``value`` usable as one subject token (no dots, wildcards or spaces)."""
    cleaned = _BAD_TOKEN.sub("_", value)
    return cleaned or "_"


def stream_name(partition: str = DEFAULT_PARTITION) -> str:
    return f"EI_{token(partition).upper().replace('-', '_')}"


def dlq_stream_name(partition: str = DEFAULT_PARTITION) -> str:
    return f"EIDLQ_{token(partition).upper().replace('-', '_')}"


def all_subjects(partition: str = DEFAULT_PARTITION) -> str:
    return f"ei.{token(partition)}.>"


def dlq_subjects(partition: str = DEFAULT_PARTITION) -> str:
    return f"eidlq.{token(partition)}.>"


def dlq_subject(partition: str, consumer: str) -> str:
    return f"eidlq.{token(partition)}.{token(consumer)}"


def cmd_subject(partition: str, node: str) -> str:
    return f"ei.{token(partition)}.cmd.{token(node)}"


def shadow_prefix(partition: str, name: str) -> str:
    return f"ei.{token(partition)}.shadow.{token(name)}"


def is_shadow(subject: str) -> bool:
    parts = subject.split(".", 3)
    return len(parts) > 2 and parts[2] == "shadow"


#: The event types of each subject family (the table above; events/authority.py's AUTHORITY
#: takes its rows' types from here, so a new event joins one family in one place).
AGENT_EVENTS = (BranchOpened, RequestSubmitted, ContextCompacted, BranchEnded, RequestCancelled)
KV_EVENTS = (KvStored, KvEvicted, KvMoved, KvFetched)
NODE_EVENTS = (NodeRegistered, NodeHeartbeat, NodeRemoved, IterationDone, RequestStarted, FirstToken,
               RequestFinished, RoleSwitched)
ROUTE_EVENTS = (RouteDecided, KvStageOrdered)
PLAN_EVENTS = (ModelFitted, PlanEvaluated, RoleSwitchOrdered)
CMD_EVENTS = (SwitchRole,)
CLOCK_EVENTS = (Tick,)
ANOMALY_EVENTS = (AnomalyReported,)


def subject_for(event: Event, partition: str = DEFAULT_PARTITION, shadow: str | None = None) -> str:
    """The subject an event is published on."""
    p = token(partition)
    if shadow is not None:
        return f"{shadow_prefix(partition, shadow)}.{type(event).__name__.lower()}"
    if isinstance(event, AGENT_EVENTS):
        return f"ei.{p}.agent.{token(event.branch)}"
    if isinstance(event, KV_EVENTS):
        node = event.dst_node if isinstance(event, (KvMoved, KvFetched)) else event.node
        return f"ei.{p}.kv.{token(node)}"
    if isinstance(event, NODE_EVENTS):
        return f"ei.{p}.node.{token(event.node)}"
    if isinstance(event, ROUTE_EVENTS):
        return f"ei.{p}.route"
    if isinstance(event, PLAN_EVENTS):
        return f"ei.{p}.plan"
    if isinstance(event, CMD_EVENTS):
        return cmd_subject(partition, event.node)
    if isinstance(event, CLOCK_EVENTS):
        return f"ei.{p}.clock"
    if isinstance(event, ANOMALY_EVENTS):
        return f"ei.{p}.anomaly.{token(event.component)}"
    raise TypeError(f"no subject for event type {type(event).__name__}")
