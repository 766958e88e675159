"""SQL views over the ``events`` table: one typed view per event kind and the named views.

Per kind: ``ev_<snake_name>`` (``ev_route_decided``, ``ev_plan_evaluated``, ...) with the
columns ``seq, ts, src, subject`` and one typed column per field of the event, parsed once per
row with ``json_transform`` into a STRUCT built from the catalog's annotations (lists of
structs stay typed: ``fetch_plan``, ``scores``, ``candidates``). Block hashes are ``UBIGINT``.
A field missing from an old payload reads as its catalog default.

Named views (documented with example queries in docs/recorder.md):

- ``plan_evaluations``: one row per PlanEvaluated, current/chosen split flattened.
- ``role_switches``: RoleSwitchOrdered with the plan evaluation that preceded it and the
  engine's RoleSwitched acknowledgement that followed it.
- ``model_fits``: ModelFitted with the coefficients by name.
- ``route_decisions``: RouteDecided with fetched blocks/tokens and the per-node scores list;
  ``route_scores`` has one row per (decision, candidate node).
- ``requests``: one row per submitted request: route, start, first token, finish, TTFT, E2E.

Everything reads the ``events`` relation only, so the same SQL works over Parquet files that
hold the same columns (see ``roll_to_parquet`` in docs/recorder.md). Over a format-2/3 log the
same rows are read from its stored rows directly, with cheaper plans (:class:`Stored`): the
keys of the stored tables (:func:`view_key`) hash the plain SQL.
"""

from __future__ import annotations

import hashlib
import json
import re
import types
import typing
from collections.abc import Iterable
from typing import Any, Literal, NamedTuple, NewType, get_args, get_origin, get_type_hints

import msgspec

from events.catalog import EVENT_TYPES, RequestStarted, RequestSubmitted
from events.ids import BlockHash

_BASE_COLUMNS = ("seq", "ts", "src", "subject")
_SKIP_FIELDS = {"type", "ts", "src"}  # already columns of ``events``


def view_name(event_type: type | str) -> str:
    name = event_type if isinstance(event_type, str) else event_type.__name__
    return "ev_" + re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


def duck_type(annotation: Any) -> Any:
    """The json_transform structure for one annotation: a type name, a list or a dict."""
    if annotation is BlockHash:
        return "UBIGINT"
    if isinstance(annotation, NewType):
        return duck_type(annotation.__supertype__)
    origin = get_origin(annotation)
    if origin is Literal:
        return "VARCHAR"
    if origin in (typing.Union, types.UnionType):
        args = [a for a in get_args(annotation) if a is not type(None) and a is not msgspec.UnsetType]
        return duck_type(args[0]) if len(args) == 1 else "JSON"
    if origin is list:
        return [duck_type(get_args(annotation)[0])]
    if isinstance(annotation, type) and issubclass(annotation, msgspec.Struct):
        return {name: duck_type(t) for name, t in get_type_hints(annotation).items()}
    return {str: "VARCHAR", int: "BIGINT", float: "DOUBLE", bool: "BOOLEAN"}.get(annotation, "JSON")


def _sql_literal(value: Any) -> str | None:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return "'" + value.replace("'", "''") + "'"
    return None


