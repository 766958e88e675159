"""Mooncake transfer engine backend (TCP here, RDMA where the NICs have it)."""

from engine.transfer.mooncake.backend import MooncakeTransfer, mooncake_available

__all__ = ["MooncakeTransfer", "mooncake_available"]
