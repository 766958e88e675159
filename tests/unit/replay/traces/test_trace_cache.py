"""Imported trace files cached in their compact form (replay/traces/importers/cache.py): the same
sessions back, keyed by the file's bytes and the importing code, never stale, never fatal."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from replay.traces.format import encode_session
from replay.traces.importers import cache, weka
from replay.traces.importers.weka import import_weka

WEKA = Path(__file__).resolve().parents[3] / "fixtures" / "traces" / "weka-claude-code"


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(cache.CACHE_ENV, str(tmp_path / "c"))
    return tmp_path / "c" / "traces"


def _encoded(res) -> list[bytes]:
    return [encode_session(s) for s in res.sessions]


def _entries(root: Path) -> list[Path]:
    return sorted(root.rglob("*.bin")) if root.exists() else []


def test_a_cached_import_is_the_same_sessions_without_parsing(cache_dir, monkeypatch):
    first = import_weka(WEKA)
    assert len(first.sessions) == 3 and len(_entries(cache_dir)) == 3

    def no_parse(*_a, **_k):
        raise AssertionError("parsed although cached")

    monkeypatch.setattr(weka, "_import_weka_bytes", no_parse)
    again = import_weka(WEKA)
    assert _encoded(again) == _encoded(first)
    # lists rebuilt from shared prefixes are still separate lists with the same ints
    reqs = [r for s in again.sessions for _, _, r in s.requests()]
    assert len({id(r.blocks) for r in reqs}) == len(reqs)


def test_a_changed_file_is_parsed_again(cache_dir, tmp_path):
    d = tmp_path / "t"
    shutil.copytree(WEKA, d)
    f = d / "trace_0504.json"
    import_weka(f)
    doc = json.loads(f.read_text())
    doc["requests"][0]["out"] += 7
    f.write_text(json.dumps(doc))
    (s,) = import_weka(f).sessions
    assert next(s.requests())[2].output_tokens == doc["requests"][0]["out"]
    assert len(_entries(cache_dir)) == 2  # one entry per content


def test_other_code_is_another_key_and_old_entries_go(cache_dir, monkeypatch):
    import_weka(WEKA / "trace_0504.json")
    (old,) = _entries(cache_dir)
    monkeypatch.setattr(cache, "_fingerprints", {weka._MODULE: "0" * 24})  # as if the importer changed
    assert cache.load(weka._MODULE, (WEKA / "trace_0504.json").read_bytes(), "trace_0504.json") is None
    import_weka(WEKA / "trace_0504.json")
    (new,) = _entries(cache_dir)
    assert new.parent.name == "0" * 24 and not old.exists()


def test_the_fingerprint_follows_the_code(monkeypatch, tmp_path):
    root = tmp_path / "repo"
    for rel in (weka._MODULE, *cache._CODE):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes((cache._ROOT / rel).read_bytes())
    monkeypatch.setattr(cache, "_ROOT", root)
    monkeypatch.setattr(cache, "_fingerprints", {})
    a = cache.fingerprint(weka._MODULE)
    (root / "replay/traces/format.py").write_text((root / "replay/traces/format.py").read_text() + "\n# edited\n")
    monkeypatch.setattr(cache, "_fingerprints", {})
    assert cache.fingerprint(weka._MODULE) != a


def test_a_corrupt_entry_is_a_miss_and_is_rewritten(cache_dir):
    want = _encoded(import_weka(WEKA / "trace_0291.json"))
    (entry,) = _entries(cache_dir)
    entry.write_bytes(entry.read_bytes()[:100])
    assert _encoded(import_weka(WEKA / "trace_0291.json")) == want
    assert cache.load(weka._MODULE, (WEKA / "trace_0291.json").read_bytes(), "trace_0291.json") is not None


def test_a_file_with_a_bad_record_is_not_cached(cache_dir, tmp_path):
    doc = json.loads((WEKA / "trace_0504.json").read_text())
    doc["requests"][1]["hash_ids"] = [1, True]
    f = tmp_path / "bad.json"
    f.write_text(json.dumps(doc))
    res = import_weka(f, skip_bad=True)
    assert res.skipped and res.sessions and _entries(cache_dir) == []
    assert import_weka(f, skip_bad=True).skipped  # reported again: it was parsed again


def test_an_empty_variable_turns_the_cache_off(monkeypatch):
    monkeypatch.setenv(cache.CACHE_ENV, "")
    assert cache.cache_dir() is None
    assert len(import_weka(WEKA).sessions) == 3


def test_an_unwritable_folder_is_no_error(monkeypatch, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    monkeypatch.setenv(cache.CACHE_ENV, str(blocker))
    assert len(import_weka(WEKA).sessions) == 3


def test_the_same_bytes_under_another_name_are_another_session(cache_dir, tmp_path):
    """A session's source (and, without an ``id`` field, its id) names the file: the key has it."""
    import_weka(WEKA / "trace_0291.json")
    other = tmp_path / "renamed.json"
    other.write_bytes((WEKA / "trace_0291.json").read_bytes())
    (s,) = import_weka(other).sessions
    assert s.source == "weka:renamed.json" and len(_entries(cache_dir)) == 2
