"""Build a transfer backend by name (``--transfer loopback|mooncake``)."""

from __future__ import annotations

from engine.transfer.base import TransferBackend, TransferError

BACKENDS = ("loopback", "mooncake")


def make_transfer(name: str, *, node: str = "n0", host: str = "127.0.0.1", fabric=None) -> TransferBackend:
    if name == "loopback":
        from engine.transfer.loopback import LoopbackFabric, LoopbackTransfer  # lazy: needs torch (optional)

        return LoopbackTransfer(fabric if fabric is not None else LoopbackFabric(), node)
    if name == "mooncake":
        from engine.transfer.mooncake import MooncakeTransfer  # lazy: needs torch (optional)

        return MooncakeTransfer(host)
    raise TransferError(f"unknown transfer backend {name!r} (known: {', '.join(BACKENDS)})")
