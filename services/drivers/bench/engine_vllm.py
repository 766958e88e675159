"""The vLLM column of ``evolving bench engine``: one vLLM server on the same model, driven through
its OpenAI API with the bench's own prompts.

The server is launched as ``evolving up --engines vllm`` launches one
(services/drivers/up/vllm.py :func:`server_command`, the model converted to a Hugging Face folder
by services/drivers/gateway/hf_export.py) with ``OMP_NUM_THREADS`` = the bench's torch threads and
``--max-num-batched-tokens`` large enough for the biggest batch's prompts (or the prefill
sequence) to go in one step, as ours does. Measured after ours and transformers, never beside
them (one machine), and stopped (its process group killed) whatever happens.

Decode at batch B: B ``/v1/completions`` requests with the same token-id prompts as ours,
submitted together, streamed, ``max_tokens`` = steps + 1, ``ignore_eos``, temperature 0, with
``continuous_usage_stats`` so that every chunk carries the request's ``completion_tokens`` so far
(a chunk is not always one token: vLLM holds back a token whose text is an incomplete UTF-8
character and sends it with the next; a request that does not end with exactly ``max_tokens``
fails the bench). The rate is the tokens that arrived while all B decoded (after the last first
token, before the first request ended) over that window, so a request admitted a step late does
not count as a smaller batch. Prefill: one request of ``--prefill`` fresh tokens (a new
prompt each round: the server's prefix cache would otherwise answer it), ``max_tokens`` 1, the
request's wall time. Best of ``--repeats`` for both, after one warm-up request.

What the figures include that ours do not: the server's HTTP and streaming, its scheduler and
the API-server process beside the engine core on the same cores (ours time ``_forward`` alone).
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

SERVED = "bench"
START_TIMEOUT_S = 900.0


def skip_reason() -> str | None:
    """Why there is no vLLM column (one line), or None."""
    if importlib.util.find_spec("vllm") is None:
        return "vllm is not importable (bash scripts/setup.sh --vllm)"
    return None


class Server:
    """One launched vLLM server (its process group), stopped by :meth:`stop`."""

    def __init__(self, model: str, *, threads: int, batched_tokens: int, max_model_len: int, dtype: str,
                 log: Path) -> None:
        from engine.backends.vllm.launch import server_command  # lazy: only with the vLLM column
        from services.adapters.bus.natsserver import free_port  # lazy: only with the vLLM column
        from services.drivers.gateway.hf_export import hf_folder  # lazy: converting needs gguf, safetensors

        self.hf = str(hf_folder(model))
        self.url = f"http://127.0.0.1:{free_port()}"
        self.log = log
        cmd, env = server_command(self.hf, SERVED, self.url, f"tcp://127.0.0.1:{free_port()}", block_size=64,
                                  max_model_len=max_model_len, threads=threads, kv_cache_gib=1,
                                  extra=["--max-num-batched-tokens", str(batched_tokens),
                                         "--dtype", dtype])  # the last --dtype wins
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(cmd, env={**os.environ, **env}, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)

    def wait(self, timeout_s: float = START_TIMEOUT_S) -> float:
        """Block until ``/health`` answers; the seconds it took."""
        t0 = time.monotonic()
        while True:
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                    if r.status == 200:
                        return time.monotonic() - t0
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() - t0 > timeout_s:
                tail = self.log.read_text(errors="replace")[-2000:]
                raise RuntimeError(f"vLLM did not start (rc {self.proc.poll()}), {self.log}:\n{tail}")
            time.sleep(1.0)

    def stop(self) -> None:
        if self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        except ProcessLookupError:
            pass

    def complete(self, prompt: list[int], max_tokens: int) -> list[tuple[float, int]]:
        """One streamed greedy completion of exactly ``max_tokens`` tokens; per chunk its arrival
        time (``time.perf_counter``) and the completion tokens so far."""
        body = {"model": SERVED, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
        req = urllib.request.Request(f"{self.url}/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        times = []
        with urllib.request.urlopen(req, timeout=600) as r:
            for raw in r:
                line = raw.strip()
                if not line.startswith(b"data:") or line == b"data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                total = (chunk.get("usage") or {}).get("completion_tokens")
                if chunk.get("choices") and isinstance(total, int):
                    times.append((time.perf_counter(), total))
        if not times or times[-1][1] != max_tokens:
            raise RuntimeError(f"vLLM streamed {times[-1][1] if times else 0} tokens, not max_tokens {max_tokens}")
        return times


def _together(server: Server, prompts: list[list[int]], max_tokens: int) -> list[list[tuple[float, int]]]:
    """The prompts submitted at once (a thread each); every request's chunks (time, tokens so far)."""
    out: list[list[tuple[float, int]] | BaseException] = [[] for _ in prompts]

    def one(i: int) -> None:
        try:
            out[i] = server.complete(prompts[i], max_tokens)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            out[i] = exc

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for o in out:
        if isinstance(o, BaseException):
            raise o
    return out  # type: ignore[return-value]


