"""Command-line options of the live processes, parsed once at their entry points.

* the bus options every live process shares: ``--nats-url`` (one server or a comma-separated
  cluster), ``--partition``, ``--stream-replicas`` and the credentials options
  (services.adapters.bus.security.add_cli_options). The entry point (``evolving serve``,
  ``evolving up``, the gateway, the engine worker, ``evolving sql --live``) turns them into the
  typed value the adapters take: :func:`bus_auth` gives a
  :class:`~services.adapters.bus.security.BusAuth`, whose ``credentials()`` the bus connects with;
* a service's options (``evolving serve NAME``): the common ones, then its row's of the services
  table (services/drivers/services.py).

Nothing here starts anything, so ``evolving --help`` can build every parser without loading the
runner, the recorder or DuckDB.
"""

from __future__ import annotations

import argparse
import os

from services.adapters.bus.security import BusAuth, add_cli_options
from services.drivers.services import SERVICES

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


def bus_auth(args: argparse.Namespace) -> BusAuth:
    """The credentials options of ``args`` (add_cli_options's; absent ones: not given)."""
    return BusAuth(**{field: getattr(args, option, None) for field, option in AUTH_OPTIONS.items()})


def add_common(p: argparse.ArgumentParser) -> None:
    add_bus_args(p)
    p.add_argument("--metrics-port", type=int, default=None,
                   help="serve /metrics and /healthz on this port (0: a free port; default: off)")
    p.add_argument("--metrics-host", default="127.0.0.1")
    p.add_argument("--snapshot-every", type=int, default=5000, help="events between snapshots")
    p.add_argument("--snapshot-interval-s", type=float, default=5.0, help="seconds between snapshots")


def add_service_args(p: argparse.ArgumentParser, kind: str) -> None:
    """The options of ``evolving serve KIND``: the common ones, then its row's."""
    add_common(p)
    for option in SERVICES[kind].options:
        p.add_argument(*option.flags, **option.kwargs)
