"""``scripts/demo.sh``: the sessions it replays are bundled with their LICENSE
and source, its flags are ``evolving compare``'s, and docs/demo.md shows the table it prints."""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

from replay.sim.cli import register_sim
from replay.sim.report import ROWS
from replay.traces.importers.spec import load_workload

ROOT = Path(__file__).resolve().parents[2]
BUNDLE = ROOT / "deploy" / "traces" / "calibration"


def _demo_argv() -> list[str]:
    text = (ROOT / "scripts" / "demo.sh").read_text().replace("\\\n", " ")
    line = next(x for x in text.splitlines() if x.startswith("exec .venv/bin/evolving compare"))
    return shlex.split(line)[3:-1]  # after `evolving compare`, without "$@"


def test_the_demo_sessions_are_bundled_with_their_license_and_source():
    files = sorted(BUNDLE.glob("trace_*.json.gz"))
    assert len(files) == 34 and sum(f.stat().st_size for f in files) < 3_000_000  # a few MB at most
    assert "Apache License" in (BUNDLE / "LICENSE").read_text()
    readme = (BUNDLE / "README.md").read_text()
    assert "github.com/callanjfox/kv-cache-tester" in readme and "94f6046dfd9c0c8bc0cdb24a5aa6579bac8669bf" in readme
    w = load_workload(str(BUNDLE))
    assert len(w.sessions) == 34 and not w.skipped


def test_the_demo_replays_the_bundle_at_agent_pace_in_the_pressure_profile():
    p = argparse.ArgumentParser()
    sub = p.add_subparsers()
    register_sim(sub, sub.add_parser("bench").add_subparsers())  # compare's own parser
    args = p.parse_args(["compare", *_demo_argv()])
    assert Path(ROOT / args.trace).resolve() == BUNDLE and args.pace == "agent" and args.agents == 126
    assert args.profile == "gb300-glm52-pressure" and args.nodes == 9


def test_the_readme_shows_the_rows_the_demo_table_prints():
    doc = (ROOT / "docs" / "demo.md").read_text()  # the README points there for what the demo printed
    demo = doc[doc.index("`scripts/demo.sh` replays 34 real"):doc.index("## The tests")]
    labels = re.findall(r"^[│|] ?([a-zA-Z][^│|]*?) +[│|]", demo, flags=re.MULTILINE)
    wanted = [label for label, *_ in ROWS] + ["time in split"]
    assert [x for x in labels if x in wanted] == wanted  # every row, in the table's order
    for label in ("lost KV reuse", "idle prefill GPU time", "KV demand peak / host KV"):
        assert label in demo
