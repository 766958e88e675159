"""A trace file nested 100k deep is a one-line error naming the file, not a traceback:
every importer checks the nesting of its JSON text before decoding it
(``replay.traces.format.MAX_JSON_DEPTH``, ``events.jsondepth``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from events.jsondepth import nesting_depth
from replay.traces.format import MAX_JSON_DEPTH, TraceFormatError, decode_session, save_sessions
from replay.traces.importers.spec import load_workload
from replay.traces.workloads import generate
from services.drivers.cli import main

DEEP = 100_000


def _arrays(n: int) -> str:
    return "[" * n + "]" * n


#: (file name, content, explicit format): each as its format's content detection sees it
CASES = {
    "sessions": ("deep.jsonl", '{"format_version": 1, "id": "s", "x": ' + _arrays(DEEP) + "}\n", "sessions"),
    "kv-cache-tester": ("deep.json", '{"requests": ' + _arrays(DEEP) + "}", "weka"),
    "bare array": ("deep2.json", _arrays(DEEP), "weka"),
    "mooncake": ("deep_mc.jsonl", '{"input_length": 1, "hash_ids": ' + _arrays(DEEP) + "}\n", "mooncake"),
    "agentic": ("deep_ag.jsonl", '{"request_id": "r", "hash_ids": [], "wait_for": ' + _arrays(DEEP) + "}\n",
                "agentic-mooncake"),
    "claude-code": ("deep_cc.jsonl", '{"sessionId": "a", "message": ' + '{"a":' * DEEP + "1" + "}" * DEEP
                    + "}\n", "claude-code"),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("explicit", [False, True], ids=["detected", "named"])
def test_a_trace_nested_100k_deep_is_an_error_naming_the_file(tmp_path, case, explicit):
    name, text, fmt = CASES[case]
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(TraceFormatError) as ei:
        load_workload(f"{fmt}:{path}" if explicit else str(path))
    e = ei.value
    assert e.file == str(path) and e.field == "(json)", str(e)
    assert f"(the limit is {MAX_JSON_DEPTH})" in e.message and "deep" in e.message, str(e)


def test_the_commands_print_one_line(tmp_path, capsys):
    path = tmp_path / "deep.json"
    path.write_text(CASES["kv-cache-tester"][1])
    assert main(["trace", "stats", str(path)]) != 0
    err = capsys.readouterr().err
    assert err.startswith(f"error: {path}:0: (json): JSON nested {DEEP + 1} deep") and "Traceback" not in err


def test_in_a_folder_the_deep_file_is_skipped_and_the_rest_served(tmp_path):
    d = tmp_path / "traces"
    d.mkdir()
    save_sessions(d / "a_good.jsonl", generate("cc", seed=0, agents=2))
    (d / "b_deep.jsonl").write_text(CASES["sessions"][1])
    w = load_workload(str(d))
    assert len(w.sessions) == 2
    (skipped,) = w.skipped
    assert skipped.file == str(d / "b_deep.jsonl") and "deep" in skipped.message


def test_a_session_line_at_the_limit_still_decodes_to_its_own_error():
    """Depth alone is no error: a line nested just within the limit gets the decoder's verdict."""
    ok = '{"format_version": 1, "id": "s", "x": ' + _arrays(MAX_JSON_DEPTH - 1) + "}"
    with pytest.raises(TraceFormatError) as ei:
        decode_session(ok, "f.jsonl", 3)
    assert "nested" not in ei.value.message  # a missing field, not the depth


def test_a_real_trace_is_far_from_the_limit():
    fixtures = Path(__file__).resolve().parents[3] / "fixtures" / "traces"
    files = sorted(fixtures.rglob("*.json*"))[:40]
    assert files and max(nesting_depth(f.read_bytes()) for f in files if not f.name.endswith(".gz")) < 16
