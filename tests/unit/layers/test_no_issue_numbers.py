"""Comments and docstrings in the code say why, not which issue asked for it (docs/architecture.md):
an issue number means nothing to a reader of the code, and the reason it stood for goes stale
unseen. The docs and commit messages keep the history."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
CODE = ("events", "services", "engine", "replay", "kernels", "scripts")
ISSUE = re.compile(r"\b[Ii]ssue \d+")


def issue_references(root: Path = ROOT) -> list[str]:
    out = []
    for top in CODE:
        for path in sorted((root / top).rglob("*.py")):
            for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                if ISSUE.search(line):
                    out.append(f"{path.relative_to(root)}:{n}: {line.strip()}")
    return out


def test_no_code_comment_names_an_issue():
    assert issue_references() == []


def test_the_check_can_fail(tmp_path):
    (tmp_path / "engine").mkdir()
    (tmp_path / "engine" / "x.py").write_text('"""A fix (issue 12 part 3)."""\n')
    assert issue_references(tmp_path) == ['engine/x.py:1: """A fix (issue 12 part 3)."""']
