"""Who may do what on the bus: per-service NATS users, subject permissions and credentials.

An open NATS lets anyone who reaches it forge ``RouteDecided`` or ``SwitchRole``, read every
generated token, purge the stream or overwrite snapshots. This module gives every process its
own NATS user whose permissions allow exactly what its role needs (docs/security.md). Two
tables say it, and :func:`service_permissions` generates the server's permissions from them:

* :data:`READS`: what a role may read of the partition's event stream ``EI_<P>``: the filter
  subjects of the consumers it may create, whether through its own durable (named like its
  account) and/or ephemeral consumers;
* :func:`_role_events` (publishing) and :func:`_role_subscribes` (core NATS subscriptions).

============  ======================  ==================================================
role          reads the stream        may publish
============  ======================  ==================================================
directory     durable ``ei.<p>.>``    its anomalies ``ei.<p>.anomaly.<name>``
planner       durable ``ei.<p>.>``    ``ei.<p>.plan``, ``ei.<p>.cmd.*`` (SwitchRole), ``ei.<p>.clock``
                                      (Tick), ``ei.<p>.node.*`` (NodeRemoved), its anomalies
router        durable ``ei.<p>.>``    ``ei.<p>.route`` (in charge) or ``ei.<p>.shadow.<name>.>``
                                      (shadow), anomalies
recorder      durable ``ei.<p>.>``    nothing on the stream; answers ``eictl.<p>.recorder.>``
gateway       ephemeral               ``ei.<p>.agent.>``; the only one that reads ``eitok.<p>.>``;
              ``ei.<p>.route``,       the only writer of the prompt bucket ``EI_PROMPTS_<P>``
              ``ei.<p>.node.*``,
              ``ei.<p>.agent.>``
engine N      ephemeral ``ei.<p>.>``  ``ei.<p>.kv.N``, ``ei.<p>.node.N``, tokens ``eitok.<p>.>``;
                                      the only readers of the prompt bucket
operator      nothing                 ``eictl.<p>.>`` (``sql --live`` requests)
admin         everything              everything (``evolving up`` itself, stream creation, tests)
============  ======================  ==================================================

The server checks a consumer's filter only on the filtered create subject
``$JS.API.CONSUMER.CREATE.<stream>.<consumer>.<filter>`` (nats-server 2.10+: a request whose
config names another filter, or several, is refused), so that form is the only one granted:
the legacy ``CONSUMER.CREATE.<stream>`` (ephemeral), ``CONSUMER.DURABLE.CREATE`` and the
unfiltered ``CONSUMER.CREATE.<stream>.<consumer>`` (any filter, or several) are granted to
nobody but the admin. A core that folds several subject families reads ``ei.<p>.>``: one
consumer with several filters cannot be checked by the server, and several consumers would
lose the stream's total order the cores fold in.

Every non-admin user also gets: next/ack/info/delete on the consumers it may create, its own
dead-letter subject, its own snapshot bucket ``EI_SNAP_<P>_<NAME>`` (nobody else may write it;
none for the gateway and the operator, which keep no state) and a private inbox prefix
``_INBOX_<user>`` (nobody else can read its replies). Stream purge, delete and update are the
admin's alone. Pulling from (or re-creating) another service's durable is denied by name: the
config generator knows every durable of the partition.

Credentials reach a process from flags, a file or the environment (:class:`Credentials`);
``evolving up`` generates throwaway ones for its embedded server (:func:`generate_accounts`).
"""

from __future__ import annotations

import json
import os
import secrets
import ssl
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from events.subjects import dlq_stream_name, stream_name, token

ROLES = ("directory", "planner", "router", "recorder", "gateway", "engine", "operator", "admin")
ENV_PREFIX = "EI_NATS_"


