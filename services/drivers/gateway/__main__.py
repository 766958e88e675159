"""``python -m services.drivers.gateway --port 8000 --nats-url URL [--partition P] ...``

Runs the OpenAI-compatible gateway (services/drivers/gateway/app.py) against a NATS JetStream server.
Without ``--nats-url`` it starts an embedded ``nats-server`` (local trials only: no router or
engine will be attached to it, so requests time out with 503 unless you start them too).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import tomllib
from pathlib import Path

from aiohttp import web

from services.adapters.bus import NatsBus, StreamSettings
from services.adapters.bus.nats_prompts import NatsPromptStore
from services.adapters.bus.natsserver import EmbeddedNats
from services.adapters.bus.options import bus_auth
from services.adapters.bus.security import CredentialsError, add_cli_options
from services.adapters.bus.tokens import NatsTokenMux
from services.adapters.logging import configure_logging, get_logger
from services.drivers.gateway.app import Gateway, GatewayConfig
from services.drivers.gateway.auth import ENV_VAR, ApiKeyConfigError, load_api_keys
from services.drivers.gateway.guard import GatewayRunner
from services.drivers.gateway.model import AUTO, ModelError, load_model, names_model
from services.drivers.gateway.toolcalls import PARSERS


def _env_epoch() -> float | None:
    raw = os.environ.get("EI_CLOCK_EPOCH", "").strip()
    return float(raw) if raw else None


DEFAULT_CONTEXT = GatewayConfig.context_length
#: how long the gateway waits at start for its prompt stores to take a write (NatsPromptStore.warm)
PROMPT_WARM_S = 60.0
PROFILE_DIR = Path(__file__).resolve().parents[3] / "deploy" / "profiles"


def context_from_profile(name_or_path: str) -> tuple[int | None, str]:
    """``context_length`` from an engine profile's TOML (top level or ``[model]``), and where it came from."""
    p = Path(name_or_path)
    if not p.suffix:
        p = PROFILE_DIR / f"{name_or_path}.toml"
    try:
        with open(p, "rb") as fh:
            d = tomllib.load(fh)
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise SystemExit(f"python -m services.drivers.gateway: --profile {name_or_path}: {exc}") from None
    v = d.get("context_length", (d.get("model") if isinstance(d.get("model"), dict) else {}).get("context_length"))
    if v is None:
        return None, f"profile {p.name} has no context_length"
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise SystemExit(f"python -m services.drivers.gateway: {p}: context_length must be a positive integer, got {v!r}")
    return v, f"profile {p.name}"


