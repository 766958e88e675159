"""THE table of the live services: for each one, the cores it folds and how each is built, the
subjects it consumes and publishes, and its options.

=========  ==================================  =================================================
service    cores folded (CORES)                publishes (``<p>``: the partition)
=========  ==================================  =================================================
directory  ``directory``                       ``ei.<p>.anomaly.directory``
planner    ``planner`` (plug-in) +             ``ei.<p>.plan`` (ModelFitted, PlanEvaluated,
           ``liveness``                        RoleSwitchOrdered), ``ei.<p>.cmd.<node>``
                                               (SwitchRole), ``ei.<p>.node.<node>``
                                               (NodeRemoved), ``ei.<p>.clock`` (Tick every
                                               ``--tick-s``, the adapter's clock), anomalies
router     ``router`` (plug-in)                ``ei.<p>.route`` (RouteDecided), anomalies;
                                               ``--shadow NAME``: ``ei.<p>.shadow.NAME.route``
recorder   none (lands the stream in DuckDB)   nothing
=========  ==================================  =================================================

Every service consumes the whole partition, ``ei.<p>.>``, through its own durable consumer (a
shadow router's is ``shadow-NAME``): each core folds several subject families in the stream's
order, and a single filter is the only one the server can check. What each account may read
(:attr:`ServiceKind.consumes`) comes from its role's row of
``services.adapters.bus.security.READS``, which the secured bus enforces. Each service builds
the cores it folds from the table of cores (services/adapters/recipes.py, shared with
``evolving verify`` and the simulator) and writes the run_config entry it was started with to
the snapshot store under ``config.<key>`` (``config.shadow.NAME`` for a shadow router); the
recorder merges the non-shadow ones into the log's ``run_config``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from services.adapters.bus.security import READS
from services.adapters.plugins import PLANNER_GROUP, ROUTER_GROUP, canonical
from services.adapters.recipes import CORES, CoreRecipe


# ---------------------------------------------------------------------------- services
def parse_kv(items: Sequence[str] | None) -> dict[str, Any]:
    """``["k=v", ...]`` -> kwargs; a value that parses as JSON is taken as JSON (numbers,
    booleans, lists), else as a string."""
    out: dict[str, Any] = {}
    for item in items or ():
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"expected KEY=VALUE, got {item!r}")
        try:
            out[key] = json.loads(raw)
        except json.JSONDecodeError:
            out[key] = raw
    return out


@dataclass(frozen=True)
class Option:
    """One command-line option of a service: ``parser.add_argument(*flags, **kwargs)``."""

    flags: tuple[str, ...]
    kwargs: Mapping[str, Any] = field(default_factory=dict)

    @property
    def dest(self) -> str:
        """The parsed option's name, as argparse derives it (``--planner-arg`` -> ``planner_arg``)."""
        return self.kwargs.get("dest") or self.flags[0].lstrip("-").replace("-", "_")


def opt(*flags: str, **kwargs: Any) -> Option:
    return Option(flags, kwargs)


@dataclass(frozen=True)
class Fold:
    """One core a service folds: its recipe (a key of :data:`CORES`) and, for a core other
    than the service's own, which parsed options give its constructor keywords."""

    core: str
    args: Mapping[str, str] = field(default_factory=dict)  # keyword -> option (its destination)


@dataclass(frozen=True)
class ServiceConfig:
    """One service as started, from its parsed options (:meth:`ServiceKind.configure`)."""

    kind: str
    name: str  # durable consumer, snapshot key, message-id prefix: "router", "shadow-NAME"
    key: str  # the configuration snapshot ``config.<key>``: "router", "shadow.NAME"
    entry: Mapping[str, Any]  # its run_config entry ({"plugin", "kwargs"}; {} for the directory)
    runner_config: Mapping[str, Any]  # what the runner fingerprints into its snapshots
    core_kwargs: tuple[Mapping[str, Any], ...]  # constructor keywords of each folded core
    shadow: str | None = None


