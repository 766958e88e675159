"""The layer rule (docs/contracts.md): imports only go down or sideways, never up; no circles.

    4 apps      services/drivers/: the live services, the gateway, the `evolving` commands;
                replay/cli.py (the simulator's commands); replay/fidelity/ (live against simulated)
    3 drivers   engine/worker/, replay/ (sim, experiments): started by the apps above
    2 adapters  services/adapters/, engine/ (backends, KV pool, transfer), kernels/, replay/traces/
    1 cores     services/cores/
    0 events    events/

The folder says the layer: the most specific prefix of the table below wins, and a new module
lands in a layer by the folder it is put in. Imports inside functions count too (a lazy import
is still a dependency), and each one must say why it is lazy (``# lazy: <reason>`` on its line):
an optional dependency (torch, mooncake, sglang, tokenizers, ...) or a measured start-up cost.
The cores are also imported in a fresh interpreter, which must not end up with NATS, aiohttp,
DuckDB, the drivers or the simulator loaded.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
FIRST_PARTY = ("events", "services", "engine", "kernels", "replay")

EVENTS, CORES, ADAPTERS, DRIVERS, APPS = 0, 1, 2, 3, 4
NAMES = {EVENTS: "events", CORES: "cores", ADAPTERS: "adapters", DRIVERS: "drivers", APPS: "apps"}

#: folder prefix -> layer; the longest matching prefix wins.
LAYER_OF = {
    "events": EVENTS,
    "services.cores": CORES,
    "services.adapters": ADAPTERS,
    "engine": ADAPTERS,
    "kernels": ADAPTERS,
    "replay.traces": ADAPTERS,  # the trace format and importers: the gateway's drive and the simulator share it
    "services": DRIVERS,  # services/__init__.py: the docstring only
    # `up` starts engine workers and `bench` runs the simulator: what those need from the apps
    # (bus options, the table of cores) lives lower down, never here
    "services.drivers": APPS,
    "engine.worker": DRIVERS,  # the node worker process: a loop over an engine backend, started by `up`
    "replay": DRIVERS,
    "replay.cli": APPS,  # the simulator's `evolving` subcommands, registered by services/drivers/cli.py
    "replay.fidelity": APPS,  # drives a live stack through the gateway and the simulator side by side
}

#: third-party packages a core may import besides the standard library.
CORE_THIRD_PARTY = {"numpy", "scipy", "msgspec"}
#: modules that must never be loaded by importing a core.
CORE_FORBIDDEN_LOADED = ("nats", "aiohttp", "duckdb", "services.drivers", "services.adapters", "replay",
                         "engine", "structlog", "rich")
CORE_PACKAGES = ["services.cores"]
LAZY_TAG = "# lazy:"


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


def _rel(path: Path) -> Path | str:
    """A path as the checks print it: from the repository root (a probe outside it: its name)."""
    return path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name


def first_party_modules() -> list[Path]:
    out = []
    for top in FIRST_PARTY:
        out += sorted(p for p in (ROOT / top).rglob("*.py") if "__pycache__" not in p.parts)
    return out


def compiled_modules() -> set[str]:
    """Our compiled modules (``*.pyx``, built by setup.py): import targets with no Python source
    to parse (their purity is checked by tests/unit/cores/directory/test_snapshot_purity.py)."""
    return {module_name(p) for top in FIRST_PARTY for p in (ROOT / top).rglob("*.pyx")}


def _absolute(path: Path, node: ast.ImportFrom) -> str:
    mod = module_name(path)
    if not node.level:
        return node.module or ""
    package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    base = package.split(".")
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _nodes(tree: ast.AST):
    """(import node, nested) for every import; nested = inside a function body."""
    def walk(node, nested):
        for child in ast.iter_child_nodes(node):
            inner = nested or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child, inner
            yield from walk(child, inner)
    yield from walk(tree, False)


_PARSED: dict[tuple[Path, int], list] = {}


def _import_nodes(path: Path) -> list:
    """``_nodes`` of the file, parsed once per process and version of the file."""
    key = (path, path.stat().st_mtime_ns)
    if key not in _PARSED:
        _PARSED[key] = list(_nodes(ast.parse(path.read_text(), filename=str(path))))
    return _PARSED[key]


def known_modules() -> set[str]:
    return {module_name(p) for p in first_party_modules()} | compiled_modules()


def imports_of(path: Path, known: set[str] | None = None) -> list[tuple[int, str, bool]]:
    """(line, absolute name, nested) for every import statement; ``from a import b`` gives
    ``a.b`` when that is a module of ours (``known``), else ``a``."""
    known = known_modules() if known is None else known
    found = []
    for node, nested in _import_nodes(path):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name, nested) for a in node.names]
            continue
        base = _absolute(path, node)
        subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in known]
        found += [(node.lineno, s, nested) for s in subs] or [(node.lineno, base, nested)]
    return found


def violations() -> list[str]:
    bad = []
    known = known_modules()
    for path in first_party_modules():
        mod = module_name(path)
        own = layer_of(mod)
        if own is None:
            bad.append(f"{mod}: no layer assigned (put it in a layer's folder, see docs/contracts.md)")
            continue
        for line, name, _ in imports_of(path, known):
            top = name.split(".")[0]
            rel = f"{_rel(path)}:{line}"
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


def import_graph() -> dict[str, set[str]]:
    """Our module -> our modules it imports (at module level or inside functions)."""
    known = known_modules()
    graph: dict[str, set[str]] = {}
    for path in first_party_modules():
        mod = module_name(path)
        out = graph.setdefault(mod, set())
        for _, name, _ in imports_of(path, known):
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name and name != mod:
                out.add(name)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return sorted(out)


def unexplained_lazy_imports() -> list[str]:
    bad = []
    for path in first_party_modules():
        lines = path.read_text().splitlines()
        for node, nested in _import_nodes(path):
            if nested and LAZY_TAG not in lines[node.lineno - 1] and LAZY_TAG not in lines[node.end_lineno - 1]:
                bad.append(f"{_rel(path)}:{node.lineno}: {lines[node.lineno - 1].strip()}")
    return bad


def test_no_import_goes_up_a_layer():
    assert violations() == []


def test_no_import_circle():
    assert circles(import_graph()) == []


def test_every_import_inside_a_function_says_why():
    assert unexplained_lazy_imports() == []


def test_the_layer_check_can_fail(tmp_path, monkeypatch):
    # the probe is a core module the checks are told about, written outside the source tree: in
    # the tree it was seen for a moment by the other scans here running on another xdist worker
    fake = tmp_path / "_layer_probe.py"
    fake.write_text("import time\nfrom services.drivers.serve import main\nimport duckdb\n\n\n"
                    "def f():\n    import numpy\n")
    real_modules, real_name = first_party_modules, module_name
    monkeypatch.setitem(globals(), "first_party_modules", lambda: [*real_modules(), fake])
    monkeypatch.setitem(globals(), "module_name",
                        lambda p: "services.cores.directory._layer_probe" if p == fake else real_name(p))
    bad, lazy = violations(), unexplained_lazy_imports()
    assert any("imports services.drivers.serve (apps)" in b for b in bad)
    assert any("third-party duckdb" in b for b in bad)
    assert any("imports time (clock" in b for b in bad)
    assert any("_layer_probe.py:7: import numpy" in b for b in lazy)


def test_a_driver_importing_the_apps_is_an_arrow_back_up(tmp_path, monkeypatch):
    # the two arrows that once ran back up: the engine worker read the services' bus options, the
    # simulator the services' table of cores
    fake = tmp_path / "_up_probe.py"
    fake.write_text("from services.drivers.options import add_service_args\n")
    real_modules, real_name = first_party_modules, module_name
    monkeypatch.setitem(globals(), "first_party_modules", lambda: [*real_modules(), fake])
    monkeypatch.setitem(globals(), "module_name",
                        lambda p: "engine.worker._up_probe" if p == fake else real_name(p))
    assert [b for b in violations() if "_up_probe" in b] == [
        "_up_probe.py:1: engine.worker._up_probe (drivers) imports services.drivers.options (apps)"]


def test_the_circle_check_can_fail():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert circles(graph) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


@pytest.mark.parametrize("package", CORE_PACKAGES)
def test_a_core_loads_nothing_from_above_in_a_fresh_interpreter(package):
    mods = [module_name(p) for p in first_party_modules()
            if module_name(p) == package or module_name(p).startswith(package + ".")]
    code = ("import importlib, json, sys\n"
            f"for m in {mods!r}: importlib.import_module(m)\n"
            "print(json.dumps(sorted(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    loaded = json.loads(out.stdout)
    bad = [m for m in loaded if any(m == f or m.startswith(f + ".") for f in CORE_FORBIDDEN_LOADED)]
    assert bad == [], f"importing {package} loaded {bad}"


def test_no_program_entry_in_a_core_package():
    """``python -m`` entry points live with the drivers (``python -m services.drivers.serve NAME``).
    Adapters may carry the program of their own twin (the fake SGLang server, the transfer node)."""
    mains = [module_name(p) for p in first_party_modules() if p.name == "__main__.py"]
    assert [m for m in mains if layer_of(m) == CORES] == []
    guarded = [str(p.relative_to(ROOT)) for p in first_party_modules()
               if layer_of(module_name(p)) == CORES and 'if __name__ == "__main__"' in p.read_text()]
    assert guarded == []


def test_the_structure_drawing_is_current_and_clean():
    """docs/structure.md is what scripts/structure.py draws now, with no arrow up a floor and no
    circle of folders (the script exits 1 on either, or when the page is stale)."""
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "structure.py"), "--check"], cwd=ROOT,
                          capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_the_structure_check_can_fail():
    spec = importlib.util.spec_from_file_location("structure", ROOT / "scripts" / "structure.py")
    structure = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(structure)
    floors = {"a/": 3, "b/": 2, "c/": 1}
    text = structure.render(floors, {"a/": {"b/"}, "b/": {"c/", "a/"}, "c/": set()})
    assert "- violation: b/ (adapters) -> a/ (drivers)" in text
    assert "- circle: a/ -> b/" in text
    assert "violation" not in structure.render(floors, {"a/": {"b/"}, "b/": {"c/"}})
