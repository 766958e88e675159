"""Iteration-time models fitted on *measured* iterations (``evolving bench planner --timings
FILE`` / ``--engine torch``): eq. 1 / eq. 2 beside the naive model and beside the extra terms
real engines ask for, each scored on held-back iterations (docs/planner.md, "Fitting on
measured timings").

The CSV (one row per scheduler iteration; a header row names the columns, in any order):

==============  ========  ===========================================================
column          needed    meaning
==============  ========  ===========================================================
phase           yes       ``prefill`` or ``decode``
duration_s      yes       measured wall time of the iteration, seconds (> 0)
batch           yes       requests in the iteration
sum_t_uc        prefill   new (uncached) tokens computed, summed over the batch
sum_A           prefill   query-key pairs, sum of ``t_uc*t_c + t_uc*(t_uc+1)/2``
sum_t_rst       no        tokens restored from host memory (0 if absent)
sum_t_c         no        cached prefix tokens reused, summed over the batch (0 if absent)
sum_A_new       no        the new-new part of ``sum_A`` (``t_uc*(t_uc+1)/2`` summed); lets a
                          fit give cached and new query-key pairs separate costs
sum_ctx         decode    context tokens the batch attends over, summed (dense decode term)
t_fwd           no        tokens fed per request per decode iteration (1 if absent)
k, E            no        routed experts per token / experts (MoE); absent = dense model
==============  ========  ===========================================================

Fitting is the planner's own: NNLS on relative residuals, unit-norm columns, every fifth
iteration held back (``services.cores.costmodel.fit_columns``); the error is the mean absolute
percentage error (MAPE) on the held-back iterations only.

Model forms compared (prefill / decode):

- ``naive``: ``a + b * total input tokens`` (prefill: new + cached; decode: context tokens).
- ``eq1``: METHOD eq. 1, ``c0 + c1 sum_t_uc + c2 sum_A + c3 sum_t_rst``.
- ``eq1+split``: eq. 1 with separate coefficients for cached-new and new-new query-key pairs
  (needs ``sum_A_new``): measured on GPUs the two differ 2.6-5x.
- ``eq1+floor``: eq. 1 with ``max(sum_t_uc, F)`` for the linear term: below ~256 new tokens an
  iteration is bound by reading the weights, not by compute. ``F`` is chosen on the training
  iterations (never on the held-back ones) from 32..1024.
- ``eq2``: METHOD eq. 2, ``d0 + d1 phi(B) + d2 B``.
- ``eq2+ctx``: eq. 2 plus ``d3 * sum_ctx``: a dense model without MLA reads every request's
  KV each decode step.

Not a pure core: it reads files.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from events.catalog import IterationDone
from services.cores.costmodel import HOLDOUT_EVERY, fit_columns

COLUMNS = ("phase", "duration_s", "batch", "sum_t_uc", "sum_A", "sum_t_rst", "sum_t_c", "sum_A_new",
           "sum_ctx", "t_fwd", "k", "E")
REQUIRED = ("phase", "duration_s", "batch")
PHASE_NEEDS = {"prefill": ("sum_t_uc", "sum_A"), "decode": ("sum_ctx",)}
FLOORS = (32, 64, 128, 256, 512, 1024)


class TimingsError(ValueError):
    """A timings file that cannot be fitted; the message says what and where."""


@dataclass(frozen=True, slots=True)
class Timing:
    phase: str
    duration_s: float
    batch: float
    sum_t_uc: float = 0.0
    sum_A: float = 0.0
    sum_t_rst: float = 0.0
    sum_t_c: float = 0.0
    sum_A_new: float | None = None
    sum_ctx: float | None = None
    t_fwd: float = 1.0
    k: float | None = None
    E: float | None = None


def _number(text: str, where: str, col: str) -> float:
    try:
        x = float(text)
    except ValueError:
        raise TimingsError(f"{where}: column {col!r} is not a number: {text!r}") from None
    if not np.isfinite(x):
        raise TimingsError(f"{where}: column {col!r} is not finite: {text!r}")
    return x


def parse_timings(text: str, source: str = "<timings>") -> list[Timing]:
    """Rows of a timings CSV; :class:`TimingsError` names the line and column of bad input."""
    reader = csv.DictReader(io.StringIO(text))
    header = [h.strip() for h in (reader.fieldnames or [])]
    if not header:
        raise TimingsError(f"{source}: empty file (expected a header row: {', '.join(COLUMNS)})")
    reader.fieldnames = header
    unknown = sorted(set(header) - set(COLUMNS))
    if unknown:
        raise TimingsError(f"{source}: unknown column(s) {unknown}; known: {', '.join(COLUMNS)}")
    missing = [c for c in REQUIRED if c not in header]
    if missing:
        raise TimingsError(f"{source}: missing column(s) {missing}")
    rows: list[Timing] = []
    for i, rec in enumerate(reader, start=2):
        where = f"{source}:{i}"
        phase = (rec.get("phase") or "").strip()
        if phase not in PHASE_NEEDS:
            raise TimingsError(f"{where}: phase must be 'prefill' or 'decode', got {phase!r}")
        vals: dict[str, float] = {}
        for col in header:
            cell = (rec.get(col) or "").strip()
            if col == "phase" or cell == "":
                continue
            vals[col] = _number(cell, where, col)
        for col in REQUIRED[1:] + PHASE_NEEDS[phase]:
            if col not in vals:
                raise TimingsError(f"{where}: {phase} row has no {col!r}")
        if vals["duration_s"] <= 0:
            raise TimingsError(f"{where}: duration_s must be > 0, got {vals['duration_s']}")
        neg = [c for c, v in vals.items() if v < 0]
        if neg:
            raise TimingsError(f"{where}: negative value in {neg}")
        rows.append(Timing(phase=phase, **vals))
    if not rows:
        raise TimingsError(f"{source}: a header but no iterations")
    return rows


def read_timings(path: str | Path) -> list[Timing]:
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise TimingsError(f"{p}: cannot read: {e.strerror or e}") from None
    return parse_timings(text, str(p))


def write_timings(rows: Iterable[Timing], path: str | Path) -> int:
    """Write rows in the documented format; returns the row count."""
    n = 0
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(COLUMNS)
        for r in rows:
            w.writerow(["" if getattr(r, c) is None else getattr(r, c) for c in COLUMNS])
            n += 1
    return n


def from_iteration(ev: IterationDone, *, sum_ctx: float | None = None, sum_A_new: float | None = None,
                   k: float | None = None, E: float | None = None) -> Timing:
    """A measured ``IterationDone`` as a timing row (context sums the event does not carry are
    passed by whoever measured them)."""
    return Timing(phase=ev.phase, duration_s=ev.duration_s, batch=float(ev.batch), sum_t_uc=float(ev.sum_t_uc),
                  sum_A=float(ev.sum_A), sum_t_rst=float(ev.sum_t_rst), sum_t_c=float(ev.sum_t_c),
                  sum_A_new=sum_A_new, sum_ctx=sum_ctx, t_fwd=float(ev.t_fwd), k=k, E=E)


# ------------------------------------------------------------------------------------ model forms
def _col(rows: Sequence[Timing], name: str) -> np.ndarray:
    return np.array([getattr(r, name) or 0.0 for r in rows], dtype=float)


def _phi(rows: Sequence[Timing]) -> np.ndarray:
    B, t_fwd = _col(rows, "batch"), _col(rows, "t_fwd")
    out = np.zeros(len(rows))
    for i, r in enumerate(rows):
        if B[i] <= 0:
            continue
        if r.k is None or r.E is None or r.E <= 0:
            out[i] = 1.0  # dense: every weight is read each step
        else:
            out[i] = 1.0 - (1.0 - r.k / r.E) ** (t_fwd[i] * B[i])
    return out


Design = Callable[[Sequence[Timing]], np.ndarray]


def _prefill_forms(rows: Sequence[Timing]) -> dict[str, tuple[tuple[str, ...], Design]]:
    ones = lambda rs: np.ones(len(rs))
    forms: dict[str, tuple[tuple[str, ...], Design]] = {
        "naive": (("1", "t_uc+t_c"), lambda rs: np.column_stack([ones(rs), _col(rs, "sum_t_uc") + _col(rs, "sum_t_c")])),
        "eq1": (("1", "t_uc", "A", "t_rst"), lambda rs: np.column_stack(
            [ones(rs), _col(rs, "sum_t_uc"), _col(rs, "sum_A"), _col(rs, "sum_t_rst")])),
    }
    if all(r.sum_A_new is not None for r in rows):
        forms["eq1+split"] = (("1", "t_uc", "A_cached", "A_new", "t_rst"), lambda rs: np.column_stack(
            [ones(rs), _col(rs, "sum_t_uc"), _col(rs, "sum_A") - _col(rs, "sum_A_new"), _col(rs, "sum_A_new"),
             _col(rs, "sum_t_rst")]))
    return forms


def _decode_forms() -> dict[str, tuple[tuple[str, ...], Design]]:
    ones = lambda rs: np.ones(len(rs))
    return {
        "naive": (("1", "ctx"), lambda rs: np.column_stack([ones(rs), _col(rs, "sum_ctx")])),
        "eq2": (("1", "phi", "B"), lambda rs: np.column_stack([ones(rs), _phi(rs), _col(rs, "batch")])),
        "eq2+ctx": (("1", "phi", "B", "ctx"), lambda rs: np.column_stack(
            [ones(rs), _phi(rs), _col(rs, "batch"), _col(rs, "sum_ctx")])),
    }


def _floor_design(F: float) -> Design:
    return lambda rs: np.column_stack([np.ones(len(rs)), np.maximum(_col(rs, "sum_t_uc"), F),
                                       _col(rs, "sum_A"), _col(rs, "sum_t_rst")])


def _train_mape(X: np.ndarray, y: np.ndarray, coef: Sequence[float]) -> float:
    train = (np.arange(len(y)) % HOLDOUT_EVERY) != HOLDOUT_EVERY - 1
    pred = X[train] @ np.asarray(coef)
    return float(np.mean(np.abs(pred - y[train]) / y[train]))


def _score(name: str, terms: tuple[str, ...], X: np.ndarray, y: np.ndarray) -> dict:
    fit = fit_columns(X, y)
    row = {"model": name, "terms": list(terms), "samples": fit.samples, "status": fit.status}
    if fit.fitted:
        hold = (np.arange(len(y)) % HOLDOUT_EVERY) == HOLDOUT_EVERY - 1
        ape = np.abs(X[hold] @ np.asarray(fit.coefficients) - y[hold]) / y[hold]
        row.update(coefficients=fit.coefficients, holdout_mape=fit.mape, holdout_p90=float(np.quantile(ape, 0.9)))
    return row


def fit_table(rows: Sequence[Timing]) -> dict:
    """Every model form fitted on each phase's iterations, with hold-out errors and the ratio
    of the naive form's error to each form's."""
    out: dict = {}
    for phase in ("prefill", "decode"):
        rs = [r for r in rows if r.phase == phase]
        if not rs:
            continue
        y = _col(rs, "duration_s")
        forms = _prefill_forms(rs) if phase == "prefill" else _decode_forms()
        table = [_score(name, terms, design(rs), y) for name, (terms, design) in forms.items()]
        if phase == "prefill":
            best: tuple[float, float] | None = None
            for F in FLOORS:  # F chosen on the training iterations only
                X = _floor_design(F)(rs)
                fit = fit_columns(X, y)
                if fit.fitted:
                    m = _train_mape(X, y, fit.coefficients)
                    if best is None or m < best[0]:
                        best = (m, F)
            if best is not None:
                F = best[1]
                row = _score("eq1+floor", ("1", f"max(t_uc,{F})", "A", "t_rst"), _floor_design(F)(rs), y)
                row["floor_tokens"] = F
                table.append(row)
        naive = next((t for t in table if t["model"] == "naive" and "holdout_mape" in t), None)
        for t in table:
            if naive is not None and t.get("holdout_mape"):
                t["naive_over_this"] = naive["holdout_mape"] / t["holdout_mape"]
        fitted = [t for t in table if "holdout_mape" in t]
        out[phase] = {"iterations": len(rs), "models": table,
                      "best": min(fitted, key=lambda t: (t["holdout_mape"], len(t["terms"])))["model"] if fitted else None}
    if not out:
        raise TimingsError("no prefill or decode iterations to fit")
    return out


def format_table(t: dict, title: str) -> str:
    lines = [title]
    for phase, block in t.items():
        lines.append(f"  {phase}: {block['iterations']} iterations (every {HOLDOUT_EVERY}th held back); best: {block['best']}")
        for m in block["models"]:
            if "holdout_mape" not in m:
                lines.append(f"    {m['model']:<10} {m['status']}")
                continue
            ratio = f"   naive/this {m['naive_over_this']:6.1f}x" if "naive_over_this" in m else ""
            lines.append(f"    {m['model']:<10} MAPE {m['holdout_mape']:8.2%}   p90 {m['holdout_p90']:8.2%}{ratio}"
                         f"   [{' + '.join(m['terms'])}]")
    return "\n".join(lines)
