"""Options are parsed once (docs/architecture.md): argparse's ``Namespace`` is read only by the
command modules listed in :data:`COMMANDS`, each of which turns it into a typed value (a frozen
dataclass or msgspec Struct: ``SimSpec``, ``BenchSimSpec``, ``FidelitySpec``, ``BusAuth``, the
engine backends' options, ...) at the command's entry point; nothing below reads ``args.*``.

Every module of every package is checked (``events``, ``services``, ``engine``, ``replay``,
``kernels``); ``scripts/`` is not a package: each file there is a command run by its path.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
PACKAGES = ("events", "services", "engine", "replay", "kernels")

#: The modules that may read the Namespace: the commands and their options modules, each with
#: what it turns the flags into (or why it is a command).
COMMANDS: dict[str, str] = {
    # the live services and their processes
    "services/drivers/cli.py": "`evolving`: the parser of every subcommand; hands args to the chosen one",
    "services/adapters/bus/options.py": "the bus options every live process shares -> BusSpec, BusAuth",
    "services/drivers/options.py": "a service's flags -> ServiceOptions (service_options)",
    "services/drivers/gateway/__main__.py": "python -m services.drivers.gateway: flags -> GatewayConfig",
    "services/drivers/gateway/cli.py": "`evolving drive`: flags -> DriveConfig",
    "services/drivers/up/cli.py": "`evolving serve`, `up`, `bench live`: flags -> ServiceOptions, UpSpec, LiveBenchSpec",
    "services/drivers/up/options.py": "`evolving up`'s flags -> UpSpec (up_spec)",
    "services/drivers/up/businit.py": "python -m services.drivers.up.businit: a child command of up",
    "services/drivers/up/compose_secrets.py": "python -m ...compose_secrets: the compose stack's secrets command",
    "services/drivers/up/k8s_secrets.py": "python -m ...k8s_secrets: the Kubernetes secrets command",
    "services/drivers/up/vllm_server.py": "python -m ...vllm_server: a child command of up (one vLLM server)",
    "services/drivers/recorder/cli.py": "`evolving sql`, `verify`, `bench recorder`: their entry points",
    "services/drivers/chaos/cli.py": "`evolving chaos`: flags -> the chaos run's settings",
    "services/drivers/soak/cli.py": "`evolving soak`: flags -> SoakConfig, AgentLoadConfig",
    "services/drivers/nats_cli.py": "`evolving nats` and `bench bus`: their entry points",
    "services/drivers/bench/cli.py": "`evolving bench ...` (router, planner, kv, engine, gateway, ...): flags -> "
                                     "each bench's settings",
    "services/drivers/bench/dynamo_cli.py": "`evolving bench dynamo`: flags -> the Dynamo bench's spec",
    "services/drivers/bench/kv_cli.py": "`evolving bench kv-*`: their entry points",
    # the engine
    "engine/worker/__main__.py": "python -m engine.worker: its command; builds the host and the backend from its flags",
    "engine/backends/sglang/options.py": "the SGLang backend's flags -> SglangConfig (config_from_args)",
    "engine/backends/torch/options.py": "the torch backend's flags -> its backend (make_backend)",
    "engine/backends/vllm/options.py": "the vLLM backend's flags -> VllmConfig (config_from_args)",
    "engine/backends/sglang/fake.py": "python -m engine.backends.sglang.fake: a stand-in server's command",
    "engine/backends/vllm/fake.py": "python -m engine.backends.vllm.fake: a stand-in server's command",
    "engine/transfer/node.py": "python -m engine.transfer.node: the transfer node's command",
    # the simulator and the experiments
    "replay/cli.py": "`evolving verify`, `trace ...`, `gen`: their entry points",
    "replay/sim/cli.py": "`evolving replay`, `compare`, `sweep-static`, `bench sim`: flags -> SimSpec / BenchSimSpec",
    "replay/sim/scaling_plot.py": "python -m replay.sim.scaling_plot: the plot's command",
    "replay/experiments/cli.py": "`evolving experiments`, `regimes`: flags -> the matrix's settings, SimSpec",
    "replay/fidelity/cli.py": "`evolving calibrate`, `fidelity`: flags -> CalibrateSpec / FidelitySpec",
}

#: Below the commands and still handed the Namespace: each a known gap, with why (empty today;
#: a stale entry fails the test below).
NOT_YET: dict[str, str] = {}


def reads_args(source: str) -> list[int]:
    """Lines that see the Namespace: ``args.<name>``, ``getattr/hasattr/vars(args, ...)`` or
    ``Namespace`` (``argparse.Namespace``, or imported by name)."""
    found = set()
    for n in ast.walk(ast.parse(source)):
        if isinstance(n, ast.Attribute) and (n.attr == "Namespace" or (isinstance(n.value, ast.Name)
                                                                        and n.value.id == "args")) or isinstance(n, ast.Name) and n.id == "Namespace" or (isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in {"getattr", "hasattr", "vars"}
              and n.args and isinstance(n.args[0], ast.Name) and n.args[0].id == "args"):
            found.add(n.lineno)
    return sorted(found)


def _modules() -> dict[str, str]:
    return {path.relative_to(ROOT).as_posix(): path.read_text(encoding="utf-8")
            for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py"))}


def test_the_check_finds_a_module_that_reads_args():
    assert reads_args("def f(args: argparse.Namespace):\n    return args.url\n") == [1, 2]
    assert reads_args("def f(args):\n    return getattr(args, 'url', None)\n") == [2]
    assert reads_args("from argparse import Namespace\nx = Namespace(url=1)\n") == [2]
    assert reads_args("def f(spec):\n    return spec.url\n") == []
    assert reads_args("def f(cfg):\n    return vars(cfg)\n") == []


def test_nothing_below_the_commands_reads_args():
    found = [f"{name}:{line}" for name, source in _modules().items()
             if name not in COMMANDS and name not in NOT_YET for line in reads_args(source)]
    assert not found, ("turn the options into a typed value in the command module (and add it to COMMANDS "
                       "only if it is one):\n" + "\n".join(found))


def test_the_lists_name_modules_that_read_args():
    """A stale entry (a module gone, or one that no longer reads the Namespace) leaves the list."""
    modules = _modules()
    stale = [name for name in (*COMMANDS, *NOT_YET) if name not in modules or not reads_args(modules[name])]
    assert not stale, "no longer reads args (remove it from the list): " + ", ".join(stale)
