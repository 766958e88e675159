"""``evolving calibrate``'s fitter (replay/fidelity/calibrate.py) on iteration events of known
coefficients, written to a real DuckDB log by the recorder's writer (``DuckDbEventLog.append``),
and the profile file it writes read back by the simulator's loader."""

from __future__ import annotations

import numpy as np
import pytest

from engine.profiles import load_profile
from events.catalog import (
    FirstToken,
    IterationDone,
    KvFetched,
    KvMoved,
    NodeRegistered,
    RequestSubmitted,
    RoleSwitched,
    SwitchRole,
)
from events.subjects import subject_for
from replay.fidelity.calibrate import (
    calibrate_events,
    calibrate_log,
    fit_link,
    format_calibration,
    profile_toml,
)
from services.adapters.eventlog import DuckDbEventLog

C = {"c0": 0.02, "c1": 2.0e-3, "c2": 4.0e-6}
D = {"d0": 0.03, "d2": 0.04, "d_ctx": 1.5e-5}


def synthetic_run(noise: float = 0.0, seed: int = 0) -> list:
    """A collocated warm-up's worth of iterations (eq. 1 and dense eq. 2, exact or with relative
    noise), a P->D hand-off per request, peer fetches, and two role switches."""
    rng = np.random.default_rng(seed)
    ev: list = [NodeRegistered(ts=0.0, src="n0", node="n0", role="collocated", l1_capacity_tokens=11648,
                               l2_capacity_tokens=23296, prefill_token_budget=2048, max_running_requests=32)]
    t = 1.0
    for i in range(60):
        uc, tc = int(rng.integers(16, 2048)), int(rng.integers(0, 4096))
        A = uc * tc + uc * (uc + 1) / 2
        d = (C["c0"] + C["c1"] * uc + C["c2"] * A) * (1 + noise * rng.standard_normal())
        ev.append(IterationDone(ts=t, src="n0", node="n0", phase="prefill", duration_s=d, batch=1, sum_t_uc=uc,
                                sum_A=A, sum_t_c=tc))
        B, ctx = int(rng.integers(1, 9)), int(rng.integers(100, 8000))
        d = (D["d0"] + D["d2"] * B + D["d_ctx"] * ctx) * (1 + noise * rng.standard_normal())
        ev.append(IterationDone(ts=t + 0.5, src="n0", node="n0", phase="decode", duration_s=d, batch=B,
                                sum_t_c=ctx))
        t += 1.0
    for i in range(8):  # P->D: 5 ms + 0.5 ms/token; fetches: 1 ms + 0.1 ms/token
        tokens = 256 * (i + 1)
        ev += [RequestSubmitted(ts=t, src="gw", request=f"r{i}", branch="b", prompt_tokens=tokens, blocks=[]),
               FirstToken(ts=t + 1, src="n0", request=f"r{i}", node="n0"),
               KvMoved(ts=t + 1 + 0.005 + 5e-4 * tokens, src="n1", src_node="n0", dst_node="n1", request=f"r{i}"),
               KvFetched(ts=t + 2, src="n1", request=f"r{i}", src_node="n0", dst_node="n1",
                         blocks=list(range(1, tokens // 64 + 1)), duration_s=0.001 + 1e-4 * tokens)]
        t += 3
    # two switches: ordered at t, the node's last iteration (its drain) 2 s later, acked 0.25 s after that
    for node in ("n0", "n1"):
        ev += [SwitchRole(ts=t, src="planner", node=node, to_role="prefill"),
               IterationDone(ts=t + 2, src=node, node=node, phase="decode", batch=1, sum_t_c=10,
                             duration_s=D["d0"] + D["d2"] + D["d_ctx"] * 10),
               RoleSwitched(ts=t + 2.25, src=node, node=node, role="prefill", duration_s=2.25)]
        t += 5
    return ev


def write_log(path, events) -> None:
    with DuckDbEventLog(str(path)) as log:
        assert log.append([(i, subject_for(e), e) for i, e in enumerate(events, start=1)]) == len(events)


def term(fit, name):
    return next(t for t in fit.terms if t.name == name)


def test_exact_iterations_give_back_their_coefficients_through_a_duckdb_log(tmp_path):
    write_log(tmp_path / "run.duckdb", synthetic_run())
    cal = calibrate_log(tmp_path / "run.duckdb")
    assert cal.prefill.rows == 60 and cal.decode.rows == 62  # the two drain iterations are decode rows too
    for fit, truth in ((cal.prefill, C), (cal.decode, D)):
        for name, want in truth.items():
            assert term(fit, name).coefficient == pytest.approx(want, rel=1e-6), name
        assert fit.cv_mape < 1e-6
    # c3: no restore in any row -> unidentified, kept at 0
    assert not term(cal.prefill, "c3").identified and term(cal.prefill, "c3").coefficient == 0.0
    # the links and the switch, measured the same way
    assert cal.p2d.latency_s == pytest.approx(0.005, rel=1e-6) and cal.p2d.s_per_token == pytest.approx(5e-4)
    assert cal.fetch.latency_s == pytest.approx(0.001, rel=1e-6) and cal.fetch.s_per_token == pytest.approx(1e-4)
    assert cal.switch_s == pytest.approx(0.25) and cal.switches == 2  # the drain is left out


def test_each_term_reports_what_it_explains():
    cal = calibrate_events(synthetic_run(noise=0.05))
    assert 0.01 < cal.decode.cv_mape < 0.1
    for t in cal.decode.terms:  # every term of the truth is needed: the error grows without it
        assert t.cv_mape_without > cal.decode.cv_mape, t
        assert 0 <= t.fold_rsd < 0.5, t
    for name, want in D.items():
        assert term(cal.decode, name).coefficient == pytest.approx(want, rel=0.15), name
    report = format_calibration(cal)
    assert "eq1: 60 iterations" in report and "unidentified" in report and "d_ctx" in report


def test_the_profile_file_is_one_the_simulator_reads(tmp_path):
    cal = calibrate_events(synthetic_run(), source="synthetic")
    path = tmp_path / "cal.toml"
    path.write_text(profile_toml(cal, "cal"))
    p = load_profile(str(path))
    assert (p.c0, p.c1, p.c2, p.c3) == pytest.approx((C["c0"], C["c1"], C["c2"], 0.0), rel=1e-6)
    assert (p.d0, p.d2, p.d_ctx, p.d1) == pytest.approx((D["d0"], D["d2"], D["d_ctx"], 0.0), rel=1e-3)
    assert p.phi(5) == 1.0 and p.experts == 1  # dense: phi(B) = 1, d1 = 0
    assert (p.l1_capacity_tokens, p.l2_capacity_tokens, p.prefill_token_budget, p.max_running) == (
        11648, 23296, 2048, 32)
    assert p.p2d_transfer_s(1000) == pytest.approx(0.005 + 0.5, rel=1e-6)
    assert p.fetch_s(1000) == pytest.approx(0.001 + 0.1, rel=1e-6)
    assert p.switch_in_place_s == pytest.approx(0.25)


def test_too_few_iterations_are_not_fitted_and_say_so():
    ev = synthetic_run()[:7]  # the registration and 3 iterations of each phase
    cal = calibrate_events(ev)
    assert cal.prefill is None and cal.decode is None
    assert any("not fitted" in n for n in cal.notes)
    assert fit_link("x", [1, 2], [1, 2]) is None  # under 3 samples


def test_dispersed_timings_are_scaled_to_their_measured_total():
    """Right-skewed noise (a loaded machine: most iterations near the model, some far slower):
    the relative NNLS alone predicts short; the profile's coefficients carry the scale that makes
    the fit's total the measured total, so the simulator's busy time is the measured one."""
    rng = np.random.default_rng(1)
    ev = []
    for i in range(200):
        B, ctx = int(rng.integers(1, 9)), int(rng.integers(100, 8000))
        slow = rng.lognormal(0.0, 0.8)  # median 1, mean ~1.38
        ev.append(IterationDone(ts=float(i), src="n0", node="n0", phase="decode", batch=B, sum_t_c=ctx,
                                duration_s=(D["d0"] + D["d2"] * B + D["d_ctx"] * ctx) * slow))
    cal = calibrate_events(ev)
    fit = cal.decode
    assert fit.mean_scale > 1.2  # the relative fit alone fell short of the total
    pred = sum(fit.coef("d0") + fit.coef("d2") * e.batch + fit.coef("d_ctx") * e.sum_t_c for e in ev)
    assert pred == pytest.approx(sum(e.duration_s for e in ev), rel=1e-9)
    assert fit.residual_rsd > 0.5  # the simulator's noise says how dispersed they were


def test_the_simulators_profile_flag_takes_the_files_path(tmp_path):
    """``evolving replay --profile FILE.toml`` (replay/sim/inputs.py): a path, not only a name."""

    from replay.sim.inputs import SimSpec, run_profile

    path = tmp_path / "cal.toml"
    path.write_text(profile_toml(calibrate_events(synthetic_run(), source="synthetic"), "cal"))
    p = run_profile(SimSpec(profile=str(path)))
    assert p.name == "cal" and p.c1 == pytest.approx(C["c1"], rel=1e-6)
