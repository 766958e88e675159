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


_AGENT = (BranchOpened, RequestSubmitted, ContextCompacted, BranchEnded, RequestCancelled)
_KV = (KvStored, KvEvicted, KvFetched)
_NODE = (NodeRegistered, NodeHeartbeat, NodeRemoved, IterationDone, RequestStarted, FirstToken,
         RequestFinished, RoleSwitched)
_PLAN = (ModelFitted, PlanEvaluated, RoleSwitchOrdered)


def subject_for(event: Event, partition: str = DEFAULT_PARTITION, shadow: str | None = None) -> str:
    """The subject an event is published on."""
    p = token(partition)
    if shadow is not None:
        return f"{shadow_prefix(partition, shadow)}.{type(event).__name__.lower()}"
    if isinstance(event, _AGENT):
        return f"ei.{p}.agent.{token(event.branch)}"
    if isinstance(event, _KV):
        node = event.dst_node if isinstance(event, KvFetched) else event.node
        return f"ei.{p}.kv.{token(node)}"
    if isinstance(event, KvMoved):
        return f"ei.{p}.kv.{token(event.dst_node)}"
    if isinstance(event, _NODE):
        return f"ei.{p}.node.{token(event.node)}"
    if isinstance(event, (RouteDecided, KvStageOrdered)):
        return f"ei.{p}.route"
    if isinstance(event, _PLAN):
        return f"ei.{p}.plan"
    if isinstance(event, SwitchRole):
        return cmd_subject(partition, event.node)
    if isinstance(event, Tick):
        return f"ei.{p}.clock"
    if isinstance(event, AnomalyReported):
        return f"ei.{p}.anomaly.{token(event.component)}"
    raise TypeError(f"no subject for event type {type(event).__name__}")