# ----------------------------------------------------------------------------- credentials
@dataclass(frozen=True)
class Credentials:
    """How one process authenticates to NATS (all optional: none = an open server)."""

    user: str | None = None
    password: str | None = None
    token: str | None = None
    creds_file: str | None = None  # a NATS .creds file (JWT + nkey seed)
    nkey_seed_file: str | None = None
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    inbox_prefix: str | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Credentials:
        """``EI_NATS_USER``, ``EI_NATS_PASSWORD`` (or ``EI_NATS_PASSWORD_FILE``, e.g. a Docker
        secret), ``EI_NATS_TOKEN``, ``EI_NATS_CREDS``, ``EI_NATS_NKEY_SEED_FILE``,
        ``EI_NATS_TLS_CA``, ``EI_NATS_TLS_CERT``, ``EI_NATS_TLS_KEY``, or
        ``EI_NATS_CREDENTIALS_FILE`` (a JSON file :func:`write_credentials` writes)."""
        env = os.environ if env is None else env
        get = lambda k: env.get(ENV_PREFIX + k) or None
        base = cls.from_file(get("CREDENTIALS_FILE")) if get("CREDENTIALS_FILE") else cls()
        password = get("PASSWORD")
        if password is None and get("PASSWORD_FILE"):
            password = _read_secret(get("PASSWORD_FILE"), "EI_NATS_PASSWORD_FILE")
        return base.merged(cls(user=get("USER"), password=password, token=get("TOKEN"),
                               creds_file=get("CREDS"), nkey_seed_file=get("NKEY_SEED_FILE"),
                               tls_ca=get("TLS_CA"), tls_cert=get("TLS_CERT"), tls_key=get("TLS_KEY")))

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> Credentials:
        """A JSON object with any of this class's fields."""
        try:
            data = json.loads(Path(path).read_text())
        except OSError as exc:
            raise CredentialsError(f"cannot read NATS credentials file {path}: {exc.strerror}") from exc
        except json.JSONDecodeError as exc:
            raise CredentialsError(f"NATS credentials file {path} is not JSON: {exc}") from exc
        if not isinstance(data, dict):
            raise CredentialsError(f"NATS credentials file {path} must hold a JSON object")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(data) - known)
        if unknown:
            raise CredentialsError(f"NATS credentials file {path}: unknown field(s) {', '.join(unknown)}")
        return cls(**data)

    def merged(self, other: Credentials) -> Credentials:
        """``other``'s set fields win over this one's."""
        mine, theirs = asdict(self), asdict(other)
        return Credentials(**{k: theirs[k] if theirs[k] is not None else v for k, v in mine.items()})

    @property
    def empty(self) -> bool:
        return not any(asdict(self).values())

    def connect_options(self) -> dict:
        """Keyword arguments for ``nats.connect``."""
        opts: dict = {}
        if self.user:
            opts.update(user=self.user, password=self.password or "")
        if self.token:
            opts["token"] = self.token
        if self.creds_file:
            opts["user_credentials"] = self.creds_file
        if self.nkey_seed_file:
            opts["nkeys_seed"] = self.nkey_seed_file
        if self.inbox_prefix or self.user:
            opts["inbox_prefix"] = (self.inbox_prefix or inbox_prefix(self.user)).encode()
        if self.tls_ca or self.tls_cert:
            ctx = ssl.create_default_context(cafile=self.tls_ca)
            if self.tls_cert:
                ctx.load_cert_chain(self.tls_cert, self.tls_key)
            opts["tls"] = ctx
        return opts


class CredentialsError(ValueError):
    """Credentials that cannot be used, said in one line."""


