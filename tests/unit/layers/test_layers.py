"""The layer rule (docs/contracts.md): imports only go down or sideways, never up.

    3 drivers   services.live, services.gateway, services.bench, replay, engine.worker, CLIs, __main__
    2 adapters  bus, runner, recorder, metrics, nats server, plug-in loader, engine backends, kernels
    1 cores     services.core, services.costmodel, services.directory, services.planner, services.router
    0 events    events

Every first-party module gets a layer from the table below (the most specific prefix wins); a
new module whose layer is unknown fails the test until it is placed. Imports inside functions
count too (a lazy import is still a dependency), except in ``__main__`` shims, which are drivers
by definition. The cores are also imported in a fresh interpreter, which must not end up with
NATS, aiohttp, DuckDB, the live services, the gateway or the simulator loaded.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
FIRST_PARTY = ("events", "services", "engine", "kernels", "replay")

EVENTS, CORES, ADAPTERS, DRIVERS = 0, 1, 2, 3
NAMES = {EVENTS: "events", CORES: "cores", ADAPTERS: "adapters", DRIVERS: "drivers"}

#: prefix -> layer; the longest matching prefix wins.
LAYER_OF = {
    "events": EVENTS,
    "services": DRIVERS,  # services/__init__.py, services.cli, services.buscli
    "services.core": CORES,
    "services.costmodel": CORES,
    "services.directory": CORES,
    "services.planner": CORES,
    "services.router": CORES,
    "services.partitions": CORES,  # the partition map: pure, events + stdlib (issue 16)
    "services.bus": ADAPTERS,
    "services.runner": ADAPTERS,
    "services.metrics": ADAPTERS,
    "services.natsserver": ADAPTERS,
    "services.logging": ADAPTERS,
    "services.plugins": ADAPTERS,
    "services.security": ADAPTERS,
    "services.recorder": ADAPTERS,
    "services.recorder.cli": DRIVERS,
    "services.recorder.bench": DRIVERS,
    "services.cli": DRIVERS,
    "services.buscli": DRIVERS,
    "services.bench": DRIVERS,
    "services.live": DRIVERS,
    "services.gateway": DRIVERS,
    "engine": ADAPTERS,
    "engine.worker": DRIVERS,
    "kernels": ADAPTERS,
    "kernels.cli": DRIVERS,
    "kernels.bench": DRIVERS,
    "replay": DRIVERS,
}

#: third-party packages a core may import besides the standard library.
CORE_THIRD_PARTY = {"numpy", "scipy", "msgspec"}
#: modules that must never be loaded by importing a core.
CORE_FORBIDDEN_LOADED = ("nats", "aiohttp", "duckdb", "services.live", "services.gateway", "replay",
                         "services.bus", "services.runner", "structlog", "rich")
CORE_PACKAGES = ["services.core", "services.costmodel", "services.directory", "services.planner",
                 "services.router", "services.partitions"]


def layer_of(module: str) -> int | None:
    best, layer = -1, None
    for prefix, lay in LAYER_OF.items():
        if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
            best, layer = len(prefix), lay
    return layer


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def first_party_modules() -> list[Path]:
    out = []
    for top in FIRST_PARTY:
        out += sorted(p for p in (ROOT / top).rglob("*.py") if "__pycache__" not in p.parts)
    return out


def imports_of(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module) for every import statement in the file, nested ones included."""
    tree = ast.parse(path.read_text(), filename=str(path))
    mod = module_name(path)
    package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            found.append((node.lineno, name))
    return found


def violations() -> list[str]:
    bad = []
    for path in first_party_modules():
        mod = module_name(path)
        if path.name == "__main__.py":
            continue  # a program shim: a driver by definition
        own = layer_of(mod)
        if own is None:
            bad.append(f"{mod}: no layer assigned (add it to LAYER_OF and docs/contracts.md)")
            continue
        for line, name in imports_of(path):
            top = name.split(".")[0]
            rel = f"{path.relative_to(ROOT)}:{line}"
            if top in FIRST_PARTY:
                target = layer_of(name)
                if target is not None and target > own:
                    bad.append(f"{rel}: {mod} ({NAMES[own]}) imports {name} ({NAMES[target]})")
            elif own == CORES and top not in sys.stdlib_module_names and top not in CORE_THIRD_PARTY:
                bad.append(f"{rel}: core {mod} imports third-party {name}")
            elif own == CORES and top in {"time", "random", "asyncio", "uuid", "socket", "threading",
                                          "subprocess", "secrets", "datetime"}:
                bad.append(f"{rel}: core {mod} imports {name} (clock, randomness or I/O)")
    return bad


def test_no_import_goes_up_a_layer():
    assert violations() == []


def test_the_layer_check_can_fail(tmp_path, monkeypatch):
    fake = ROOT / "services" / "directory" / "_layer_probe.py"
    assert not fake.exists()
    fake.write_text("import time\nfrom services.live.serve import main\nimport duckdb\n")
    try:
        bad = violations()
    finally:
        fake.unlink()
    assert any("imports services.live.serve (drivers)" in b for b in bad)
    assert any("third-party duckdb" in b for b in bad)
    assert any("imports time (clock" in b for b in bad)


@pytest.mark.parametrize("package", CORE_PACKAGES)
def test_a_core_loads_nothing_from_above_in_a_fresh_interpreter(package):
    mods = [module_name(p) for p in first_party_modules()
            if module_name(p) == package or module_name(p).startswith(package + ".")]
    mods = [m for m in mods if not m.endswith("__main__")]
    code = ("import importlib, json, sys\n"
            f"for m in {mods!r}: importlib.import_module(m)\n"
            "print(json.dumps(sorted(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    loaded = json.loads(out.stdout)
    bad = [m for m in loaded if any(m == f or m.startswith(f + ".") for f in CORE_FORBIDDEN_LOADED)]
    assert bad == [], f"importing {package} loaded {bad}"