def resolve_limits(args: argparse.Namespace, model_context: tuple[int | None, str] = (None, "")
                   ) -> tuple[int, int, frozenset[str], str]:
    """(context length, body limit in bytes, API keys, where the context length came from);
    a bad value exits with one line. The context length: ``--context-length``, else the
    smaller of the model's own (``model_context``: its GGUF metadata or config.json) and the
    ``--profile``'s, else the default."""
    prog = "python -m services.drivers.gateway"
    if args.context_length is not None:
        if args.context_length < 1:
            raise SystemExit(f"{prog}: --context-length must be >= 1, got {args.context_length}")
        ctx, why = args.context_length, "--context-length"
    else:
        ctx, why = None, "default"
        if args.profile:
            ctx, why = context_from_profile(args.profile)
        if model_context[0] is not None and (ctx is None or model_context[0] <= ctx):
            ctx, why = model_context[0], f"model: {model_context[1]}"
        if ctx is None:
            ctx, why = DEFAULT_CONTEXT, f"default ({why})" if args.profile else "default"
    if not args.max_body_mb > 0:
        raise SystemExit(f"{prog}: --max-body-mb must be > 0, got {args.max_body_mb}")
    try:
        keys = load_api_keys(args.api_keys_file, os.environ.get(ENV_VAR))
    except ApiKeyConfigError as exc:
        raise SystemExit(f"{prog}: {exc}") from None
    return ctx, int(args.max_body_mb * 1024 * 1024), keys, why


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m services.drivers.gateway", description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1",
                   help="interface to listen on (default: loopback only; compose passes 0.0.0.0)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--nats-url", default=os.environ.get("EI_NATS_URL") or None,
                   help="NATS server URL or a comma-separated list of a cluster's servers "
                        "(default: env EI_NATS_URL, else an embedded nats-server)")
    p.add_argument("--partition", default=os.environ.get("EI_PARTITION") or "default")
    p.add_argument("--partitions", default=None, metavar="P0,P1,...",
                   help="serve several partitions: each session goes to one by a stable hash of its root "
                        "branch id, on that partition's stream (docs/partitions.md; default: --partition alone)")
    p.add_argument("--stream-replicas", type=int, default=None,
                   help="replicas of the partition's stream (default: env EI_STREAM_REPLICAS, else 1)")
    p.add_argument("--model", default="evolving-sim", help="model name served by /v1/models")
    p.add_argument("--served-model-name", action="append", default=[], metavar="NAME",
                   help="a model name requests may ask for (repeatable); given, only --model and these are "
                        "served (another is a 404); default: any name a client sends is served by this model")
    p.add_argument("--block-tokens", type=int, default=64)
    p.add_argument("--tokenizer", "--model-path", dest="tokenizer", default=os.environ.get("EI_TOKENIZER") or AUTO,
                   metavar="PATH|auto|bytes",
                   help="the model's tokenizer and chat template: a GGUF file, a tokenizer.json or a model folder "
                        "(tokenizer.json + tokenizer_config.json); needs 'tokenizers' and 'jinja2' (pip install -e "
                        "'.[engine]'); 'auto': the bundled model's (SmolLM2-135M-Instruct's GGUF, without its context "
                        "length: usage counts agree with a client using that tokenizer), bytes where it is not "
                        "installed; 'bytes': the byte-level tokenizer and simple template (one ASCII character = one "
                        "token, no model files); default: env EI_TOKENIZER, else auto")
    p.add_argument("--tool-call-parser", choices=PARSERS, default="auto",
                   help="how tool calls are read from the model's text (docs/gateway.md, Tool calls): hermes "
                        "(<tool_call> JSON: Hermes, Qwen), llama3_json, mistral ([TOOL_CALLS]), none; auto "
                        "(default): from the chat template")
    p.add_argument("--prompt-store", choices=("auto", "on", "off"), default="auto",
                   help="put each prompt's token ids into the partition's prompt bucket EI_PROMPTS_<P> for the "
                        "engine that prefills it (docs/engines.md, Prompts); auto: on when --tokenizer names a model's files")
    p.add_argument("--prompt-ttl-s", type=float, default=600.0,
                   help="seconds a prompt stays in the store (the bucket's max age; default %(default)s)")
    p.add_argument("--route-timeout-s", type=float, default=GatewayConfig.route_timeout_s,
                   help="seconds to wait for the router's RouteDecided, then 503 (default %(default)s: "
                        "longer than a NATS cluster's failover, docs/gateway.md)")
    p.add_argument("--token-timeout-s", type=float, default=60.0)
    p.add_argument("--default-max-tokens", type=int, default=0,
                   help="budget of a request that sets none: what the context leaves, at most this "
                        "(default 0: no cap but --context-length and 65,536, as vLLM; the engine ends the turn)")
    p.add_argument("--time-scale", type=float, default=1.0,
                   help="event ts = epoch + (wall - epoch) * scale (match the sim engines' --time-scale)")
    p.add_argument("--clock-epoch", type=float, default=_env_epoch(),
                   help="epoch of the scaled clock (default: env EI_CLOCK_EPOCH, else now)")
    p.add_argument("--context-length", type=int, default=None,
                   help="prompt + completion tokens a request may use (default: the model's own, from its "
                        "GGUF metadata or config.json, or the --profile's context_length if smaller; "
                        f"else {DEFAULT_CONTEXT})")
    p.add_argument("--profile", default=os.environ.get("EI_PROFILE") or None,
                   help="engine profile (deploy/profiles/NAME.toml or a path) whose context_length "
                        "bounds prompts (default: env EI_PROFILE)")
    p.add_argument("--max-body-mb", type=float, default=8.0,
                   help="largest request body in MiB; larger ones get 413 before they are read")
    p.add_argument("--api-keys-file", default=None,
                   help="file of API keys, one a line; requests to /v1/* then need 'Authorization: "
                        f"Bearer KEY' (keys may also come from env {ENV_VAR}, comma-separated)")
    p.add_argument("--branch-ttl-s", type=float, default=GatewayConfig.branch_ttl_s,
                   help="end an open branch after this many seconds (event clock) without a request: "
                        "BranchEnded(reason=idle) (default: %(default)s; 0: never)")
    p.add_argument("--shutdown-grace-s", type=float, default=5.0,
                   help="on SIGTERM/SIGINT, seconds the requests in flight may still finish; the rest end "
                        "with a 503 / an error event in their stream (default: %(default)s)")
    p.add_argument("--src", default="gateway", help="publisher id in the events' src field")
    p.add_argument("--log-format", choices=["console", "json"], default=None)
    p.add_argument("--log-level", default=None)
    add_cli_options(p)
    return p