def _read_secret(path: str, what: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError as exc:
        raise CredentialsError(f"cannot read {what} {path}: {exc.strerror}") from exc


def add_cli_options(parser) -> None:
    """``--nats-user``, ``--nats-password-file``, ``--nats-credentials``, ``--nats-creds``,
    ``--nats-tls-ca/-cert/-key`` (each falls back to its ``EI_NATS_*`` variable)."""
    g = parser.add_argument_group("NATS credentials (default: the EI_NATS_* environment variables)")
    g.add_argument("--nats-user", default=None, help="NATS user name (env EI_NATS_USER)")
    g.add_argument("--nats-password-file", default=None, help="file holding the password (e.g. a Docker secret)")
    g.add_argument("--nats-credentials", default=None, help="JSON credentials file (evolving up writes these)")
    g.add_argument("--nats-creds", default=None, help="NATS .creds file (JWT + nkey)")
    g.add_argument("--nats-tls-ca", default=None, help="CA bundle that signed the servers' certificates (TLS)")
    g.add_argument("--nats-tls-cert", default=None, help="client certificate, for servers that verify clients")
    g.add_argument("--nats-tls-key", default=None, help="private key of --nats-tls-cert")


@dataclass(frozen=True)
class BusAuth:
    """What a process was told on its command line about its NATS credentials (the options of
    :func:`add_cli_options`, each None when not given), parsed once at its entry point
    (services/drivers/options.py); :meth:`credentials` adds the file and the environment."""

    user: str | None = None  # --nats-user
    password_file: str | None = None  # --nats-password-file
    credentials_file: str | None = None  # --nats-credentials (a JSON file write_credentials writes)
    creds_file: str | None = None  # --nats-creds (a NATS .creds file)
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None

    def credentials(self, env: Mapping[str, str] | None = None) -> Credentials:
        """Flags over the credentials file over the environment (``EI_NATS_*``)."""
        creds = Credentials.from_env(env)
        if self.credentials_file:
            creds = creds.merged(Credentials.from_file(self.credentials_file))
        password = _read_secret(self.password_file, "--nats-password-file") if self.password_file else None
        return creds.merged(Credentials(user=self.user, password=password, creds_file=self.creds_file,
                                        tls_ca=self.tls_ca, tls_cert=self.tls_cert, tls_key=self.tls_key))


# ----------------------------------------------------------------------------- permissions
@dataclass(frozen=True)
class Permissions:
    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    deny_publish: tuple[str, ...] = ()
    allow_responses: bool = False  # may answer requests it received (once, to their reply subject)

    def as_config(self) -> dict:
        pub: dict = {"allow": list(self.publish)}
        if self.deny_publish:
            pub["deny"] = list(self.deny_publish)
        out = {"publish": pub, "subscribe": {"allow": list(self.subscribe)}}
        if self.allow_responses:
            out["allow_responses"] = True
        return out


@dataclass(frozen=True)
class ServiceSpec:
    """One process of a partition: its role, its name (user, durable, snapshot key) and, for
    an engine, its node; for a router in shadow, its shadow name."""

    role: str
    name: str
    node: str | None = None
    shadow: str | None = None
    #: further ``AnomalyReported.component`` values it reports, e.g. ``router.<policy name>``
    #: for a router (its plug-in's ``name``, which only the one who starts it knows)
    components: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"unknown role {self.role!r}: one of {', '.join(ROLES)}")
        if self.role == "engine" and not self.node:
            raise ValueError("an engine account needs its node id")


def inbox_prefix(user: str) -> str:
    return f"_INBOX_{token(user)}"


def snapshot_bucket(partition: str, name: str) -> str:
    """One object-store bucket per service, so write permission is per service."""
    return f"EI_SNAP_{token(partition).upper()}_{token(name).upper()}".replace("-", "_")


@dataclass(frozen=True)
class StreamReads:
    """What one role may read of its partition's event stream (a row of :data:`READS`)."""

    filters: tuple[str, ...] = ()  # consumer filter subjects it may create consumers on, <p>: the partition
    durable: bool = False  # through its own durable consumer, named like its account
    ephemeral: bool = False  # through ephemeral consumers (random names, NatsBus.consumer(None))
    why: str = ""
    snapshots: bool = True  # its own snapshot bucket EI_SNAP_<P>_<NAME> (read and write)

    def subjects(self, partition: str) -> tuple[str, ...]:
        return tuple(f.replace("<p>", token(partition)) for f in self.filters)


