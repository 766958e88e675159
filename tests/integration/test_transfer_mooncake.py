"""Two worker processes, each holding a host pool, move KV blocks through Mooncake over TCP.

Skipped, with the import error as the reason, where Mooncake (or libibverbs1) is missing; the
loopback fake then covers the same contract in tests/contract/test_transfer.py.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest

pytest.importorskip("torch")

from engine.transfer.mooncake import mooncake_available

OK, WHY = mooncake_available()
pytestmark = pytest.mark.skipif(not OK, reason=f"Mooncake unavailable: {WHY}")

LAYOUT = "bf16:16x4x2x64"  # 16 KiB blocks
SLOTS = 32


class Node:
    def __init__(self, seed: int) -> None:
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "engine.transfer.node",
                "--backend",
                "mooncake",
                "--layout",
                LAYOUT,
                "--slots",
                str(SLOTS),
                "--seed",
                str(seed),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        hello = self._line()
        self.descriptor = hello["descriptor"]
        self.checksums = hello["checksums"]

    def _line(self) -> dict:
        line = self.proc.stdout.readline()
        assert line, f"node exited with {self.proc.wait(timeout=10)}"
        return json.loads(line)

    def ask(self, **cmd) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._line()

    def close(self) -> int:
        self.proc.stdin.write('{"op": "quit"}\n')
        self.proc.stdin.flush()
        return self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def two_nodes():
    # One pair for the module (each start imports torch, each stop joins Mooncake's threads);
    # the tests use disjoint slots.
    a, b = Node(seed=1), Node(seed=2)
    try:
        yield a, b
        assert a.close() == 0 and b.close() == 0, "a node did not quit cleanly"
    finally:
        for n in (a, b):
            if n.proc.poll() is None:
                n.proc.kill()
                n.proc.wait()


def test_peer_fetch_between_processes_moves_the_exact_bytes(two_nodes):
    a, b = two_nodes
    assert a.descriptor["endpoint"] != b.descriptor["endpoint"]
    assert a.checksums != b.checksums
    remote, local = [4, 5, 6, 7, 20, 3], [0, 1, 2, 3, 31, 10]
    reply = b.ask(op="read", peer=a.descriptor, remote_slots=remote, local_slots=local)
    assert reply["ok"], reply
    assert reply["checksums"] == [a.checksums[s] for s in remote]
    assert reply["stats"] == {"nbytes": 6 * 16384, "blocks": 6, "runs": 3}
    untouched = b.ask(op="checksums", slots=[4, 5, 30])["checksums"]
    assert untouched == [b.checksums[s] for s in (4, 5, 30)]


def test_prefill_to_decode_write_lands_in_the_peer_pool(two_nodes):
    a, b = two_nodes
    reply = a.ask(op="write", local_slots=[9, 8], peer=b.descriptor, remote_slots=[12, 13])
    assert reply["ok"], reply
    got = b.ask(op="checksums", slots=[12, 13])["checksums"]
    assert got == [a.checksums[9], a.checksums[8]]


def test_bad_requests_fail_without_killing_the_node(two_nodes):
    a, b = two_nodes
    bad = b.ask(op="read", peer=a.descriptor, remote_slots=[SLOTS], local_slots=[25])
    assert not bad["ok"] and f"slot {SLOTS} is outside" in bad["error"]
    dead = dict(a.descriptor, endpoint=f"127.0.0.1:{_free_port()}")
    unreachable = b.ask(op="read", peer=dead, remote_slots=[0], local_slots=[25])
    assert not unreachable["ok"] and "PeerUnreachable" in unreachable["error"]
    assert b.ask(op="read", peer=a.descriptor, remote_slots=[1], local_slots=[25])["ok"]


def test_raw_socket_baseline_sends_the_same_bytes(two_nodes):
    a, _ = two_nodes
    port = a.ask(op="serve_socket", slots=[2, 0])["port"]
    with socket.create_connection(("127.0.0.1", port)) as conn:
        data = b""
        while len(data) < 2 * 16384:
            chunk = conn.recv(65536)
            assert chunk, "socket closed early"
            data += chunk
    import hashlib

    sums = [
        int.from_bytes(hashlib.blake2b(data[i * 16384 : (i + 1) * 16384], digest_size=8).digest(), "little")
        for i in range(2)
    ]
    assert sums == [a.checksums[2], a.checksums[0]]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
