"""Draw the code's structure: folders on their layer's floor, an arrow for every import between them.

``python scripts/structure.py`` rewrites docs/structure.md (the drawing as text, and the import
table) and docs/structure.png; ``--check`` exits 1 when docs/structure.md is stale (a test runs
it). Every import statement counts, the ones inside functions too. A floor is the layer of
tests/unit/layers/test_layers.py: 0 events, 1 cores, 2 adapters, 3 drivers (the engine worker,
the simulator, the experiments), 4 apps (services/drivers/: the live services, the gateway and
the ``evolving`` commands, replay/cli.py among them; replay/fidelity/: live runs against
simulated ones), which start and
compose the drivers below. An arrow from a lower
floor to a higher one ("back up"), or a circle of folders, is printed as a violation, and
``--check`` fails on it.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOPS = ("events", "services", "engine", "kernels", "replay")
FLOORS = {0: "events", 1: "cores", 2: "adapters", 3: "drivers", 4: "apps"}
#: folder prefix -> floor (the longest prefix wins), as in the layer test.
FLOOR_OF = {"events": 0, "services.cores": 1, "services.adapters": 2, "engine": 2, "kernels": 2,
            "replay.traces": 2, "services": 3, "services.drivers": 4, "engine.worker": 3, "replay": 3,
            "replay.fidelity": 4, "replay.cli": 4}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def modules() -> dict[str, Path]:
    out = {}
    for top in TOPS:
        for p in sorted((ROOT / top).rglob("*.py")):
            if "__pycache__" not in p.parts:
                out[module_name(p)] = p
    return out


def folder_of(mod: str, known: dict[str, Path]) -> str:
    """The drawn unit of a module: its package (a folder), or the module itself where it sits at
    the root of a layer's folder (services/adapters/runner.py)."""
    path = known[mod]
    rel = path.relative_to(ROOT)
    if len(rel.parts) == 3 and rel.parts[0] == "services" and path.name != "__init__.py":
        return str(rel)  # a module at a layer folder's root (services/drivers/serve.py) is its own unit
    if len(rel.parts) == 2 and rel.parts[0] == "replay" and path.name != "__init__.py":
        return str(rel)  # replay/cli.py: the simulator's commands, a floor above the simulator
    parts = rel.parent.parts
    if parts[0] == "services" and len(parts) >= 2:
        parts = parts[:3]
    elif parts[0] in ("engine", "replay"):
        parts = parts[:3] if parts[:2] == ("engine", "backends") else parts[:2]
    else:
        parts = parts[:1]
    return "/".join(parts) + "/"


def floor_of(mod: str) -> int:
    best, floor = -1, 3
    for prefix, f in FLOOR_OF.items():
        if (mod == prefix or mod.startswith(prefix + ".")) and len(prefix) > best:
            best, floor = len(prefix), f
    return floor


def imports(path: Path, mod: str, known: dict[str, Path]) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                b = package.split(".")
                base = ".".join(b[: len(b) - (node.level - 1)] + ([node.module] if node.module else []))
            names = [f"{base}.{a.name}" for a in node.names] + [base]
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name and name != mod:
                out.add(name)
    return out


