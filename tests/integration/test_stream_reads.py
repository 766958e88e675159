"""Each account reads only what its row of ``READS`` grants, on a real
nats-server: the consumers an account may create (filters, durable, ephemeral) are enforced by
the server, tokens are read by the gateway alone, and an engine cannot publish decisions.

A refused JetStream call has two witnesses: the client gets no answer (a timeout) and the
server reports a permissions violation on that subject to the client's error callback."""

from __future__ import annotations

import asyncio
import json

import nats
import pytest
from nats.js import api

from events import codec
from events.catalog import ModelFitted, NodeHeartbeat, RouteDecided, SwitchRole, Tick
from events.subjects import stream_name, subject_for
from services.adapters.bus import NatsBus
from services.adapters.bus.natsserver import EmbeddedNats
from services.adapters.bus.security import (
    READS,
    ServiceSpec,
    generate_accounts,
    service_permissions,
)
from services.drivers.services import SERVICES

P = "rd"
STREAM = stream_name(P)
WHOLE = f"ei.{P}.>"
SPECS = [ServiceSpec("directory", "directory"), ServiceSpec("planner", "planner"),
         ServiceSpec("router", "router"), ServiceSpec("router", "shadow-ca", shadow="cache_aware"),
         ServiceSpec("recorder", "recorder"), ServiceSpec("gateway", "gateway"),
         ServiceSpec("engine", "engine-n1", node="n1"), ServiceSpec("operator", "operator")]
ROLE = {s.name: s.role for s in SPECS}


@pytest.fixture(scope="module")
def secured():
    accounts = generate_accounts(P, SPECS)
    with EmbeddedNats(accounts=accounts) as srv:

        async def seed() -> None:  # the admin creates the streams and puts one event on them
            admin = await NatsBus.connect(srv.url, P, credentials=accounts["admin"].credentials(), name="admin")
            await admin.publish(RouteDecided(ts=1.0, request="r0", prefill_node="n1", decode_node="n1"))
            await admin.close()

        asyncio.run(seed())
        yield srv, accounts


class Client:
    """A raw nats-py client of one account that keeps the server's permission errors."""

    def __init__(self, nc, errors: list[str]) -> None:
        self.nc, self.errors = nc, errors
        self.js = nc.jetstream(timeout=1.0)

    @classmethod
    async def of(cls, secured, user: str) -> Client:
        srv, accounts = secured
        errors: list[str] = []

        async def on_error(exc) -> None:
            errors.append(str(exc).lower())

        nc = await nats.connect(srv.url, error_cb=on_error, allow_reconnect=False,
                                **accounts[user].credentials().connect_options())
        return cls(nc, errors)

    def violated(self, subject: str) -> bool:
        return any("permissions violation" in e and subject.lower() in e for e in self.errors)

    async def create(self, filt: str | None, *, name: str | None = None, durable: str | None = None,
                     filters: list[str] | None = None) -> bool:
        """Whether the server created the consumer (refused: no answer within the timeout)."""
        cfg = api.ConsumerConfig(name=name, durable_name=durable, filter_subject=filt, filter_subjects=filters,
                                 ack_policy=api.AckPolicy.NONE if durable is None else api.AckPolicy.ALL,
                                 mem_storage=True, inactive_threshold=5.0 if durable is None else None)
        try:
            await self.js.add_consumer(STREAM, config=cfg)
        except (TimeoutError, nats.errors.TimeoutError, nats.errors.NoRespondersError):
            return False
        return True


async def _clients(secured, users):
    return {u: await Client.of(secured, u) for u in users}


def test_the_table_is_the_one_source():
    """The services' ``consumes`` is their account's row; no account but the admin's is granted a
    consumer-create subject the server cannot check (legacy or unfiltered)."""
    for kind in SERVICES.values():
        assert kind.consumes == READS[kind.role].filters
    assert READS["gateway"].filters == ("ei.<p>.route", "ei.<p>.node.*", "ei.<p>.agent.>")
    assert not READS["gateway"].durable
    assert READS["operator"].filters == ()
    for spec in SPECS:
        allow = service_permissions(spec, P, [s.name for s in SPECS]).publish
        user = spec.name
        creates = [s for s in allow
                   if s.startswith((f"$JS.API.CONSUMER.CREATE.{STREAM}", "$JS.API.CONSUMER.DURABLE.CREATE"))]
        assert f"$JS.API.CONSUMER.CREATE.{STREAM}" not in creates
        assert f"$JS.API.CONSUMER.CREATE.{STREAM}.*" not in creates
        assert f"$JS.API.CONSUMER.CREATE.{STREAM}.{user}" not in creates
        assert not any(s.startswith("$JS.API.CONSUMER.DURABLE.CREATE") for s in creates), creates
        assert all(len(s.split(".")) > 6 for s in creates), creates  # every one names its filter


