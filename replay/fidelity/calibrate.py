"""``evolving calibrate LOG --out FILE.toml``: a simulator profile fitted to a recorded live run.

The engines' ``IterationDone`` events of the log are fitted with the project's own NNLS
(services/cores/costmodel.py: relative residuals, unit-norm columns, non-negative
coefficients): prefill by eq. 1 (``c0 + c1 t_uc + c2 A + c3 t_rst``), decode by eq. 2 with
its context term (``d0 + d1 phi(B) + d2 B + d_ctx sum_ctx``). A model whose engines report
no experts is dense: ``phi(B)`` is 1 for every batch (the intercept again), so the profile
gets ``experts = experts_per_token = 1`` and ``d1 = 0``, and eq. 2 is fitted as ``1, B, ctx``.

**The mean, not the typical iteration.** The NNLS minimises *relative* residuals: right for the
planner (a 5% error on a 20 ms iteration weighs as much as on a 2 s one), but under dispersed
timings it predicts below the median, and the simulator multiplies its prediction by a noise of
mean 1, so its busy time would come out short. On a loaded 2-core box (load 11-20) iterations of
the same shape vary by 40-50%; the relative fit's total was 0.71x the measured prefill time and
0.24x the decode time on the very rows it was fitted on (docs/simulator.md, "Validated against
live"). So the form and the ratios between the terms are the NNLS's, and the coefficients are
then scaled by one factor per equation (``mean_scale``) that makes the fit's total over the rows
the measured total; the noise written is the relative std of measured / fitted.

Each term's error is reported three ways: its coefficient on all rows, the spread of that
coefficient over the 5 folds of a cross-validation (relative standard deviation: how well the
rows pin it), and how much the cross-validated error (MAPE, every row predicted by the fit on
the other folds) grows when the term is left out (what it explains). A term whose column is
zero in every row (no restore from host ever happened) is *unidentified*: it keeps 0.

Transfer and host-fetch costs, measured the same way where the log has them (Theil-Sen, the
router's own robust fit, ``costmodel.theil_sen``):

- peer fetch: each ``KvFetched``'s ``duration_s`` against its tokens -> ``fetch_latency_s``,
  ``fetch_bandwidth_Bps``;
- prefill -> decode: ``FirstToken`` on the prefill node to the decode node's ``KvMoved`` of
  that request (its pull landed) against the prompt's tokens -> ``p2d_latency_s``,
  ``p2d_bandwidth_Bps``;
- role switch: from the order (``SwitchRole``) or, when the node was still draining, from its
  last ``IterationDone`` before the ack, to the ack (``RoleSwitched``): the switch itself, the
  drain left out (the simulator drains by itself, then charges ``in_place_s``); the median ->
  ``in_place_s``. The torch engine carries out a ``restart`` in place, so ``restart_s`` is the
  same figure.

Capacities, token budget and running cap are the engines' own (``NodeRegistered``); noise is
the fit's residual relative standard deviation. Every number in the file says where it came from.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

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
from services.cores.costmodel import cross_validated_ape, fit_coefficients, theil_sen, usable

FOLDS = 5
#: fewest iterations an equation is fitted on: every fold then trains on at least 5 rows for its 3-4 terms
MIN_ROWS = FOLDS + 2
#: the events a calibration reads
TYPES = ("IterationDone", "KvFetched", "KvMoved", "NodeRegistered", "RequestSubmitted", "FirstToken",
         "SwitchRole", "RoleSwitched")


@dataclass
class TermFit:
    name: str
    coefficient: float
    fold_rsd: float  # relative std of the coefficient over the folds (nan: 0 in every fold)
    cv_mape_without: float  # cross-validated MAPE with this term left out
    identified: bool = True


@dataclass
class EquationFit:
    equation: str  # "eq1" | "eq2"
    rows: int
    dropped: int
    cv_mape: float
    cv_p90: float
    residual_rsd: float  # relative std of the measured / fitted ratio (the simulator's noise)
    mean_scale: float = 1.0  # the factor that made the fit's total the measured total (docstring)
    terms: list[TermFit] = field(default_factory=list)

    def coef(self, name: str) -> float:
        return next((t.coefficient for t in self.terms if t.name == name), 0.0)


@dataclass
class LinkFit:
    what: str
    samples: int
    latency_s: float
    s_per_token: float
    mape: float


@dataclass
class Calibration:
    source: str
    prefill: EquationFit | None
    decode: EquationFit | None
    fetch: LinkFit | None
    p2d: LinkFit | None
    switch_s: float | None
    switches: int
    nodes: dict[str, dict] = field(default_factory=dict)  # NodeRegistered facts per node
    notes: list[str] = field(default_factory=list)


# --------------------------------------------------------------------------- fitting (pure)
def fit_equation(equation: str, terms: Sequence[str], X: np.ndarray, y: np.ndarray) -> EquationFit | None:
    """NNLS fit of ``X c = y`` with each term's error (module docstring); None under ``MIN_ROWS`` rows."""
    keep = usable(X, y)
    X, y = X[keep], y[keep]
    if len(y) < MIN_ROWS:
        return None
    coef, unidentified = fit_coefficients(X, y)
    pred = X @ np.asarray(coef)
    scale = float(np.sum(y) / np.sum(pred)) if np.sum(pred) > 0 else 1.0
    coef = [c * scale for c in coef]
    ape = cross_validated_ape(X, y, FOLDS)
    folds = np.arange(len(y)) % FOLDS
    per_fold = np.array([fit_coefficients(X[folds != f], y[folds != f])[0] for f in range(FOLDS)])
    out = EquationFit(equation, len(y), int((~keep).sum()), float(np.mean(ape)), float(np.quantile(ape, 0.9)),
                      float(np.std(y / (pred * scale))), mean_scale=scale)
    for j, name in enumerate(terms):
        mean = float(np.mean(per_fold[:, j]))
        rsd = float(np.std(per_fold[:, j]) / mean) if mean > 0 else float("nan")
        others = [i for i in range(len(terms)) if i != j]
        without = float(np.mean(cross_validated_ape(X[:, others], y, FOLDS))) if others else float("nan")
        out.terms.append(TermFit(name, float(coef[j]), rsd, without, identified=j not in unidentified))
    return out