def _ident(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


class Stored(NamedTuple):
    """How the typed views of a format-2/3 log read its stored rows (services.adapters.eventlog.
    columnar): ``rows``, the FROM clause of the rows alone (``r``, ``event_rows r``);
    ``rows_dict``, of the rows and the dictionary list ``d`` (``rows_from_sql``); ``blocks``, a
    row's list over both (``blocks_sql``); ``n_blocks``, its length over ``r`` alone
    (``blocks_len_sql``)."""

    rows: str
    rows_dict: str
    blocks: str
    n_blocks: str


def event_view_sql(event_type: type, stored: Stored | None = None) -> str:
    """``CREATE OR REPLACE VIEW ev_<kind> AS`` :func:`kind_select`."""
    return f"CREATE OR REPLACE VIEW {view_name(event_type)} AS {kind_select(event_type, stored)}"


def kind_select(event_type: type, stored: Stored | None = None, sized: bool = False) -> str:
    """The rows of one kind's typed view. ``stored``: a format-2/3 log's rows (:class:`Stored`).
    A kind with a ``blocks`` field then reads its other fields from the stored payload (which
    holds ``"blocks":[]``) and its list straight from the stored runs, as ``UBIGINT[]``: no JSON
    text of the list is built and parsed again (7.3 M hashes in the README demo's log); a kind
    without one reads its payload as stored (it is the whole payload), without the ``events``
    view's dictionary (built per query: 0.2-0.45 CPU s for each named view on a 9-node half hour).
    ``sized`` (with ``stored``): the list's length as ``n_blocks`` instead of the list, neither it
    nor the dictionary built (the named views that only count a prompt's blocks)."""
    fields = [f for f in msgspec.structs.fields(event_type) if f.name not in _SKIP_FIELDS]
    hints = get_type_hints(event_type)
    structure = {f.name: duck_type(hints[f.name]) for f in fields}
    direct = stored is not None and "blocks" in structure
    if direct:
        structure.pop("blocks")
    cols = []
    for f in fields:
        col = "b" if direct and f.name == "blocks" else f"p.{_ident(f.name)}"
        default = _sql_literal(f.default) if f.default is not msgspec.NODEFAULT else None
        if default is not None:
            col = f"coalesce({col}, {default})"
        cols.append(f"{col} AS {_ident('n_blocks' if direct and sized and f.name == 'blocks' else f.name)}")
    where = f"type = '{event_type.__name__}'"
    if not cols:
        source = "events" if stored is None else stored.rows
        return f"SELECT {', '.join(_BASE_COLUMNS)} FROM {source} WHERE {where}"
    select = ", ".join([*_BASE_COLUMNS, *cols])
    spec = json.dumps(structure).replace("'", "''")
    if stored is not None:
        blocks = (f", {stored.n_blocks if sized else stored.blocks} AS b" if direct else "")
        source = stored.rows_dict if direct and not sized else stored.rows
        return (
            f"SELECT {select} FROM ("
            f"SELECT r.seq, r.ts, r.src, r.subject, json_transform(r.payload, '{spec}') AS p{blocks} "
            f"FROM {source} WHERE r.{where})"
        )
    return (
        f"SELECT {select} FROM ("
        f"SELECT seq, ts, src, subject, json_transform(payload, '{spec}') AS p "
        f"FROM events WHERE {where})"
    )


#: ``ts`` as a UTC TIMESTAMP (live runs stamp Unix seconds; simulated runs start at 1970-01-01).
_AT = "make_timestamp((ts * 1e6)::BIGINT) AS at_utc"

NAMED_VIEWS: dict[str, str] = {
    "plan_evaluations": """
SELECT seq, ts, {AT}, planner, window_start, window_end,
       "current".prefill AS current_prefill, "current".decode AS current_decode,
       chosen.prefill AS chosen_prefill, chosen.decode AS chosen_decode,
       chosen IS NOT NULL AND chosen <> "current" AS switched,
       reason, len(candidates) AS n_candidates, candidates
FROM ev_plan_evaluated
""",
    "role_switches": """
SELECT o.seq, o.ts, make_timestamp((o.ts * 1e6)::BIGINT) AS at_utc, o.node, o.from_role, o.to_role, o.mechanism, o.reason,
       p.seq AS plan_seq, p.ts AS plan_ts, p.planner, p.reason AS plan_reason,
       p."current".prefill AS plan_current_prefill, p."current".decode AS plan_current_decode,
       p.chosen.prefill AS plan_chosen_prefill, p.chosen.decode AS plan_chosen_decode,
       p.candidates AS plan_candidates,
       a.seq AS ack_seq, a.ts AS ack_ts, a.role AS ack_role, a.drained, a.duration_s AS switch_duration_s,
       a.kv_dropped
FROM ev_role_switch_ordered o
ASOF LEFT JOIN ev_plan_evaluated p ON o.seq >= p.seq
ASOF LEFT JOIN ev_role_switched a ON o.node = a.node AND a.seq >= o.seq
""",
    "model_fits": """
SELECT seq, ts, {AT}, node, phase, coefficients,
       coefficients[1] AS c0, coefficients[2] AS c1, coefficients[3] AS c2, coefficients[4] AS c3,
       samples, mape
FROM ev_model_fitted
""",
    "route_decisions": """
SELECT r.seq, r.ts, make_timestamp((r.ts * 1e6)::BIGINT) AS at_utc, r.request, r.branch, r.policy, r.shadow, r.reroute,
       r.prefill_node, r.decode_node, r.t_c, r.t_uc, r.predicted_ttft_s,
       coalesce(list_sum([s.n_blocks FOR s IN r.fetch_plan]), 0) AS fetched_blocks,
       coalesce(list_sum([s.n_blocks FOR s IN r.fetch_plan]), 0) * coalesce(q.block_tokens, 64)
           AS fetched_tokens,
       len(r.fetch_plan) AS fetch_steps, r.fetch_plan, r.scores
FROM ev_route_decided r
LEFT JOIN (SELECT request, any_value(block_tokens) AS block_tokens
           FROM {SUBMITTED} GROUP BY request) q USING (request)
""",
    "route_scores": """
SELECT seq, ts, {AT}, request, policy, shadow, prefill_node, decode_node,
       s.node, s.score, s.t_c, s.queue_s, s.fetch_excess_s, s.node = prefill_node AS chosen
FROM (SELECT *, unnest(scores) AS s FROM ev_route_decided)
""",
    "requests": """
WITH sub AS (
    SELECT request, min(seq) AS seq, min(ts) AS submitted_ts, any_value(branch) AS branch,
           any_value(version) AS version, any_value(prompt_tokens) AS prompt_tokens,
           any_value(max_tokens) AS max_tokens, {N_BLOCKS} AS n_blocks
    FROM {SUBMITTED} GROUP BY request),
route AS (
    SELECT request, arg_max(ts, seq) AS routed_ts, arg_max(prefill_node, seq) AS prefill_node,
           arg_max(decode_node, seq) AS decode_node, arg_max(t_c, seq) AS t_c,
           arg_max(t_uc, seq) AS t_uc, arg_max(predicted_ttft_s, seq) AS predicted_ttft_s,
           arg_max(policy, seq) AS policy, count(*) - 1 AS reroutes
    FROM ev_route_decided WHERE NOT shadow GROUP BY request),
started AS (
    SELECT request, min(ts) FILTER (phase = 'prefill') AS prefill_started_ts,
           min(ts) FILTER (phase = 'decode') AS decode_started_ts{STARTED_EXTRA}
    FROM ev_request_started GROUP BY request),
first AS (SELECT request, min(ts) AS first_token_ts FROM ev_first_token GROUP BY request),
fin AS (
    SELECT request, arg_max(ts, seq) AS finished_ts, arg_max(output_tokens, seq) AS output_tokens,
           arg_max(error, seq) AS error, arg_max(node, seq) AS finished_node
    FROM ev_request_finished GROUP BY request)
SELECT sub.request, sub.branch, sub.version, sub.seq, sub.submitted_ts,
       make_timestamp((sub.submitted_ts * 1e6)::BIGINT) AS submitted_at, sub.prompt_tokens,
       sub.n_blocks, sub.max_tokens, route.policy, route.prefill_node, route.decode_node,
       route.t_c, route.t_uc, route.predicted_ttft_s, route.reroutes, route.routed_ts,
       started.prefill_started_ts, first.first_token_ts, started.decode_started_ts,{STARTED_COLS}
       fin.finished_ts, fin.output_tokens, fin.error,
       first.first_token_ts - sub.submitted_ts AS ttft_s,
       fin.finished_ts - sub.submitted_ts AS e2e_s,
       started.prefill_started_ts - sub.submitted_ts AS queue_s,
       (fin.finished_ts - first.first_token_ts) / nullif(fin.output_tokens - 1, 0) AS tpot_s
FROM sub
LEFT JOIN route USING (request)
LEFT JOIN started USING (request)
LEFT JOIN first USING (request)
LEFT JOIN fin USING (request)
""",
}


#: What the engine found at prefill start, when the catalog's RequestStarted carries it.
_STARTED_FACTS = ("cached_tokens", "restored_tokens", "fetched_tokens")


def _named_view_sql(body: str, stored: Stored | None = None) -> str:
    """A named view's SQL; ``stored`` (a format-2/3 log): the same rows, read with a cheaper plan
    (the prompts' block counts from the stored runs, ``{SUBMITTED}``). The keys
    (:func:`view_key`) hash the plain SQL: how a format is read is not in them."""
    have = {f.name for f in msgspec.structs.fields(RequestStarted)}
    facts = [f for f in _STARTED_FACTS if f in have]
    extra = "".join(f",\n           max({f}) FILTER (phase = 'prefill') AS prefill_{f}" for f in facts)
    cols = "".join(f" started.prefill_{f}," for f in facts)
    if stored is None:
        submitted, n_blocks = view_name(RequestSubmitted), "any_value(len(blocks))"
    else:
        submitted, n_blocks = f"({kind_select(RequestSubmitted, stored, sized=True)})", "any_value(n_blocks)"
    return (body.replace("{AT}", _AT).replace("{STARTED_EXTRA}", extra).replace("{STARTED_COLS}", cols)
            .replace("{SUBMITTED}", submitted).replace("{N_BLOCKS}", n_blocks))


def create_views(con, temp: bool = False, events_sql: str | None = None,
                 stored: tuple[str, str] | None = None) -> None:
    """(Re)create every view on ``con`` (inside the caller's transaction, if any). ``temp``:
    session-only views that shadow the ones stored in a file opened read-only, so a reader
    always sees the views of its own catalog version. ``events_sql``: the ``events`` relation
    itself, as a view (a format-2 log, services/adapters/eventlog/columnar.py), made first;
    ``stored``: that log's stored rows, which the kinds with a block list read directly
    (:func:`event_view_sql`)."""
    kind = "TEMP VIEW" if temp else "VIEW"
    if events_sql is not None:
        con.execute(f"CREATE OR REPLACE {kind} events AS {events_sql}")
    for event_type in EVENT_TYPES:
        con.execute(event_view_sql(event_type, stored).replace("CREATE OR REPLACE VIEW",
                                                               f"CREATE OR REPLACE {kind}", 1))
    for name, body in NAMED_VIEWS.items():
        con.execute(f"CREATE OR REPLACE {kind} {name} AS {_named_view_sql(body, stored)}")


def catalog_key() -> str:
    """The single key of every view at once, which logs stored before the per-view keys carry
    (``materialized_views``): a log whose key equals this version's still has current tables."""
    h = hashlib.sha256()
    for event_type in EVENT_TYPES:
        h.update(event_view_sql(event_type).encode())
    for name, body in NAMED_VIEWS.items():
        h.update(name.encode() + _named_view_sql(body).encode())
    return h.hexdigest()[:16]


def view_reads(name: str) -> list[str]:
    """The kind views (``ev_*``) and named views that named view ``name`` reads, sorted."""
    kinds = {view_name(t) for t in EVENT_TYPES}
    used = set(re.findall(r"\b(ev_[a-z_]+|[a-z_]+)\b", _named_view_sql(NAMED_VIEWS[name])))
    return sorted(used & (kinds | (set(NAMED_VIEWS) - {name})))


def view_key(name: str, _seen: frozenset[str] = frozenset()) -> str:
    """What named view ``name`` is, as a digest of its SQL and of the views it reads (their
    fields, types and defaults): its stored table is current while this is the key it was
    stored with, so a change to one kind's view stales only the tables that read that kind.
    The storage format's decoding is not in it (a format is read alike by every version)."""
    by_name = {view_name(t): t for t in EVENT_TYPES}
    assert name not in _seen, f"named views read each other in a circle: {sorted(_seen)}"
    h = hashlib.sha256(name.encode() + _named_view_sql(NAMED_VIEWS[name]).encode())
    for read in view_reads(name):
        h.update(read.encode())
        h.update((event_view_sql(by_name[read]) if read in by_name else view_key(read, _seen | {name})).encode())
    return h.hexdigest()[:16]


def view_keys() -> dict[str, str]:
    """:func:`view_key` of every named view."""
    return {name: view_key(name) for name in NAMED_VIEWS}


def materialize_views(con, names: Iterable[str] | None = None) -> None:
    """Each named view's rows (of ``names``; default all) as a table ``mat_<name>`` (inside the
    caller's transaction)."""
    for name in NAMED_VIEWS if names is None else names:
        con.execute(f"CREATE OR REPLACE TABLE mat_{name} AS SELECT * FROM {name}")


def use_materialized(con, names: Iterable[str] | None = None) -> None:
    """Session views that read the ``mat_<name>`` tables (of ``names``; default all) instead of
    computing the named views; the others stay computed."""
    for name in NAMED_VIEWS if names is None else names:
        con.execute(f"CREATE OR REPLACE TEMP VIEW {name} AS SELECT * FROM mat_{name}")


def view_names() -> list[str]:
    return [view_name(t) for t in EVENT_TYPES] + list(NAMED_VIEWS)
