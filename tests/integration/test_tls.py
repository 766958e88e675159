"""The TLS option end to end: a nats-server with a certificate from a private
CA, a client that trusts that CA connects and publishes; a client without it, or without
TLS, is refused. Certificates are made with the openssl command line for the test."""

from __future__ import annotations

import shutil
import subprocess

import nats
import pytest

from events.catalog import Tick
from services.adapters.bus import NatsBus
from services.adapters.bus.natsserver import EmbeddedNats
from services.adapters.bus.security import Credentials, ServiceSpec, generate_accounts

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="the openssl command is absent")


def make_certs(folder) -> dict[str, str]:
    def run(*args):
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=folder)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=ei-test-ca",
        "-keyout", "ca.key", "-out", "ca.pem")
    (folder / "san.cnf").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    run("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1", "-keyout", "server.key",
        "-out", "server.csr")
    run("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
        "-days", "2", "-extfile", "san.cnf", "-out", "server.pem")
    return {k: str(folder / v) for k, v in (("ca", "ca.pem"), ("cert", "server.pem"), ("key", "server.key"))}


async def test_tls_bus_accepts_a_client_that_trusts_its_ca_and_refuses_the_rest(tmp_path):
    certs = make_certs(tmp_path)
    accounts = generate_accounts("tls", [ServiceSpec("router", "router")])
    with EmbeddedNats(accounts=accounts, tls={"cert_file": certs["cert"], "key_file": certs["key"]}) as srv:
        url = srv.url.replace("nats://", "tls://")
        creds = accounts["admin"].credentials(tls_ca=certs["ca"])
        bus = await NatsBus.connect(url, "tls", credentials=creds)
        try:
            assert await bus.publish(Tick(ts=1.0)) == 1
        finally:
            await bus.close()
        plain = Credentials(user="admin", password=accounts["admin"].password)
        with pytest.raises(Exception):  # noqa: B017 - no CA: certificate verification fails
            await nats.connect(url, allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=3,
                               **plain.connect_options())
        with pytest.raises(Exception):  # noqa: B017 - plain TCP to a TLS-required server
            await nats.connect(srv.url, allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=3,
                               tls=None, **plain.connect_options())
