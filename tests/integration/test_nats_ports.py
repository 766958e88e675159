"""A port picked for nats-server can be taken by another process before the server binds it
(the fresh-clone CI of 90aedc9: "Error listening on router port ... address already in use" in
``NatsCluster(3)``, two test workers side by side). A picked port that turns out taken is picked
again; a port the caller named is not moved. Real nats-servers, the port held by a listening
socket of this test."""

from __future__ import annotations

import socket

import pytest

from services.adapters.bus.natsserver import EmbeddedNats, NatsCluster, NatsServerError, _ready


def _hold(port: int) -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("127.0.0.1", port))
    s.listen()
    return s


def test_a_picked_client_port_found_taken_is_picked_again():
    server = EmbeddedNats()
    taken = server.port
    with _hold(taken), server:
        assert server.port != taken and _ready("127.0.0.1", server.port)


def test_a_named_port_found_taken_is_an_error_not_a_move():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with _hold(port), pytest.raises(NatsServerError, match="address already in use"):
        EmbeddedNats(port=port).start()


def test_a_cluster_whose_route_port_is_taken_starts_on_new_ports():
    cluster = NatsCluster(3, name="ports")
    taken = int(cluster.servers[1].cluster["listen"].rsplit(":", 1)[1])
    with _hold(taken), cluster:
        routes = [int(s.cluster["listen"].rsplit(":", 1)[1]) for s in cluster.servers]
        assert taken not in routes
        assert all(_ready("127.0.0.1", s.port) for s in cluster.servers)
        for s in cluster.servers:  # each names the other two's new routes
            assert sorted(s.cluster["routes"]) == sorted(f"nats-route://127.0.0.1:{p}" for p in routes
                                                         if not s.cluster["listen"].endswith(f":{p}"))
