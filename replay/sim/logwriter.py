"""The simulator's log writer process: a child interpreter that owns one DuckDB event log.

:class:`replay.sim.simlog.SimLog` (``writer="process"``) starts it as ``python -m
replay.sim.logwriter PATH FORMAT`` (a plain subprocess, not ``multiprocessing``: a spawned
``multiprocessing`` child imports the parent's main module again, which runs a user's script a
second time when it has no ``if __name__ == "__main__"`` guard). The wire, over the child's
stdin, is frames of an 8-byte little-endian length and a msgpack body: first the run
configuration (a map, or nil), then each batch (a list of ``[seq, subject, event]``, the events
in their wire codec), then a frame of length 0 (the end). The child answers on stdout, one JSON
object a line: ``{"error": ...}`` as soon as a batch fails (it then keeps reading and stores
nothing more, so the parent never blocks on it) and ``{"final": true, ...}`` with its counts
after closing the file.

The parent side (:class:`WriterProcess`) hands batches to a feeder thread through a bounded
queue (the simulation waits when ``queue_batches`` are outstanding), and a reader thread
collects the answers; a child that dies is an error at the next blocked hand-over or at close,
never a hang.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgspec

_LEN = 8
#: The folder that holds ``replay/``: put on the child's path, whatever this process's path is.
_ROOT = str(Path(__file__).resolve().parents[2])
#: How long a blocked hand-over or close waits before it looks whether the child lives.
_POLL_S = 0.5


def _widen(pipe) -> None:
    """Give the pipe to the child a 1 MiB buffer where the OS allows it (Linux ``F_SETPIPE_SZ``;
    the default 64 KiB makes the feeder thread wake, and take the GIL from the simulation, once
    per 64 KiB of a batch)."""
    try:
        import fcntl  # lazy: Linux and other POSIX only

        fcntl.fcntl(pipe.fileno(), getattr(fcntl, "F_SETPIPE_SZ", 1031), 1 << 20)
    except (ImportError, OSError):
        pass  # not Linux, or above /proc/sys/fs/pipe-max-size: the default buffer works the same


class WriterProcess:
    """The parent's handle on one writer process (see the module docstring)."""

    def __init__(self, path: str, fmt: str, config: dict | None, queue_batches: int = 4) -> None:
        self.path = path
        self._encode = msgspec.msgpack.Encoder().encode
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([_ROOT, *filter(None, [env.get("PYTHONPATH")])])
        self._proc = subprocess.Popen([sys.executable, "-m", "replay.sim.logwriter", path, fmt],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        _widen(self._proc.stdin)
        self._queue: queue.Queue = queue.Queue(maxsize=queue_batches)
        self._reports: list[dict] = []
        self._final = threading.Event()
        self.pipe_error: str | None = None
        self._feeder = threading.Thread(target=self._feed, name=f"logwriter-feed-{path}", daemon=True)
        self._reader = threading.Thread(target=self._read, name=f"logwriter-read-{path}", daemon=True)
        self._feeder.start()
        self._reader.start()
        self._queue.put(self._encode(config))

    # ------------------------------------------------------------------ threads
    def _feed(self) -> None:
        out = self._proc.stdin
        try:
            while True:
                data = self._queue.get()
                if data is None:
                    out.write((0).to_bytes(_LEN, "little"))
                    out.flush()
                    out.close()
                    return
                out.write(len(data).to_bytes(_LEN, "little"))
                out.write(data)
        except (BrokenPipeError, OSError, ValueError) as exc:  # the child is gone
            self.pipe_error = f"{type(exc).__name__}: {exc}"
            while True:  # keep taking batches: the simulation must never block on a dead writer
                try:
                    if self._queue.get(timeout=_POLL_S) is None:
                        return
                except queue.Empty:
                    pass

    def _read(self) -> None:
        for line in self._proc.stdout:
            try:
                rep = json.loads(line)
            except ValueError:
                continue  # not ours (nothing else writes there; kept safe anyway)
            self._reports.append(rep)
            if rep.get("final"):
                break
        self._final.set()

    # ------------------------------------------------------------------ the parent's calls
    def error(self) -> str | None:
        """The first failure the child reported, if any (read without waiting)."""
        return next((r["error"] for r in list(self._reports) if r.get("error")), None)

    def alive(self) -> bool:
        return self._proc.poll() is None

    def _gone(self) -> str:
        return f"the log writer process exited (code {self._proc.poll()})"

    def put(self, rows: list) -> None:
        """Hand one batch to the child; raise :class:`RuntimeError` if it died with batches due."""
        self._put(self._encode(rows))

    def _put(self, item: bytes | None) -> None:
        while True:
            try:
                self._queue.put(item, timeout=_POLL_S)
                return
            except queue.Full:
                if not self.alive():
                    raise RuntimeError(f"{self._gone()} with batches not written") from None

    def close(self) -> dict:
        """The end frame, then the child's final report (``{}`` and an ``error`` if it has none)."""
        try:
            self._put(None)
        except RuntimeError as exc:
            self.kill()
            return {"error": str(exc)}
        while not self._final.wait(_POLL_S):
            if not self.alive():
                self._final.wait(_POLL_S)  # its last lines may still be in the pipe
                break
        final = next((r for r in self._reports if r.get("final")), None)
        try:
            self._proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.kill()
        self._proc.stdout.close()
        if final is None:
            return {"error": self.error() or f"{self._gone()} without its final report"
                    + (f" ({self.pipe_error})" if self.pipe_error else "")}
        return final

    def kill(self) -> None:
        if self.alive():
            self._proc.kill()
        self._proc.wait()

    @property
    def pid(self) -> int:
        return self._proc.pid


# ---------------------------------------------------------------------- the child
def _frames(inp):
    while True:
        head = inp.read(_LEN)
        if len(head) < _LEN:
            return  # the parent is gone: what came is what there is
        n = int.from_bytes(head, "little")
        if n == 0:
            return
        body = inp.read(n)
        if len(body) < n:
            return
        yield body


def main(argv: list[str] | None = None) -> int:
    from events.catalog import AnyEvent  # lazy: the child only; the parent need not load the catalog here
    from services.adapters.eventlog import DuckDbEventLog  # lazy: the child only (DuckDB)

    path, fmt = (argv if argv is not None else sys.argv[1:])[:2]
    out = sys.stdout

    def say(rep: dict) -> None:
        out.write(json.dumps(rep) + "\n")
        out.flush()

    decode = msgspec.msgpack.Decoder(list[tuple[int, str, AnyEvent]]).decode
    frames = _frames(sys.stdin.buffer)
    stored, write_s, write_cpu_s, error, log = 0, 0.0, 0.0, None, None
    try:
        config = msgspec.msgpack.decode(next(frames, msgspec.msgpack.encode(None)))
        log = DuckDbEventLog(path, format=fmt)
        if config is not None:
            log.set_run_config(config)
    except BaseException as exc:  # noqa: BLE001 - reported to the simulation's process
        error = f"{type(exc).__name__}: {exc}"
        say({"error": error})
    for data in frames:
        if error is not None:
            continue
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            stored += log.append(decode(data))
        except BaseException as exc:  # noqa: BLE001 - reported to the simulation's process
            error = f"{type(exc).__name__}: {exc}"
            say({"error": error})
        write_s += time.perf_counter() - t0
        write_cpu_s += time.thread_time() - c0
    if log is not None:
        try:
            log.close()
        except BaseException as exc:  # noqa: BLE001
            error = error or f"closing the log: {type(exc).__name__}: {exc}"
    say({"final": True, "stored": stored, "write_s": write_s, "write_cpu_s": write_cpu_s,
         "process_cpu_s": time.process_time(), "error": error})
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    # the log is closed and the report sent: skip the interpreter's teardown (DuckDB, Arrow,
    # NumPy), which the simulation would otherwise wait for at close (~0.2 s)
    os._exit(code)
