"""The table of cores: the built-in routers and planners by plug-in name, and how each core is
built from its ``run_config`` entry (:class:`CoreRecipe`).

One table for every driver that builds cores: ``evolving serve`` (services/drivers/serve.py),
``evolving verify`` (services/drivers/recorder/verify.py, from a log's ``run_config``) and the
simulator's stacks (replay/sim/stacks.py). It sits among the adapters, beside the entry-point
loader it uses (:mod:`services.adapters.plugins`), so that the simulator and the live services
read the same table without one driver importing another.

* a core's ``run_config`` entry is ``{"class": "pkg.module:Class", "kwargs": {...}}`` or
  ``{"plugin": NAME, "kwargs": {...}}`` (a plug-in of the recipe's entry-point group), or ``{}``
  for the built-in default; :meth:`CoreRecipe.build` builds it;
* class paths that logs recorded before the folders had their layers name
  (``services.planner.core:...``, ``services.router.baselines:...``) resolve through
  :data:`LEGACY_CLASS_PATHS`, so that old logs still verify.

Layer 2 (adapter: Python entry points and class paths). May import: ``.plugins``.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from services.adapters.plugins import PLANNER_GROUP, ROUTER_GROUP, load

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

#: Class paths that logs recorded before the layered folders name in their ``run_config``
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
