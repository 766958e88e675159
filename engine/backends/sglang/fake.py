"""A protocol-faithful fake SGLang server, for tests and the CPU-only live stack.

Same routes and answers as SGLang 0.5.23's HTTP server (sglang/srt/entrypoints/http_server.py)
for what the backend uses, and the same ZMQ KV-event wire format (engine/backends/sglang/wire.py,
pinned against SGLang's bytes):

- ``GET /health`` -> 200; ``GET /server_info`` -> ``disaggregation_mode``, ``page_size``,
  ``enable_pd_role_switch``, ``kv_events_config``, ``disaggregation_bootstrap_port`` and the
  ``kv_events`` descriptor (publisher, endpoint host and port base, topic, block size, DP size).
- ``POST /generate`` with ``input_ids``, ``sampling_params.max_new_tokens``, ``rid``,
  ``stream`` and, in PD mode, ``bootstrap_host/port/room`` (400 without a room, as SGLang's
  prefill refuses an unpaired request). Streaming: ``data: {json}\\n\\n`` chunks with the
  cumulative ``text`` and ``meta_info`` (``prompt_tokens``, ``completion_tokens``,
  ``cached_tokens``, ``finish_reason``), then ``data: [DONE]``. A prefill server answers once
  the prefill is done (one JSON, no text); the decode server with the same room streams.
- ``GET /metrics``: ``sglang:num_running_reqs`` and ``sglang:num_queue_reqs`` (Prometheus text).
- ``POST /abort_request`` (``rid``); ``POST /pd_role_switch`` (``new_role``) with SGLang's
  checks in SGLang's order (not enabled, invalid role, not in PD mode, already in role, not
  idle) and answer shape (``success``, ``message``, ``old_role``, ``new_role``,
  ``safe_to_restore``; 200 or 400). A successful switch resets the prefix cache
  (``AllBlocksCleared``), as SGLang's ``_release_prefix_cache_for_role_switch`` does.
- SGLang's "Decode batch" scheduler log line every ``--decode-log-interval`` decode iterations
  (the source of the SGLang backend's decode ``IterationDone``).
- A radix cache of ``page_size`` pages with LRU leaf eviction at ``capacity_pages``, publishing
  ``BlockStored`` (one per page, chained by ``parent_block_hash``) and ``BlockRemoved`` on a ZMQ
  PUB socket as three frames (topic, 8-byte sequence, msgpack ``KVEventBatch``).

What it does not model: real timing (prefill ``prefill_s_per_token``, ``decode_s_per_token``),
SGLang's exact page-hash function (a SHA-256 chain too, different bytes), KV transfer.

``python -m engine.backends.sglang.fake --port 30000 --mode prefill --kv-events-port 5557``
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import time
from collections import OrderedDict

from aiohttp import web

from engine.backends.fake_server import FakeServer
from engine.backends.sglang.wire import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, frames
from services.adapters.aio import wait_for

#: Decode servers wait for the prefill of the same bootstrap room (in-process pairing).
_ROOMS: dict[int, asyncio.Event] = {}


def _room(room: int) -> asyncio.Event:
    return _ROOMS.setdefault(room, asyncio.Event())


class FakeSglang(FakeServer):
    """One fake server (module docstring)."""

    frames = staticmethod(frames)

    def __init__(self, *, mode: str = "null", enable_role_switch: bool = True, page_size: int = 64,
                 capacity_pages: int = 4096, kv_events_port: int | None = None, topic: str = "",
                 bootstrap_port: int = 8998, prefill_s_per_token: float = 2e-6, decode_s_per_token: float = 0.002,
                 chunk_tokens: int = 4, pair_wait_s: float = 30.0, log_decode: bool = False,
                 decode_log_interval: int = 40) -> None:
        assert mode in ("null", "prefill", "decode"), mode
        super().__init__(kv_events_port, topic)
        self.mode, self.enable_role_switch = mode, enable_role_switch
        self.page_size, self.capacity_pages = page_size, capacity_pages
        self.bootstrap_port = bootstrap_port
        self.prefill_s, self.decode_s, self.chunk_tokens = prefill_s_per_token, decode_s_per_token, chunk_tokens
        self.pair_wait_s = pair_wait_s  # decode: how long to wait for the prefill of the room (in-process)
        self.log_decode, self.decode_log_interval = log_decode, decode_log_interval
        self._steps, self._gen_tokens, self._log_t = 0, 0, time.monotonic()
        self.pages: OrderedDict[int, tuple[int | None, int]] = OrderedDict()  # hash -> (parent, children), LRU
        self.switches: list[dict] = []

    # ------------------------------------------------------------------ lifecycle
    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/server_info", self._server_info)
        app.router.add_get("/get_server_info", self._server_info)
        app.router.add_post("/generate", self._generate)
        app.router.add_post("/abort_request", self._abort)
        app.router.add_post("/pd_role_switch", self._role_switch)
        app.router.add_get("/metrics", self._metrics)
        return app

    def _batch(self, events: list) -> KVEventBatch:
        return KVEventBatch(ts=time.time(), events=events, attn_dp_rank=0)

    @staticmethod
    def page_hash(parent: int | None, tokens: list[int]) -> int:
        h = hashlib.sha256((parent or 0).to_bytes(8, "big", signed=True))
        h.update(b"".join(int(t).to_bytes(4, "little") for t in tokens))
        return int.from_bytes(h.digest()[:8], "big", signed=True)

    def _insert(self, ids: list[int]) -> int:
        """Insert the full pages of ``ids``; returns the cached prefix length in tokens."""
        events, parent, cached = [], None, 0
        ps = self.page_size
        for i in range(0, len(ids) - len(ids) % ps, ps):
            toks = ids[i:i + ps]
            h = self.page_hash(parent, toks)
            if h in self.pages:
                self.pages.move_to_end(h)
                if cached == i:
                    cached = i + ps
            else:
                self._evict_for(1, events, keep=parent)
                self.pages[h] = (parent, 0)
                if parent is not None and parent in self.pages:
                    p, c = self.pages[parent]
                    self.pages[parent] = (p, c + 1)
                events.append(BlockStored(block_hashes=[h], parent_block_hash=parent, token_ids=toks, block_size=ps,
                                          lora_id=None, medium="GPU"))
            parent = h
        self._publish(events)
        return cached

    def _evict_for(self, n: int, events: list, keep: int | None) -> None:
        while len(self.pages) + n > self.capacity_pages:
            victim = next((h for h, (_, c) in self.pages.items() if c == 0 and h != keep), None)
            if victim is None:
                return
            parent, _ = self.pages.pop(victim)
            if parent in self.pages:
                p, c = self.pages[parent]
                self.pages[parent] = (p, c - 1)
            events.append(BlockRemoved(block_hashes=[victim], medium="GPU"))

    # ------------------------------------------------------------------ routes
    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(text="")

    async def _server_info(self, request: web.Request) -> web.Response:
        kv, desc = None, None
        if self.kv_events_port is not None:
            kv = json.dumps({"publisher": "zmq", "endpoint": f"tcp://*:{self.kv_events_port}", "topic": self.topic})
            # the descriptor SGLang's describe_kv_events_publisher puts under "kv_events"
            desc = {"publisher": "zmq", "endpoint_host": "*", "endpoint_port_base": self.kv_events_port,
                    "topic": self.topic, "block_size": self.page_size, "dp_size": 1}
        return web.json_response({
            "version": "fake-0.5.23", "disaggregation_mode": self.mode, "page_size": self.page_size,
            "enable_pd_role_switch": self.enable_role_switch, "kv_events_config": kv,
            "disaggregation_bootstrap_port": self.bootstrap_port, "kv_events": desc,
            "internal_states": [{"fake": True}]})

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
        except ValueError:
            return web.json_response({"error": {"message": "body is not JSON"}}, status=400)
        ids = body.get("input_ids")
        if not isinstance(ids, list) or not ids:
            return web.json_response({"error": {"message": "input_ids must be a non-empty list"}}, status=400)
        if self.mode != "null" and body.get("bootstrap_room") is None:
            return web.json_response({"error": {"message": "bootstrap_room is required in PD disaggregation mode"}},
                                     status=400)
        rid = str(body.get("rid") or f"fake-{id(body)}")
        max_new = int((body.get("sampling_params") or {}).get("max_new_tokens", 16))
        task = asyncio.current_task()
        self.inflight[rid] = task
        try:
            if self.mode == "prefill":
                cached = self._insert(ids)
                await asyncio.sleep(self.prefill_s * (len(ids) - cached))
                _room(int(body["bootstrap_room"])).set()
                return web.json_response({"text": "", "meta_info": self._meta(rid, ids, cached, 1, "length")})
            cached = 0
            if self.mode == "decode":
                with contextlib.suppress(asyncio.TimeoutError):
                    await wait_for(_room(int(body["bootstrap_room"])).wait(), self.pair_wait_s)
                _ROOMS.pop(int(body["bootstrap_room"]), None)
            else:
                cached = self._insert(ids)
                await asyncio.sleep(self.prefill_s * (len(ids) - cached))
            return await self._stream(request, rid, ids, cached, max_new, bool(body.get("stream")))
        finally:
            self.inflight.pop(rid, None)

    def _meta(self, rid, ids, cached, done, finish) -> dict:
        return {"id": rid, "prompt_tokens": len(ids), "completion_tokens": done, "cached_tokens": cached,
                "finish_reason": None if finish is None else {"type": finish, "length": done}}

    async def _stream(self, request, rid, ids, cached, max_new, stream) -> web.StreamResponse:
        if not stream:
            await asyncio.sleep(self.decode_s * max_new)
            return web.json_response({"text": "x" * max_new, "meta_info": self._meta(rid, ids, cached, max_new,
                                                                                      "length")})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        done = 0
        while done < max_new:
            step = min(self.chunk_tokens if done else 1, max_new - done)
            await asyncio.sleep(self.decode_s * step)
            done += step
            self._decode_log(step)
            out = {"text": "x" * done, "meta_info": self._meta(rid, ids, cached, done,
                                                                "length" if done >= max_new else None)}
            await resp.write(b"data: " + json.dumps(out).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def _metrics(self, request: web.Request) -> web.Response:
        """The two gauges the backend reads, in SGLang's names and Prometheus text format."""
        labels = '{model_name="fake",engine_type="unified",tp_rank="0",pp_rank="0"}'
        text = ("# HELP sglang:num_running_reqs The number of running requests.\n"
                "# TYPE sglang:num_running_reqs gauge\n"
                f"sglang:num_running_reqs{labels} {float(len(self.inflight))}\n"
                "# HELP sglang:num_queue_reqs The number of requests in the waiting queue.\n"
                "# TYPE sglang:num_queue_reqs gauge\n"
                f"sglang:num_queue_reqs{labels} 0.0\n")
        return web.Response(text=text, content_type="text/plain")

    def _decode_log(self, tokens: int) -> None:
        """SGLang's "Decode batch" line every ``decode_log_interval`` iterations (one token per
        request and iteration here), in the format of its metrics_reporter.py."""
        self._steps += tokens
        self._gen_tokens += tokens
        if not self.log_decode or self._steps < self.decode_log_interval:
            return
        now = time.monotonic()
        tput = self._gen_tokens / max(1e-9, now - self._log_t)
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        print(f"[{stamp} TP0] Decode batch, #running-req: {max(1, len(self.inflight))}, #token: {len(self.pages) * 64}, "
              f"token usage: {len(self.pages) / max(1, self.capacity_pages):.2f}, cuda graph: False, "
              f"gen throughput (token/s): {tput:.2f}, #queue-req: 0", flush=True)
        self._steps, self._gen_tokens, self._log_t = 0, 0, now

    async def _abort(self, request: web.Request) -> web.Response:
        body = await request.json()
        task = self.inflight.get(str(body.get("rid", "")))
        if task is not None:
            task.cancel()
        return web.Response(text="")

    async def _role_switch(self, request: web.Request) -> web.Response:
        body = await request.json()
        new, old = str(body.get("new_role") or "").lower(), self.mode

        def answer(ok: bool, msg: str, safe: bool = False) -> web.Response:
            out = {"success": ok, "message": msg, "old_role": old, "new_role": new, "safe_to_restore": safe}
            self.switches.append(out)
            return web.json_response(out, status=200 if ok else 400)

        if not self.enable_role_switch:
            return answer(False, "--enable-pd-role-switch is not set on this instance", True)
        if new not in ("prefill", "decode"):
            return answer(False, f"invalid new_role={new!r}", True)
        if self.mode == "null":
            return answer(False, "instance is not running in PD disaggregation mode", True)
        if new == old:
            return answer(True, "already in target role")
        if self.inflight:
            return answer(False, "instance is not idle; drain all requests before switching", True)
        self.pages.clear()
        self._publish([AllBlocksCleared()])
        self.mode = new
        return answer(True, "ok")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m engine.backends.sglang.fake",
                                description="fake SGLang server (HTTP routes + ZMQ KV events) for tests")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=30000, help="HTTP port")
    p.add_argument("--mode", "--disaggregation-mode", dest="mode", choices=("null", "prefill", "decode"),
                   default="null", help="--disaggregation-mode the fake pretends to run with")
    p.add_argument("--pair-wait-s", type=float, default=0.0,
                   help="decode: wait this long for the prefill of the same bootstrap room (same process only)")
    p.add_argument("--decode-s-per-token", type=float, default=0.002, help="simulated decode time per token")
    p.add_argument("--kv-events-port", type=int, default=None, help="bind the ZMQ KV-event publisher here")
    p.add_argument("--page-size", type=int, default=64, help="tokens per page")
    p.add_argument("--capacity-pages", type=int, default=4096, help="GPU cache size in pages")
    p.add_argument("--decode-log-interval", type=int, default=40,
                   help="print SGLang's 'Decode batch' log line every this many decode iterations")
    p.add_argument("--no-role-switch", action="store_true", help="behave as without --enable-pd-role-switch")
    args = p.parse_args(argv)
    fake = FakeSglang(mode=args.mode, enable_role_switch=not args.no_role_switch, page_size=args.page_size,
                      capacity_pages=args.capacity_pages, kv_events_port=args.kv_events_port,
                      pair_wait_s=args.pair_wait_s, decode_s_per_token=args.decode_s_per_token, log_decode=True,
                      decode_log_interval=args.decode_log_interval)

    return fake.serve_forever(args.host, args.port, "fake sglang")


if __name__ == "__main__":
    raise SystemExit(main())
