"""Helpers shared by the importers: results, error location in JSON text, prefix length."""

from __future__ import annotations

import gzip
import json
import json.scanner
import os
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from replay.traces.format import GZIP_MAGIC, Session, TraceFormatError, depth_error, sniff


@dataclass
class ImportResult:
    """What an importer produced, and (with ``skip_bad``) what it skipped and why."""

    sessions: list[Session] = field(default_factory=list)
    skipped: list[TraceFormatError] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


class Problems:
    """Collects bad input: raises at once, or (``skip_bad``) records and lets the caller skip.
    ``skip_bad_files``: a problem with a whole file (field ``(file)``: empty, binary, gzip) is
    recorded and the file skipped even without ``skip_bad`` (folder loads, spec.py)."""

    def __init__(self, skip_bad: bool, result: ImportResult, skip_bad_files: bool = False):
        self.skip_bad, self.result, self.skip_bad_files = skip_bad, result, skip_bad_files

    def bad(self, file: str, line: int, field_path: str, message: str) -> None:
        err = TraceFormatError(file, line, field_path, message)
        if not self.skip_bad and not (self.skip_bad_files and field_path == "(file)"):
            raise err
        self.result.skipped.append(err)


_SNIFF = 8192


def check_text_file(path: str | os.PathLike[str], problems: Problems, *, gzip_ok: bool = False) -> bool:
    """Sniff ``path``: report a one-line problem (line 0, field ``(file)``) and return False if it
    is empty, binary or (unless ``gzip_ok``) gzip; True when it looks like text."""
    with open(path, "rb") as fh:
        head = fh.read(_SNIFF)
    why = sniff(head, gzip_ok=gzip_ok)
    if why is not None:
        problems.bad(str(path), 0, "(file)", why)
        return False
    return True


def read_text(path: str | os.PathLike[str], problems: Problems) -> str | None:
    """The text of a JSON document, gunzipped when it is gzip data (by content, not by name);
    ``None`` (after reporting to ``problems``) when empty, binary or a corrupt gzip stream."""
    return decode_text(str(path), Path(path).read_bytes(), problems)


def decode_text(file: str, raw: bytes, problems: Problems) -> str | None:
    """:func:`read_text` of bytes already read from ``file``."""
    if raw.startswith(GZIP_MAGIC):
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError, zlib.error) as exc:
            problems.bad(file, 0, "(file)", f"corrupt gzip data: {exc}")
            return None
    why = sniff(raw[:_SNIFF], gzip_ok=False)
    if why is None:
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            why = f"binary data, not UTF-8 JSON text (byte {exc.start})"
    problems.bad(file, 0, "(file)", why)
    return None


def json_lines(path: str | os.PathLike[str], problems: Problems) -> Iterator[tuple[int, dict[str, Any]]]:
    """``(line number, object)`` for every non-blank line of a JSONL file; a line that is not
    valid JSON or not an object is reported to ``problems`` (raise, or record and skip). An
    empty, binary or gzip file is one problem (see :func:`sniff`) and yields nothing."""
    file = str(path)
    if not check_text_file(path, problems):
        return
    with open(path, "rb") as fh:
        for lineno, raw in enumerate(fh, start=1):
            if not raw.strip():
                continue
            deep = depth_error(raw, file, lineno)
            if deep is not None:
                problems.bad(file, lineno, deep.field, deep.message)
                continue
            try:
                rec = json.loads(raw)
            except json.JSONDecodeError as exc:
                problems.bad(file, lineno, "(json)", f"not valid JSON: {exc.msg} (column {exc.colno})")
                continue
            if not isinstance(rec, dict):
                problems.bad(file, lineno, "(line)", "must be a JSON object")
                continue
            yield lineno, rec


_PREFIX_CHUNK = 64


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two block lists (lists: slices are compared).

    Slices are compared in C (the whole common length first: a prompt usually extends the
    previous one), then chunks of ``_PREFIX_CHUNK``; only the first unequal chunk is walked
    element by element. The same answer as the element loop, ~50x faster on real prompts."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    i = 0
    while i + _PREFIX_CHUNK <= n and a[i:i + _PREFIX_CHUNK] == b[i:i + _PREFIX_CHUNK]:
        i += _PREFIX_CHUNK
    while i < n and a[i] == b[i]:
        i += 1
    return i


class _PositionDecoder(json.JSONDecoder):
    """A JSON decoder that records where every object and array starts (pure-Python scanner)."""

    def __init__(self) -> None:
        super().__init__()
        self.positions: dict[int, int] = {}
        parse_object, parse_array = self.parse_object, self.parse_array

        def obj(s_and_end, *args):  # type: ignore[no-untyped-def]
            value, end = parse_object(s_and_end, *args)
            self.positions[id(value)] = s_and_end[1] - 1
            return value, end

        def arr(s_and_end, scan_once, *args):  # type: ignore[no-untyped-def]
            value, end = parse_array(s_and_end, scan_once, *args)
            self.positions[id(value)] = s_and_end[1] - 1
            return value, end

        self.parse_object, self.parse_array = obj, arr
        self.scan_once = json.scanner.py_make_scanner(self)


def locate(text: str, path: Sequence[str | int]) -> tuple[int, int]:
    """(line, column), 1-based, of the JSON value at ``path`` (or its nearest container)."""
    dec = _PositionDecoder()
    try:
        node: Any = dec.decode(text)
    except ValueError:
        return 0, 0
    pos = dec.positions.get(id(node), 0)
    for key in path:
        try:
            node = node[key]
        except (KeyError, IndexError, TypeError):
            break
        pos = dec.positions.get(id(node), pos)
    line = text.count("\n", 0, pos) + 1
    col = pos - (text.rfind("\n", 0, pos) + 1) + 1
    return line, col


def json_path(path: Sequence[str | int]) -> str:
    out = ""
    for p in path:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else p)
    return out or "(document)"
