"""The repository stands alone: from a clone with no ``../shared`` beside it, every default
trace, profile and document a command reads is inside the clone, and the README's demo runs
(shrunk by its own flags). The clone shares this checkout's virtual environment (its packages,
not its files: the code is imported from the clone)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _extensions() -> list[Path]:
    """The compiled modules setup.py builds in place (every ``Extension("pkg.mod", ...)``)."""
    names = re.findall(r'Extension\(\s*"([\w.]+)"', (ROOT / "setup.py").read_text())
    assert names, "setup.py names no extension"
    found = [so for name in names for so in ROOT.glob(name.replace(".", "/") + "*.so")]
    assert len(found) >= len(names), (names, found)
    return found


def _clone(tmp_path: Path) -> Path:
    repo = tmp_path / "alone" / "repo"  # tmp_path/alone has no shared/ beside repo
    subprocess.run(["git", "clone", "-q", "--no-hardlinks", str(ROOT), str(repo)], check=True, timeout=120)
    for so in _extensions():  # built by setup, not tracked
        (repo / so.relative_to(ROOT)).write_bytes(so.read_bytes())
    assert not (repo.parent / "shared").exists()
    return repo


def _env(repo: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(repo), "PYTHONSAFEPATH": "1"}


def test_every_default_input_is_inside_the_clone(tmp_path):
    repo = _clone(tmp_path)
    probe = """
import json, services.drivers.bench.directory as d, replay.sim.bench as b, replay.experiments.matrix as m
import replay.sim.inputs as i
print(json.dumps({"directory": str(d.DEFAULT_TRACES), "sim": str(b.DEFAULT_CALIBRATION),
                  "matrix": str(m.calibration_trace()), "fixture": str(i.FIXTURE_TRACE), "file": d.__file__}))
"""
    out = subprocess.run([sys.executable, "-c", probe], cwd=repo, env=_env(repo), capture_output=True, text=True,
                         timeout=120, check=True)
    paths = json.loads(out.stdout)
    assert paths.pop("file").startswith(str(repo))
    for name, p in paths.items():
        assert Path(p).resolve().is_relative_to(repo.resolve()), (name, p)
        assert Path(p).is_dir() and any(Path(p).glob("*.json*")), (name, p)
    readme = (repo / "README.md").read_text()
    assert "../shared" not in readme and (repo / "docs" / "method.md").exists()


def test_the_readme_demo_runs_in_a_clone_without_shared(tmp_path):
    repo = _clone(tmp_path)
    cmd = [sys.executable, "-m", "services.drivers.cli", "compare", "--trace", "deploy/traces/calibration",
           "--pace", "agent", "--agents", "40", "--profile", "gb300-glm52-pressure", "--duration", "1m",
           "--warmup", "30s", "--fast", "--stacks", "evolving,dynamo", "--no-progress", "--out-dir", "runs/demo"]
    out = subprocess.run(cmd, cwd=repo, env=_env(repo), capture_output=True, text=True, timeout=600, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "throughput (req/s)" in out.stdout and (repo / "runs" / "demo" / "evolving.duckdb").exists()
