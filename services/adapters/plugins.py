"""Find routers and planners by name through Python entry points.

Built-ins and third-party packages register under the groups ``evolving.routers`` and
``evolving.planners``; a user's package adds one with, in its pyproject.toml::

    [project.entry-points."evolving.routers"]
    my_router = "my_pkg.router:MyRouter"
"""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points

ROUTER_GROUP = "evolving.routers"
PLANNER_GROUP = "evolving.planners"


#: Other names a command line accepts for a built-in plug-in -> its one canonical name, the one
#: recorded in run_config and in events. The least-TTFT router is ``evolving`` (the stack it
#: belongs to, as the planner); ``least_ttft`` names its policy, as ``cache_aware`` does.
SYNONYMS: dict[str, dict[str, str]] = {ROUTER_GROUP: {"least_ttft": "evolving"}}


#: Parts a plug-in name may carry after its name (``NAME+PART+...``), per group: part -> the
#: ``"module:function"`` that turns the plug-in's class into the variant with the part, as the
#: simulator's composed stacks name them (replay/sim/stacks.py). ``evolving+prestage``: the
#: router that stages a finished turn's KV on the node it predicts for the next turn
#: (services/cores/router/prestage.py).
PARTS: dict[str, dict[str, str]] = {ROUTER_GROUP: {"prestage": "services.cores.router.prestage:with_prestage"}}


def canonical(group: str, name: str) -> str:
    """``name``'s canonical plug-in name in ``group`` (its base name's synonym resolved, the
    parts kept in their order)."""
    base, *parts = name.split("+")
    return "+".join([SYNONYMS.get(group, {}).get(base, base), *parts])


class PluginNotFound(LookupError):
    pass


def available(group: str) -> dict[str, object]:
    return {ep.name: ep for ep in entry_points(group=group)}


def load(group: str, name: str):
    """The class (or factory) registered as ``name`` (or a synonym of it) in ``group``, turned
    into its variant by each ``+PART`` of the name (:data:`PARTS`)."""
    base, *parts = canonical(group, name).split("+")
    eps = available(group)
    if base not in eps:
        known = ", ".join(sorted(eps)) or "none"
        raise PluginNotFound(f"no {group} plug-in named {base!r} (installed: {known})")
    obj = eps[base].load()
    for part in parts:
        path = PARTS.get(group, {}).get(part)
        if path is None:
            known = ", ".join(sorted(PARTS.get(group, {}))) or "none"
            raise PluginNotFound(f"no part {part!r} for {group} plug-ins (parts: {known})")
        module, _, attr = path.partition(":")
        try:
            obj = getattr(importlib.import_module(module), attr)(obj)
        except KeyError as exc:
            raise PluginNotFound(f"{name!r}: {exc.args[0]}") from None
    return obj


def load_router(name: str):
    return load(ROUTER_GROUP, name)


def load_planner(name: str):
    return load(PLANNER_GROUP, name)
