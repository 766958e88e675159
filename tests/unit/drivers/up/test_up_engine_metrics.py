"""``evolving up`` gives each engine worker a metrics port, listed with the services' ones."""

from __future__ import annotations

import argparse

from services.drivers.up.launch import plan_children, start_fields
from services.drivers.up.options import UpSpec, add_up_args, up_spec


def _args(*argv: str) -> UpSpec:
    p = argparse.ArgumentParser()
    add_up_args(p)
    return up_spec(p.parse_args(["--engines", "2", "--insecure", *argv]), clock_epoch=0.0)


def _port(cmd: list[str]) -> str | None:
    return cmd[cmd.index("--metrics-port") + 1] if "--metrics-port" in cmd else None


def test_engines_get_metrics_ports_after_the_services(tmp_path):
    children, urls = plan_children(_args("--metrics-port", "9100"), "nats://x:1", tmp_path, tmp_path / "r.duckdb")
    by = {c.name: c.cmd for c in children}
    assert [_port(by[n]) for n in ("recorder", "directory", "planner", "router")] == ["9100", "9101", "9102", "9103"]
    assert (_port(by["engine-n0"]), _port(by["engine-n1"])) == ("9104", "9105")
    assert urls["metrics"]["engine-n1"] == "http://127.0.0.1:9105/metrics"
    assert start_fields(urls)["metrics"].endswith(",engine-n0:9104,engine-n1:9105")


def test_free_ports_and_off(tmp_path):
    children, urls = plan_children(_args("--metrics-port", "0"), "nats://x:1", tmp_path, tmp_path / "r.duckdb")
    ports = {c.name: _port(c.cmd) for c in children if c.name.startswith("engine-")}
    assert all(p and int(p) > 0 for p in ports.values()) and len(set(ports.values())) == 2
    children, urls = plan_children(_args("--metrics-port", "-1"), "nats://x:1", tmp_path, tmp_path / "r.duckdb")
    assert not any("--metrics-port" in c.cmd for c in children) and urls["metrics"] == {}
