"""``python -m services.drivers.up.k8s_secrets``: the Secrets of the Kubernetes deployment (deploy/k8s).

The manifests of ``deploy/k8s`` name Secrets and never hold one; this prints them (a ``v1 List``
in JSON, which ``kubectl apply -f -`` reads), generated exactly as the compose deployment's
(:mod:`services.drivers.up.compose_secrets`: one NATS user per service with its subject
permissions, services.adapters.bus.security):

- ``evolving-nats-auth`` (key ``auth.conf``): what every NATS server includes
  (``deploy/k8s/base/nats.conf``): the ``authorization`` block and the cluster routes' password
  and URLs, ``nats-route://route:PW@nats-<i>.nats:6222`` (the StatefulSet's pods behind its
  headless service, resolved in the namespace);
- ``evolving-nats-<service>`` (key ``credentials.json``) for ``admin`` (the ``bus-init`` Job),
  ``directory``, ``planner``, ``router``, ``recorder``, ``gateway`` and ``operator``;
- ``evolving-nats-engines`` (one key ``<pod>.json`` per engine pod ``engine-<i>``): an
  engine's node id is its pod's name, and its account may publish only as that node; the pods of
  the engine StatefulSet share its pod template, so each mounts the one Secret and reads its own
  key (docs/deploy.md, "Kubernetes": the trade-off);
- ``evolving-gateway-api-keys`` (key ``api-keys``): one random API key.

One partition per namespace (docs/deploy.md, "Kubernetes"): ``--partition`` and ``--engines``
are that namespace's. New passwords on every run: create them once (``kubectl create -f -``
refuses to replace them); rotate by applying again and restarting every pod.
"""

from __future__ import annotations

import argparse
import json
import secrets
import sys
from typing import Any

from services.adapters.bus.security import ServiceSpec, generate_accounts
from services.drivers.up.compose_secrets import ROUTE_PORT, nats_include

#: the control plane's accounts (name = the Deployment/StatefulSet and its Secret's suffix)
SERVICES = ("directory", "planner", "router", "recorder", "gateway", "operator")
NATS_REPLICAS = 3


def engine_pods(engines: int) -> list[str]:
    """The engine StatefulSet's pod names, which are the engines' node ids."""
    return [f"engine-{i}" for i in range(engines)]


def nats_route_hosts(replicas: int = NATS_REPLICAS) -> tuple[str, ...]:
    """Each NATS pod's DNS name through the headless service (resolved in the namespace)."""
    return tuple(f"nats-{i}.nats" for i in range(replicas))


def _secret(name: str, namespace: str | None, data: dict[str, str]) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "labels": {"app.kubernetes.io/part-of": "evolving-infra"}}
    if namespace:
        meta["namespace"] = namespace
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque", "metadata": meta, "stringData": data}


def build(partition: str = "default", engines: int = 3, namespace: str | None = None,
          router_policy: str = "evolving") -> dict[str, Any]:
    """The ``v1 List`` of every Secret the manifests of one partition name."""
    pods = engine_pods(engines)
    specs = [ServiceSpec(name, name, components=(f"router.{router_policy}",)) if name == "router"
             else ServiceSpec(name, name) for name in SERVICES]
    specs += [ServiceSpec("engine", pod, node=pod) for pod in pods]
    accounts = generate_accounts(partition, specs)

    def creds(user: str) -> str:
        acc = accounts[user]
        return json.dumps({"user": acc.user, "password": acc.password,
                           "inbox_prefix": acc.credentials().inbox_prefix}) + "\n"

    items = [_secret("evolving-nats-auth", namespace,
                     {"auth.conf": nats_include(accounts, secrets.token_urlsafe(24),
                                                servers=nats_route_hosts(), port=ROUTE_PORT)})]
    items += [_secret(f"evolving-nats-{name}", namespace, {"credentials.json": creds(name)})
              for name in ("admin", *SERVICES)]
    items.append(_secret("evolving-nats-engines", namespace, {f"{pod}.json": creds(pod) for pod in pods}))
    items.append(_secret("evolving-gateway-api-keys", namespace,
                         {"api-keys": f"sk-ei-{secrets.token_urlsafe(24)}\n"}))
    return {"apiVersion": "v1", "kind": "List", "items": items}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m services.drivers.up.k8s_secrets",
                                description=__doc__.splitlines()[0])
    p.add_argument("--partition", default="default", help="the partition the permissions are for (EI_PARTITION)")
    p.add_argument("--engines", type=int, default=3, help="engine pods (the engine StatefulSet's replicas)")
    p.add_argument("--namespace", default=None, help="metadata.namespace of every Secret (default: none)")
    p.add_argument("--router", default="evolving", help="the router plug-in's policy name (EI_ROUTER)")
    args = p.parse_args(argv)
    if args.engines < 1:
        p.error("--engines must be at least 1")
    json.dump(build(args.partition, args.engines, args.namespace, args.router), sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