def fit_link(what: str, tokens: Sequence[float], seconds: Sequence[float]) -> LinkFit | None:
    """``seconds = latency + s_per_token * tokens`` by Theil-Sen; None under 3 samples."""
    x, y = np.asarray(tokens, dtype=float), np.asarray(seconds, dtype=float)
    ok = np.isfinite(x) & np.isfinite(y) & (x > 0) & (y > 0)
    x, y = x[ok], y[ok]
    if len(x) < 3:
        return None
    ts = theil_sen(x, y)
    if ts is None:  # one size only: all of it latency
        slope, icpt = 0.0, float(np.median(y))
    else:
        slope, icpt = ts
    slope, icpt = max(0.0, slope), max(0.0, icpt)
    mape = float(np.mean(np.abs(icpt + slope * x - y) / y))
    return LinkFit(what, len(x), icpt, slope, mape)


def calibrate_events(events: Iterable, source: str = "<events>") -> Calibration:
    """A :class:`Calibration` from a run's events, in log order (module docstring)."""
    pre: list[tuple[float, ...]] = []
    dec: list[tuple[float, ...]] = []
    fetch_x: list[float] = []
    fetch_y: list[float] = []
    p2d_x: list[float] = []
    p2d_y: list[float] = []
    switches: list[float] = []
    nodes: dict[str, dict] = {}
    prompt: dict[str, int] = {}
    first: dict[str, tuple[float, str]] = {}
    ordered: dict[str, float] = {}  # node -> ts of its pending SwitchRole
    last_iter: dict[str, float] = {}  # node -> ts of its last IterationDone
    block = 64
    for e in events:
        if isinstance(e, IterationDone):
            last_iter[e.node] = e.ts
            w = max(1, int(e.iterations))
            if e.phase == "prefill":
                pre += [(e.sum_t_uc, e.sum_A, e.sum_t_rst, e.duration_s)] * w
            else:
                dec += [(e.batch, e.t_fwd, e.sum_t_c, e.duration_s)] * w
        elif isinstance(e, NodeRegistered):
            nodes[e.node] = {"l1_capacity_tokens": e.l1_capacity_tokens, "l2_capacity_tokens": e.l2_capacity_tokens,
                             "prefill_token_budget": e.prefill_token_budget,
                             "max_running_requests": e.max_running_requests, "profile": getattr(e, "profile", "")}
        elif isinstance(e, KvFetched):
            fetch_x.append(len(e.blocks) * block)
            fetch_y.append(e.duration_s)
        elif isinstance(e, RequestSubmitted):
            prompt[e.request] = e.prompt_tokens
        elif isinstance(e, FirstToken):
            first[e.request] = (e.ts, e.node)
        elif isinstance(e, KvMoved) and e.src_phase == "prefill" and e.dst_phase == "decode" and e.request:
            f = first.pop(e.request, None)
            if f is not None and f[1] == e.src_node and e.request in prompt:
                p2d_x.append(prompt[e.request])
                p2d_y.append(e.ts - f[0])
        elif isinstance(e, SwitchRole):
            ordered[e.node] = e.ts
        elif isinstance(e, RoleSwitched):
            at = ordered.pop(e.node, None)
            if at is not None:
                switches.append(max(0.0, e.ts - max(at, last_iter.get(e.node, at))))
    cal = Calibration(source, None, None, fit_link("peer fetch", fetch_x, fetch_y),
                      fit_link("prefill -> decode", p2d_x, p2d_y),
                      float(np.median(switches)) if switches else None, len(switches), nodes)
    if pre:
        a = np.asarray(pre, dtype=float)
        X = np.column_stack([np.ones(len(a)), a[:, 0], a[:, 1], a[:, 2]])
        cal.prefill = fit_equation("eq1", ("c0", "c1", "c2", "c3"), X, a[:, 3])
    if dec:
        a = np.asarray(dec, dtype=float)
        # dense (the torch engine's model; phi = 1 duplicates the intercept): 1, B, ctx
        X = np.column_stack([np.ones(len(a)), a[:, 0], a[:, 2]])
        cal.decode = fit_equation("eq2", ("d0", "d2", "d_ctx"), X, a[:, 3])
    for what, got, n in (("prefill", cal.prefill, len(pre)), ("decode", cal.decode, len(dec))):
        if got is None:
            cal.notes.append(f"{what}: {n} iterations, fewer than {MIN_ROWS}: not fitted (the base profile's kept)")
    return cal


