"""Named stacks: a planner, a router, an eviction policy, a KV pool mode and a switch mechanism.

=====================  =========  ============  ===========  ===========  ==============  ========
stack                  planner    router        eviction     KV pool      switch          start
=====================  =========  ============  ===========  ===========  ==============  ========
evolving               evolving   evolving      count_aware  shared/async in_place        collocated warm-up
dynamo                 dynamo     cache_aware   lru          node-local   restart         6P3D
arrow                  arrow      cache_aware   lru          node-local   in_place_drop_kv 6P3D
static:<P>P<D>D        static     cache_aware   lru          node-local   (none)          P/D
memory-pool            evolving   evolving      count_aware  fetch at start in_place      warm-up
=====================  =========  ============  ===========  ===========  ==============  ========

Ablations swap one part of ``evolving`` back to the baseline's: ``evolving-lru`` (eviction),
``evolving-cacheaware`` (router), ``evolving-fetchatstart`` (pool reads at prefill start, the
memory-pool variant), ``evolving-localcache`` (no shared pool), ``evolving-restart`` and
``evolving-dropkv`` (switch mechanism), ``evolving-static:<P>P<D>D`` (no planner).

The baselines' routers are SGLang Model Gateway cache-aware for prefill; their decode routing
is the router base's round robin (METHOD.md §5). Baselines start at 6P3D on 9 nodes (two
thirds prefill on other sizes) unless ``start`` is given.
"""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass, field, replace
from typing import Any

from engine.profiles import Profile
from events.ids import Role

ROUTERS = {
    "evolving": "services.router.core:LeastTtftRouter",
    "cache_aware": "services.router.baselines:CacheAwareRouter",
    "sticky": "services.router.baselines:StickyRouter",
    "round_robin": "services.router.baselines:RoundRobinRouter",
    "least_loaded": "services.router.baselines:LeastLoadedRouter",
    "dynamo_kv": "services.router.baselines:DynamoKvRouter",
}
PLANNERS = {
    "evolving": "services.planner.core:EvolvingPlanner",
    "static": "services.planner.baselines:StaticPlanner",
    "dynamo": "services.planner.baselines:DynamoPlanner",
    "arrow": "services.planner.baselines:ArrowPlanner",
}


def _load(path: str):
    mod, _, attr = path.partition(":")
    return getattr(importlib.import_module(mod), attr)


@dataclass(frozen=True)
class Stack:
    name: str
    planner: str = "evolving"
    router: str = "evolving"
    eviction: str = "count_aware"
    fetch_mode: str = "async"  # async | at_start | none
    mechanism: str = "in_place"  # in_place | restart | in_place_drop_kv
    split: tuple[int, int] | None = None  # None: collocated warm-up, the planner orders the split
    planner_args: dict[str, Any] = field(default_factory=dict)
    router_args: dict[str, Any] = field(default_factory=dict)
    shared_directory: bool = False  # eviction reads the router's embedded directory (speed)

    def initial_roles(self, nodes: int) -> list[Role]:
        if self.split is None:
            return ["collocated"] * nodes
        p, d = self.split
        if p + d != nodes:
            p = max(1, min(nodes - 1, round(nodes * p / (p + d))))
            d = nodes - p
        return ["prefill"] * p + ["decode"] * d

    def core_config(self, profile: Profile, cfg) -> dict[str, Any]:
        """How this run's cores are built, in the ``run_config`` form that ``evolving verify``
        rebuilds them from (class path + JSON kwargs per core): one source for both."""
        pargs: dict[str, Any] = {"name": self.planner, "warmup_s": float(cfg.warmup_s), "mechanism": self.mechanism,
                                 "k": profile.experts_per_token, "E": profile.experts}
        if self.split is not None:  # baselines order their configured split at warm-up end
            roles = self.initial_roles(cfg.nodes)
            pargs["initial"] = f"{roles.count('prefill')}P{roles.count('decode')}D"
        pargs.update(self.planner_args)
        rargs = {"name": self.router, "shadow": False, "block_tokens": profile.block_tokens, **self.router_args}
        return {"cores": ["directory", "planner", "router"],
                "directory": {"class": "services.directory.core:DirectoryCore", "kwargs": {}},
                "planner": {"class": PLANNERS[self.planner], "kwargs": _accepted(PLANNERS[self.planner], pargs)},
                "router": {"class": ROUTERS[self.router], "kwargs": rargs}}

    def make_cores(self, profile: Profile, cfg) -> list:
        """[directory, planner, router], fresh, configured for this run."""
        conf = self.core_config(profile, cfg)
        return [_load(conf[c]["class"])(**conf[c]["kwargs"]) for c in conf["cores"]]

    def make_eviction(self, profile: Profile):
        from services.directory.eviction import POLICIES

        return POLICIES[self.eviction](block_tokens=profile.block_tokens)

    def describe(self) -> str:
        start = "collocated warm-up" if self.split is None else f"{self.split[0]}P{self.split[1]}D"
        return (f"{self.name}: planner={self.planner} router={self.router} eviction={self.eviction} "
                f"pool={self.fetch_mode} switch={self.mechanism} start={start}")


