"""``evolving sql --live``: query a run while its recorder still writes it.

DuckDB admits one writer process per file, and the recorder of a running stack is it: another
process cannot open the file (lock), and a byte copy taken without its ``.wal`` misses every
row not yet checkpointed (it reads as 0 events). So the client asks the recorder, over NATS
request/reply, for a **snapshot**: the recorder checkpoints and copies its file under its own
write lock (:meth:`DuckDbEventLog.snapshot`) to ``RUN.snapshot.duckdb`` next to the log, and
answers with the file name and the stream position it holds. The client opens that copy
read-only in the SQL sandbox.

Files next to ``RUN.duckdb`` while the recorder runs (both removed when it stops):

- ``RUN.duckdb.live.json``: how to reach the recorder (``nats_url``, ``partition``,
  ``subject``, ``pid``); ``evolving sql --live RUN.duckdb`` reads it, so no URL is needed.
- ``RUN.snapshot.duckdb``: the last snapshot (replaced atomically by the next one).

The request subject is ``eictl.<partition>.recorder.snapshot``: outside ``ei.<partition>.>``,
so requests are never captured by the partition's stream. The recorder answers one request at
a time and reuses its last snapshot when the log has not moved or when it is younger than
``min_interval_s`` (1 s), so a burst of queries costs one copy.
"""

from __future__ import annotations

import asyncio
import json
import os
from dataclasses import dataclass

import nats
from nats.errors import Error as NatsError
from nats.errors import NoRespondersError

from events.subjects import token
from services.adapters.aio import wait_for
from services.adapters.bus.options import DEFAULT_NATS_URL
from services.adapters.bus.security import Credentials, CredentialsError


class LiveError(RuntimeError):
    """No snapshot could be had; ``str`` is one line that says why and what to try."""


def snapshot_subject(partition: str) -> str:
    return f"eictl.{token(partition)}.recorder.snapshot"


def sidecar_path(db: str | os.PathLike) -> str:
    return os.fspath(db) + ".live.json"


def snapshot_path(db: str | os.PathLike) -> str:
    db = os.fspath(db)
    return db.removesuffix(".duckdb") + ".snapshot.duckdb"


@dataclass(frozen=True)
class Snapshot:
    path: str  # where this process can open it
    file: str  # its name, as the recorder wrote it next to the log
    applied_seq: int
    age_s: float
    bytes: int


def read_sidecar(db: str | os.PathLike) -> dict:
    try:
        with open(sidecar_path(db), encoding="utf-8") as fh:
            data = json.load(fh)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        raise LiveError(f"{sidecar_path(db)} is unreadable ({exc}); pass --nats-url and --partition") from exc
    return data if isinstance(data, dict) else {}


def operator_credentials(db: str | os.PathLike, given=None):
    """The credentials ``sql --live`` uses: ``given`` (flags, env) when they say anything, else
    the operator account that ``evolving up`` wrote next to its run's log
    (``RUN_DIR/credentials/operator.json``), else none (an open bus)."""
    if given is not None and not given.empty:
        return given
    env = Credentials.from_env()
    if not env.empty:
        return env
    path = os.path.join(os.path.dirname(os.path.abspath(db)), "credentials", "operator.json")
    return Credentials.from_file(path) if os.path.isfile(path) else None


def request_snapshot(db: str, *, nats_url: str | None = None, partition: str | None = None,
                     timeout_s: float = 30.0, credentials=None) -> Snapshot:
    """Ask the recorder writing ``db`` for a snapshot; the path this process can open."""
    return asyncio.run(request_snapshot_async(db, nats_url=nats_url, partition=partition, timeout_s=timeout_s,
                                              credentials=credentials))


async def request_snapshot_async(db: str, *, nats_url: str | None = None, partition: str | None = None,
                                 timeout_s: float = 30.0, credentials=None) -> Snapshot:
    """``credentials``: services.adapters.bus.security.Credentials (default: :func:`operator_credentials`);
    ``nats_url`` may list a cluster's servers, comma-separated."""
    side = read_sidecar(db)
    url = nats_url or side.get("nats_url") or os.environ.get("EI_NATS_URL") or DEFAULT_NATS_URL
    try:
        creds = operator_credentials(db, credentials)
    except CredentialsError as exc:
        raise LiveError(str(exc)) from exc
    auth = creds.connect_options() if creds is not None else {}
    part = partition or side.get("partition") or os.environ.get("EI_PARTITION") or "default"
    subject = snapshot_subject(part)
    where = f"the recorder of {db} (partition {part!r} on {url})"
    errors: list[BaseException] = []

    async def on_error(exc: BaseException) -> None:  # instead of nats-py's traceback on stderr
        errors.append(exc)

    try:
        nc = await wait_for(
            nats.connect(servers=[u.strip() for u in url.split(",") if u.strip()], name="evolving-sql",
                         allow_reconnect=False, max_reconnect_attempts=1,
                         reconnect_time_wait=0.2,  # 0 attempts would retry forever (nats-py 2.x)
                         connect_timeout=min(5.0, timeout_s), error_cb=on_error, **auth),
            timeout=timeout_s)
    except (OSError, TimeoutError, NatsError) as exc:
        cause = errors[-1] if errors else exc
        raise LiveError(f"cannot reach the bus at {url} to ask {where}: "
                        f"{type(cause).__name__} {cause}".rstrip()) from exc
    try:
        msg = await nc.request(subject, json.dumps({"db": os.path.basename(db)}).encode(), timeout=timeout_s)
    except NoRespondersError as exc:
        raise LiveError(f"no recorder answers on {subject}: is the run still going? ({where})") from exc
    except (TimeoutError, NatsError) as exc:
        raise LiveError(f"{where} did not answer within {timeout_s:g} s ({type(exc).__name__})") from exc
    finally:
        await nc.close()
    try:
        reply = json.loads(msg.data)
    except ValueError as exc:
        raise LiveError(f"{where} answered something that is not JSON: {msg.data[:80]!r}") from exc
    if not reply.get("ok"):
        raise LiveError(f"{where} could not take a snapshot: {reply.get('error', 'no reason given')}")
    theirs = reply.get("db")
    if theirs and theirs != os.path.basename(db):
        raise LiveError(f"the recorder on {subject} writes {theirs}, not {os.path.basename(db)}")
    file = os.path.basename(str(reply.get("file", "")))
    path = os.path.join(os.path.dirname(os.path.abspath(db)), file)
    if not file or not os.path.isfile(path):
        raise LiveError(f"the recorder wrote {reply.get('path') or file!r}, which is not visible here as {path}: "
                        "query it on the machine (or volume) that holds the run's files")
    return Snapshot(path=path, file=file, applied_seq=int(reply.get("applied_seq", 0)),
                    age_s=float(reply.get("age_s", 0.0)), bytes=int(reply.get("bytes", 0)))
