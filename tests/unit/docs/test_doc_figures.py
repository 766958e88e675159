"""Every figure in the docs carries its date, and the command that produced it (issue 48 part 5).

A section of README.md or docs/*.md that holds a table of figures (two rows or more, each with at
least two number cells: `4.88`, `1,002`, `23.0x`, `40.6%`, `0.35 s`) must name:

- in its own text (from its heading to the next heading), a date: `2026-12-06`, `6 Dec 2026`, or
  the words `date not recorded` (where git does not know it either: then say so, never guess); a
  section above often dates other figures than a subsection's;
- in its own text or the opening text of a section above it (the part before that section's first
  subheading), the machine (`2-core`, `cores`, `machine`, `VM`, `CPU`, `H100`, ...: a loose check,
  it catches a table with no word about where it ran; statistics of files say they are the same on
  any machine) and a command: a fenced sh/bash/console block, or an inline `` `evolving ...` ``, `` `python ...` ``,
  `` `pytest ...` ``, `` `bash ...` `` or `` `scripts/...` ``.

A table of numbers that are not measurements (a profile's parameters, a definition) says so in its
section: `<!-- figures: not measured (why) -->`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b|\b\d{1,2} (Nov|Dec)[a-z]* 20\d\d\b|date not recorded", re.IGNORECASE)
COMMAND = re.compile(r"`(\.venv/bin/)?(evolving|python3?|pytest|bash|scripts/)[ /][^`]*`|^\s*```(sh|bash|console)\s*$",
                     re.MULTILINE)
MACHINE = re.compile(r"\d-core|\bcores?\b|machine|\bVM\b|\bbox\b|\bCPU|\bGPU|H100|H200", re.IGNORECASE)
NOT_MEASURED = re.compile(r"<!--\s*figures:\s*not measured\s*\((.+?)\)\s*-->")
NUMBER = re.compile(r"^\s*\**[~<>+-]?\s*\d[\d,]*(\.\d+)?\s*(x|×|%|s|ms|us|µs|GB|GiB|MB|MiB|req/s|/s)?\**\s*$")


@dataclass
class Section:
    doc: str
    line: int
    level: int
    title: str
    body: list[str]


def sections(text: str, doc: str = "-") -> list[tuple[Section, list[Section]]]:
    """Each section (split at every heading #..####, fences respected) with its ancestors."""
    lines = text.splitlines()
    flat: list[Section] = [Section(doc, 1, 0, "(top)", [])]
    fence = False
    for i, line in enumerate(lines):
        if line.strip().startswith("```"):
            fence = not fence
        m = None if fence else re.match(r"^(#{1,4}) \S", line)
        if m:
            flat.append(Section(doc, i + 1, len(m.group(1)), line.strip(), []))
        flat[-1].body.append(line)
    out, stack = [], []
    for s in flat:
        while stack and stack[-1].level >= s.level:
            stack.pop()
        out.append((s, list(stack)))
        stack.append(s)
    return out


def figure_rows(body: list[str]) -> int:
    rows = 0
    for line in body:
        if line.strip().startswith("|"):
            cells = line.strip().strip("|").split("|")
            rows += sum(bool(NUMBER.match(c)) for c in cells) >= 2
    return rows


def audit(text: str, doc: str = "-") -> list[str]:
    bad = []
    for s, ancestors in sections(text, doc):
        own = "\n".join(s.body)
        if figure_rows(s.body) < 2 or NOT_MEASURED.search(own):
            continue
        context = "\n".join([own, *("\n".join(a.body) for a in ancestors)])
        missing = [what for what, rx, text in (("a date", DATE, own), ("a machine", MACHINE, context),
                                               ("a command", COMMAND, context)) if not rx.search(text)]
        if missing:
            bad.append(f"{doc}:{s.line}: {s.title[:70]!r}: a table of figures without {' or '.join(missing)}")
    return bad


def docs() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_every_table_of_figures_has_its_date_and_command():
    bad = [b for d in docs() for b in audit(d.read_text(), str(d.relative_to(ROOT)))]
    assert not bad, ("each section with a table of figures names the date it was measured (2026-12-06, "
                     "6 Dec 2026, or 'date not recorded') and the command (docs/../test_doc_figures.py):\n"
                     + "\n".join(bad))


def test_the_audit_can_fail():
    table = "| run | a | b |\n|---|---|---|\n| x | 1.5 | 20% |\n| y | 2,000 | 3.1x |\n"
    assert audit(f"# A\n\n## B\n{table}") == [
        "-:3: '## B': a table of figures without a date or a machine or a command"]
    assert audit(f"# A\n\n## B\nOn 6 Dec 2026, 2 cores:\n{table}") == [
        "-:3: '## B': a table of figures without a command"]
    # the machine and the command may stand in the opening text of a section above; the date may not
    assert audit(f"# A\nOn the 2-core VM, `evolving bench sim`.\n\n## B\n\n### C\n2026-12-01\n{table}") == []
    assert audit(f"# A\n2026-12-01 on this machine, `evolving bench sim`\n\n## B\n{table}") == [
        "-:4: '## B': a table of figures without a date"]
    # ... but not in a sibling's
    assert audit(f"# A\n\n## B\n2026-12-01 machine `evolving x`\n\n## C\n{table}") != []
    assert audit(f"## B\n<!-- figures: not measured (a profile's parameters) -->\n{table}") == []
    assert audit("## B\n| a | b | c |\n|---|---|---|\n| 1 | 2 | 3 |\n") == []  # one row is not a table of figures
    assert audit(f"## B\n```text\n# not a heading\n```\ndate not recorded, 2 cores; `python -m x`\n{table}") == []
