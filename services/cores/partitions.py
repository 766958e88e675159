"""The partition map: which partition owns a node, and which one serves a session.

A cluster too large for one set of cores is split into partitions (METHOD.md, deployment;
docs/partitions.md). Each partition ``p`` has its own stream (``ei.<p>.>``, events/subjects.py)
and its own directory, planner and router. This module is the single place that says who is
where; it is pure (stdlib and ``events`` only) and deterministic across processes and runs:

* **nodes -> partition**: contiguous blocks of the node list (:meth:`PartitionMap.contiguous`,
  sizes differ by at most one, the first partitions take the extra nodes), or an explicit
  ``node -> partition`` table (:meth:`PartitionMap.explicit`).
* **sessions -> partition**: by the id of the session's *root branch*, through a stable hash
  (BLAKE2b, 64 bits, modulo the partition count; never Python's salted ``hash``). A fork or a
  sub-agent is assigned by its root, so it lands where its root's KV is.
* **the cross-partition rule** (:meth:`PartitionMap.may_fetch`, :meth:`PartitionMap.may_move`):
  KV fetches and role moves stay inside one partition.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from events.subjects import DEFAULT_PARTITION, token


class PartitionError(ValueError):
    """A partition map that cannot be built (one line, naming what is wrong)."""


def partition_names(count: int, base: str = DEFAULT_PARTITION) -> tuple[str, ...]:
    """The names of ``count`` partitions: ``(base,)`` for one; ``p0 .. p<N-1>`` for the default
    base, else ``<base>-0 .. <base>-<N-1>``. Every name is one subject token."""
    if count < 1:
        raise PartitionError(f"partitions must be >= 1, got {count}")
    if count == 1:
        return (base,)
    if base == DEFAULT_PARTITION:
        return tuple(f"p{i}" for i in range(count))
    return tuple(f"{token(base)}-{i}" for i in range(count))


def stable_hash(text: str) -> int:
    """A 64-bit hash of ``text`` that is the same in every process, run and machine."""
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "big")


def session_index(root_branch: str, partitions: int) -> int:
    """The partition index of a session among ``partitions``, by its root branch id."""
    return stable_hash(root_branch) % partitions


def block_sizes(total: int, parts: int) -> list[int]:
    """``total`` items in ``parts`` contiguous blocks, sizes differing by at most one (the first
    ``total % parts`` blocks take one more)."""
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


@dataclass(frozen=True)
class PartitionMap:
    """``names[i]`` is partition ``i``; ``nodes[i]`` are its nodes, in order."""

    names: tuple[str, ...]
    nodes: tuple[tuple[str, ...], ...]
    _index: dict[str, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.names:
            raise PartitionError("a partition map needs at least one partition")
        if len(set(self.names)) != len(self.names):
            raise PartitionError(f"partition names repeat: {list(self.names)}")
        for n in self.names:
            if token(n) != n:
                raise PartitionError(f"partition name {n!r} is not one subject token (use letters, digits, -, _)")
        if len(self.nodes) != len(self.names):
            raise PartitionError(f"{len(self.names)} partitions but {len(self.nodes)} node lists")
        index: dict[str, int] = {}
        for i, ns in enumerate(self.nodes):
            for node in ns:
                if node in index:
                    raise PartitionError(f"node {node!r} is in partitions {self.names[index[node]]!r} "
                                         f"and {self.names[i]!r}")
                index[node] = i
        object.__setattr__(self, "_index", index)

    # ------------------------------------------------------------------ building
    @classmethod
    def contiguous(cls, nodes: Sequence[str], partitions: int | Sequence[str]) -> PartitionMap:
        """Split ``nodes`` (in order) into contiguous blocks, one per partition."""
        names = partition_names(partitions) if isinstance(partitions, int) else tuple(partitions)
        if not names:
            raise PartitionError("a partition map needs at least one partition")
        if len(nodes) < len(names):
            raise PartitionError(f"{len(nodes)} nodes cannot fill {len(names)} partitions (each needs one)")
        out, at = [], 0
        for size in block_sizes(len(nodes), len(names)):
            out.append(tuple(nodes[at:at + size]))
            at += size
        return cls(names, tuple(out))

    @classmethod
    def explicit(cls, assignment: Mapping[str, str], names: Sequence[str] | None = None) -> PartitionMap:
        """``node -> partition name``; partitions ordered as ``names`` (default: first appearance)."""
        order = list(names) if names is not None else list(dict.fromkeys(assignment.values()))
        pos = {n: i for i, n in enumerate(order)}
        lists: list[list[str]] = [[] for _ in order]
        for node, part in assignment.items():
            if part not in pos:
                raise PartitionError(f"node {node!r} is assigned to unknown partition {part!r} "
                                     f"(partitions: {order})")
            lists[pos[part]].append(node)
        for name, ns in zip(order, lists, strict=True):
            if not ns:
                raise PartitionError(f"partition {name!r} has no node")
        return cls(tuple(order), tuple(tuple(ns) for ns in lists))

    @classmethod
    def parse(cls, spec: str) -> PartitionMap:
        """``p0=n0,n1;p1=n2,n3``: an explicit map from text (a flag or a config value)."""
        assignment: dict[str, str] = {}
        names: list[str] = []
        for part in filter(None, (s.strip() for s in spec.split(";"))):
            name, eq, members = part.partition("=")
            name = name.strip()
            if not eq or not name:
                raise PartitionError(f"bad partition spec {part!r}: use NAME=NODE,NODE;NAME=NODE")
            names.append(name)
            for node in filter(None, (m.strip() for m in members.split(","))):
                if node in assignment:
                    raise PartitionError(f"node {node!r} is in partitions {assignment[node]!r} and {name!r}")
                assignment[node] = name
        return cls.explicit(assignment, names)

    # ------------------------------------------------------------------ queries
    def __len__(self) -> int:
        return len(self.names)

    def index(self, name: str) -> int:
        try:
            return self.names.index(name)
        except ValueError:
            raise PartitionError(f"unknown partition {name!r} (partitions: {list(self.names)})") from None

    def node_index(self, node: str) -> int:
        try:
            return self._index[node]
        except KeyError:
            raise PartitionError(f"node {node!r} is in no partition") from None

    def partition_of_node(self, node: str) -> str:
        return self.names[self.node_index(node)]

    def nodes_of(self, partition: str | int) -> tuple[str, ...]:
        i = partition if isinstance(partition, int) else self.index(partition)
        return self.nodes[i]

    def session_index(self, root_branch: str) -> int:
        """The partition index of a session, by its root branch id (stable hash)."""
        return session_index(root_branch, len(self.names))

    def session_partition(self, root_branch: str) -> str:
        return self.names[self.session_index(root_branch)]

    # ------------------------------------------------------------------ the cross-partition rule
    def may_fetch(self, src_node: str, dst_node: str) -> bool:
        """A KV fetch from ``src_node`` to ``dst_node`` is allowed only inside one partition:
        each directory knows only its partition's copies, so a prefix held elsewhere is
        recomputed (docs/partitions.md)."""
        return self.node_index(src_node) == self.node_index(dst_node)

    def may_move(self, planner_partition: str, node: str) -> bool:
        """A planner orders role moves only for its own partition's nodes."""
        return self.node_index(node) == self.index(planner_partition)

    def describe(self) -> dict[str, list[str]]:
        return {name: list(ns) for name, ns in zip(self.names, self.nodes, strict=True)}
