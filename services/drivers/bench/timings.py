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

Every form is fitted the planner's way (NNLS on relative residuals, unit-norm columns,
``services.cores.costmodel``) on the usable rows (a duration over 1 ns, counts under 1e15; the
others are counted and left out of every score) and scored twice: the planner's own split (every
fifth iteration held back: ``holdout_mape``) and a 5-fold cross-validation over all usable rows
(row i in fold i % 5, each predicted by the fit on the other four: ``cv_mape``, ``cv_p90``),
which picks ``best`` (ties: fewer terms) - on a small file one fixed split scores 2-3 rows. A
term whose column is a combination of the ones before it in these rows is named (``dependent``):
the fit cannot tell them apart. A form that cannot be fitted says why.

Model forms compared (prefill / decode):

- ``naive``: ``a + b * total input tokens`` (prefill: new + cached; decode: context tokens).
- ``eq1``: METHOD eq. 1, ``c0 + c1 sum_t_uc + c2 sum_A + c3 sum_t_rst``.
- ``eq1+req``: eq. 1 plus a cost per request in the iteration (its kernel launches, padding to a
  tile, sampling): where the cost per token depends on the batch beyond tokens and pairs.
- ``eq1+split``: eq. 1 with separate coefficients for cached-new and new-new query-key pairs
  (needs ``sum_A_new`` on every row): measured on GPUs the two differ 2.6-5x.
- ``eq1+floor``: eq. 1 with ``max(sum_t_uc, F)`` for the linear term: below ~256 new tokens an
  iteration is bound by reading the weights, not by compute. ``F`` is chosen on the planner's
  training iterations (never its held-back ones) from 32..1024.
- ``eq2``: METHOD eq. 2, ``d0 + d1 phi(B) + d2 B``; for a dense model phi is 1 for every batch
  (the intercept again), so eq. 2 is ``d0 + d2 B`` there.
