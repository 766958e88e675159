"""The engine worker: one process per node, an engine backend (engine/backend.py) on the bus.

``python -m engine.worker --node n1 --role collocated --profile gb300-glm52 --nats-url URL``
``python -m engine.worker --backend sglang --sglang-url http://h:30000 ...`` (engine/backends/sglang)
``python -m engine.worker --backend vllm --vllm-url http://h:8000 --kv-events-endpoint tcp://h:5557`` (engine/backends/vllm)
``python -m engine.worker --backend torch [--model PATH] [--device cuda]`` (engine/backends/torch)

The worker depends only on the port: ``--backend sim`` runs the simulated node model in
wall-clock time, ``--backend sglang`` drives one SGLang server. What it does (the numbers are
the order of a request's life on this node)
1. Start, as the services do (services/adapters/runner.py): restore the worker's view (services/cores/worker_view.py:
   directory + requests in flight) from its snapshot ``engine-<node>`` and fold the tail of the
   stream after it (from sequence 1 without a usable snapshot) up to the head seen at start,
   without acting on it. If the directory still believes this node is alive (an earlier run
   of the same id), publish ``NodeRemoved(reason="restarted")`` first: that run's KV is gone.
   Then ``NodeRegistered``. A snapshot is written every ``--snapshot-every`` folded events and
   at a clean stop, only when every event this node published has come back from the stream
   (its own events are applied at once, before their echo: a snapshot taken between the two
   would apply them twice after a restart).
2. From the head on, act on the stream: a non-shadow ``RouteDecided`` with ``prefill_node`` =
   this node enqueues a prefill job (``RequestSubmitted`` gave its blocks and lengths; with
   ``--prompt-store``, on for every backend but sim, its token ids are read from the gateway's
   prompt bucket first, off the event loop: ``prompts``, docs/engines.md "Prompts"); a
   reroute away from this node takes the queued job off; ``SwitchRole`` on
   ``ei.<p>.cmd.<node>`` drains and switches (``backend.order_switch``; the backend
   acknowledges with ``RoleSwitched``); a ``KvStageOrdered`` naming this node (a ``+prestage``
   router) goes to ``backend.stage_in``, which pulls the finished turn's KV into the node's host
   tier and reports ``KvMoved`` (the torch backend; any other logs that it does not stage).
3. Prefill -> decode across processes: the sim node hands the KV to its decode node in
   process (``NodeHost.peer(...).kv_arrived``). Here a remote peer is a proxy whose
   ``kv_arrived`` does nothing; the *decode* worker instead watches the stream for the
   ``FirstToken`` of a request routed to it and calls ``backend.kv_arrived`` ``p2d_transfer_s``
   later (the SGLang backend ignores that call: SGLang's own PD transfer pairs the servers).
4. Every event the node emits (KV facts, ``IterationDone``, ``RequestStarted``, ``FirstToken``,
   ``RequestFinished``, ``RoleSwitched``) is applied to the local directory at once and
   published in order; its echo from the stream (same ``src``, after the start head) is
   skipped, so eviction sees this node's own KV without waiting for the round trip.
5. Tokens go to the gateway on core NATS (``services.adapters.bus.tokens``), as the backend reports
   them (``host.token``): the sim's are ``"tok "`` per token (engine/backends/sim/backend.py),
   SGLang's are the streamed text. ``backend.progress()`` runs every ``--token-interval-s``.
6. ``NodeHeartbeat`` every ``--heartbeat-s`` (1 s of wall clock, ``heartbeat_s * time_scale``
   model seconds) from a thread of its own on a NATS connection of its own, not behind the queue
   of the node's events nor the worker's loop: a drain, a switch, a backlog of publications or a
   busy loop never delays it; it carries the node's progress (``applied_seq``, ``published``) and
   how late its loop is (``loop_lag_s``, measured by the thread; docs/live.md, "Liveness"). If the
   stream says this node was removed (``NodeRemoved`` of another source, e.g. the liveness
   watcher after a stall or a SIGSTOP), the worker registers again: ``NodeRegistered`` with its
   current role and capacities, then ``KvStored`` (no request) of the KV its view held before
   the removal, by tier and last access (the directory dropped it), so it gets work again.
   SIGTERM/SIGINT: ``NodeRemoved(reason="shutdown")``, flush, exit 0.
7. ``--kv-bytes`` (sim backend): real bytes behind the node's KV pool (engine/kvplane.py). Every
   KV fact the node emits goes through the data plane before it is published: stores write
   bytes, a ``KvFetched`` reads the blocks from the peer's host pool, a ``KvMoved`` has the
   prefill node write them into this node's slots (Mooncake over TCP between processes), every
   checksum verified; a transfer whose checksums differ is refused and the request recomputes
   those blocks (``kvgate``: a queued prefill waits for its fetched bytes). ``NodeRegistered.transfer_endpoint`` tells peers where; the counts are
   logged (``kv_bytes`` every 10 heartbeats, ``kv_bytes_summary`` at stop).
8. ``--metrics-port P`` (0: a free port; -1, the default: off): ``/metrics`` and ``/healthz`` on
   ``--metrics-host`` (services/adapters/metrics.py's server), the node's gauges and counters
   (engine/metrics.py). The ``"first"`` token message carries the prompt tokens the node found
   cached (its ``RequestStarted(prefill).cached_tokens``) to the gateway's usage.

Time: the node model's clock is ``epoch + (wall - epoch) * time_scale`` (seconds), the clock
the planner's ticker and the gateway use with the same ``--clock-epoch`` (default: the
worker's start), so ``--time-scale 1`` is real time and ``10`` runs the model ten times faster
than the wall clock (tests); event ``ts`` are model time. A scheduled callback runs with ``now`` = its own due time
even when the loop is late, so the model's timeline is exactly what it planned.

The package: ``__main__`` (``python -m engine.worker``: arguments, preflight checks, backend
construction, ``main``; as the gateway's services/drivers/gateway/__main__.py), ``loop``
(``EngineWorker``: its state, the backend's callbacks, start and stop), ``stream`` (folding the
stream: routes, switches, decode admission, rejoin after a removal, snapshots), ``publish``
(the retrying publisher and the heartbeats), ``prompts`` (``PromptFetch``: the jobs' token ids
from the prompt store), ``cancel`` (a ``RequestCancelled`` stops the request on the node holding
it: docs/gateway.md, "Cancellation"), ``kvgate`` (``--kv-bytes``: refused transfers recomputed), ``host`` (``WallClockHost``, the scaled clock the
backend runs on, and ``RemotePeer``).
"""
