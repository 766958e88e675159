"""The KV-event forwarder of ``evolving chaos --engines vllm`` (services/drivers/chaos/zmq_proxy.py):
a subscriber behind it gets the publisher's frames untouched and filtered by its topic; killing it
loses what is published meanwhile (the gap a worker must notice), starting it again on the same
address mends the link without the subscriber doing anything."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import zmq

from services.adapters.bus.natsserver import free_port

REPO = Path(__file__).resolve().parents[4]


def _proxy(front: str, back: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "services.drivers.chaos.zmq_proxy", front, back], cwd=REPO)


def _pump(pub, sub, seq: int, deadline_s: float = 30.0) -> tuple[int, list[list[bytes]]]:
    """Publish numbered frames until the subscriber receives one; (next seq, what it received)."""
    got: list[list[bytes]] = []
    end = time.monotonic() + deadline_s
    while not got:
        assert time.monotonic() < end, "nothing came through the forwarder"
        pub.send_multipart([b"other", b"x"])  # another topic: filtered out
        pub.send_multipart([b"kv", seq.to_bytes(8, "big"), b"payload"])
        seq += 1
        while sub.poll(50):
            got.append(sub.recv_multipart())
    return seq, got


def test_frames_pass_untouched_and_a_cut_loses_what_was_published_meanwhile():
    ctx = zmq.Context.instance()
    p_front, p_back = free_port(), free_port()
    pub = ctx.socket(zmq.PUB)
    pub.bind(f"tcp://*:{p_front}")
    sub = ctx.socket(zmq.SUB)
    sub.connect(f"tcp://127.0.0.1:{p_back}")
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    proxy = _proxy(f"tcp://127.0.0.1:{p_front}", f"tcp://127.0.0.1:{p_back}")
    try:
        seq, got = _pump(pub, sub, 0)
        assert all(f[0] == b"kv" and f[2] == b"payload" and len(f) == 3 for f in got)
        before = int.from_bytes(got[-1][1], "big")
        proxy.kill()
        proxy.wait()
        cut = range(seq, seq + 20)
        for s in cut:  # published while the link is cut
            pub.send_multipart([b"kv", s.to_bytes(8, "big"), b"payload"])
        seq += len(cut)
        proxy = _proxy(f"tcp://127.0.0.1:{p_front}", f"tcp://127.0.0.1:{p_back}")
        seq, got = _pump(pub, sub, seq)
        first_after = int.from_bytes(got[0][1], "big")
        assert first_after >= cut[-1] + 1 > before + 1  # a gap the subscriber can see in the sequence
    finally:
        proxy.kill()
        proxy.wait()
        pub.close(linger=0)
        sub.close(linger=0)
