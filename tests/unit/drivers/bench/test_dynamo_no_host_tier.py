"""``bench dynamo --offline --host-kv-tokens 0`` (our nodes with the mocker's tiers: GPU only):
every request finds at its prefill start the prefix the router planned on. Before, the
least-TTFT router planned fetches from a peer's GPU tier into nodes that have no host tier for
the fetch to land in (engine/backends/sim/node.py ``_receive``): the fetch never happened and
the prefix was recomputed (108 of 950 requests on the pressure cut, P95 TTFT 5.74 s against the
real Dynamo's 3.79; docs/experiments.md, "Offline in the pressure regime"). On this fixture cut
the old router planned 2 such fetches."""

from __future__ import annotations

from pathlib import Path

import duckdb
import pytest

from services.drivers.bench.dynamo import OfflineSpec, run_offline

FIXTURE = str(Path(__file__).resolve().parents[3] / "fixtures" / "traces" / "weka-claude-code")


def _run(tmp_path: Path, **kw) -> duckdb.DuckDBPyConnection:
    s = OfflineSpec(trace=FIXTURE, sessions=3, turns=20, block_tokens=64, concurrency=3,
                    profile="gb300-glm52-pressure", prefill=3, decode=1, stacks=("evolving",), **kw)
    res = run_offline(s, python=tmp_path / "none", work=tmp_path, keep_logs=True)
    return duckdb.connect(res["logs"]["evolving"], read_only=True)


def _planned_but_missing(con) -> int:
    """Requests that found less of their prompt cached at prefill start than the router planned."""
    return con.execute("SELECT count(*) FROM mat_requests WHERE t_c > prefill_cached_tokens"
                   " + prefill_restored_tokens + prefill_fetched_tokens").fetchone()[0]


def test_with_no_host_tier_no_fetch_is_planned_and_every_planned_prefix_is_found(tmp_path: Path) -> None:
    with _run(tmp_path, host_kv_tokens=0) as con:
        n, fetch_plans = con.execute("SELECT count(*), count(*) FILTER (WHERE fetched_tokens > 0)"
                                 " FROM mat_route_decisions").fetchone()
        assert n == 43 and fetch_plans == 0
        assert _planned_but_missing(con) == 0
        # the nodes were registered without a host tier, which is what the router read
        assert con.execute("SELECT count(*) FROM ev_node_registered WHERE l2_capacity_tokens = 0"
                       " AND l1_capacity_tokens > 0").fetchone()[0] == 4


@pytest.mark.parametrize("host", [None, 7_400_000])
def test_with_a_host_tier_planned_prefixes_are_found_too(tmp_path: Path, host) -> None:
    kw = {} if host is None else {"host_kv_tokens": host}
    with _run(tmp_path, **kw) as con:
        assert _planned_but_missing(con) == 0