def decode_rate(chunks: list[list[tuple[float, int]]]) -> tuple[float, int, float]:
    """(tokens/s, tokens, seconds) over the window in which every request decoded: from the last
    first chunk to the first last chunk, counting the tokens that arrived inside it (per request:
    its tokens so far at the window's end less those at its start)."""
    start = max(c[0][0] for c in chunks)
    end = min(c[-1][0] for c in chunks)
    if end <= start:
        raise RuntimeError("no window in which every request decoded (the requests did not overlap)")

    def upto(c: list[tuple[float, int]], t: float) -> int:
        return max((n for x, n in c if x <= t), default=0)

    n = sum(upto(c, end) - upto(c, start) for c in chunks)
    return n / (end - start), n, end - start


#: submissions of one batch before giving up on a window in which all its requests decode together;
#: each submission asks for twice the tokens of the one before
OVERLAP_TRIES = 4


def _overlapping_rate(server: Server, prompts: list[list[int]], max_tokens: int) -> tuple[float, int, float]:
    """decode_rate of a batch submitted at once, submitted again with twice the tokens when its
    requests did not overlap: the server admits requests one by one as they arrive, and on a quiet
    machine a request of a few tokens can finish before the last one's first chunk (on a loaded one,
    the threads can start that late); such a sample measures no batch at all."""
    for attempt in range(1, OVERLAP_TRIES + 1):
        tokens = max_tokens * 2 ** (attempt - 1)
        try:
            return decode_rate(_together(server, prompts, tokens))
        except RuntimeError as exc:
            if "did not overlap" not in str(exc) or attempt == OVERLAP_TRIES:
                raise RuntimeError(f"{exc} in {attempt} submissions of {len(prompts)} requests, the last of {tokens} "
                                   f"tokens each: use more --steps") from None
    raise AssertionError("unreachable")


def measure(model: str, decode_prompts: dict[int, list[list[int]]], steps: int, fresh, prefill: int,
            repeats: int, threads: int, dtype: str = "bfloat16", progress=None) -> dict:
    """The vLLM column: decode rows at each batch of ``decode_prompts`` and the prefill figure
    (``fresh(n)`` gives a new prompt of n token ids)."""
    prompt = max(len(p) for ps in decode_prompts.values() for p in ps)
    batched = max(2048, prefill + 1, max(decode_prompts) * (prompt + 1))
    max_len = max(prompt + (steps + 1) * 2 ** (OVERLAP_TRIES - 1) + 1, prefill + 2)  # room for the last retry
    log = Path(tempfile.mkdtemp(prefix="bench-vllm-")) / "vllm.log"
    result = {"dtype": dtype, "threads": threads, "log": str(log), "decode": [], "prefill": {}}
    server = Server(model, threads=threads, batched_tokens=batched, max_model_len=max_len, dtype=dtype, log=log)
    try:
        if progress:
            progress(f"vLLM server starting (log {log})")
        result["start_s"] = server.wait()
        server.complete(fresh(prompt), steps + 1)  # warm-up
        result["load_before"] = os.getloadavg()[0]
        for b, prompts in decode_prompts.items():
            best = (0.0, 0, 0.0)
            for _ in range(repeats):
                best = max(best, _overlapping_rate(server, prompts, steps + 1))
            row = {"batch": b, "tok_s": best[0], "window_tokens": best[1], "window_s": best[2]}
            result["decode"].append(row)
            if progress:
                progress(f"decode batch {b}: vLLM {row['tok_s']:.1f} tok/s")
        best_s = min(_timed_prefill(server, fresh(prefill)) for _ in range(repeats))
        result["prefill"] = {"tokens": prefill, "tok_s": prefill / best_s}
        result["load_after"] = os.getloadavg()[0]
    finally:
        server.stop()
    return result


def _timed_prefill(server: Server, prompt: list[int]) -> float:
    t0 = time.perf_counter()
    server.complete(prompt, 1)
    return time.perf_counter() - t0
