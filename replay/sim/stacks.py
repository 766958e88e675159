"""Named stacks: a planner, a router, an eviction policy, a KV pool mode and a switch mechanism.

=====================  =========  ============  ===========  ===========  ==============  ========
stack                  planner    router        eviction     KV pool      switch          start
=====================  =========  ============  ===========  ===========  ==============  ========
evolving               evolving   evolving      count_aware  shared/async in_place        collocated warm-up
                       (prefill queue order short_first, and its router prices each node's
                       wait in that order; every other stack fcfs)
dynamo                 dynamo     cache_aware   lru          node-local   restart         6P3D
arrow                  arrow      cache_aware   lru          node-local   in_place_drop_kv 6P3D
static:<P>P<D>D        static     cache_aware   lru          node-local   (none)          P/D
memory-pool            evolving   evolving      count_aware  fetch at start in_place      warm-up
=====================  =========  ============  ===========  ===========  ==============  ========

Ablations swap one part of ``evolving`` back to the baseline's: ``evolving-lru`` (eviction),
``evolving-cacheaware`` (router), ``evolving-fetchatstart`` (pool reads at prefill start, the
memory-pool variant), ``evolving-localcache`` (no shared pool), ``evolving-restart`` and
``evolving-dropkv`` (switch mechanism), ``evolving-static:<P>P<D>D`` (no planner).

Composed stacks: ``BASE+PART+PART...`` swaps parts of any base stack, each
part named by its value (the kinds never share a name)::

    router      least_ttft (= evolving's), cache_aware, sticky, round_robin, least_loaded, dynamo_kv
    data plane  async (fetch from peers while queued), at_start (fetch when prefill starts), local
    eviction    lru, count_aware
    switch      in_place, restart, drop_kv
    next turn   prestage (the router stages a finished turn's KV in the predicted node's host
                tier), specprefill (Dynamo's speculative next-turn prefill, a max_tokens=1
                request); docs/simulator.md, "The next turn's KV"
    routing     pack (the least-TTFT router's ``pack_slack`` = ``PACK_SLACK``: long prefills join
                long work; docs/experiments.md, "Head-of-line blocking behind cold prefills")
    prefill     fcfs (SGLang's and vLLM's default queue order: the baselines'), short_first
    order       (evolving's: shortest expected prefill first with aging, time-bounded
                iterations; engine/backends/sim/prefill_order.py)

e.g. ``static:4P5D+round_robin+async`` (a fixed split, round-robin routing, the shared pool
with asynchronous fetch) or ``dynamo+count_aware``. A spec that starts with a part applies it
to ``evolving`` (``cache_aware+async`` = ``evolving-cacheaware``). A router that plans no fetch
(every baseline router) gets its fetch plan from the data plane: the node's driver looks the
request up in the directory (``replay/sim/simulation.py``), so the data plane is independent of routing.

``start`` (``--start``) is the split every node serves from t = 0, for every stack: baselines
start there instead of 6P3D; ``evolving`` skips the collocated warm-up and its warm-up-end
decision is SE-gated against that split; a static stack starts there and orders its own split
at the warm-up end.

The baselines' routers are SGLang Model Gateway cache-aware for prefill; their decode routing
is the router base's round robin (METHOD.md §5). Baselines start at 6P3D on 9 nodes (two
thirds prefill on other sizes) unless ``start`` is given.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Any

from engine.backends.sim.prefill_order import AGING, LONG_S, LONG_SHARE
from engine.profiles import Profile
from events.ids import Role
from services.adapters.recipes import CORES, PLANNERS, ROUTERS, resolve
from services.cores.directory.eviction import POLICIES


@dataclass(frozen=True)
class Stack:
    name: str
    planner: str = "evolving"
    router: str = "evolving"
    eviction: str = "count_aware"
    fetch_mode: str = "async"  # async | at_start | none
    mechanism: str = "in_place"  # in_place | restart | in_place_drop_kv
    split: tuple[int, int] | None = None  # None: collocated warm-up, the planner orders the split
    start: tuple[int, int] | None = None  # --start: the roles at t = 0 (overrides the warm-up/split)
    planner_args: dict[str, Any] = field(default_factory=dict)
    router_args: dict[str, Any] = field(default_factory=dict)
    shared_directory: bool = False  # eviction reads the router's embedded directory (speed)
    # (docs/simulator.md, "The next turn's KV"): the router orders a finished
    # turn's KV into the predicted next prefill node's host tier (``+prestage``); the frontend
    # sends Dynamo's speculative next-turn prefill, a max_tokens=1 request (``+specprefill``)
    prestage: bool = False
    specprefill: bool = False
    # the prefill nodes' queue order (engine/backends/sim/prefill_order.py):
    # ``fcfs`` as SGLang and vLLM by default; ``short_first`` (ours) without head-of-line blocking
    prefill_order: str = "fcfs"

    @property
    def plans_fetch(self) -> bool:
        """Whether the router itself plans peer fetches (else the data plane does)."""
        return self.router in ROUTERS_PLANNING_FETCH

    def initial_roles(self, nodes: int) -> list[Role]:
        split = self.start if self.start is not None else self.split
        if split is None:
            return ["collocated"] * nodes
        p, d = split
        if p + d != nodes:
            p = max(1, min(nodes - 1, round(nodes * p / (p + d))))
            d = nodes - p
        return ["prefill"] * p + ["decode"] * d

    def core_config(self, profile: Profile, cfg) -> dict[str, Any]:
        """How this run's cores are built, in the ``run_config`` form that ``evolving verify``
        rebuilds them from (class path + JSON kwargs per core): one source for both."""
        pargs: dict[str, Any] = {"name": self.planner, "warmup_s": float(cfg.warmup_s), "mechanism": self.mechanism,
                                 "k": profile.experts_per_token, "E": profile.experts}
        if self.split is not None or self.start is not None:
            # baselines order their configured split at warm-up end; evolving's warm-up-end
            # decision is SE-gated against its start split
            roles = replace(self, start=None).initial_roles(cfg.nodes) if self.split is not None else \
                self.initial_roles(cfg.nodes)
            pargs["initial"] = f"{roles.count('prefill')}P{roles.count('decode')}D"
        pargs.update(self.planner_args)
        # the deployment's profile seeds the router's iteration-time models until the planner's
        # first fit (services/cores/router/state.py), as Dynamo starts from its pre-deployment profiling
        rargs = {"name": self.router, "shadow": False, "block_tokens": profile.block_tokens,
                 **profile.router_priors(), **self.router_args}
        if self.router == "evolving" and self.fetch_mode == "none":  # node-local caches: no pool to fetch from
            rargs.setdefault("shared_pool", False)
        if self.router == "evolving" and self.prefill_order != "fcfs":  # price the queue in the order it is served
            rargs.setdefault("prefill_order", self.prefill_order)
            rargs.setdefault("order_aging", AGING)
            rargs.setdefault("order_long_s", LONG_S)
            rargs.setdefault("order_long_share", LONG_SHARE)
        router = ROUTERS[self.router]
        if self.prestage:
            if router not in PRESTAGING:
                raise KeyError(f"stack {self.name!r}: router {self.router!r} has no prestaging variant "
                               f"(its choice advances its state); routers with one: "
                               f"{', '.join(n for n, p in ROUTERS.items() if p in PRESTAGING)}")
            router = PRESTAGING[router]
        return {"cores": ["directory", "planner", "router"],
                "directory": {"class": CORES["directory"].default, "kwargs": {}},
                "planner": {"class": PLANNERS[self.planner], "kwargs": _accepted(PLANNERS[self.planner], pargs)},
                "router": {"class": router, "kwargs": rargs}}

    def make_cores(self, profile: Profile, cfg) -> list:
        """[directory, planner, router], fresh, configured for this run."""
        conf = self.core_config(profile, cfg)
        return [CORES[c].build(conf[c]) for c in conf["cores"]]

    def make_eviction(self, profile: Profile):
        return POLICIES[self.eviction](block_tokens=profile.block_tokens)

    def describe(self) -> str:
        first = self.start if self.start is not None else self.split
        start = "collocated warm-up" if first is None else f"{first[0]}P{first[1]}D"
        extra = "".join(f" {k}=on" for k in ("prestage", "specprefill") if getattr(self, k))
        return (f"{self.name}: planner={self.planner} router={self.router} eviction={self.eviction} "
                f"pool={self.fetch_mode} switch={self.mechanism} prefill={self.prefill_order} start={start}{extra}")


def _accepted(path: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Drop keywords the planner's config does not know (planners differ in their knobs)."""
    cls = resolve(path)
    conf = getattr(cls, "Config", None)
    fields = getattr(conf, "__struct_fields__", None)
    if not fields:
        return kwargs
    return {k: v for k, v in kwargs.items() if k in fields}


