"""The three ZMQ frames every engine's KV-event publisher sends (SGLang and vLLM alike):
the topic, an 8-byte big-endian signed sequence number, and the encoded batch. Pure."""

from __future__ import annotations


def join(topic: str, seq: int, payload: bytes) -> list[bytes]:
    """The frames of one message, as the publishers send them."""
    return [topic.encode(), seq.to_bytes(8, "big"), payload]


def split(parts: list[bytes]) -> tuple[str, int, bytes]:
    """``(topic, seq, payload)`` of one received message; ValueError naming what is wrong."""
    if len(parts) != 3:
        raise ValueError(f"KV-event message has {len(parts)} frames, expected 3 (topic, seq, payload)")
    topic, seq, payload = parts
    if len(seq) != 8:
        raise ValueError(f"KV-event sequence frame has {len(seq)} bytes, expected 8")
    return topic.decode(), int.from_bytes(seq, "big", signed=True), payload
