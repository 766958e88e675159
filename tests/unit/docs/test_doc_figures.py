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

Figures in prose (outside tables, code and inline code): a number with a fraction and a unit
(`2.19x`, `0.73 ms`, `34.5 s`, `1.4 tokens/s`, `55.5%`, `1.9 GB`) is taken as measured; round
numbers are mostly settings (a 600 s timeout, 64 MiB), so they are not (a loose rule: it catches a
section of measurements with no word of when and how, not every figure). A section that states
one carries a date and a command in its own text or in the opening text of a section above it
(prose often dates a whole story once, at its start), or a link to a section that has them
(`[how](#anchor)`, `[how](other.md#anchor)`), or the not-measured note (the paper's figures,
settings written with a fraction), which in an opening text above covers the subsections' prose. Where git knows the date but not the command: `command not
recorded`.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b|\b\d{1,2} (Nov|Dec)[a-z]* 20\d\d\b|date not recorded", re.IGNORECASE)
COMMAND = re.compile(r"`(\.venv/bin/)?(evolving|python3?|pytest|bash|scripts/)[ /][^`]*`|^\s*```(sh|bash|console)\s*$"
                     r"|command not recorded", re.MULTILINE)
MACHINE = re.compile(r"\d-core|\bcores?\b|machine|\bVM\b|\bbox\b|\bCPU|\bGPU|H100|H200", re.IGNORECASE)
NOT_MEASURED = re.compile(r"<!--\s*figures:\s*not measured\s*\((.+?)\)\s*-->")
#: a figure in prose taken as measured: a fraction and a unit
PROSE_FIGURE = re.compile(r"(?<![\w.])[~≈]?\d[\d,]*\.\d+\s?(req/s|tok/s|tokens/s|ms|s|x|×|%|GB|GiB|MB|MiB)(?![\w/])")
LINK = re.compile(r"\]\(([\w./-]*\.md)?#([\w-]+)\)")
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


def prose_figures(body: list[str]) -> list[str]:
    """The measured-looking figures of a section's prose (no tables, code, inline code, comments)."""
    out, fence = [], False
    for line in body:
        if line.strip().startswith("```"):
            fence = not fence
            continue
        if fence or line.strip().startswith("|"):
            continue
        line = re.sub(r"<!--.*?-->", "", re.sub(r"`[^`]*`", "", line))
        out += [m.group(0) for m in PROSE_FIGURE.finditer(line)]
    return out


def slug(title: str) -> str:
    """A heading's anchor as GitHub makes it."""
    text = re.sub(r"[^\w\- ]", "", title.lstrip("#").strip().lower())
    return text.replace(" ", "-")


def audit(text: str, doc: str = "-", others: dict[str, str] | None = None) -> list[str]:
    """``others``: the text of the other docs by path relative to the repository (links to them)."""
    bad = []
    for s, ancestors in sections(text, doc):
        own = "\n".join(s.body)
        if NOT_MEASURED.search(own):
            continue
        context = "\n".join([own, *("\n".join(a.body) for a in ancestors)])
        if figure_rows(s.body) >= 2:
            missing = [what for what, rx, text in (("a date", DATE, own), ("a machine", MACHINE, context),
                                                   ("a command", COMMAND, context)) if not rx.search(text)]
            if missing:
                bad.append(f"{doc}:{s.line}: {s.title[:70]!r}: a table of figures without {' or '.join(missing)}")
        figures = prose_figures(s.body)
        if not figures or NOT_MEASURED.search(context):  # a note above covers its subsections' prose
            continue
        opening = context  # each section's own text ends at its first subheading: the opening
        missing = [what for what, rx in (("a date", DATE), ("a command", COMMAND)) if not rx.search(opening)]
        if missing and not any(_dated(text if not f else (others or {}).get(_rel(doc, f), ""), anchor)
                               for f, anchor in LINK.findall(own)):
            bad.append(f"{doc}:{s.line}: {s.title[:70]!r}: figures in prose ({', '.join(figures[:3])}) without "
                       f"{' or '.join(missing)}, or a link to the section that has them")
    return bad


def _rel(doc: str, link: str) -> str:
    """A link's target doc, relative to the repository, from the doc it stands in."""
    return link if link.startswith("docs/") else os.path.normpath(Path(doc).parent / link).replace("\\", "/")


def _dated(text: str, anchor: str) -> bool:
    """Whether the section ``anchor`` of ``text`` carries a date and a command (as above)."""
    for s, ancestors in sections(text):
        if slug(s.title) == anchor:
            opening = "\n".join(["\n".join(s.body), *("\n".join(a.body) for a in ancestors)])
            return bool(DATE.search(opening) and COMMAND.search(opening))
    return False


def docs() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_every_table_of_figures_has_its_date_and_command():
    texts = {str(d.relative_to(ROOT)): d.read_text() for d in docs()}
    bad = [b for doc, text in texts.items() for b in audit(text, doc, texts)]
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


def test_the_prose_audit_can_fail():
    bad = "# A\n\n## B\nThe engine ran at 2.19x the baseline.\n"
    assert audit(bad) == [("-:3: '## B': figures in prose (2.19x) without a date or a command, "
                           "or a link to the section that has them")]
    assert audit("## B\nOn 2026-12-06 it ran at 2.19x.\n") == [
        "-:1: '## B': figures in prose (2.19x) without a command, or a link to the section that has them"]
    assert audit("## B\nOn 2026-12-06 (`evolving bench engine`) it ran at 2.19x.\n") == []
    # round numbers are settings, not figures; code and tables are not prose
    assert audit("## B\nA 600 s timeout, 64 MiB, `--x 1.5s`.\n```sh\nsleep 0.5s\n```\n") == []
    # dated in the opening text of a section above, or in the section a link names
    assert audit("# A\n2026-12-06, `evolving bench x`\n\n## B\nIt took 3.4 s.\n") == []
    assert audit("# A\n\n## B\n2026-12-06, `evolving bench x`\n\n## C\nIt took 3.4 s.\n") != []
    linked = "## B\nIt took 3.4 s ([how](#how-measured)).\n\n## How measured\n"
    assert audit(linked + "2026-12-06, `evolving bench x`\n") == []
    assert audit(linked + "Some day.\n") != []  # the section it names must carry them
    assert audit("## B\nIt took 3.4 s ([how](other.md#runs)).\n", "docs/a.md",
                 {"docs/other.md": "## Runs\n2026-12-06, `evolving bench x`\n"}) == []
    assert audit("## B\n<!-- figures: not measured (the paper's) -->\nThe paper's 2.19x.\n") == []
    assert audit("# A\n<!-- figures: not measured (the paper's) -->\n## B\nThe paper's 2.19x.\n") == []
