"""The services table (services/drivers/services.py) is the one place that says which cores a
service folds and how each is built: the built-in plug-ins agree with the entry points, the
class paths of pre-layout logs resolve, the subjects a service publishes are the ones its
account may publish, and ``evolving serve`` builds its runner from the row."""

from __future__ import annotations

import argparse
import importlib
import tomllib
from pathlib import Path

import pytest

from events.subjects import token
from services.adapters.bus.memory import InMemoryBus
from services.adapters.bus.port import subject_matches
from services.adapters.bus.security import ServiceSpec, service_permissions
from services.adapters.recipes import CORES, LEGACY_CLASS_PATHS, PLANNERS, ROUTERS, resolve
from services.cores.corestack import CoreStack
from services.cores.directory.core import DirectoryCore
from services.cores.liveness import LivenessWatcher
from services.drivers import serve
from services.drivers.options import ServiceOptions, add_service_args, service_options
from services.drivers.services import CONFIG_KEYS, SERVICES, parse_kv

ROOT = Path(__file__).resolve().parents[3]


def _args(kind: str, *argv: str) -> ServiceOptions:
    p = argparse.ArgumentParser()
    add_service_args(p, kind)
    return service_options(kind, p.parse_args([*(["--db", "x.duckdb"] if kind == "recorder" else []), *argv]))


def test_the_built_in_plug_ins_are_the_entry_points():
    groups = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]
    assert ROUTERS == groups["evolving.routers"]
    assert PLANNERS == groups["evolving.planners"]
    for recipe in CORES.values():
        assert isinstance(resolve(recipe.default), type)
        for path in recipe.builtins.values():
            assert isinstance(resolve(path), type)


@pytest.mark.parametrize("old", sorted(LEGACY_CLASS_PATHS))
def test_a_pre_layout_class_path_resolves_to_todays_class(old):
    with pytest.raises(ModuleNotFoundError):  # gone: only the alias table finds it
        importlib.import_module(old.partition(":")[0])
    assert resolve(old) is resolve(LEGACY_CLASS_PATHS[old])
    assert resolve(old).__name__ == old.rpartition(":")[2]


def test_every_old_core_name_is_covered():
    olds = {p.rpartition(":")[2] for p in LEGACY_CLASS_PATHS}
    news = {p.rpartition(":")[2] for p in [*ROUTERS.values(), *PLANNERS.values(), CORES["directory"].default]}
    assert olds == news


@pytest.mark.parametrize("kind", [k for k in SERVICES if not SERVICES[k].records])
def test_what_a_service_publishes_its_account_may_publish(kind):
    svc = SERVICES[kind]
    p, name = "default", "evolving"
    for shadow, subjects in ((None, svc.publishes), ("canary", svc.shadow_publishes)):
        if not subjects:
            continue
        spec = ServiceSpec(svc.role, f"shadow-{shadow}" if shadow else kind, shadow=shadow,
                           components=(f"router.{shadow or name}",) if kind == "router" else ())
        allowed = service_permissions(spec, p).publish
        for subject in subjects:
            concrete = (subject.replace("<p>", p).replace("<node>", "n1").replace("<name>", shadow or "")
                        .replace("<policy>", name))
            concrete = ".".join(token(t) for t in concrete.split("."))
            assert any(subject_matches(a, concrete) for a in allowed), (kind, subject, concrete)


def test_the_recorded_configurations_are_the_decision_services():
    assert CONFIG_KEYS == ("directory", "planner", "router")
    assert [k for k, s in SERVICES.items() if s.records] == ["recorder"]


def test_parse_kv_takes_json_values_else_strings():
    assert parse_kv(["a=1", "b=x", "c=[1, 2]", "d=true"]) == {"a": 1, "b": "x", "c": [1, 2], "d": True}
    with pytest.raises(SystemExit):
        parse_kv(["nokey"])


def test_core_spec_and_configure_give_the_old_shapes():
    assert serve.core_spec("directory", _args("directory")) == ("directory", {}, "directory")
    planner = _args("planner", "--planner", "static", "--planner-arg", "initial=4P5D", "--heartbeat-timeout-s", "3")
    assert serve.core_spec("planner", planner) == (
        "planner", {"plugin": "static", "kwargs": {"initial": "4P5D"}}, "planner")
    conf = SERVICES["planner"].configure(planner.row)
    assert conf.runner_config == {"plugin": "static", "kwargs": {"initial": "4P5D"}, "heartbeat_timeout_s": 3.0}
    assert conf.core_kwargs == ({"initial": "4P5D"}, {"timeout_s": 3.0})
    shadow = _args("router", "--router", "round_robin", "--shadow", "canary")
    assert serve.core_spec("router", shadow) == (
        "shadow-canary", {"plugin": "round_robin", "kwargs": {"name": "canary", "shadow": True}}, "shadow.canary")
    with pytest.raises(ValueError, match="no core service named 'recorder'"):
        serve.core_spec("recorder", _args("recorder"))


def test_build_runner_folds_the_rows_cores():
    bus = InMemoryBus("p")
    d = serve.build_runner("directory", _args("directory"), bus)
    assert isinstance(d.make_core(), DirectoryCore) and d.cfg.config == {} and d.cfg.name == "directory"
    p = serve.build_runner("planner", _args("planner", "--heartbeat-timeout-s", "4"), bus)
    stack = p.make_core()
    assert isinstance(stack, CoreStack)
    planner, watcher = stack.cores
    assert type(planner) is resolve(PLANNERS["evolving"]) and isinstance(watcher, LivenessWatcher)
    assert watcher.timeout_s == 4.0
    restored = p.restore_core(stack.snapshot())
    assert [type(c) for c in restored.cores] == [type(planner), LivenessWatcher]
    r = serve.build_runner("router", _args("router", "--shadow", "canary"), bus)
    assert (r.cfg.name, r.cfg.shadow) == ("shadow-canary", "canary") and r.make_core().shadow


def test_a_plug_in_that_does_not_load_is_one_line():
    with pytest.raises(serve.PluginLoadError, match="cannot load router plug-in 'nope': PluginNotFound"):
        serve.build_runner("router", _args("router", "--router", "nope"), InMemoryBus("p"))
    with pytest.raises(serve.PluginLoadError, match="cannot load planner plug-in 'static': ValidationError"):
        serve.build_runner("planner", _args("planner", "--planner", "static", "--planner-arg", "bogus=1"),
                           InMemoryBus("p"))


def test_least_ttft_is_a_synonym_of_the_evolving_router_and_the_log_records_evolving():
    r = serve.build_runner("router", _args("router", "--router", "least_ttft"), InMemoryBus("p"))
    assert r.cfg.config["plugin"] == "evolving"
    assert type(r.make_core()) is resolve(ROUTERS["evolving"])
    assert SERVICES["router"].entry(_args("router", "--router", "cache_aware").row)["plugin"] == "cache_aware"
