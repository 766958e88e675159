"""``evolving up`` writes its ready file only once every engine's ``NodeRegistered`` is on the
stream; when one is still missing after ``--ready-timeout-s`` it writes none, stops, and
names the missing engines."""

from __future__ import annotations

import argparse
import asyncio
import json

from events.catalog import NodeHeartbeat, NodeRegistered
from services.adapters.bus import InMemoryBus
from services.drivers.up.launch import Up, plan_children
from services.drivers.up.options import add_up_args, up_spec


def _up(tmp_path, timeout_s: float) -> Up:
    p = argparse.ArgumentParser()
    add_up_args(p)
    spec = up_spec(p.parse_args(["--engines", "3", "--insecure", "--no-gateway", "--metrics-port", "-1", "--partition", "rp",
                                    "--run-dir", str(tmp_path / "run"), "--ready-file", str(tmp_path / "ready.json"),
                                    "--ready-timeout-s", str(timeout_s)]))
    up = Up(spec)
    up.children, up.urls = plan_children(up.spec, "nats://x:1", up.run_dir, up.db)
    return up


async def test_ready_file_waits_for_every_engine_registration(tmp_path):
    up, bus = _up(tmp_path, 20.0), InMemoryBus("rp")
    ready = asyncio.create_task(up._write_ready(bus))
    await bus.publish(NodeRegistered(ts=1.0, src="n0", node="n0", role="collocated"))
    await bus.publish(NodeHeartbeat(ts=1.0, src="n1", node="n1", role="collocated"))  # not a registration
    await bus.publish(NodeRegistered(ts=1.0, src="n2", node="n2", role="collocated"))
    await asyncio.sleep(0.3)
    assert not ready.done() and not (tmp_path / "ready.json").exists()
    await bus.publish(NodeRegistered(ts=2.0, src="n1", node="n1", role="collocated"))
    await asyncio.wait_for(ready, 10)
    assert "db" in json.loads((tmp_path / "ready.json").read_text())
    assert up.failure is None and not up.stop.is_set()


async def test_missing_engines_are_named_and_no_ready_file_is_written(tmp_path):
    up, bus = _up(tmp_path, 0.5), InMemoryBus("rp")
    await bus.publish(NodeRegistered(ts=1.0, src="n1", node="n1", role="collocated"))
    await asyncio.wait_for(up._write_ready(bus), 10)
    assert not (tmp_path / "ready.json").exists()
    assert up.stop.is_set() and up.exit_code == 1
    assert up.failure.startswith("engine(s) n0, n2 did not register (NodeRegistered) within --ready-timeout-s 0.5 s")
    assert "engine-n0.log" in up.failure and "engine-n2.log" in up.failure and "engine-n1.log" not in up.failure
