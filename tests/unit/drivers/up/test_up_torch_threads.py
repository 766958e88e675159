"""``evolving up --engines torch:N`` splits the machine's cores between its engines, as it does for
vLLM servers: torch takes every core for each engine otherwise, and engines on one box slow each
other's iterations (docs/simulator.md section 9). A user's own ``OMP_NUM_THREADS`` is kept."""

from __future__ import annotations

import argparse

from services.drivers.up.launch import plan_children, torch_engine_env
from services.drivers.up.options import add_up_args, up_spec


def _spec(*argv: str):
    p = argparse.ArgumentParser()
    add_up_args(p)
    return up_spec(p.parse_args(["--insecure", "--metrics-port", "-1", *argv]), clock_epoch=0.0)


def test_each_engine_gets_its_share_of_the_cores(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert torch_engine_env(2, 2) == {"OMP_NUM_THREADS": "1"}
    assert torch_engine_env(2, 16) == {"OMP_NUM_THREADS": "8"}
    assert torch_engine_env(3, 16) == {"OMP_NUM_THREADS": "5"}
    assert torch_engine_env(4, 2) == {"OMP_NUM_THREADS": "1"}  # at least one


def test_the_users_setting_is_kept(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    assert torch_engine_env(2, 16) is None


def test_torch_engine_children_carry_it_and_sim_engines_do_not(tmp_path, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr("os.cpu_count", lambda: 8)
    spec = _spec("--engines", "torch:4", "--model", str(tmp_path / "m.gguf"))
    children, _ = plan_children(spec, "nats://x:1", tmp_path, tmp_path / "r.duckdb")
    engines = [c for c in children if c.name.startswith("engine-")]
    assert len(engines) == 4
    assert all(c.env == {"OMP_NUM_THREADS": "2"} for c in engines)
    assert all(not (c.env or {}).get("OMP_NUM_THREADS") for c in children if not c.name.startswith("engine-"))
    sim = _spec("--engines", "4")
    children, _ = plan_children(sim, "nats://x:1", tmp_path / "s", tmp_path / "s.duckdb")
    assert all(not (c.env or {}).get("OMP_NUM_THREADS") for c in children)


def test_the_router_starts_from_the_declared_profile_and_run_config_records_it(tmp_path):
    """``up --profile P``: the router's --router-arg carries P's eq. 1 / eq. 2 as its starting
    models (as the simulator's stacks give them), and the services table's row records the same
    values, so ``evolving verify`` rebuilds the router with them; a user's own prior is kept."""
    import json

    from engine.profiles import load_profile
    from services.drivers.up.options import plugin_options, router_args

    spec = _spec("--engines", "2", "--profile", "gb300-glm52-pressure")
    want = load_profile("gb300-glm52-pressure").router_priors()
    children, _ = plan_children(spec, "nats://x:1", tmp_path, tmp_path / "r.duckdb")
    cmd = next(c.cmd for c in children if c.name == "router")
    args = dict(a.split("=", 1)[1].split("=", 1) for a in cmd if a.startswith("--router-arg="))
    assert {k: json.loads(v) for k, v in args.items()} == want
    assert plugin_options(spec)["router_arg"] == tuple(router_args(spec))
    mine = _spec("--engines", "2", "--profile", "gb300-glm52-pressure", "--router-arg", "prior_prefill=[1, 2, 3, 4]")
    got = router_args(mine)
    assert "prior_prefill=[1, 2, 3, 4]" in got and sum(a.startswith("prior_prefill=") for a in got) == 1
    assert router_args(_spec("--engines", "2")) == []  # no profile: the router's built-in prior
