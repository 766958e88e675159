"""The bus options every live process shares, and the typed value they become.

``--nats-url`` (one server or a comma-separated cluster), ``--partition``, ``--stream-replicas``
and the credentials options (:func:`~services.adapters.bus.security.add_cli_options`). Each
entry point (``evolving serve``, ``evolving up``, the gateway, the engine worker, ``evolving sql
--live``) parses them once and turns them into what the adapters take: :func:`bus_spec` gives a
:class:`BusSpec` (URL, partition, replicas and a :class:`~services.adapters.bus.security.BusAuth`,
whose ``credentials()`` the bus connects with).

They live beside the bus (not with the drivers) because every process that talks to the bus needs
them, the engine worker included, and none of those may import the services' drivers.
Nothing here connects or starts anything, so every ``--help`` can build its parser cheaply.

Layer 2 (adapter: NATS). May import: the standard library, ``.security``.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field

from services.adapters.bus.security import BusAuth, add_cli_options

DEFAULT_NATS_URL = "nats://127.0.0.1:4222"
#: BusAuth field -> the parsed option add_cli_options defines for it
AUTH_OPTIONS = {"user": "nats_user", "password_file": "nats_password_file", "credentials_file": "nats_credentials",
                "creds_file": "nats_creds", "tls_ca": "nats_tls_ca", "tls_cert": "nats_tls_cert",
                "tls_key": "nats_tls_key"}


def env_int(name: str, default: int) -> int:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        return int(raw)
    except ValueError:
        raise SystemExit(f"{name} must be an integer, got {raw!r}") from None


def add_bus_args(p: argparse.ArgumentParser) -> None:
    """``--nats-url`` (a comma-separated server list for a cluster), ``--partition``,
    ``--stream-replicas`` and the credentials options (services.adapters.bus.security.add_cli_options)."""
    p.add_argument("--nats-url", default=os.environ.get("EI_NATS_URL", DEFAULT_NATS_URL),
                   help="NATS server URL, or a comma-separated list of a cluster's servers (env EI_NATS_URL)")
    p.add_argument("--partition", default=os.environ.get("EI_PARTITION", "default"))
    p.add_argument("--stream-replicas", type=int, default=env_int("EI_STREAM_REPLICAS", 1),
                   help="replicas of the partition's stream and of this service's snapshot bucket "
                        "(3 on a 3-server cluster; env EI_STREAM_REPLICAS; default 1)")
    add_cli_options(p)


@dataclass(frozen=True, kw_only=True)
class BusSpec:
    """Where and as whom a process connects: its bus options parsed once (:func:`bus_spec`)."""

    nats_url: str = DEFAULT_NATS_URL  # one server, or a comma-separated cluster
    partition: str = "default"
    stream_replicas: int = 1  # of the partition's stream and the process's snapshot bucket
    auth: BusAuth = field(default_factory=BusAuth)


def bus_spec(args: argparse.Namespace) -> BusSpec:
    """The options :func:`add_bus_args` added, as a :class:`BusSpec`."""
    return BusSpec(nats_url=args.nats_url, partition=args.partition,
                   stream_replicas=getattr(args, "stream_replicas", 1) or 1, auth=bus_auth(args))


def bus_auth(args: argparse.Namespace) -> BusAuth:
    """The credentials options of ``args`` (add_cli_options's; absent ones: not given)."""
    return BusAuth(**{field: getattr(args, option, None) for field, option in AUTH_OPTIONS.items()})
