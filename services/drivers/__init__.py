"""Layer 3, the drivers: they run the cores against the outside world (docs/contracts.md).

- ``services.py`` - the table of services: which cores each folds, how they are built;
- ``options.py`` - the live processes' command-line options (bus, credentials, a service's),
  parsed once at the entry point into the typed values the adapters take;
- ``serve.py`` - ``evolving serve NAME`` / ``python -m services.drivers.serve NAME``;
- ``up/`` - ``evolving up``: NATS, the services, engines and the gateway as child processes;
- ``chaos/`` - ``evolving chaos``: the fault suite over a live stack under load;
- ``recorder/`` - the recorder service, ``evolving verify``, ``evolving sql``;
- ``gateway/`` - the OpenAI-compatible gateway and ``evolving drive``;
- ``bench/`` - ``evolving bench ...``, each against a baseline measured in the same run;
- ``cli.py`` / ``nats_cli.py`` - the ``evolving`` command line and ``evolving nats``.

May import everything below: adapters, cores, ``events``.
"""