WHOLE_PARTITION = ("ei.<p>.>",)
#: THE table of who reads what of the event stream (services/drivers/services.py's services
#: take their ``consumes`` from it). ``ei.<p>.>`` where a core folds several subject families.
READS: dict[str, StreamReads] = {
    "directory": StreamReads(WHOLE_PARTITION, durable=True,
                             why="DirectoryCore folds agent, kv, node and route events, interleaved"),
    "planner": StreamReads(WHOLE_PARTITION, durable=True,
                           why="planner + liveness fold agent, node, kv, route events and the clock"),
    "router": StreamReads(WHOLE_PARTITION, durable=True,
                          why="agent, kv, node, route and plan events (its directory, ModelFitted, RoleSwitchOrdered)"),
    "recorder": StreamReads(WHOLE_PARTITION, durable=True, why="lands every event in DuckDB"),
    "gateway": StreamReads(("ei.<p>.route", "ei.<p>.node.*", "ei.<p>.agent.>"), ephemeral=True,
                           why="waits for each request's RouteDecided; ends the requests a RequestFinished "
                               "error fails (node.*); rebuilds its branch table at start (agent.>)",
                           snapshots=False),
    "engine": StreamReads(WHOLE_PARTITION, ephemeral=True,
                          why="its worker view (a DirectoryCore), its route decisions and commands"),
    "operator": StreamReads(why="sql --live asks the recorder over eictl; it reads no stream", snapshots=False),
    "admin": StreamReads((">",), durable=True, ephemeral=True, why="everything"),
}

#: The prompt store (services/adapters/bus/prompts.py): the KV bucket ``EI_PROMPTS_<P>`` of token
#: ids by request id, written by the gateway alone (it may create it) and read by the engines alone.
PROMPT_BUCKET = "EI_PROMPTS_<P>"


def prompt_bucket(partition: str) -> str:
    """The partition's prompt bucket (a KV bucket: stream ``KV_<bucket>``)."""
    return f"EI_PROMPTS_{token(partition).upper()}".replace("-", "_")


def _prompts_write(partition: str) -> list[str]:
    """The gateway's: put values, look at and create the bucket's stream; no read (no GET)."""
    b = prompt_bucket(partition)
    return [f"$KV.{b}.>", f"$JS.API.STREAM.INFO.KV_{b}", f"$JS.API.STREAM.CREATE.KV_{b}"]


def _prompts_read(partition: str) -> list[str]:
    """An engine's: direct gets of one key (any replica answers) and the stream's info; no put."""
    b = prompt_bucket(partition)
    return [f"$JS.API.STREAM.INFO.KV_{b}", f"$JS.API.DIRECT.GET.KV_{b}.>"]


def _js_reads(stream: str, user: str, reads: StreamReads, partition: str) -> list[str]:
    """The JetStream API calls of the consumers :data:`READS` lets one account create: the
    filtered create subject only (the server checks the filter against the request)."""
    api, out = "$JS.API", []
    filters = reads.subjects(partition)
    if reads.durable and filters:
        out += [f"{api}.CONSUMER.CREATE.{stream}.{user}.{f}" for f in filters]
        out += [f"{api}.CONSUMER.INFO.{stream}.{user}", f"{api}.CONSUMER.DELETE.{stream}.{user}",
                f"{api}.CONSUMER.MSG.NEXT.{stream}.{user}", f"$JS.ACK.{stream}.{user}.>"]
    if reads.ephemeral and filters:
        out += [f"{api}.CONSUMER.CREATE.{stream}.*.{f}" for f in filters]
        out += [f"{api}.CONSUMER.MSG.NEXT.{stream}.*", f"{api}.CONSUMER.DELETE.{stream}.*",
                f"{api}.CONSUMER.INFO.{stream}.*"]
    return out


def _snapshots(bucket: str) -> list[str]:
    obj, api = f"OBJ_{bucket}", "$JS.API"
    return [f"$O.{bucket}.>", f"{api}.STREAM.INFO.{obj}", f"{api}.STREAM.CREATE.{obj}",
            f"{api}.STREAM.MSG.GET.{obj}", f"{api}.DIRECT.GET.{obj}", f"{api}.DIRECT.GET.{obj}.>",
            f"{api}.STREAM.PURGE.{obj}", f"{api}.CONSUMER.CREATE.{obj}", f"{api}.CONSUMER.CREATE.{obj}.>",
            f"{api}.CONSUMER.DELETE.{obj}.*", f"$JS.FC.{obj}.>", f"$JS.ACK.{obj}.>"]