BASELINE_START = (6, 3)
_SPLIT = re.compile(r"^(\d+)P(\d+)D$", re.IGNORECASE)

EVOLVING = Stack("evolving", prefill_order="short_first")
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


#: router class path -> its prestaging variant (services/cores/router/prestage.py), for the
#: routers whose choice has no side effect (sticky and round robin advance state when they choose)
PRESTAGING: dict[str, str] = {
    ROUTERS[name]: f"services.cores.router.prestage:{cls}"
    for name, cls in (("evolving", "PrestageLeastTtftRouter"), ("cache_aware", "PrestageCacheAwareRouter"),
                      ("dynamo_kv", "PrestageDynamoKvRouter"), ("least_loaded", "PrestageLeastLoadedRouter"))
}

#: Routers that plan peer fetches themselves; for every other router the data plane does.
ROUTERS_PLANNING_FETCH = frozenset({"evolving"})

#: ``+pack`` (docs/experiments.md "Head-of-line blocking behind cold prefills"): the
#: least-TTFT router's ``pack_slack`` (docs/router.md): a request may wait up to this many times
#: its own predicted prefill time longer to join the longest acceptable queue, so 300-400K-token
#: cold prefills stack on a few prefill nodes instead of one on every node. Measured on the 34
#: bundled sessions at the pressure profile (5 min + 10 min): 1 -> P95 TTFT 4.0 s, 2 -> 1.8 s
#: (17.4 s without); 2 is the part's value. Not the default: one workload and one seed so far.
PACK_SLACK = 2.0

