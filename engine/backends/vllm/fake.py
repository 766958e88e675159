"""A fake vLLM server for tests: the OpenAI-compatible routes the vLLM backend uses and a ZMQ
publisher of KV events in vLLM 0.33's layout (engine/backends/vllm/wire.py).

Routes as vLLM's API server answers them: ``GET /health`` (200, empty), ``GET /v1/models``,
``POST /v1/completions`` (token-id ``prompt``, ``max_tokens``, ``stream`` with ``stream_options
{include_usage, continuous_usage_stats}``: one SSE chunk per step, ``usage`` on every chunk
with continuous stats, a closing usage-only chunk with ``prompt_tokens_details.cached_tokens``,
then ``data: [DONE]``; 400 with vLLM's error shape for a bad body or the wrong model), ``GET
/metrics`` (``vllm:num_requests_running`` / ``vllm:num_requests_waiting``). A client that goes
away aborts its request, as vLLM does. Sampling: the body's fields are kept (``requests``);
unless ``ignore_eos`` is true the output ends at "end of turn" after ``eos_after`` tokens
(``finish_reason: "stop"``), as a model's EOS would. Limits: ``GET /v1/models`` names
``max_model_len`` and a prompt + ``max_tokens`` over it is a 400 as in vLLM; ``/metrics``
carries ``vllm:cache_config_info`` (``num_gpu_blocks`` = ``capacity_blocks``, ``block_size``)
and ``process_start_time_seconds``. :meth:`FakeVllm.restart` is a server restart: empty cache,
sequence numbers from 0, a new start time. ``POST /reset_prefix_cache`` is served only with
``dev_mode`` (vLLM's ``VLLM_SERVER_DEV_MODE=1``), 404 otherwise. ``shared_store`` (a dict two
fakes share) models vLLM's ``ExampleConnector`` in ``kv_both``: every prompt's KV stored, a peer's
loaded (counted in ``loaded`` and in ``cached_tokens``) under the connector's keys. KV: a prefix cache of ``block_size``-token blocks with
LRU leaf eviction, publishing one ``BlockStored`` per request for its new full blocks (SHA-256
``bytes`` block hashes, or unsigned 64-bit ints with ``int_hashes``, as
``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``), ``BlockRemoved`` per evicted block, ``AllBlocksCleared``
on ``POST /reset_prefix_cache``; ``medium="GPU"``, ``group_idx=0``, ``data_parallel_rank`` set
as vLLM's publisher does. Not modelled: real timing, vLLM's exact hash function (its seed and
CBOR encoding), scheduling, chunked prefill.
``python -m engine.backends.vllm.fake --port 8000 --kv-events-port 5557``.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import time
import uuid
from collections import OrderedDict

from aiohttp import web

from engine.backends.fake_server import FakeServer
from engine.backends.vllm.wire import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, frames


class FakeVllm(FakeServer):
    """One fake server (module docstring)."""

    frames = staticmethod(frames)
    handler_cancellation = True  # a client that goes away cancels its handler (vLLM aborts the request)

    def __init__(self, *, model: str = "fake/model", block_size: int = 16, capacity_blocks: int = 4096,
                 kv_events_port: int | None = None, topic: str = "", int_hashes: bool = False,
                 dp_rank: int = 0, prefill_s_per_token: float = 2e-6, decode_s_per_token: float = 0.002,
                 eos_after: int = 6, max_model_len: int = 131072, dev_mode: bool = True,
                 shared_store: dict | None = None) -> None:
        super().__init__(kv_events_port, topic)
        self.model, self.block_size, self.capacity = model, block_size, capacity_blocks
        self.eos_after, self.max_model_len, self.dev_mode = eos_after, max_model_len, dev_mode
        self.started_s = time.time()
        self.store, self.loaded = shared_store, 0  # vLLM's ExampleConnector (kv_both), modelled
        self.busy_resets = 0  # the next resets answered {"success": false}, as while blocks are held
        self.int_hashes, self.dp_rank = int_hashes, dp_rank
        self.prefill_s, self.decode_s = prefill_s_per_token, decode_s_per_token
        self.blocks: OrderedDict = OrderedDict()  # hash -> [parent, children], LRU order
        self.requests: list[dict] = []  # bodies received

    # ------------------------------------------------------------------ lifecycle
    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/reset_prefix_cache", self._reset)
        app.router.add_get("/metrics", self._metrics)
        return app

    def restart(self) -> None:
        """The server process restarted: its cache is empty, its publisher counts from 0 again."""
        self.blocks.clear()
        self.seq = 0
        self.started_s = max(time.time(), self.started_s + 1.0)

    def _batch(self, events: list) -> KVEventBatch:
        return KVEventBatch(ts=time.time(), events=events, data_parallel_rank=self.dp_rank)

    def block_hash(self, parent, tokens: list[int]):
        h = hashlib.sha256(parent if isinstance(parent, bytes) else (parent or 0).to_bytes(8, "big"))
        h.update(b"".join(int(t).to_bytes(4, "little") for t in tokens))
        return int.from_bytes(h.digest()[:8], "big") if self.int_hashes else h.digest()

    def _cache(self, ids: list[int]) -> int:
        """Cache the full blocks of ``ids``; returns the cached prefix in tokens."""
        events, parent, cached, new, new_parent, new_tokens = [], None, 0, [], None, []
        bs = self.block_size
        for i in range(0, len(ids) - len(ids) % bs, bs):
            toks = ids[i:i + bs]
            h = self.block_hash(parent, toks)
            if h in self.blocks:
                self.blocks.move_to_end(h)
                if cached == i:
                    cached = i + bs
            else:
                self._evict(events, keep=parent)
                self.blocks[h] = [parent, 0]
                if parent in self.blocks:
                    self.blocks[parent][1] += 1
                if not new:
                    new_parent = parent
                new.append(h)
                new_tokens.extend(toks)
            parent = h
        if new:  # vLLM's cache_full_blocks: one event for the blocks a step made full
            events.append(BlockStored(block_hashes=new, parent_block_hash=new_parent, token_ids=new_tokens,
                                      block_size=bs, lora_id=None, medium="GPU", lora_name=None,
                                      extra_keys=[None] * len(new), group_idx=0))
        self._publish(events)
        return cached

    def _evict(self, events: list, keep) -> None:
        while len(self.blocks) + 1 > self.capacity:
            victim = next((h for h, (_, c) in self.blocks.items() if c == 0 and h != keep), None)
            if victim is None:
                return
            parent, _ = self.blocks.pop(victim)
            if parent in self.blocks:
                self.blocks[parent][1] -= 1
            events.append(BlockRemoved(block_hashes=[victim], medium="GPU", group_idx=0))

    def _connector(self, ids: list[int]) -> int:
        """The shared store: the prompt's KV loaded if a peer stored it (looked up by its first
        ``(len - 2) // block`` blocks, as ExampleConnector does), then stored (``(len - 1) // block``)."""
        if self.store is None:
            return 0
        bs = self.block_size
        look, keep = (len(ids) - 2) // bs * bs, (len(ids) - 1) // bs * bs
        hit = look if look > 0 and tuple(ids[:look]) in self.store else 0
        self.loaded += bool(hit)
        if keep > 0:
            self.store[tuple(ids[:keep])] = self.port
        return hit

    # ------------------------------------------------------------------ routes
    @staticmethod
    def _error(msg: str, status: int = 400) -> web.Response:
        kind = "BadRequestError" if status == 400 else "NotFoundError"
        return web.json_response({"error": {"message": msg, "type": kind, "param": None, "code": status}},
                                 status=status)

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(text="")

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": self.model, "object": "model", "created": 0, "owned_by": "vllm", "root": self.model,
             "parent": None, "max_model_len": self.max_model_len}]})

    async def _reset(self, request: web.Request) -> web.Response:
        if not self.dev_mode:
            return web.json_response({"detail": "Not Found"}, status=404)
        if self.busy_resets > 0:  # blocks still held by running requests: vLLM refuses, 200 all the same
            self.busy_resets -= 1
            return web.json_response({"success": False})
        self.blocks.clear()
        self._publish([AllBlocksCleared()])
        return web.json_response({"success": True})

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
        except ValueError:
            return self._error("body is not JSON")
        self.requests.append(body)
        if body.get("model") != self.model:
            return self._error(f"The model `{body.get('model')}` does not exist.", 404)
        ids = body.get("prompt")
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) for t in ids):
            return self._error("this fake takes token-id prompts only")
        rid = str(body.get("request_id") or request.headers.get("X-Request-Id") or uuid.uuid4().hex)
        max_tokens = int(body.get("max_tokens") or 16)
        if len(ids) + max_tokens > self.max_model_len:
            return self._error(f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                               f"requested {len(ids) + max_tokens} tokens ({len(ids)} in the messages, {max_tokens} "
                               "in the completion).")
        out_tokens, reason = max_tokens, "length"
        if not body.get("ignore_eos") and self.eos_after < max_tokens:
            out_tokens, reason = self.eos_after, "stop"
        opts = body.get("stream_options") or {}
        self.inflight[rid] = asyncio.current_task()
        try:
            # vLLM computes the prompt's last token even on a full hit: whole blocks before it
            cached = min(self._cache(ids), (len(ids) - 1) // self.block_size * self.block_size)
            cached = max(cached, self._connector(ids))
            await asyncio.sleep(self.prefill_s * (len(ids) - cached))
            cid, created = f"cmpl-{rid}", int(time.time())

            max_tokens = out_tokens

            def usage(done: int, final: bool = False) -> dict:
                u = {"prompt_tokens": len(ids), "total_tokens": len(ids) + done, "completion_tokens": done}
                if final:
                    u["prompt_tokens_details"] = {"cached_tokens": cached}
                return u

            if not body.get("stream"):
                await asyncio.sleep(self.decode_s * max_tokens)
                return web.json_response({"id": cid, "object": "text_completion", "created": created,
                                          "model": self.model, "choices": [{"index": 0, "text": "x" * max_tokens,
                                                                            "logprobs": None, "finish_reason": reason,
                                                                            "stop_reason": None}],
                                          "usage": usage(max_tokens, True)})
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for done in range(1, max_tokens + 1):
                await asyncio.sleep(self.decode_s)
                chunk = {"id": cid, "object": "text_completion", "created": created, "model": self.model,
                         "choices": [{"index": 0, "text": "x", "logprobs": None,
                                      "finish_reason": reason if done == max_tokens else None,
                                      "stop_reason": None}]}
                if opts.get("include_usage") and opts.get("continuous_usage_stats"):
                    chunk["usage"] = usage(done)
                await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            if opts.get("include_usage"):
                final = {"id": cid, "object": "text_completion", "created": created, "model": self.model,
                         "choices": [], "usage": usage(max_tokens, True)}
                await resp.write(b"data: " + json.dumps(final).encode() + b"\n\n")
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        finally:
            self.inflight.pop(rid, None)

    async def _metrics(self, request: web.Request) -> web.Response:
        labels = f'{{engine="0",model_name="{self.model}"}}'
        text = ("# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
                "# TYPE vllm:num_requests_running gauge\n"
                f"vllm:num_requests_running{labels} {float(len(self.inflight))}\n"
                "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.\n"
                "# TYPE vllm:num_requests_waiting gauge\n"
                f"vllm:num_requests_waiting{labels} 0.0\n"
                "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n"
                "# TYPE vllm:cache_config_info gauge\n"
                f'vllm:cache_config_info{{block_size="{self.block_size}",enable_prefix_caching="True",engine="0",'
                f'num_cpu_blocks="None",num_gpu_blocks="{self.capacity}"}} 1.0\n'
                "# HELP process_start_time_seconds Start time of the process since unix epoch in seconds.\n"
                "# TYPE process_start_time_seconds gauge\n"
                f"process_start_time_seconds {self.started_s}\n")
        return web.Response(text=text, content_type="text/plain")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m engine.backends.vllm.fake",
                                description="fake vLLM server (OpenAI completions + ZMQ KV events) for tests")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="HTTP port")
    p.add_argument("--model", default="fake/model", help="the model name /v1/models lists")
    p.add_argument("--kv-events-port", type=int, default=None, help="bind the ZMQ KV-event publisher here")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block (vLLM --block-size)")
    p.add_argument("--capacity-blocks", type=int, default=4096, help="GPU cache size in blocks")
    p.add_argument("--int-hashes", action="store_true", help="publish int block hashes instead of bytes")
    p.add_argument("--decode-s-per-token", type=float, default=0.002, help="simulated decode time per token")
    args = p.parse_args(argv)
    fake = FakeVllm(model=args.model, block_size=args.block_size, capacity_blocks=args.capacity_blocks,
                    kv_events_port=args.kv_events_port, int_hashes=args.int_hashes,
                    decode_s_per_token=args.decode_s_per_token)

    return fake.serve_forever(args.host, args.port, "fake vllm")


if __name__ == "__main__":
    raise SystemExit(main())
