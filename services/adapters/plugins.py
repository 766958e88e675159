"""Find routers and planners by name through Python entry points.

Built-ins and third-party packages register under the groups ``evolving.routers`` and
``evolving.planners``; a user's package adds one with, in its pyproject.toml::

    [project.entry-points."evolving.routers"]
    my_router = "my_pkg.router:MyRouter"
"""

from __future__ import annotations

from importlib.metadata import entry_points

ROUTER_GROUP = "evolving.routers"
PLANNER_GROUP = "evolving.planners"


#: Other names a command line accepts for a built-in plug-in -> its one canonical name, the one
#: recorded in run_config and in events. The least-TTFT router is ``evolving`` (the stack it
#: belongs to, as the planner); ``least_ttft`` names its policy, as ``cache_aware`` does.
SYNONYMS: dict[str, dict[str, str]] = {ROUTER_GROUP: {"least_ttft": "evolving"}}


def canonical(group: str, name: str) -> str:
    """``name``'s canonical plug-in name in ``group`` (itself unless it is a synonym)."""
    return SYNONYMS.get(group, {}).get(name, name)


class PluginNotFound(LookupError):
    pass


def available(group: str) -> dict[str, object]:
    return {ep.name: ep for ep in entry_points(group=group)}


def load(group: str, name: str):
    """The class (or factory) registered as ``name`` (or a synonym of it) in ``group``."""
    name = canonical(group, name)
    eps = available(group)
    if name not in eps:
        known = ", ".join(sorted(eps)) or "none"
        raise PluginNotFound(f"no {group} plug-in named {name!r} (installed: {known})")
    return eps[name].load()


def load_router(name: str):
    return load(ROUTER_GROUP, name)


def load_planner(name: str):
    return load(PLANNER_GROUP, name)
