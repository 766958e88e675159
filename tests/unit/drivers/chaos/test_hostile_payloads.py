"""The hostile suite's attacker covers every event type, and forges only: nothing it sends on a
subject is admitted by the event authority (services/drivers/chaos/hostile.py)."""

from __future__ import annotations

import typing

from events import codec
from events.authority import Admission
from events.catalog import AnyEvent
from services.adapters.bus.port import subject_matches
from services.adapters.bus.security import ServiceSpec, service_permissions
from services.drivers.chaos.hostile import _payloads, attack_subjects, forged_events


def test_every_event_type_is_forged():
    assert {type(e) for e in forged_events(1.0, "n1")} == set(typing.get_args(AnyEvent))


def test_nothing_the_attacker_sends_is_admitted():
    """What the server lets an account publish (its permissions) the authority refuses."""
    nodes = ["n0", "n1"]
    specs = {"gateway": ServiceSpec("gateway", "gateway"), "engine-n0": ServiceSpec("engine", "engine-n0", node="n0"),
             "planner": ServiceSpec("planner", "planner"), "router": ServiceSpec("router", "router"),
             "directory": ServiceSpec("directory", "directory")}
    for account, spec in specs.items():
        own = spec.node
        allowed = service_permissions(spec, "default").publish
        adm = Admission(clock=1000.0)
        for subject in attack_subjects("default", nodes):
            if not any(subject_matches(p, subject) for p in allowed):
                continue  # the server denies it
            for kind, data, hdrs in _payloads(account, own, subject, nodes, 1000.0):
                try:
                    codec.check_schema(hdrs.get(codec.SCHEMA_HEADER))
                    ev = codec.decode(data)
                except codec.CodecError:
                    continue  # dead-lettered before any fold
                assert adm.reason(ev, subject) is not None, (account, subject, kind)