#: Parts of a composed stack (``BASE+PART+...``): part name -> (Stack field, value).
PARTS: dict[str, tuple[str, Any]] = {
    **{name: ("router", name) for name in ROUTERS if name != "evolving"},
    "least_ttft": ("router", "evolving"),
    "async": ("fetch_mode", "async"),
    "at_start": ("fetch_mode", "at_start"),
    "local": ("fetch_mode", "none"),
    "lru": ("eviction", "lru"),
    "count_aware": ("eviction", "count_aware"),
    "in_place": ("mechanism", "in_place"),
    "restart": ("mechanism", "restart"),
    "drop_kv": ("mechanism", "in_place_drop_kv"),
    "prestage": ("prestage", True),
    "specprefill": ("specprefill", True),
    "pack": ("router_args", {"pack_slack": PACK_SLACK}),
    "fcfs": ("prefill_order", "fcfs"),
    "short_first": ("prefill_order", "short_first"),
}


def _base_stack(key: str, spec: str) -> Stack:
    if key.startswith("static:"):
        return Stack(key, planner="static", router="cache_aware", eviction="lru", fetch_mode="none",
                     mechanism="in_place", split=parse_split(key.split(":", 1)[1]))
    if key.startswith("evolving-static:"):
        return replace(EVOLVING, name=key, planner="static", split=parse_split(key.split(":", 1)[1]))
    if key in PRESETS:
        return PRESETS[key]
    raise KeyError(f"unknown stack {spec!r}; known: {', '.join(sorted(PRESETS))}, static:<P>P<D>D, "
                   f"evolving-static:<P>P<D>D, each optionally +PART (parts: {', '.join(PARTS)})")


def get_stack(name: str, start: str | None = None) -> Stack:
    """A preset by name, ``static:<P>P<D>D`` or ``evolving-static:<P>P<D>D``, optionally with
    ``+PART`` swaps (module docstring); ``start`` is the split every node serves from t = 0."""
    spec = name.strip()
    head, *parts = [x.strip() for x in spec.split("+")]
    if head in PARTS and head not in PRESETS:  # "cache_aware+async": parts of evolving
        head, parts = "evolving", [head, *parts]
    st = _base_stack(head, spec)
    seen: dict[str, str] = {}
    for part in parts:
        if part not in PARTS:
            raise KeyError(f"stack {spec!r}: unknown part {part!r}; parts: {', '.join(PARTS)}")
        fld, value = PARTS[part]
        if fld in seen:
            raise KeyError(f"stack {spec!r}: two {fld.replace('_', ' ')} parts ({seen[fld]}, {part})")
        seen[fld] = part
        if fld == "router_args":  # a router keyword, added to the base's
            value = {**st.router_args, **value}
        st = replace(st, **{fld: value})
    if "router_args" in seen and st.router != "evolving":  # only the least-TTFT router has them
        raise KeyError(f"stack {spec!r}: part {seen['router_args']!r} is a least-TTFT router keyword; "
                       f"this stack's router is {st.router!r}")
    if parts:
        st = replace(st, name=spec)
    if start is not None:
        split = parse_split(start)
        if st.planner in ("dynamo", "arrow"):  # their configured split is where they start
            st = replace(st, split=split)
        else:
            st = replace(st, start=split)
    return st