@dataclass(frozen=True)
class ServiceKind:
    """One row of :data:`SERVICES`."""

    name: str
    role: str  # its NATS account's role (services/adapters/bus/security.py)
    folds: tuple[Fold, ...]  # the cores, in fold order (a CoreStack when more than one); () records
    publishes: tuple[str, ...]  # subjects, ``<p>`` the partition
    options: tuple[Option, ...] = ()
    plugin: str | None = None  # the option naming its plug-in (``--router``; ``--router-arg`` K=V)
    group: str | None = None  # that plug-in's entry-point group (its synonyms resolve there)
    ticks: bool = False  # publishes Tick every --tick-s (the adapter's clock)
    shadow_publishes: tuple[str, ...] = ()  # with ``--shadow NAME`` instead of ``publishes``
    runner_args: tuple[str, ...] = ()  # options recorded in the runner's config besides the entry

    @property
    def consumes(self) -> tuple[str, ...]:
        """The filters of the consumers its account may create: its role's row of
        services.adapters.bus.security.READS, the one source (the server enforces it)."""
        return READS[self.role].filters

    @property
    def records(self) -> bool:
        """Folds no core: lands the stream in DuckDB (the recorder)."""
        return not self.folds

    @property
    def recipes(self) -> tuple[CoreRecipe, ...]:
        return tuple(CORES[f.core] for f in self.folds)

    def entry(self, row: Mapping[str, Any]) -> dict[str, Any]:
        """The run_config entry of this service's own core, from its row's options by name
        (``{"router": ..., "router_arg": [...]}``)."""
        if self.plugin is None:
            return {}
        name = row[self.plugin]
        if self.group is not None:
            name = canonical(self.group, name)  # the run_config records the canonical name
        return {"plugin": name, "kwargs": parse_kv(row[f"{self.plugin}_arg"])}

    def configure(self, row: Mapping[str, Any]) -> ServiceConfig:
        """The service as started with its row's options (``ServiceOptions.row``)."""
        entry = self.entry(row)
        name = key = self.name
        shadow = row.get("shadow") if self.shadow_publishes else None
        if shadow:
            entry["kwargs"].update(name=shadow, shadow=True)
            name, key = f"shadow-{shadow}", f"shadow.{shadow}"
        kwargs = tuple(entry.get("kwargs", {}) if i == 0 else {kw: row[a] for kw, a in f.args.items()}
                       for i, f in enumerate(self.folds))
        runner = {**entry, **{a: row[a] for a in self.runner_args}}
        return ServiceConfig(self.name, name, key, entry, runner, kwargs, shadow)


SERVICES: dict[str, ServiceKind] = {
    "directory": ServiceKind(
        "directory", "directory", (Fold("directory"),), ("ei.<p>.anomaly.directory",)),
    "planner": ServiceKind(
        "planner", "planner", (Fold("planner"), Fold("liveness", {"timeout_s": "heartbeat_timeout_s"})),
        ("ei.<p>.plan", "ei.<p>.cmd.<node>", "ei.<p>.node.<node>", "ei.<p>.clock", "ei.<p>.anomaly.planner",
         "ei.<p>.anomaly.liveness"),
        options=(
            opt("--planner", default="evolving", help="planner plug-in name (evolving.planners)"),
            opt("--planner-arg", action="append", default=[], metavar="K=V"),
            opt("--tick-s", type=float, default=1.0, help="Tick period, wall clock (0: no ticks)"),
            opt("--heartbeat-timeout-s", type=float, default=10.0,
                help="NodeRemoved after this long without a node event (0: never)"),
            opt("--time-scale", type=float, default=1.0,
                help="Tick ts = epoch + (wall - epoch) * scale (match the engines' --time-scale)"),
            opt("--clock-epoch", type=float, default=None, help="epoch of the scaled clock (default: now)"),
        ),
        plugin="planner", group=PLANNER_GROUP, ticks=True, runner_args=("heartbeat_timeout_s",)),
    "router": ServiceKind(
        "router", "router", (Fold("router"),), ("ei.<p>.route", "ei.<p>.anomaly.router_<policy>"),
        options=(
            opt("--router", default="evolving",
                help="router plug-in name (evolving.routers; least_ttft: a synonym of evolving)"),
            opt("--router-arg", action="append", default=[], metavar="K=V",
                help="router constructor keyword (repeatable)"),
            opt("--shadow", default=None, metavar="NAME",
                help="run in shadow under this name: decisions go to ei.<p>.shadow.NAME.>"),
        ),
        plugin="router", group=ROUTER_GROUP, shadow_publishes=("ei.<p>.shadow.<name>.route", "ei.<p>.anomaly.router_<name>")),
    "recorder": ServiceKind(
        "recorder", "recorder", (), (),
        options=(
            opt("--db", required=True, help="DuckDB file of the run"),
            opt("--run-config", default=None, help="JSON file (or inline JSON) merged into run_config"),
            opt("--flush-interval-s", type=float, default=1.0,
                help="append what is buffered this long after its oldest row (each append is one DuckDB "
                     "transaction, several ms: at 0.2 s they were most of the recorder's CPU while serving)"),
            opt("--drain-timeout-s", type=float, default=5.0,
                help="on stop, wait this long at most to record up to the stream head"),
            opt("--memory-limit", default="512MB",
                help="DuckDB memory_limit of the recorder's connection (its buffer pool otherwise keeps "
                     "written data up to 80%% of RAM: `evolving soak` saw its RSS grow ~4 MB/min); '' = DuckDB's"),
        )),
}

#: The configuration snapshots the recorder merges into the log's run_config (shadows aside).
CONFIG_KEYS = tuple(name for name, kind in SERVICES.items() if not kind.records)