async def test_a_service_account_cannot_create_a_consumer_over_the_whole_stream(secured):
    """An ephemeral ``ei.<p>.>`` consumer, and every unchecked create form, is refused unless the
    account's row grants it (the engines' worker view); the durables read the whole partition
    under their own name only."""
    clients = await _clients(secured, [s.name for s in SPECS])
    try:
        async def probe(user: str, c: Client) -> dict:
            reads = READS[ROLE[user]]
            got = {
                "ephemeral_whole": await c.create(WHOLE, name=f"x-{user}"),
                "legacy_ephemeral": await c.create(WHOLE),  # $JS.API.CONSUMER.CREATE.<stream>
                "legacy_durable": await c.create(WHOLE, durable=user),  # ...DURABLE.CREATE.<stream>.<name>
                "unfiltered": await c.create(None, name=f"y-{user}"),  # ...CREATE.<stream>.<name>
                "multi_filter": await c.create(None, name=f"z-{user}", filters=[f"ei.{P}.route", f"ei.{P}.plan"]),
                "own_durable_whole": await c.create(WHOLE, name=user, durable=user),
                "foreign_durable": await c.create(WHOLE, name="planner" if user != "planner" else "router",
                                                  durable="planner" if user != "planner" else "router"),
            }
            whole = reads.ephemeral and WHOLE in reads.subjects(P)
            # the server checks subjects, not the config: whoever may create an ephemeral consumer
            # on a filter may also make it durable (docs/security.md, "What is not covered")
            want = {"ephemeral_whole": whole, "legacy_ephemeral": False, "legacy_durable": False, "unfiltered": False,
                    "multi_filter": False, "own_durable_whole": reads.durable or whole, "foreign_durable": False}
            return {"user": user, "got": got, "want": want}

        results = await asyncio.gather(*(probe(u, c) for u, c in clients.items()))
        for r in results:
            assert r["got"] == r["want"], r
        # the refusals are the server's: a permissions violation on the create subject
        gw = clients["gateway"]
        assert gw.violated(f"$JS.API.CONSUMER.CREATE.{STREAM}.x-gateway.{WHOLE}")
        assert gw.violated(f"$JS.API.CONSUMER.CREATE.{STREAM}")
        assert clients["directory"].violated(f"$JS.API.CONSUMER.CREATE.{STREAM}.x-directory.{WHOLE}")
        assert not clients["engine-n1"].violated(f"x-engine-n1.{WHOLE}")  # its row grants it
    finally:
        for c in clients.values():
            await c.nc.close()


async def test_the_gateway_reads_route_decisions_only_and_cannot_hijack_a_durable(secured):
    c = await Client.of(secured, "gateway")
    try:
        assert await c.create(f"ei.{P}.route", name="gw-route")
        # RequestFinished errors (node.*) and its branch table at start (agent.>), nothing else
        assert await c.create(f"ei.{P}.node.*", name="gw-node")
        assert await c.create(f"ei.{P}.agent.>", name="gw-agent")
        assert not await c.create(f"ei.{P}.kv.>", name="gw-kv")
        assert not await c.create(f"ei.{P}.*", name="gw-star")
        # a config whose filter is not the one in the subject: the server refuses it (400)
        req = {"stream_name": STREAM, "config": {"name": "gw-lie", "filter_subject": WHOLE, "ack_policy": "none"}}
        msg = await c.nc.request(f"$JS.API.CONSUMER.CREATE.{STREAM}.gw-lie.ei.{P}.route", json.dumps(req).encode(),
                                 timeout=2)
        assert json.loads(msg.data)["error"]["err_code"] == 10131  # filtered subject mismatch
        # re-creating the router's durable with its own filter (an update) is denied by name
        assert not await c.create(f"ei.{P}.route", name="router", durable="router")
        assert not await c.create(f"ei.{P}.route", name="router")
    finally:
        await c.nc.close()


