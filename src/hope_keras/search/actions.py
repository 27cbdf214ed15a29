"""The actions a HOPE run ranks and executes, and the queue of the best ones.

Each group (its cheapest prune or merge) and each residual block (its eviction)
keeps one `Action` in `ActionQueue`, a heap keyed by the ranking ``DR``: a step
re-prices only what it touched, and an entry whose group or block changed since it
was pushed is dropped when it surfaces. A step therefore does not grow with the
number of layers.
"""

from __future__ import annotations

import dataclasses
import heapq
from typing import Callable, Dict, Optional


@dataclasses.dataclass(frozen=True)
class Action:
    """One candidate action, as the engine ranks and executes it.

    Attributes:
        kind: ``"prune"``, ``"merge"`` or ``"evict"``.
        unit: The group (prune, merge) or residual block (evict) it acts on.
        i: The pruned neuron, or the merge's vessel slot (−1 for an eviction).
        j: The merge's removed slot (−1 otherwise).
        J: Its distortion under the run's cost.
        DR: The ranking key the engine minimises (``cost.rank(J, ...)``).
        P_init: The static parameter footprint of the action (docs/theory.md §3).
        neurons: Compressible neurons it removes.
    """

    kind: str
    unit: str
    i: int
    j: int
    J: float
    DR: float
    P_init: float
    neurons: int


class ActionQueue:
    """The best action of each group and block, cheapest ``DR`` first (ties: the
    first pushed)."""

    def __init__(self):
        self._heap: list = []
        self._seq = 0
        self._block_version: Dict[str, int] = {}

    def clear(self) -> None:
        """Drops every entry (a re-ranking pushes them all again)."""
        self._heap = []

    def push_group(self, action: Action, version: int) -> None:
        """`action`, the group's best at its state `version`."""
        self._seq += 1
        heapq.heappush(self._heap, (action.DR, self._seq, "g", action.unit, version, action))

    def push_block(self, action: Action) -> None:
        """`action`, the eviction of its block; it replaces the block's earlier ones."""
        name = action.unit
        self._seq += 1
        v = self._block_version.get(name, 0) + 1
        self._block_version[name] = v
        heapq.heappush(self._heap, (action.DR, self._seq, "b", name, v, action))

    def cheapest(self, valid: Callable, max_removed: Optional[int] = None) -> Optional[Action]:
        """The cheapest entry still current (``valid(kind, name, version)``, kind
        ``"g"`` or ``"b"``), skipping evictions that remove more than `max_removed`
        neurons; it stays queued until it is executed."""
        skipped = []
        found = None
        while self._heap:
            entry = heapq.heappop(self._heap)
            _, _, kind, name, version, action = entry
            if kind == "b" and self._block_version.get(name) != version:
                continue
            if not valid(kind, name, version):
                continue
            if action.kind == "evict" and max_removed is not None \
                    and action.neurons > max_removed:
                skipped.append(entry)
                continue
            found = entry
            break
        for e in skipped:
            heapq.heappush(self._heap, e)
        if found is not None:
            heapq.heappush(self._heap, found)  # stays until executed
        return None if found is None else found[5]
