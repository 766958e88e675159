"""In-process fake transfer backend (``LoopbackFabric`` + ``LoopbackTransfer``)."""

from engine.transfer.loopback.backend import LoopbackFabric, LoopbackTransfer

__all__ = ["LoopbackFabric", "LoopbackTransfer"]