async def serve(args: argparse.Namespace) -> int:
    log = get_logger("gateway")
    try:  # before the bus: a named model that cannot load is one line, exit 2
        model = load_model(args.tokenizer)
    except ModelError as exc:
        raise SystemExit(f"python -m services.drivers.gateway: {exc}") from None
    if args.tokenizer == AUTO and model.tokenizer.name == "bytes":  # the default could not have the bundled model's
        log.warning("tokenizer_fallback", tokenizer=model.note)
    context_length, max_body, keys, ctx_from = resolve_limits(args, (model.context_length, model.context_from))
    if not args.prompt_ttl_s > 0:
        raise SystemExit(f"python -m services.drivers.gateway: --prompt-ttl-s must be > 0, got {args.prompt_ttl_s}")
    store_prompts = args.prompt_store == "on" or (args.prompt_store == "auto" and names_model(args.tokenizer))
    if not keys and args.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("no_api_keys", host=args.host,
                    hint=f"anyone who reaches {args.host}:{args.port} can submit requests: "
                         f"set --api-keys-file or {ENV_VAR}")
    embedded = None
    url = args.nats_url
    if url is None:
        embedded = EmbeddedNats().start()
        url = embedded.url
        log.warning("embedded_nats", url=url)
    try:
        creds = bus_auth(args).credentials()
    except CredentialsError as exc:
        raise SystemExit(f"python -m services.drivers.gateway: {exc}") from None
    replicas = args.stream_replicas or int(os.environ.get("EI_STREAM_REPLICAS") or 1)
    bus = await NatsBus.connect(url, partition=args.partition, name=f"gateway-{args.src}",
                                credentials=None if creds.empty else creds,
                                settings=StreamSettings(replicas=replicas))
    cfg = GatewayConfig(partition=args.partition, model=args.model,
                        served_model_names=tuple(args.served_model_name), block_tokens=args.block_tokens,
                        route_timeout_s=args.route_timeout_s, token_timeout_s=args.token_timeout_s,
                        default_max_tokens=args.default_max_tokens, tokenizer=args.tokenizer, src=args.src,
                        time_scale=args.time_scale, clock_epoch=args.clock_epoch,
                        context_length=context_length, max_body_bytes=max_body, api_keys=keys,
                        branch_ttl_s=args.branch_ttl_s, tool_call_parser=args.tool_call_parser)
    lanes, extra = None, []
    names = [n.strip() for n in (args.partitions or "").split(",") if n.strip()]
    if len(names) > 1:
        if len(set(names)) != len(names):
            raise SystemExit(f"python -m services.drivers.gateway: --partitions repeats a name: {args.partitions}")
        lanes = {}
        for name in names:
            b = bus if name == args.partition else await NatsBus.connect(
                url, partition=name, name=f"gateway-{args.src}-{name}", credentials=None if creds.empty else creds,
                settings=StreamSettings(replicas=replicas))
            if b is not bus:
                extra.append(b)
            lanes[name] = (b, NatsTokenMux.from_bus(b))
    prompts = None
    if store_prompts:
        buses = {n: b for n, (b, _) in lanes.items()} if lanes else {args.partition: bus}
        prompts = {n: NatsPromptStore.from_bus(b, ttl_s=args.prompt_ttl_s) for n, b in buses.items()}
        for name, store in prompts.items():  # before listening: health passes once a prompt can be stored
            try:
                took = await store.warm(PROMPT_WARM_S)
                log.info("prompt_store_ready", partition=name, seconds=round(took, 2))
            except Exception as exc:  # noqa: BLE001 - requests retry on their own; say why it is slow
                log.warning("prompt_store_not_ready", partition=name, within_s=PROMPT_WARM_S,
                            error=f"{type(exc).__name__}: {exc}")
    gw = Gateway(bus, NatsTokenMux.from_bus(bus), cfg, lanes=lanes, prompts=prompts, model=model)
    runner = GatewayRunner(gw.make_app())  # aiohttp's own protocol errors as JSON (guard.py)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port)
    await site.start()
    log.info("gateway_listening", host=args.host, port=args.port, nats=url, partition=args.partition,
             context_length=context_length, context_from=ctx_from, max_body_bytes=max_body,
             auth=f"{len(keys)} key(s)" if keys else "off", tokenizer=model.note,
             prompt_store=f"EI_PROMPTS_* ttl {args.prompt_ttl_s:g} s" if prompts else "off")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("gateway_stopping", in_flight=gw.in_flight)
    # the requests in flight get a grace period, then end with a clean error
    deadline = loop.time() + max(0.0, args.shutdown_grace_s)
    while gw.in_flight and loop.time() < deadline:
        await asyncio.sleep(0.05)
    await gw.cancel_in_flight("gateway_stopping")  # their engines stop decoding what nobody will read
    failed = gw.fail_in_flight("the gateway is shutting down; send the request again")
    if failed:  # their relays write the error (503 / an error event in the stream) and end
        log.warning("requests_failed_at_stop", requests=failed)
        end = loop.time() + 2.0
        while gw.in_flight and loop.time() < end:
            await asyncio.sleep(0.02)
    await runner.cleanup()
    for b in extra:
        await b.close()
    await bus.close()
    if embedded is not None:
        embedded.stop()
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(level=args.log_level, fmt=args.log_format)
    return asyncio.run(serve(args))


if __name__ == "__main__":
    sys.exit(main())