def _accepted(path: str, args: dict[str, Any]) -> dict[str, Any]:
    """Drop keywords the planner's config does not know (planners differ in their knobs)."""
    cls = _load(path)
    conf = getattr(cls, "Config", None)
    fields = getattr(conf, "__struct_fields__", None)
    if not fields:
        return args
    return {k: v for k, v in args.items() if k in fields}


BASELINE_START = (6, 3)
_SPLIT = re.compile(r"^(\d+)P(\d+)D$", re.IGNORECASE)

EVOLVING = Stack("evolving")
PRESETS: dict[str, Stack] = {
    "evolving": EVOLVING,
    "dynamo": Stack("dynamo", planner="dynamo", router="cache_aware", eviction="lru", fetch_mode="none",
                    mechanism="restart", split=BASELINE_START),
    "arrow": Stack("arrow", planner="arrow", router="cache_aware", eviction="lru", fetch_mode="none",
                   mechanism="in_place_drop_kv", split=BASELINE_START),
    "memory-pool": replace(EVOLVING, name="memory-pool", fetch_mode="at_start"),
    "evolving-lru": replace(EVOLVING, name="evolving-lru", eviction="lru"),
    "evolving-cacheaware": replace(EVOLVING, name="evolving-cacheaware", router="cache_aware"),
    "evolving-fetchatstart": replace(EVOLVING, name="evolving-fetchatstart", fetch_mode="at_start"),
    "evolving-localcache": replace(EVOLVING, name="evolving-localcache", fetch_mode="none"),
    "evolving-restart": replace(EVOLVING, name="evolving-restart", mechanism="restart"),
    "evolving-dropkv": replace(EVOLVING, name="evolving-dropkv", mechanism="in_place_drop_kv"),
}


def parse_split(text: str) -> tuple[int, int]:
    m = _SPLIT.match(text.strip())
    if not m:
        raise ValueError(f"bad split {text!r}: expected like 4P5D")
    p, d = int(m.group(1)), int(m.group(2))
    if p < 1 or d < 1:
        raise ValueError(f"bad split {text!r}: needs at least one prefill and one decode node")
    return p, d


def get_stack(name: str, start: str | None = None) -> Stack:
    """A preset by name, ``static:<P>P<D>D`` or ``evolving-static:<P>P<D>D``; ``start``
    overrides a baseline's initial split."""
    key = name.strip()
    if key.startswith("static:"):
        st = Stack(key, planner="static", router="cache_aware", eviction="lru", fetch_mode="none",
                   mechanism="in_place", split=parse_split(key.split(":", 1)[1]))
    elif key.startswith("evolving-static:"):
        st = replace(EVOLVING, name=key, planner="static", split=parse_split(key.split(":", 1)[1]))
    elif key in PRESETS:
        st = PRESETS[key]
    else:
        raise KeyError(f"unknown stack {name!r}; known: {', '.join(sorted(PRESETS))}, static:<P>P<D>D, "
                       f"evolving-static:<P>P<D>D")
    if start is not None and st.split is not None and not key.startswith(("static:", "evolving-static:")):
        st = replace(st, split=parse_split(start))
    return st
