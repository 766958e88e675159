"""``evolving chaos``: the fault suite as a command, over a live stack under load.

Modules: :mod:`.tail` (the harness's copy of the stream), :mod:`.load` (the load generator),
:mod:`.supervisor` (the cluster and the services as child processes), :mod:`.scenarios` (the
faults), :mod:`.accounting` (what was lost, duplicated, diverged), :mod:`.suite` (the run),
:mod:`.report` (the table), :mod:`.cli` (``evolving chaos``); :mod:`.faults` arms one fault
inside a service process, :mod:`.engine_faults` one inside an engine worker (a cut KV transfer);
:mod:`.engine_scenarios` and :mod:`.gateway_scenario` hold the engine and gateway rows,
:mod:`.recovery` the recovery measure, :mod:`.progress` the waits that end when engine work
stops moving on the stream, :mod:`.torch_model` what ``--engines torch`` runs (the reference
engine on a tiny random checkpoint the run writes, or ``--model``).


It starts its own stack on loopback - a 3-server NATS cluster (services.adapters.bus.natsserver.NatsCluster)
with the partition's stream replicated on all three (R3), the directory, planner, router and
recorder services as child processes (services.drivers.up.testing.spawn_service), and a load
generator publishing harness traffic for 2 prefill + 2 decode nodes (registrations, heartbeats,
agent branches and requests), every event with a message id and retried with the same id when
a publish fails - then injects one fault after another while the load runs:

==========================  ====================================================================
scenario                    fault
==========================  ====================================================================
kill-<service>              SIGKILL the service (no final ack, no final snapshot), start it again
kill-nats-leader            SIGKILL the nats-server leading the stream (one of three); it comes
                            back once the stack has recovered
corrupt-<kind>-snapshot     SIGKILL the service, flip one bit of its snapshot in the object
                            store, start it again: the snapshot must be rejected, the state
                            rebuilt from sequence 0
partition-engine            node d1 stops heartbeating; the planner must remove it (NodeRemoved)
duplicate-publish           republish the last 50 harness events with their message ids
rewind-consumer             delete the router's durable consumer and re-create it 100
                            sequences behind its ack floor while the router runs
malformed-events            garbage bytes, an event of a newer major schema, a request with a
                            negative block hash: each must land in the dead-letter stream of
                            every consumer while the services go on
restart-all-nats            SIGKILL all three servers, start them again: the stream comes back
kill-engine-prefill         (``--engines`` only) SIGKILL a prefill worker mid-prefill, restart
                            it: its requests are re-routed, its KV forgotten by the directory
kill-engine-decode          (``--engines`` only) the same mid-decode: its requests fail with a
                            clear error (RequestFinished(error=...)), none hangs
cut-kv-transfer             (``--engines`` only; the workers then run ``--kv-bytes``) the next
                            KV transfer of a prefill node moves half of its bytes and reports
                            success: the receiver's checksums refuse it, the request recomputes
restart-gateway             (``--engines`` only) SIGTERM a gateway mid-stream, start it again:
                            the client sees the stream end (no hang), the branch's next request
                            works on the restarted gateway (branch table rebuilt from the stream)
==========================  ====================================================================

For each scenario the table says: survived (no unplanned exit, recovered, the scenario's own
check holds), events lost (harness ids acknowledged by the bus but absent from the stream,
requests never decided, stream events absent from the recorder's DuckDB log), requests hung
(``--engines``: decided but never finished, not even with an error), events duplicated (harness ids stored twice, requests decided more than once), decisions diverged
(``verify_log`` of the recorder's DuckDB file, divergences attributed to the scenario whose
window holds their sequence) and the time to recover (seconds from the fault until every
service has folded past the stream head seen at the fault and a request published after the
fault is decided). docs/chaos.md has the long form and measured figures.
"""