def _snapshots_read(bucket: str) -> list[str]:
    """Reading another service's bucket (no ``$O.<bucket>.>`` publish: it cannot write it)."""
    obj, api = f"OBJ_{bucket}", "$JS.API"
    return [f"{api}.STREAM.INFO.{obj}", f"{api}.STREAM.MSG.GET.{obj}", f"{api}.DIRECT.GET.{obj}",
            f"{api}.DIRECT.GET.{obj}.>", f"{api}.CONSUMER.CREATE.{obj}", f"{api}.CONSUMER.CREATE.{obj}.>",
            f"{api}.CONSUMER.DELETE.{obj}.*", f"$JS.FC.{obj}.>"]


#: The core configuration each decision service writes (services/drivers/serve.py: ``config.<key>``,
#: its own bucket) and the recorder reads into the log's run_config.
RECORDED_CONFIGS = ("config.directory", "config.planner", "config.router")


def config_key(spec: ServiceSpec) -> str | None:
    """The ``config.<key>`` snapshot a decision service writes (None for the other roles)."""
    if spec.role in ("directory", "planner"):
        return f"config.{spec.role}"
    if spec.role == "router":
        return f"config.shadow.{spec.shadow}" if spec.shadow else "config.router"
    return None


def _role_events(spec: ServiceSpec, p: str) -> list[str]:
    name = token(spec.name)
    anomaly = f"ei.{p}.anomaly.{name}"
    own = [f"ei.{p}.anomaly.{token(c)}" for c in spec.components]
    if spec.role == "directory":
        return [anomaly, f"ei.{p}.anomaly.directory", *own]
    if spec.role == "planner":
        return [f"ei.{p}.plan", f"ei.{p}.cmd.*", f"ei.{p}.clock", f"ei.{p}.node.*", anomaly,
                f"ei.{p}.anomaly.planner", f"ei.{p}.anomaly.liveness", *own]
    if spec.role == "router":  # services/cores/router/base.py reports as component "router.<policy name>"
        if spec.shadow:
            return [f"ei.{p}.shadow.{token(spec.shadow)}.>", anomaly, f"ei.{p}.anomaly.router_{token(spec.shadow)}",
                    *own]
        return [f"ei.{p}.route", anomaly, f"ei.{p}.anomaly.router", *own]
    if spec.role == "gateway":
        return [f"ei.{p}.agent.>"]
    if spec.role == "engine":  # the SGLang backend reports as component "engine.sglang"
        n = token(spec.node or "")
        return [f"ei.{p}.kv.{n}", f"ei.{p}.node.{n}", f"eitok.{p}.>", f"ei.{p}.anomaly.engine_sglang", *own]
    if spec.role == "operator":
        return [f"eictl.{p}.>"]
    return []


def _role_subscribes(spec: ServiceSpec, p: str) -> list[str]:
    """Core NATS subscriptions besides the private inbox: tokens for the gateway alone, its own
    commands for an engine, ``sql --live`` requests for the recorder."""
    if spec.role == "gateway":
        return [f"eitok.{p}.>"]
    if spec.role == "engine":
        return [f"ei.{p}.cmd.{token(spec.node or '')}"]
    if spec.role == "recorder":
        return [f"eictl.{p}.recorder.>"]  # sql --live requests; answered via allow_responses
    return []


