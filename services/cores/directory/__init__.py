"""Agent-aware KV directory (METHOD.md §4.1): where KV lives, active-branch counts per copy,
longest-prefix lookup and count-aware eviction. The core is pure; see docs/directory.md.

Layer 1 (core). May import: ``events``, numpy, msgspec. Its benchmark is ``services.drivers.bench.directory``.
"""

from services.cores.directory.core import DirectoryCore
from services.cores.directory.eviction import CountAwareEviction, LruEviction
from services.cores.directory.lookup import Lookup, NodeMatch

__all__ = ["CountAwareEviction", "DirectoryCore", "Lookup", "LruEviction", "NodeMatch"]
