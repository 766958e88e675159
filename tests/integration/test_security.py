"""A secured bus, on a real nats-server: no anonymous client, and every service confined to
its subjects. Each refusal is checked twice: the client is told, and the
stream did not change."""

from __future__ import annotations

import asyncio

import nats
import pytest

from events import codec
from events.catalog import NodeHeartbeat, RouteDecided, SwitchRole
from events.subjects import stream_name, subject_for
from services.adapters.bus import NatsBus
from services.adapters.bus.nats_prompts import NatsPromptStore
from services.adapters.bus.natsserver import EmbeddedNats
from services.adapters.bus.prompts import prompt_key
from services.adapters.bus.security import (
    Credentials,
    CredentialsError,
    ServiceSpec,
    generate_accounts,
    prompt_bucket,
    service_permissions,
    write_credentials,
)

P = "sec"
SPECS = [ServiceSpec("directory", "directory"), ServiceSpec("planner", "planner"),
         ServiceSpec("router", "router"), ServiceSpec("router", "shadow-ca", shadow="cache_aware"),
         ServiceSpec("recorder", "recorder"), ServiceSpec("gateway", "gateway"),
         ServiceSpec("engine", "engine-n1", node="n1"), ServiceSpec("engine", "engine-n2", node="n2")]


@pytest.fixture(scope="module")
def secured():
    accounts = generate_accounts(P, SPECS)
    with EmbeddedNats(accounts=accounts) as srv:
        # the streams are the admin's to create: made here, not by whichever test runs first on
        # this worker (under xdist the module's tests split across workers, and a test that
        # connects as a service first found no stream: STREAM.CREATE is refused to it)
        async def create() -> None:
            admin = await NatsBus.connect(srv.url, P, credentials=accounts["admin"].credentials(), name="admin")
            await admin.close()

        asyncio.run(create())
        yield srv, accounts


async def connect(secured, user: str) -> NatsBus:
    srv, accounts = secured
    return await NatsBus.connect(srv.url, P, credentials=accounts[user].credentials(), name=user)


async def refused(bus: NatsBus, event, timeout: float = 1.0) -> bool:
    """Publishing ``event`` gets no JetStream ack (the server answers with a permissions error)."""
    try:
        await bus.js.publish(subject_for(event, P), codec.encode(event), headers=codec.headers(), timeout=timeout)
    except (TimeoutError, nats.errors.TimeoutError, nats.errors.NoRespondersError):
        return True
    return False


async def test_an_unauthenticated_or_wrong_password_client_cannot_connect(secured):
    srv, _ = secured
    for opts in ({}, {"user": "router", "password": "not-the-password"}):
        with pytest.raises(Exception, match="(?i)authoriz"):
            await nats.connect(srv.url, allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=2, **opts)


async def test_each_service_publishes_its_own_events_and_nothing_else(secured):
    admin = await connect(secured, "admin")  # creates the streams
    router, engine, planner = [await connect(secured, u) for u in ("router", "engine-n1", "planner")]
    try:
        before = await admin.last_seq()
        decided = RouteDecided(ts=1.0, request="r1", prefill_node="n1", decode_node="n2")
        assert await router.publish(decided) == before + 1
        assert await engine.publish(NodeHeartbeat(ts=1.0, node="n1", role="prefill")) == before + 2
        assert await planner.publish(SwitchRole(ts=1.0, node="n1", to_role="decode")) == before + 3
        assert await refused(router, SwitchRole(ts=2.0, node="n1", to_role="decode"))  # forge a command
        assert await refused(engine, NodeHeartbeat(ts=2.0, node="n2", role="prefill"))  # speak for another node
        assert await refused(engine, decided)  # forge a routing decision
        assert await admin.last_seq() == before + 3  # nothing refused was stored
    finally:
        for b in (router, engine, planner, admin):
            await b.close()


async def test_a_shadow_router_cannot_act_and_the_gateway_cannot_purge(secured):
    admin = await connect(secured, "admin")
    shadow, gateway = await connect(secured, "shadow-ca"), await connect(secured, "gateway")
    try:
        decided = RouteDecided(ts=1.0, request="r9", prefill_node="n1", decode_node="n2", shadow=True)
        assert await shadow.publish(decided, shadow="cache_aware") > 0
        assert await refused(shadow, decided)  # the in-charge subject is not its
        before = await admin.last_seq()
        with pytest.raises((nats.errors.TimeoutError, asyncio.TimeoutError)):
            await asyncio.wait_for(gateway.js.purge_stream(stream_name(P)), 2)
        assert await admin.last_seq() == before and (await admin.js.stream_info(stream_name(P))).state.messages
    finally:
        for b in (shadow, gateway, admin):
            await b.close()


async def test_snapshots_are_written_only_by_their_service(secured):
    router, planner = await connect(secured, "router"), await connect(secured, "planner")
    try:
        await router.put_snapshot("router", b"router-state")
        assert await router.get_snapshot("router") == b"router-state"
        with pytest.raises(Exception):  # noqa: B017 - nats-py raises a timeout or a JetStream API error
            await asyncio.wait_for(planner.put_snapshot("router", b"forged"), 5)
        assert await router.get_snapshot("router") == b"router-state"
    finally:
        await router.close()
        await planner.close()