def calibrate_log(path: str | Path) -> Calibration:
    """:func:`calibrate_events` over a recorded run's DuckDB log."""
    from services.adapters.eventlog import DuckDbEventLog  # lazy: the pure fit above needs no DuckDB

    with DuckDbEventLog(path, read_only=True) as log:
        return calibrate_events((ev for _, _, ev in log.read(types=TYPES)), source=str(path))


# --------------------------------------------------------------------------- the profile file
def _num(x: float) -> str:
    return repr(float(x)) if math.isfinite(x) else "0.0"


def profile_toml(cal: Calibration, name: str, base: str = "gb300-glm52", kv_bytes_per_token: int = 46080) -> str:
    """The profile file: the fitted numbers, each with its source; what the log could not give
    comes from ``base`` and says so. ``kv_bytes_per_token``: SmolLM2-135M in fp32 (30 layers x
    K and V x 3 KV heads x 64 dims x 4 bytes)."""
    b = load_profile(base)
    node = next(iter(sorted(cal.nodes.items())), (None, {}))[1]
    src = f"fitted from {cal.source}"
    pf, dc = cal.prefill, cal.decode

    def coef(fit: EquationFit | None, term: str, fallback: float) -> tuple[str, str]:
        if fit is None:
            return _num(fallback), f"base {base} (not fitted)"
        t = next(t for t in fit.terms if t.name == term)
        if not t.identified:
            return "0.0", "unidentified: its column is 0 in every row"
        return _num(t.coefficient), (f"{src}; fold spread {t.fold_rsd:.0%}, CV MAPE without it "
                                     f"{t.cv_mape_without:.1%}" if math.isfinite(t.fold_rsd) else f"{src}")

    lines = [f"# Calibrated from a live run ({cal.source}) by `evolving calibrate` (replay/fidelity/calibrate.py).",
             "# Dense model: experts = experts_per_token = 1, so phi(B) = 1 and d1 = 0 (the intercept d0 holds it).",
             "", f'name = "{name}"', 'model = "calibrated"', "gpus_per_node = 1", "block_tokens = 64", "",
             "[moe]", "experts = 1", "experts_per_token = 1", "", "[kv]",
             f"bytes_per_token = {kv_bytes_per_token}",
             f"l2_capacity_tokens = {int(node.get('l2_capacity_tokens') or b.l2_capacity_tokens)}  # NodeRegistered",
             f"l1_capacity_tokens = {int(node.get('l1_capacity_tokens') or b.l1_capacity_tokens)}  # NodeRegistered",
             "", "[prefill]",
             f"token_budget = {int(node.get('prefill_token_budget') or b.prefill_token_budget)}  # NodeRegistered"]
    if pf is not None:
        lines.append(f"# eq. 1 on {pf.rows} iterations ({pf.dropped} dropped): CV MAPE {pf.cv_mape:.1%}, p90 {pf.cv_p90:.1%}; "
                     f"coefficients x {pf.mean_scale:.3f} so their total is the measured total")
    for term, fb in (("c0", b.c0), ("c1", b.c1), ("c2", b.c2), ("c3", b.c3)):
        v, why = coef(pf, term, fb)
        lines.append(f"{term} = {v}  # {why}")
    lines.append(f"noise = {_num(pf.residual_rsd if pf else b.prefill_noise)}  # residual relative std")
    lines += ["", "[decode]"]
    if dc is not None:
        lines.append(f"# eq. 2 (dense: 1, B, ctx) on {dc.rows} iterations ({dc.dropped} dropped): "
                     f"CV MAPE {dc.cv_mape:.1%}, p90 {dc.cv_p90:.1%}; coefficients x {dc.mean_scale:.3f} so their "
                     f"total is the measured total")
    for term, key, fb in (("d0", "d0", b.d0), ("d2", "d2", b.d2), ("d_ctx", "d_ctx", b.d_ctx)):
        v, why = coef(dc, term, fb)
        lines.append(f"{key} = {v}  # {why}")
    lines += ["d1 = 0.0  # dense: phi(B) = 1 is the intercept", "t_fwd = 1.0  # no speculative decoding",
              "t_acc = 1.0",
              f"max_running = {int(node.get('max_running_requests') or b.max_running)}  # NodeRegistered",
              f"noise = {_num(dc.residual_rsd if dc else b.decode_noise)}  # residual relative std", "", "[transfer]"]
    for link, lat_key, bw_key, lat0, bw0 in ((cal.p2d, "p2d_latency_s", "p2d_bandwidth_Bps", b.p2d_latency_s,
                                              b.p2d_bandwidth_Bps),
                                             (cal.fetch, "fetch_latency_s", "fetch_bandwidth_Bps", b.fetch_latency_s,
                                              b.fetch_bandwidth_Bps)):
        if link is None:
            lines += [f"{lat_key} = {_num(lat0)}  # base {base}: the log has no {lat_key.split('_')[0]} samples",
                      f"{bw_key} = {_num(bw0)}  # base {base}"]
        else:
            bw = kv_bytes_per_token / link.s_per_token if link.s_per_token > 0 else 1e15
            lines += [(f"{lat_key} = {_num(link.latency_s)}  # {link.what}: Theil-Sen on {link.samples} samples, "
                       f"MAPE {link.mape:.0%}"), f"{bw_key} = {_num(bw)}  # {_num(link.s_per_token)} s/token"]
    sw = cal.switch_s
    sw_src = f"median of {cal.switches} switches (drain left out)" if sw is not None else f"base {base}: no switch"
    lines += ["", "[switch]", f"in_place_s = {_num(sw if sw is not None else b.switch_in_place_s)}  # {sw_src}",
              f"restart_s = {_num(sw if sw is not None else b.switch_in_place_s)}  # the torch engine restarts in place",
              ""]
    return "\n".join(lines)


