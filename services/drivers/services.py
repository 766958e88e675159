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
``services.adapters.bus.security.READS``, which the secured bus enforces. The same table builds the cores for ``evolving serve``
(services/drivers/serve.py), for ``evolving verify`` (services/drivers/recorder/verify.py,
from a log's ``run_config``) and for the simulator's stacks (replay/sim/stacks.py):

* a core's ``run_config`` entry is ``{"class": "pkg.module:Class", "kwargs": {...}}`` or
  ``{"plugin": NAME, "kwargs": {...}}`` (a plug-in of the recipe's entry-point group, see
  services/adapters/plugins.py), or ``{}`` for the built-in default; :meth:`CoreRecipe.build`
  builds it;
* a service writes the entry it was started with to the snapshot store under
  ``config.<key>`` (``config.shadow.NAME`` for a shadow router); the recorder merges the
  non-shadow ones into the log's ``run_config``;
* class paths of logs recorded before the layout of issue 21 (``services.planner.core:...``,
  ``services.router.baselines:...``) resolve through :data:`LEGACY_CLASS_PATHS`.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from services.adapters.bus.security import READS
from services.adapters.plugins import PLANNER_GROUP, ROUTER_GROUP, load

# ---------------------------------------------------------------------------- core classes
#: The built-in routers and planners by plug-in name (the entry points of pyproject.toml; a test
#: checks that the two agree). The simulator's stacks name their cores by these.
ROUTERS: dict[str, str] = {
    "evolving": "services.cores.router.least_ttft:LeastTtftRouter",
    "cache_aware": "services.cores.router.cache_aware:CacheAwareRouter",
    "sticky": "services.cores.router.cache_aware:StickyRouter",
    "round_robin": "services.cores.router.load_balancing:RoundRobinRouter",
    "least_loaded": "services.cores.router.load_balancing:LeastLoadedRouter",
    "dynamo_kv": "services.cores.router.dynamo:DynamoKvRouter",
}
PLANNERS: dict[str, str] = {
    "evolving": "services.cores.planner.evolving:EvolvingPlanner",
    "static": "services.cores.planner.static:StaticPlanner",
    "dynamo": "services.cores.planner.dynamo:DynamoPlanner",
    "arrow": "services.cores.planner.arrow:ArrowPlanner",
}

#: Class paths that logs recorded before the layout of issue 21 name in their ``run_config``
#: (``services/<core>/...``, then briefly ``services/cores/<core>/baselines.py``) -> today's.
#: ``evolving verify`` of such a log resolves them through this table; nothing else does.
LEGACY_CLASS_PATHS: dict[str, str] = {
    "services.directory.core:DirectoryCore": "services.cores.directory.core:DirectoryCore",
    "services.planner.core:EvolvingPlanner": PLANNERS["evolving"],
    **{f"{old}:{cls}": PLANNERS[name]
       for old in ("services.planner.baselines", "services.cores.planner.baselines")
       for name, cls in (("static", "StaticPlanner"), ("dynamo", "DynamoPlanner"), ("arrow", "ArrowPlanner"))},
    "services.router.core:LeastTtftRouter": ROUTERS["evolving"],
    **{f"{old}:{cls}": ROUTERS[name]
       for old in ("services.router.baselines", "services.cores.router.baselines")
       for name, cls in (("cache_aware", "CacheAwareRouter"), ("sticky", "StickyRouter"),
                         ("round_robin", "RoundRobinRouter"), ("least_loaded", "LeastLoadedRouter"),
                         ("dynamo_kv", "DynamoKvRouter"))},
}


def resolve(path: str):
    """``"package.module:Attr"`` -> the attribute (a pre-layout path through
    :data:`LEGACY_CLASS_PATHS` first)."""
    module, _, attr = LEGACY_CLASS_PATHS.get(path, path).partition(":")
    obj = importlib.import_module(module)
    for part in attr.split(".") if attr else ():
        obj = getattr(obj, part)
    return obj


@dataclass(frozen=True)
class CoreRecipe:
    """How one core is built from its ``run_config`` entry (module docstring)."""

    key: str  # the run_config key, the core's name in ``evolving verify --cores``
    default: str  # class path of the built-in, for an entry that names neither class nor plug-in
    group: str | None = None  # plug-in entry-point group (None: not a plug-in)
    builtins: Mapping[str, str] = field(default_factory=dict)  # plug-in name -> class path

    def load(self, entry: Mapping[str, Any]):
        """The class ``entry`` names (``plugins.PluginNotFound`` for an unknown plug-in)."""
        if "class" in entry:
            return resolve(entry["class"])
        if "plugin" in entry and self.group is not None:
            return load(self.group, entry["plugin"])
        return resolve(self.default)

    def build(self, entry: Mapping[str, Any]):
        """A fresh core: ``load(entry)(**entry["kwargs"])``."""
        return self.load(entry)(**entry.get("kwargs", {}))


CORES: dict[str, CoreRecipe] = {
    "directory": CoreRecipe("directory", "services.cores.directory.core:DirectoryCore"),
    "planner": CoreRecipe("planner", PLANNERS["evolving"], PLANNER_GROUP, PLANNERS),
    "router": CoreRecipe("router", ROUTERS["evolving"], ROUTER_GROUP, ROUTERS),
    "liveness": CoreRecipe("liveness", "services.cores.liveness:LivenessWatcher"),
}
#: The cores ``evolving verify`` rebuilds when the log's run_config names none.
VERIFIED_CORES = ("directory", "planner", "router")


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


def opt(*flags: str, **kwargs: Any) -> Option:
    return Option(flags, kwargs)


@dataclass(frozen=True)
class Fold:
    """One core a service folds: its recipe (a key of :data:`CORES`) and, for a core other
    than the service's own, which parsed options give its constructor keywords."""

    core: str
    args: Mapping[str, str] = field(default_factory=dict)  # keyword -> option attribute


@dataclass(frozen=True)
class ServiceConfig:
    """One service as started: parsed once from its options (:meth:`ServiceKind.configure`)."""

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

    def entry(self, args) -> dict[str, Any]:
        """The run_config entry of this service's own core, from its options."""
        if self.plugin is None:
            return {}
        return {"plugin": getattr(args, self.plugin), "kwargs": parse_kv(getattr(args, f"{self.plugin}_arg"))}

    def configure(self, args) -> ServiceConfig:
        entry = self.entry(args)
        name = key = self.name
        shadow = getattr(args, "shadow", None) if self.shadow_publishes else None
        if shadow:
            entry["kwargs"].update(name=shadow, shadow=True)
            name, key = f"shadow-{shadow}", f"shadow.{shadow}"
        kwargs = tuple(entry.get("kwargs", {}) if i == 0 else {kw: getattr(args, a) for kw, a in f.args.items()}
                       for i, f in enumerate(self.folds))
        runner = {**entry, **{a: getattr(args, a) for a in self.runner_args}}
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
        plugin="planner", ticks=True, runner_args=("heartbeat_timeout_s",)),
    "router": ServiceKind(
        "router", "router", (Fold("router"),), ("ei.<p>.route", "ei.<p>.anomaly.router_<policy>"),
        options=(
            opt("--router", default="evolving", help="router plug-in name (evolving.routers)"),
            opt("--router-arg", action="append", default=[], metavar="K=V",
                help="router constructor keyword (repeatable)"),
            opt("--shadow", default=None, metavar="NAME",
                help="run in shadow under this name: decisions go to ei.<p>.shadow.NAME.>"),
        ),
        plugin="router", shadow_publishes=("ei.<p>.shadow.<name>.route", "ei.<p>.anomaly.router_<name>")),
    "recorder": ServiceKind(
        "recorder", "recorder", (), (),
        options=(
            opt("--db", required=True, help="DuckDB file of the run"),
            opt("--run-config", default=None, help="JSON file (or inline JSON) merged into run_config"),
            opt("--flush-interval-s", type=float, default=0.2),
            opt("--drain-timeout-s", type=float, default=5.0,
                help="on stop, wait this long at most to record up to the stream head"),
            opt("--memory-limit", default="512MB",
                help="DuckDB memory_limit of the recorder's connection (its buffer pool otherwise keeps "
                     "written data up to 80%% of RAM: `evolving soak` saw its RSS grow ~4 MB/min); '' = DuckDB's"),
        )),
}

#: The configuration snapshots the recorder merges into the log's run_config (shadows aside).
CONFIG_KEYS = tuple(name for name, kind in SERVICES.items() if not kind.records)