async def test_each_service_still_folds_through_the_consumers_its_row_grants(secured):
    """The real NatsBus paths: every durable reads the whole partition, the gateway its route
    watcher, the engine its ephemeral view; the operator reads nothing."""
    srv, accounts = secured
    buses = {s.name: await NatsBus.connect(srv.url, P, credentials=accounts[s.name].credentials(), name=s.name,
                                           ensure=False) for s in SPECS}
    try:
        async def first(bus: NatsBus, durable: str | None, subjects: str | None = None) -> int:
            async with bus.consumer(durable, start_seq=1, subjects=subjects) as c:
                async for d in c:
                    return d.seq
            return 0

        for name in ("directory", "planner", "router", "shadow-ca", "recorder"):
            assert await asyncio.wait_for(first(buses[name], name), 10) == 1, name
        assert await asyncio.wait_for(first(buses["gateway"], None, f"ei.{P}.route"), 10) == 1
        assert await asyncio.wait_for(first(buses["engine-n1"], None), 10) == 1
        buses["operator"].js._timeout = 1.0
        with pytest.raises((TimeoutError, nats.errors.TimeoutError)):
            await asyncio.wait_for(first(buses["operator"], None), 5)
    finally:
        for b in buses.values():
            await b.close()


async def test_tokens_reach_the_gateway_alone_and_come_from_engines_alone(secured):
    users = [s.name for s in SPECS]
    clients = await _clients(secured, users)
    try:
        got: dict[str, list[bytes]] = {u: [] for u in users}
        for u, c in clients.items():
            async def cb(msg, u=u):
                got[u].append(msg.data)

            await c.nc.subscribe(f"eitok.{P}.>", cb=cb)
            await c.nc.flush()
        await clients["engine-n1"].nc.publish(f"eitok.{P}.r1", b"secret tokens")
        for u in users:  # nobody else may feed the gateway tokens
            if ROLE[u] != "engine":
                await clients[u].nc.publish(f"eitok.{P}.r1", b"forged by " + u.encode())
        for c in clients.values():
            await c.nc.flush()
        await asyncio.sleep(0.5)
        assert got["gateway"] == [b"secret tokens"], got["gateway"]
        assert got["engine-n1"] == [], got["engine-n1"]
        for u in users:
            if ROLE[u] not in ("gateway", "engine"):
                assert got[u] == [], (u, got[u])
                assert clients[u].violated(f"eitok.{P}.>"), (u, clients[u].errors)
        assert clients["engine-n1"].violated(f"eitok.{P}.>")  # an engine publishes tokens, never reads them
        assert clients["router"].violated(f"eitok.{P}.r1")  # and only engines publish them
    finally:
        for c in clients.values():
            await c.nc.close()


async def test_an_engine_cannot_publish_decisions(secured):
    srv, accounts = secured
    engine = await NatsBus.connect(srv.url, P, credentials=accounts["engine-n1"].credentials(), name="engine",
                                   ensure=False)
    admin = await NatsBus.connect(srv.url, P, credentials=accounts["admin"].credentials(), name="admin")
    try:
        before = await admin.last_seq()
        decisions = [RouteDecided(ts=2.0, request="r2", prefill_node="n1", decode_node="n1"),
                     SwitchRole(ts=2.0, node="n1", to_role="decode"),
                     ModelFitted(ts=2.0, node="n1", phase="prefill"),
                     Tick(ts=2.0)]

        async def refused(event, shadow=None) -> bool:
            try:
                await engine.js.publish(subject_for(event, P, shadow), codec.encode(event), headers=codec.headers(),
                                        timeout=1.0)
            except (TimeoutError, nats.errors.TimeoutError, nats.errors.NoRespondersError):
                return True
            return False

        assert all(await asyncio.gather(*(refused(e) for e in decisions)))
        assert await refused(decisions[0], shadow="sneaky")
        assert await engine.publish(NodeHeartbeat(ts=2.0, node="n1", role="prefill")) == before + 1  # its own
        assert await admin.last_seq() == before + 1
    finally:
        await engine.close()
        await admin.close()