def graph() -> tuple[dict[str, int], dict[str, set[str]]]:
    """(folder -> floor, folder -> folders it imports)."""
    known = modules()
    floors: dict[str, int] = {}
    edges: dict[str, set[str]] = defaultdict(set)
    empty = {m for m, p in known.items() if p.name == "__init__.py" and not imports(p, m, known)
             and not any(isinstance(n, (ast.FunctionDef, ast.ClassDef, ast.Assign)) for n in ast.parse(p.read_text()).body)}
    for mod, path in known.items():
        if mod in empty:
            continue  # a package's docstring alone: importing it costs nothing, draws nothing
        src = folder_of(mod, known)
        floors[src] = max(floors.get(src, 0), floor_of(mod))
        for dep in imports(path, mod, known) - empty:
            dst = folder_of(dep, known)
            if dst != src:
                edges[src].add(dst)
    return floors, edges


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Folders that reach each other (strongly connected, more than one), sorted."""
    nodes = sorted(set(edges) | {d for v in edges.values() for d in v})
    reach = {n: set() for n in nodes}
    for n in nodes:
        todo = list(edges.get(n, ()))
        while todo:
            m = todo.pop()
            if m not in reach[n]:
                reach[n].add(m)
                todo.extend(edges.get(m, ()))
    seen, out = set(), []
    for n in nodes:
        if n in seen:
            continue
        comp = sorted([n] + [m for m in reach[n] if n in reach[m] and m != n])
        seen.update(comp)
        if len(comp) > 1:
            out.append(comp)
    return out


def render(floors: dict[str, int], edges: dict[str, set[str]]) -> str:
    up = sorted(f"{s} ({FLOORS[floors[s]]}) -> {d} ({FLOORS[floors[d]]})"
                for s, ds in edges.items() for d in ds if floors[d] > floors[s])
    lines = ["# The code's structure", "",
             "<!-- generated by `python scripts/structure.py`; a test keeps it in sync -->", "",
             ("Folders on their layer's floor (docs/contracts.md, \"Layers\"); an arrow is an import, "
              "inside functions too. The picture is docs/structure.png."), "", "```text"]
    for floor in sorted(FLOORS, reverse=True):
        names = sorted(f for f, fl in floors.items() if fl == floor)
        lines.append(f"{floor} {FLOORS[floor]:<9}" + "  ".join(names))
    lines += ["```", "", f"Arrows running up a floor: {len(up)}. Circles of folders: {len(circles(edges))}.", ""]
    broken = [*(f"- violation: {u}" for u in up), *(f"- circle: {' -> '.join(c)}" for c in circles(edges))]
    lines += [*broken, ""] if broken else []
    lines += ["| folder | floor | imports |", "|---|---|---|"]
    for f in sorted(floors, key=lambda x: (-floors[x], x)):
        deps = ", ".join(f"`{d}`" for d in sorted(edges.get(f, ()), key=lambda d: (-floors[d], d)))
        lines.append(f"| `{f}` | {floors[f]} {FLOORS[floors[f]]} | {deps or '-'} |")
    return "\n".join(lines) + "\n"


def draw(floors: dict[str, int], edges: dict[str, set[str]], out: Path) -> None:
    import matplotlib  # lazy: scripts/structure.py --check (the test) needs no plotting (+450 ms)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # lazy: as above

    rows = {fl: sorted(f for f, x in floors.items() if x == fl) for fl in FLOORS}
    width = max(len(r) for r in rows.values())
    pos = {}
    for fl, names in rows.items():
        for i, name in enumerate(names):  # a crowded floor alternates its labels up and down
            pos[name] = ((i + 0.5) * width / len(names), fl * 2.0 + (0.3 * (-1) ** i if len(names) > 9 else 0.0))
    fig, ax = plt.subplots(figsize=(max(12, width * 1.6), 9))
    for src, dsts in edges.items():
        for dst in dsts:
            (x0, y0), (x1, y1) = pos[src], pos[dst]
            bad = floors[dst] > floors[src]
            ax.annotate("", xy=(x1, y1 + 0.25), xytext=(x0, y0 - 0.25),
                        arrowprops={"arrowstyle": "->", "lw": 1.4 if bad else 0.5,
                                    "color": "red" if bad else (0.4, 0.4, 0.7, 0.35)})
    colours = {0: "#e8e8e8", 1: "#d6ecd2", 2: "#d2e2f0", 3: "#f3e2cc", 4: "#f0d2d2"}
    for name, (x, y) in pos.items():
        ax.text(x, y, name, ha="center", va="center", fontsize=8,
                bbox={"boxstyle": "round", "fc": colours[floors[name]], "ec": "grey"})
    for fl, label in FLOORS.items():
        ax.text(-0.3, fl * 2.0, f"{fl} {label}", ha="right", va="center", fontsize=11, weight="bold")
    ax.set_xlim(-1.6, width + 0.2)
    ax.set_ylim(-0.8, 2.0 * max(FLOORS) + 0.8)
    ax.axis("off")
    ax.set_title("Folders by layer; arrows are imports (red: one running up a floor)")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--check", action="store_true", help="exit 1 when docs/structure.md is stale or a rule breaks")
    args = p.parse_args(argv)
    floors, edges = graph()
    text = render(floors, edges)
    doc = ROOT / "docs" / "structure.md"
    broken = "- violation:" in text or "- circle:" in text
    if args.check:
        stale = not doc.exists() or doc.read_text() != text
        if stale:
            print("docs/structure.md is stale: run `python scripts/structure.py`", file=sys.stderr)
        if broken:
            print(text, file=sys.stderr)
        return 1 if stale or broken else 0
    doc.write_text(text)
    draw(floors, edges, ROOT / "docs" / "structure.png")
    print(text)
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