- ``eq2+ctx``: eq. 2 plus ``d3 * sum_ctx``: a dense model without MLA reads every request's
  KV each decode step (the planner's decode model since the context term).
- ``eq2+bal``, ``eq2+ctx+bal`` (MoE rows): phi for evenly balanced routing, ``min(1, k t_fwd B / E)``,
  instead of random routing's ``1 - (1 - k/E)^(t_fwd B)``: which one a model follows is a
  property of its router (a choice per profile).

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
from services.cores.costmodel import HOLDOUT_EVERY, cross_validated_ape, fit_columns, usable

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
#: Folds of the cross-validation every form is scored by (row i is in fold i % FOLDS).
FOLDS = 5


def _col(rows: Sequence[Timing], name: str) -> np.ndarray:
    return np.array([getattr(r, name) or 0.0 for r in rows], dtype=float)


def _moe(r: Timing) -> bool:
    return r.k is not None and r.E is not None and r.E > 0


def _phi(rows: Sequence[Timing], balanced: bool = False) -> np.ndarray:
    """Fraction of routed experts a decode step reads: random routing ``1 - (1 - k/E)^(t_fwd B)``
    (METHOD eq. 2), or evenly balanced routing ``min(1, k t_fwd B / E)``; 1 for a dense model."""
    B, t_fwd = _col(rows, "batch"), _col(rows, "t_fwd")
    out = np.zeros(len(rows))
    for i, r in enumerate(rows):
        if B[i] <= 0:
            continue
        if not _moe(r):
            out[i] = 1.0  # dense: every weight is read each step
        elif balanced:
            out[i] = min(1.0, r.k * t_fwd[i] * B[i] / r.E)
        else:
            out[i] = 1.0 - (1.0 - r.k / r.E) ** (t_fwd[i] * B[i])
    return out


Design = Callable[[Sequence[Timing]], np.ndarray]
#: A form: its terms and design, or the reason it cannot be fitted on these rows.
Form = tuple[tuple[str, ...], Design] | str


def _ones(rs: Sequence[Timing]) -> np.ndarray:
    return np.ones(len(rs))


def _prefill_forms(rows: Sequence[Timing]) -> dict[str, Form]:
    eq1 = lambda rs: [_ones(rs), _col(rs, "sum_t_uc"), _col(rs, "sum_A"), _col(rs, "sum_t_rst")]
    forms: dict[str, Form] = {
        "naive": (("1", "t_uc+t_c"), lambda rs: np.column_stack([_ones(rs), _col(rs, "sum_t_uc") + _col(rs, "sum_t_c")])),
        "eq1": (("1", "t_uc", "A", "t_rst"), lambda rs: np.column_stack(eq1(rs))),
        # a cost per request in the iteration (its own kernel launches, padding to a tile, sampling)
        "eq1+req": (("1", "t_uc", "A", "t_rst", "requests"), lambda rs: np.column_stack(eq1(rs) + [_col(rs, "batch")])),
    }
    lacking = sum(r.sum_A_new is None for r in rows)
    if lacking:
        forms["eq1+split"] = f"not fitted: needs sum_A_new, which {lacking} of {len(rows)} rows lack"
    else:
        forms["eq1+split"] = (("1", "t_uc", "A_cached", "A_new", "t_rst"), lambda rs: np.column_stack(
            [_ones(rs), _col(rs, "sum_t_uc"), _col(rs, "sum_A") - _col(rs, "sum_A_new"), _col(rs, "sum_A_new"),
             _col(rs, "sum_t_rst")]))
    return forms


def _decode_forms(rows: Sequence[Timing]) -> dict[str, Form]:
    forms: dict[str, Form] = {
        "naive": (("1", "ctx"), lambda rs: np.column_stack([_ones(rs), _col(rs, "sum_ctx")])),
    }
    if not any(_moe(r) for r in rows):
        # dense: phi(B) is 1 for every batch, the intercept again: eq. 2 is 1 + B
        forms["eq2"] = (("1", "B"), lambda rs: np.column_stack([_ones(rs), _col(rs, "batch")]))
        forms["eq2+ctx"] = (("1", "B", "ctx"), lambda rs: np.column_stack(
            [_ones(rs), _col(rs, "batch"), _col(rs, "sum_ctx")]))
        return forms
    for suffix, balanced in (("", False), ("+bal", True)):
        phi_name = "phi_bal" if balanced else "phi"
        forms["eq2" + suffix] = (("1", phi_name, "B"), lambda rs, b=balanced: np.column_stack(
            [_ones(rs), _phi(rs, b), _col(rs, "batch")]))
        forms["eq2+ctx" + suffix] = (("1", phi_name, "B", "ctx"), lambda rs, b=balanced: np.column_stack(
            [_ones(rs), _phi(rs, b), _col(rs, "batch"), _col(rs, "sum_ctx")]))
    return forms


def _floor_design(F: float) -> Design:
    return lambda rs: np.column_stack([np.ones(len(rs)), np.maximum(_col(rs, "sum_t_uc"), F),
                                       _col(rs, "sum_A"), _col(rs, "sum_t_rst")])


def _planner_split(n: int) -> tuple[np.ndarray, np.ndarray]:
    hold = (np.arange(n) % HOLDOUT_EVERY) == HOLDOUT_EVERY - 1
    return ~hold, hold


def _dependent(X: np.ndarray, y: np.ndarray, terms: Sequence[str]) -> list[str]:
    """Terms whose column is (numerically) a combination of the ones before it in these rows:
    the fit cannot tell them apart, and its coefficients for them mean nothing alone."""
    Xw = X / y[:, None]
    norms = np.linalg.norm(Xw, axis=0)
    live = norms > 0
    if live.sum() < 2:
        return []
    R = np.linalg.qr(Xw[:, live] / norms[live], mode="r")
    names = [t for t, keep in zip(terms, live, strict=True) if keep]
    return [names[j] for j in range(len(names)) if abs(R[j, j]) < 1e-7]


def _score(name: str, terms: tuple[str, ...], X: np.ndarray, y: np.ndarray) -> dict:
    keep = usable(X, y)  # the rows the planner's fit keeps are the rows every error is scored on
    X, y = X[keep], y[keep]
    fit = fit_columns(X, y)
    row: dict = {"model": name, "terms": list(terms), "rows": len(y), "dropped": int((~keep).sum()),
                 "samples": fit.samples, "status": fit.status}
    if not fit.fitted or len(y) < 2 * FOLDS:
        return row
    _, hold = _planner_split(len(y))
    ape_hold = np.abs(X[hold] @ np.asarray(fit.coefficients) - y[hold]) / y[hold]
    ape = cross_validated_ape(X, y, FOLDS)
    row.update(coefficients=fit.coefficients, holdout_mape=fit.mape, holdout_p90=float(np.quantile(ape_hold, 0.9)),
               cv_mape=float(np.mean(ape)), cv_p90=float(np.quantile(ape, 0.9)),
               dependent=_dependent(X, y, terms))
    return row


def fit_table(rows: Sequence[Timing]) -> dict:
    """Every model form fitted on each phase's iterations: the planner's own fit and hold-back
    (every fifth row) and a 5-fold cross-validation over all usable rows, which picks ``best``
    (ties: fewer terms); the naive form's error over each form's; terms a form cannot tell apart
    on these rows (``dependent``); forms that cannot be fitted, with the reason."""
    out: dict = {}
    for phase in ("prefill", "decode"):
        rs = [r for r in rows if r.phase == phase]
        if not rs:
            continue
        y = _col(rs, "duration_s")
        forms = _prefill_forms(rs) if phase == "prefill" else _decode_forms(rs)
        table = []
        for name, form in forms.items():
            if isinstance(form, str):
                table.append({"model": name, "terms": [], "rows": len(rs), "status": form})
                continue
            terms, design = form
            table.append(_score(name, terms, design(rs), y))
        if phase == "prefill":
            best: tuple[float, float] | None = None
            for F in FLOORS:  # F chosen on the planner's training rows only, never the held-back ones
                X = _floor_design(F)(rs)
                keep = usable(X, y)
                Xk, yk = X[keep], y[keep]
                fit = fit_columns(Xk, yk)
                if fit.fitted:
                    train, _ = _planner_split(len(yk))
                    m = float(np.mean(np.abs(Xk[train] @ np.asarray(fit.coefficients) - yk[train]) / yk[train]))
                    if best is None or m < best[0]:
                        best = (m, F)
            if best is not None:
                F = best[1]
                row = _score("eq1+floor", ("1", f"max(t_uc,{F})", "A", "t_rst"), _floor_design(F)(rs), y)
                row["floor_tokens"] = F
                table.append(row)
        naive = next((t for t in table if t["model"] == "naive" and "cv_mape" in t), None)
        for t in table:
            if naive is not None and t.get("cv_mape"):
                t["naive_over_this"] = naive["cv_mape"] / t["cv_mape"]
        fitted = [t for t in table if "cv_mape" in t]
        usable_rows = max((t.get("rows", 0) for t in table), default=0)
        best_name = None
        if fitted:  # the lowest error; within 1e-9 of it (the same fit, rounded otherwise), fewer terms
            low = min(t["cv_mape"] for t in fitted)
            best_name = min((t for t in fitted if t["cv_mape"] <= low * (1 + 1e-9)),
                            key=lambda t: (len(t["terms"]), t["cv_mape"]))["model"]
        out[phase] = {"iterations": len(rs), "usable": usable_rows, "folds": FOLDS, "models": table,
                      "best": best_name}
    if not out:
        raise TimingsError("no prefill or decode iterations to fit")
    return out


def format_table(t: dict, title: str) -> str:
    lines = [title]
    for phase, block in t.items():
        lines.append(f"  {phase}: {block['iterations']} iterations, {block['usable']} usable; scored by "
                     f"{block['folds']}-fold cross-validation (the planner's own fit: every {HOLDOUT_EVERY}th "
                     f"held back); best: {block['best']}")
        for m in block["models"]:
            if "cv_mape" not in m:
                lines.append(f"    {m['model']:<12} {m['status']}")
                continue
            ratio = f"   naive/this {m['naive_over_this']:6.1f}x" if "naive_over_this" in m else ""
            lines.append(f"    {m['model']:<12} CV MAPE {m['cv_mape']:8.2%}   p90 {m['cv_p90']:8.2%}   "
                         f"hold-back {m['holdout_mape']:8.2%}{ratio}   [{' + '.join(m['terms'])}]")
            if m.get("dependent"):
                lines.append(f"    {'':<12} ! {', '.join(m['dependent'])}: a combination of the terms before "
                             "(collinear in these rows); those coefficients mean nothing alone")
            if m.get("dropped"):
                lines.append(f"    {'':<12} ! {m['dropped']} row(s) not usable (duration <= 1 ns or a count >= 1e15)")
    return "\n".join(lines)