async def test_only_the_gateway_reads_tokens_and_nobody_pulls_another_services_consumer(secured):
    srv, accounts = secured
    errors: list[str] = []

    async def on_error(exc):
        errors.append(str(exc))

    nc = await nats.connect(srv.url, error_cb=on_error, **accounts["router"].credentials().connect_options())
    engine, gateway = await connect(secured, "engine-n1"), await connect(secured, "gateway")
    router = await connect(secured, "router")
    try:
        got_router, got_gateway = [], []

        async def on_token(msg):
            got_router.append(msg.data)

        await nc.subscribe(f"eitok.{P}.>", cb=on_token)
        sub = await gateway.nc.subscribe(f"eitok.{P}.>")
        await nc.flush()
        await gateway.nc.flush()  # both subscriptions are known to the server before the publish
        await engine.nc.publish(f"eitok.{P}.r1", b"secret tokens")
        await engine.nc.flush()
        msg = await sub.next_msg(timeout=2)
        got_gateway.append(msg.data)
        await asyncio.sleep(0.2)
        assert got_gateway == [b"secret tokens"] and got_router == []
        assert any("permissions violation" in e.lower() for e in errors), errors
        # the router folds through its own durable, but may not pull the directory's (an event of
        # its own here: run alone or on another xdist worker than the test above, the stream is empty)
        await engine.publish(NodeHeartbeat(ts=1.0, node="n1", role="prefill"))
        async with router.consumer("router") as c:
            async for d in c:
                assert d.seq >= 1
                break
        with pytest.raises((nats.errors.TimeoutError, asyncio.TimeoutError)):
            await asyncio.wait_for(router.js.consumer_info(stream_name(P), "directory"), 2)
    finally:
        await nc.close()
        for b in (engine, gateway, router):
            await b.close()


async def test_only_the_gateway_writes_prompts_and_only_engines_read_them(secured):
    """The prompt bucket EI_PROMPTS_<P> (docs/engines.md, "Prompts"): the gateway creates it and
    puts token ids; an engine reads them and cannot write; a service account (the router) and
    the gateway itself cannot read them."""
    srv, accounts = secured
    ncs = {u: await nats.connect(srv.url, allow_reconnect=False, error_cb=_quiet,
                                 **accounts[u].credentials().connect_options())
           for u in ("gateway", "engine-n1", "router", "admin")}
    stores = {u: NatsPromptStore(nc, P, ttl_s=60, timeout_s=0.5) for u, nc in ncs.items()}
    key = f"$KV.{prompt_bucket(P)}.{prompt_key('r1')}"
    direct = f"$JS.API.DIRECT.GET.KV_{prompt_bucket(P)}.{key}"
    try:
        await stores["gateway"].put("r1", [11, 22, 33])
        assert await stores["engine-n1"].get("r1") == [11, 22, 33]
        with pytest.raises((TimeoutError, nats.errors.TimeoutError)):  # an engine cannot write
            await stores["engine-n1"].put("r2", [6, 6, 6])
        with pytest.raises((TimeoutError, nats.errors.TimeoutError)):  # nor purge the bucket
            await ncs["engine-n1"].jetstream(timeout=0.5).purge_stream(f"KV_{prompt_bucket(P)}")
        for u in ("router", "gateway"):  # neither a service account nor the gateway reads prompts
            with pytest.raises((TimeoutError, nats.errors.TimeoutError)):
                await ncs[u].request(direct, b"", timeout=0.5)
        with pytest.raises((TimeoutError, nats.errors.TimeoutError)):  # the router cannot even look
            await ncs["router"].jetstream(timeout=0.5).stream_info(f"KV_{prompt_bucket(P)}")
        assert await stores["admin"].get("r2") is None  # nothing the engine tried landed
        assert await stores["admin"].get("r1") == [11, 22, 33]
    finally:
        for nc in ncs.values():
            await nc.close()


async def _quiet(exc) -> None:
    """The refusals above are expected: nats-py reports each permission violation here."""


def test_permissions_deny_other_durables_and_grant_the_own_inbox():
    perms = service_permissions(ServiceSpec("router", "router"), P, ["router", "directory"])
    assert "$JS.API.CONSUMER.MSG.NEXT.EI_SEC.directory" in perms.deny_publish
    assert "$JS.API.CONSUMER.MSG.NEXT.EI_SEC.router" in perms.publish
    assert perms.subscribe == ("_INBOX_router.>",)
    assert not any(s.startswith("ei.sec.cmd") for s in perms.publish)


def test_credentials_from_files_and_env_with_clear_errors(tmp_path):
    accounts = generate_accounts(P, SPECS[:1])
    paths = write_credentials(accounts, tmp_path / "creds")
    assert oct(paths["directory"].stat().st_mode & 0o777) == "0o600"
    env = {"EI_NATS_CREDENTIALS_FILE": str(paths["directory"])}
    creds = Credentials.from_env(env)
    assert creds.user == "directory" and creds.password == accounts["directory"].password
    secret = tmp_path / "pw"
    secret.write_text("s3cret\n")
    assert Credentials.from_env({"EI_NATS_USER": "u", "EI_NATS_PASSWORD_FILE": str(secret)}).password == "s3cret"
    (tmp_path / "bad.json").write_text('{"user": "x", "pasword": "y"}')
    with pytest.raises(CredentialsError, match="unknown field.*pasword"):
        Credentials.from_file(tmp_path / "bad.json")
    with pytest.raises(CredentialsError, match="cannot read"):
        Credentials.from_env({"EI_NATS_CREDENTIALS_FILE": str(tmp_path / "missing.json")})
