from pathlib import Path

from events.doc import render


def test_events_doc_is_in_sync_with_the_catalog():
    page = Path(__file__).resolve().parents[3] / "docs" / "events.md"
    assert page.read_text() == render(), "docs/events.md is stale: run `python -m events.doc > docs/events.md`"
