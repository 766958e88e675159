"""The bus options are parsed once, at the entry point, into a typed ``BusAuth``; the adapters
get ``Credentials`` from it: flags over the credentials file over the environment."""

from __future__ import annotations

import argparse
import json

import pytest

from services.adapters.bus.options import AUTH_OPTIONS, add_bus_args, bus_auth
from services.adapters.bus.security import BusAuth, Credentials, CredentialsError


def _parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_bus_args(p)
    return p.parse_args(list(argv))


def test_every_credentials_option_lands_in_its_field(tmp_path):
    args = _parse("--nats-user", "u", "--nats-password-file", "pw", "--nats-credentials", "c.json",
                  "--nats-creds", "x.creds", "--nats-tls-ca", "ca", "--nats-tls-cert", "cert", "--nats-tls-key", "key")
    assert bus_auth(args) == BusAuth(user="u", password_file="pw", credentials_file="c.json", creds_file="x.creds",
                                     tls_ca="ca", tls_cert="cert", tls_key="key")
    assert set(AUTH_OPTIONS) == set(BusAuth.__dataclass_fields__)


def test_a_parser_without_the_options_gives_no_credentials():
    assert bus_auth(argparse.Namespace(nats_url="nats://x")) == BusAuth()
    assert BusAuth().credentials(env={}).empty


def test_flags_over_the_file_over_the_environment(tmp_path):
    (tmp_path / "pw").write_text("from-flag-file\n")
    (tmp_path / "c.json").write_text(json.dumps({"user": "file-user", "password": "file-pw", "tls_ca": "file-ca"}))
    env = {"EI_NATS_USER": "env-user", "EI_NATS_TOKEN": "env-token", "EI_NATS_TLS_CA": "env-ca"}
    auth = BusAuth(user="flag-user", password_file=str(tmp_path / "pw"), credentials_file=str(tmp_path / "c.json"))
    assert auth.credentials(env) == Credentials(user="flag-user", password="from-flag-file", token="env-token",
                                                tls_ca="file-ca")
    assert BusAuth(credentials_file=str(tmp_path / "c.json")).credentials(env).user == "file-user"
    assert BusAuth().credentials(env).user == "env-user"


def test_an_unreadable_file_is_one_line(tmp_path):
    with pytest.raises(CredentialsError, match="cannot read --nats-password-file"):
        BusAuth(password_file=str(tmp_path / "missing")).credentials({})
    with pytest.raises(CredentialsError, match="cannot read NATS credentials file"):
        BusAuth(credentials_file=str(tmp_path / "missing.json")).credentials({})
