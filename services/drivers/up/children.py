"""What ``evolving up`` starts, shared by one partition (launch.py) and several (partitions.py):
a child process, its environment, the groups the children stop in, and the run configuration
``up`` writes into each DuckDB log before the recorder starts."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from services.drivers.services import CONFIG_KEYS, SERVICES
from services.drivers.up.options import plugin_options

if TYPE_CHECKING:
    from services.drivers.up.options import UpSpec

REPO = Path(__file__).resolve().parents[3]

# Stop order: higher groups stop first.
G_RECORDER, G_SERVICE, G_ENGINE, G_GATEWAY = 0, 1, 2, 3
# Engine servers a worker attaches to (vLLM): started first (they load for minutes), stopped after
# their workers. Not on the bus.
G_SERVER = -1


@dataclass
class Child:
    name: str
    cmd: list[str]
    group: int
    log_path: Path
    proc: subprocess.Popen | None = None
    restarts: int = 0
    backoff_s: float = 1.0
    down_since: float | None = None
    env: dict[str, str] | None = None  # set over the common environment (a server's threads, its mode)
    bus: bool = True  # a NATS client (gets --nats-credentials); False: an engine server

    def start(self, env: dict[str, str]) -> None:
        with open(self.log_path, "ab") as out:
            self.proc = subprocess.Popen(self.cmd, cwd=REPO, env={**env, **(self.env or {})}, stdout=out,
                                         stderr=subprocess.STDOUT, start_new_session=True)  # Ctrl-C reaches only `up`

    @property
    def state(self) -> str:
        if self.proc is None:
            return "not started"
        rc = self.proc.poll()
        return "running" if rc is None else f"exited {rc}"


def child_env(environ: dict[str, str] | None = None, path: list[str] | None = None) -> dict[str, str]:
    """The environment of every child: the parent's, with ``PYTHONPATH`` = the repository root,
    then the parent's own import path (``sys.path`` entries that the interpreter does not add by
    itself, then ``PYTHONPATH``), made absolute (children run in the repository root). A plug-in
    that ``up`` can import is thus importable in the service that runs it."""
    environ = dict(os.environ if environ is None else environ)
    path = sys.path if path is None else path
    own = tuple(os.path.join(os.path.abspath(p), "") for p in {sys.prefix, sys.base_prefix, sys.exec_prefix})
    entries = [str(REPO)]
    for raw in [*path, *environ.get("PYTHONPATH", "").split(os.pathsep)]:
        if not raw:
            continue
        entry = os.path.abspath(raw)
        if os.path.join(entry, "").startswith(own) or entry in entries:
            continue  # the interpreter's own library and site-packages: every child has them
        entries.append(entry)
    return {**environ, "PYTHONPATH": os.pathsep.join(entries), "EI_LOG_FORMAT": "json"}


def run_config(spec: UpSpec) -> dict:
    """The ``run_config`` that ``evolving verify`` reads (docs/recorder.md): each decision
    service's entry (services/drivers/services.py), the cores, and how the run was started."""
    return {
        **{key: SERVICES[key].entry(plugin_options(spec)) for key in CONFIG_KEYS},
        "cores": list(CONFIG_KEYS),
        "live": {"engines": spec.engines, "engine_backend": spec.engine_kind,
                 "model": spec.model, "prefill": spec.prefill, "time_scale": spec.time_scale,
                 "shadows": list(spec.shadow), "partition": spec.partition},
    }
