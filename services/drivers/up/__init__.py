"""``evolving up``: NATS, the services, sim engines and the gateway from one command (docs/live.md).

- :mod:`.options` - its command-line options;
- :mod:`.launch` - the run: start, supervise, status line, stop in order;
- :mod:`.partitions` - ``--partitions N``: one set of services per partition;
- :mod:`.children` - what both share: a child process, its environment, the stop groups, the
  run configuration written into the log;
- :mod:`.businit` / :mod:`.compose_secrets` - the compose deployment's stream set-up and secrets;
- :mod:`.testing` - helpers of the live tests and benchmarks;
- :mod:`.cli` - ``evolving serve``, ``evolving up``, ``evolving bench live``, ``evolving drive``.
"""
