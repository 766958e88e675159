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


class PluginNotFound(LookupError):
    pass


def available(group: str) -> dict[str, object]:
    return {ep.name: ep for ep in entry_points(group=group)}


def load(group: str, name: str):
    """The class (or factory) registered as ``name`` in ``group``."""
    eps = available(group)
    if name not in eps:
        known = ", ".join(sorted(eps)) or "none"
        raise PluginNotFound(f"no {group} plug-in named {name!r} (installed: {known})")
    return eps[name].load()


def load_router(name: str):
    return load(ROUTER_GROUP, name)


def load_planner(name: str):
    return load(PLANNER_GROUP, name)
