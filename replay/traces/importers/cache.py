"""Imported trace files cached in a compact binary form: parse a file once, read it back fast.

Importing the 100 calibration sessions (67 MB of kv-cache-tester JSON, 13.7 M block ids) is
mostly JSON decoding and hashing; every ``replay``/``compare``/``experiments`` row and every
``bench sim`` paid it again. An importer that produced a session from a file without any
problem stores it here; the next import of the same bytes by the same code reads it back.

**Where**: ``$EVOLVING_CACHE_DIR/traces/`` when the variable is set (``EVOLVING_CACHE_DIR=''``
turns the cache off), else ``$XDG_CACHE_HOME/evolving-infra/traces/`` (``~/.cache/...``).
One file per trace file, ``<key>.bin``, in a folder named by the code fingerprint.

**Never stale**: the key is the SHA-256 of the trace file's bytes and its name (an importer
names a session and its ``source`` after the file) together with the *fingerprint* of the code that turns bytes into sessions: the source text of this module, the
importer's module, ``_common.py``, ``replay/traces/format.py`` and ``events/hashing.py``, plus
msgspec's version and the format version. Any change of the file or of that code is another
key; folders of other fingerprints are removed when a new entry is written. A cache entry that
cannot be read (truncated, corrupt, another layout) is a miss and is rewritten. Writes go to a
temporary name and are renamed into place, so a reader never sees half a file; a folder that
cannot be written is no error (the import simply is not cached).

**Layout** (msgpack, ``_Entry``): the session with every ``Request``/``Compact`` block list
emptied; the session's distinct block hashes once, as little-endian uint64; and per block list,
in step order, ``(base, n, tail)``: the first ``n`` blocks of block list ``base`` (an earlier
one, ``-1`` for none) followed by the hashes at the uint32 indexes ``tail``. A prompt extends
the previous prompt of its branch, so ``tail`` is short and the lists are rebuilt by slicing;
equal hashes are one int object, as the importer makes them. Decoding gives back a session
equal to the imported one (tests/unit/replay/traces/test_trace_cache.py).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

import msgspec
import numpy as np

from replay.traces.format import FORMAT_VERSION, Compact, Request, Session
from replay.traces.importers._common import common_prefix

CACHE_ENV = "EVOLVING_CACHE_DIR"
LAYOUT = 1
_ROOT = Path(__file__).resolve().parents[3]
_CODE = ("replay/traces/importers/cache.py", "replay/traces/importers/_common.py", "replay/traces/format.py",
         "events/hashing.py")
_fingerprints: dict[str, str] = {}


class _Entry(msgspec.Struct, array_like=True):
    layout: int
    session: Session
    table: bytes  # distinct block hashes, uint64 little-endian
    lists: list[tuple[int, int, bytes]]  # (base list, prefix length, uint32 indexes into table)


_ENC = msgspec.msgpack.Encoder()
_DEC = msgspec.msgpack.Decoder(_Entry)


def cache_dir() -> Path | None:
    """The cache folder (module docstring), or ``None`` when ``EVOLVING_CACHE_DIR`` is empty."""
    env = os.environ.get(CACHE_ENV)
    if env is not None:
        return Path(env) / "traces" if env.strip() else None
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "evolving-infra" / "traces"


def fingerprint(importer: str) -> str:
    """The code fingerprint for ``importer`` (a module path relative to the repository root)."""
    fp = _fingerprints.get(importer)
    if fp is None:
        h = hashlib.sha256(f"layout {LAYOUT} format {FORMAT_VERSION} msgspec {msgspec.__version__}".encode())
        for rel in (importer, *_CODE):
            h.update(rel.encode() + b"\0" + (_ROOT / rel).read_bytes() + b"\0")
        fp = _fingerprints[importer] = h.hexdigest()[:24]
    return fp


def _path(importer: str, raw: bytes, name: str) -> Path | None:
    root = cache_dir()
    if root is None:
        return None
    key = hashlib.sha256(name.encode() + b"\0" + raw).hexdigest()
    return root / fingerprint(importer) / f"{key}.bin"


def load(importer: str, raw: bytes, name: str) -> Session | None:
    """The session cached for ``raw`` (the bytes of a trace file called ``name``) imported by
    ``importer``, or ``None``."""
    p = _path(importer, raw, name)
    if p is None:
        return None
    try:
        entry = _DEC.decode(p.read_bytes())
        if entry.layout != LAYOUT:
            return None
        return _decode(entry)
    except (OSError, msgspec.DecodeError, ValueError, IndexError, TypeError, StopIteration):
        return None  # absent or unreadable: a miss (rewritten by the caller's store)


def store(importer: str, raw: bytes, name: str, session: Session) -> None:
    """Cache ``session``, imported from ``raw`` (a file called ``name``) without any problem;
    silent when it cannot."""
    p = _path(importer, raw, name)
    if p is None:
        return
    try:
        data = _ENC.encode(_encode(session))
    except (OverflowError, ValueError):  # a hash outside uint64: not cached, imported each time
        return
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=".tmp-")
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.replace(tmp, p)
        for other in p.parent.parent.iterdir():  # entries of other code versions never match again
            if other.is_dir() and other.name != p.parent.name and not other.name.startswith("."):
                shutil.rmtree(other, ignore_errors=True)
    except OSError:
        return


def _encode(s: Session) -> _Entry:
    index: dict[int, int] = {}
    lists: list[tuple[int, int, bytes]] = []
    seen: list[list[int]] = []
    last_of: dict[str, int] = {}  # branch -> its last block list
    branches = []
    for b in s.branches:
        steps = []
        for st in b.steps:
            if isinstance(st, (Request, Compact)):
                base = last_of.get(b.id, len(seen) - 1)
                n = common_prefix(seen[base], st.blocks) if base >= 0 else 0
                tail = [index.setdefault(h, len(index)) for h in st.blocks[n:]]
                lists.append((base if n else -1, n, np.array(tail, dtype="<u4").tobytes()))
                last_of[b.id] = len(seen)
                seen.append(st.blocks)
                st = msgspec.structs.replace(st, blocks=[])
            steps.append(st)
        branches.append(msgspec.structs.replace(b, steps=steps))
    table = np.array(list(index), dtype="<u8").tobytes()
    return _Entry(LAYOUT, msgspec.structs.replace(s, branches=branches), table, lists)


def _decode(e: _Entry) -> Session:
    table = np.frombuffer(e.table, dtype="<u8").tolist()
    built: list[list[int]] = []
    for base, n, tail in e.lists:
        blocks = built[base][:n] if n else []
        if tail:
            blocks += [table[i] for i in np.frombuffer(tail, dtype="<u4").tolist()]
        built.append(blocks)
    it = iter(built)
    branches = []
    for b in e.session.branches:
        steps = [msgspec.structs.replace(st, blocks=next(it)) if isinstance(st, (Request, Compact)) else st
                 for st in b.steps]
        branches.append(msgspec.structs.replace(b, steps=steps))
    if next(it, None) is not None:
        raise ValueError("cache entry: more block lists than steps")
    return msgspec.structs.replace(e.session, branches=branches)
