"""The plain-words check before DuckDB opens a file: a gzip file is named as one, and a DuckDB file
whose header checksum happens to start with gzip's magic bytes is still a DuckDB file."""

from __future__ import annotations

import gzip

import pytest

from services.adapters.eventlog.duckdb_log import DuckDbEventLog, _check_file
from services.adapters.eventlog.port import EventLogError


def test_a_gzip_file_is_named_as_one(tmp_path):
    path = tmp_path / "run.duckdb"
    path.write_bytes(gzip.compress(b"not a log"))
    with pytest.raises(EventLogError, match="gzip-compressed"):
        _check_file(str(path))


def test_a_duckdb_header_checksum_that_starts_like_gzip_is_not_taken_for_gzip(tmp_path):
    DuckDbEventLog(tmp_path / "real.duckdb").close()
    data = bytearray((tmp_path / "real.duckdb").read_bytes())
    assert data[8:12] == b"DUCK"  # the magic after the 8-byte checksum
    data[:2] = b"\x1f\x8b"  # what 1 checksum in 65,536 looks like
    path = tmp_path / "unlucky.duckdb"
    path.write_bytes(bytes(data))
    _check_file(str(path))  # no error: the magic says DuckDB
