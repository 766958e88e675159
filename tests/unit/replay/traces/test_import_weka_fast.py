"""The weka importer's fast paths give what the plain ones gave: the chunked prefix length, the
keyed BLAKE2b copy, and prompts mapped from their thread's previous prompt."""

from __future__ import annotations

from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from events.hashing import namespaced_hash
from replay.traces.importers._common import common_prefix
from replay.traces.importers.weka import _hash, _keyed_blake2b, import_weka

WEKA = Path(__file__).resolve().parents[3] / "fixtures" / "traces" / "weka-claude-code"


def _naive_prefix(a: list[int], b: list[int]) -> int:
    i = 0
    while i < min(len(a), len(b)) and a[i] == b[i]:
        i += 1
    return i


@given(st.lists(st.integers(0, 3), max_size=300), st.lists(st.integers(0, 3), max_size=300), st.integers(0, 300))
def test_common_prefix_is_the_element_loop(a, b, shared):
    b = a[:shared] + b  # long shared prefixes: the chunked path
    assert common_prefix(a, b) == _naive_prefix(a, b) == common_prefix(b, a)


@given(st.text(max_size=80), st.integers(-(2**63), 2**63 - 1))
def test_the_keyed_copy_is_namespaced_hash(ns, local_id):
    assert _hash(_keyed_blake2b(ns), local_id) == namespaced_hash(ns, local_id)


def test_every_request_maps_each_of_its_ids(monkeypatch):
    """Blocks reused from the previous prompt are the ids' own namespaced hashes."""
    import json

    monkeypatch.setenv("EVOLVING_CACHE_DIR", "")
    for f in sorted(WEKA.glob("*.json")):
        (s,) = import_weka(f).sessions
        doc = json.loads(f.read_text())
        ns = f"weka:{s.id}"
        ids = [r["hash_ids"] for r in doc["requests"] if r.get("type") != "subagent"]
        main = [r for b, _, r in s.requests() if not b.id.startswith("agent") and b.mode != "subagent"]
        assert len(main) == len(ids)
        for r, want in zip(main, ids, strict=True):
            assert r.blocks == [namespaced_hash(ns, h) for h in want]