def format_calibration(cal: Calibration) -> str:
    """The fit's report: one line per term, then the links and the switch."""
    out = [f"calibration from {cal.source}"]
    for fit in (cal.prefill, cal.decode):
        if fit is None:
            continue
        out.append(f"  {fit.equation}: {fit.rows} iterations ({fit.dropped} dropped), CV MAPE {fit.cv_mape:.1%} "
                   f"(p90 {fit.cv_p90:.1%}), measured/fitted std {fit.residual_rsd:.1%}, mean scale {fit.mean_scale:.3f}")
        out.append(f"    {'term':<6} {'coefficient':>12} {'fold spread':>12} {'CV MAPE without':>16}")
        for t in fit.terms:
            spread = f"{t.fold_rsd:.0%}" if math.isfinite(t.fold_rsd) else "-"
            coef = f"{t.coefficient:.4g}" if t.identified else "unidentified"
            out.append(f"    {t.name:<6} {coef:>12} {spread:>12} {t.cv_mape_without:>15.1%}")
    for link in (cal.fetch, cal.p2d):
        if link is not None:
            out.append(f"  {link.what}: {link.samples} samples, {link.latency_s * 1e3:.2f} ms + "
                       f"{link.s_per_token * 1e6:.3f} us/token, MAPE {link.mape:.0%}")
    if cal.switch_s is not None:
        out.append(f"  role switch (drain left out): median {cal.switch_s:.3f} s over {cal.switches}")
    out += [f"  note: {n}" for n in cal.notes]
    return "\n".join(out)


def per_node(events: Iterable) -> dict[str, int]:
    """Iterations per node (a sanity line for the report)."""
    n: dict[str, int] = defaultdict(int)
    for e in events:
        if isinstance(e, IterationDone):
            n[e.node] += 1
    return dict(n)
