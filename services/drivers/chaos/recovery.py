"""The recovery measure every scenario reports (``recover s`` in the table)."""

from __future__ import annotations

from services.drivers.chaos.supervisor import ChaosCluster


async def recover(stack: ChaosCluster, t_fault: float, head: int, timeout_s: float = 45.0) -> float:
    """Seconds from ``t_fault`` until every service folded past ``head`` and a request
    published after the fault is decided (a load that holds its requests to a few slots sends
    one such request even when the faulted node's requests still hold them all)."""
    if stack.load is not None and stack.load.max_in_flight is not None:
        stack.load.grant()

    async def done() -> bool:
        return await stack.caught_up(head) and await stack.decided_since(t_fault)

    t = await stack.wait(done, timeout_s, "recovery")
    return t - t_fault
