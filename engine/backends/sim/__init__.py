"""The simulated engine: :class:`SimNode` (the node model the cluster simulator drives) and
:class:`SimBackend` (the same node behind the worker's port, in wall-clock time)."""

from engine.backends.sim.node import DecodeJob, NodeHost, PrefillJob, SimNode

__all__ = ["DecodeJob", "NodeHost", "PrefillJob", "SimNode"]