def service_permissions(spec: ServiceSpec, partition: str, other_durables: Iterable[str] = ()) -> Permissions:
    """The permissions of one service (see the module docstring's table)."""
    p = token(partition)
    user = token(spec.name)
    if spec.role == "admin":
        return Permissions(publish=(">",), subscribe=(">",))
    stream, dlq = stream_name(partition), dlq_stream_name(partition)
    pub = ["$JS.API.INFO", f"$JS.API.STREAM.INFO.{stream}", f"$JS.API.STREAM.INFO.{dlq}",
           "$JS.API.STREAM.NAMES", f"eidlq.{p}.{user}"]
    reads = READS[spec.role]
    pub += _js_reads(stream, user, reads, partition)
    if reads.snapshots:
        pub += _snapshots(snapshot_bucket(partition, spec.name))
    if config_key(spec):
        pub += _snapshots(snapshot_bucket(partition, config_key(spec)))
    if spec.role == "recorder":
        pub += [a for key in RECORDED_CONFIGS for a in _snapshots_read(snapshot_bucket(partition, key))]
    if spec.role == "gateway":
        pub += _prompts_write(partition)
        # read-only: every consumer's position and pending count, for /health's stuck readers
        pub += [f"$JS.API.CONSUMER.LIST.{stream}"]
    if spec.role == "engine":
        pub += _prompts_read(partition)
    pub += _role_events(spec, p)
    sub = [f"{inbox_prefix(spec.name)}.>", *_role_subscribes(spec, p)]
    others = sorted({token(d) for d in other_durables} - {user})
    verbs = ("MSG.NEXT", "DELETE", "CREATE", "DURABLE.CREATE", "INFO")
    deny = [f"$JS.API.CONSUMER.{verb}.{stream}.{d}" for d in others for verb in verbs]
    deny += [f"$JS.API.CONSUMER.CREATE.{stream}.{d}.>" for d in others]
    deny += [f"$JS.ACK.{stream}.{d}.>" for d in others]
    return Permissions(publish=tuple(dict.fromkeys(pub)), subscribe=tuple(sub), deny_publish=tuple(deny),
                       allow_responses=spec.role == "recorder")


# ----------------------------------------------------------------------------- accounts and config
@dataclass(frozen=True)
class Account:
    spec: ServiceSpec
    password: str
    permissions: Permissions = field(repr=False)

    @property
    def user(self) -> str:
        return token(self.spec.name)

    def credentials(self, **tls) -> Credentials:
        return Credentials(user=self.user, password=self.password, inbox_prefix=inbox_prefix(self.spec.name),
                           **tls)


def generate_accounts(partition: str, specs: Sequence[ServiceSpec], *, admin: str = "admin",
                      password_bytes: int = 24) -> dict[str, Account]:
    """Throwaway accounts (random passwords from ``secrets``) for every service plus an admin."""
    specs = [*specs, ServiceSpec("admin", admin)]
    names = [token(s.name) for s in specs]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ValueError(f"two services share the account name(s) {', '.join(dupes)}")
    durables = [token(s.name) for s in specs]
    return {token(s.name): Account(s, secrets.token_urlsafe(password_bytes),
                                   service_permissions(s, partition, durables))
            for s in specs}


def _conf_value(v) -> str:
    return json.dumps(v)  # NATS config accepts JSON values


def authorization_block(accounts: Mapping[str, Account]) -> str:
    users = [{"user": a.user, "password": a.password, "permissions": a.permissions.as_config()}
             for a in accounts.values()]
    return "authorization {\n  users = " + _conf_value(users) + "\n}\n"


def server_config(accounts: Mapping[str, Account] | None, *, host: str, port: int, store_dir: str,
                  http_port: int | None = None, tls: Mapping[str, str] | None = None,
                  cluster: Mapping | None = None, server_name: str | None = None,
                  max_payload: str = "8MB") -> str:
    """A nats-server configuration: listen address, JetStream store, optional monitoring,
    authorization with per-service permissions, TLS and a cluster block."""
    lines = [f"listen: {_conf_value(f'{host}:{port}')}", f"max_payload: {max_payload}",
             "jetstream {", f"  store_dir: {_conf_value(store_dir)}", "}"]
    if server_name:
        lines.insert(0, f"server_name: {_conf_value(server_name)}")
    if http_port:
        lines.append(f"http: {_conf_value(f'{host}:{http_port}')}")
    if tls:
        lines.append("tls " + _conf_value(dict(tls)))
    if cluster:
        lines.append("cluster " + _conf_value(dict(cluster)))
    text = "\n".join(lines) + "\n"
    if accounts:
        text += authorization_block(accounts)
    return text


def write_credentials(accounts: Mapping[str, Account], folder: str | os.PathLike, **tls) -> dict[str, Path]:
    """One JSON credentials file per account (mode 0600); returns user -> path."""
    out = {}
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    for user, acc in accounts.items():
        path = folder / f"{user}.json"
        data = {k: v for k, v in asdict(acc.credentials(**tls)).items() if v is not None}
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(data, f)
        out[user] = path
    return out
