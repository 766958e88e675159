"""The compose deployment's bus without Docker: deploy/nats/nats.conf with
the secrets ``python -m services.drivers.up.compose_secrets`` generates, on three real nats-servers
(loopback addresses 127.0.0.1-3 stand for nats-1..3, same ports as in compose's network):
the routes authenticate and form one JetStream cluster, ``bus-init`` creates the R3 stream with
the admin account, a service account does its part, and an anonymous client, a forged command
and a stream purge by a service are refused."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import nats
import pytest

from events import codec
from events.catalog import RouteDecided, SwitchRole
from events.subjects import subject_for
from services.adapters.bus import NatsBus
from services.adapters.bus.natsserver import NatsServerError, find_nats_server, free_port
from services.adapters.bus.security import Credentials, generate_accounts
from services.drivers.up.compose_secrets import COMPOSE_SPECS, nats_include

REPO = Path(__file__).resolve().parents[2]
HOSTS = ("127.0.0.1", "127.0.0.2", "127.0.0.3")


@pytest.fixture
def compose_bus(tmp_path):
    try:
        binary = find_nats_server()
    except NatsServerError as exc:
        pytest.skip(str(exc))
    client, route, http = free_port(), free_port(), free_port()
    accounts = generate_accounts("default", COMPOSE_SPECS)
    include = nats_include(accounts, "route-secret", servers=HOSTS, port=route)
    template = (REPO / "deploy" / "nats" / "nats.conf").read_text()
    procs = []
    try:
        for i, host in enumerate(HOSTS, 1):
            d = tmp_path / f"nats-{i}"
            d.mkdir()
            conf = template
            for old, new in (("0.0.0.0:4222", f"{host}:{client}"), ("0.0.0.0:6222", f"{host}:{route}"),
                             ("127.0.0.1:8222", f"{host}:{http}"), ("store_dir: /data", f"store_dir: {d / 'js'}")):
                assert conf.count(old) == 1, old
                conf = conf.replace(old, new)
            (d / "nats.conf").write_text(conf)
            (d / "auth.conf").write_text(include)  # where compose mounts the nats-auth secret
            procs.append(subprocess.Popen([binary, "-c", str(d / "nats.conf"), "-l", str(d / "nats.log")],
                                          env={"NATS_SERVER_NAME": f"nats-{i}"}))
        urls = ",".join(f"nats://{h}:{client}" for h in HOSTS)
        yield urls, accounts, tmp_path
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def _creds_file(tmp_path: Path, accounts, user: str) -> Path:
    acc = accounts[user]
    path = tmp_path / f"nats-{user}.json"
    path.write_text(json.dumps({"user": acc.user, "password": acc.password,
                                "inbox_prefix": acc.credentials().inbox_prefix}))
    return path


def test_the_compose_bus_is_a_secured_r3_cluster(compose_bus):
    urls, accounts, tmp_path = compose_bus
    env = {**os.environ, "EI_NATS_URL": urls, "EI_STREAM_REPLICAS": "3",
           "EI_NATS_CREDENTIALS_FILE": str(_creds_file(tmp_path, accounts, "admin"))}
    t0 = time.monotonic()
    init = subprocess.run([sys.executable, "-m", "services.drivers.up.businit", "--timeout-s", "60"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120, check=False)
    assert init.returncode == 0, init.stdout + init.stderr
    assert "EI_DEFAULT: 3 replica(s)" in init.stdout, init.stdout
    assert time.monotonic() - t0 < 60
    asyncio.run(_attacks(urls, accounts))


async def _attacks(urls: str, accounts) -> None:
    with pytest.raises(Exception, match="(?i)authoriz"):
        await nats.connect(urls.split(","), allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=2)
    router = await NatsBus.connect(urls, credentials=Credentials(**_fields(accounts["router"])), name="router")
    gateway = await NatsBus.connect(urls, credentials=Credentials(**_fields(accounts["gateway"])), name="gateway")
    try:
        info = await router.js.stream_info(router.stream)
        assert info.config.num_replicas == 3 and len(info.cluster.replicas or []) == 2  # leader + 2
        before = await router.last_seq()
        assert await router.publish(RouteDecided(ts=1.0, request="r1", prefill_node="n1", decode_node="n2")) \
            == before + 1
        forged = SwitchRole(ts=1.0, node="n1", to_role="decode")
        with pytest.raises((TimeoutError, nats.errors.TimeoutError, nats.errors.NoRespondersError)):
            await gateway.js.publish(subject_for(forged, "default"), codec.encode(forged), headers=codec.headers(),
                                     timeout=2)
        with pytest.raises((TimeoutError, nats.errors.TimeoutError)):
            await asyncio.wait_for(gateway.js.purge_stream(gateway.stream), 2)
        assert await router.last_seq() == before + 1
    finally:
        await router.close()
        await gateway.close()


def _fields(acc) -> dict:
    c = acc.credentials()
    return {"user": c.user, "password": c.password, "inbox_prefix": c.inbox_prefix}
