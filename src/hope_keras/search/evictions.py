"""The residual blocks a HOPE run may evict: each eviction as an `Action`, and the
groups an executed eviction freezes.

A block is evictable when the walker found an identity or projection shortcut
around its branch (`hope_keras.graph`) and the run prices all of its groups; its
eviction removes every live neuron of those groups at once.
"""

from __future__ import annotations

import numpy as np

from hope_keras.scoring import costs
from hope_keras.search.actions import Action
from hope_keras.edit.slim import evicted_blocks


class Evictions:
    """The run's blocks: which can still be evicted, at what cost.

    Args:
        graph: The model's `hope_keras.graph.walker.Graph`.
        groups: The run's group states by name (`hope_keras.search.merge_search.GroupState`).
        reports: The analysis' block reports (capacities of the identity, branch and
            stream, the block's ``P_init``).
        actions: The run's actions (evictions only with ``"evict"``).
    """

    def __init__(self, graph, groups, reports, actions):
        self.graph = graph
        self.groups = groups
        self.blocks = {b.name: b for b in graph.blocks
                       if all(g in groups for g in b.groups)}
        self.reports = {b.name: b for b in reports if b.name in self.blocks}
        self.block_of = {g: b for g, b in graph.block_of_group().items()
                         if b in self.blocks}
        self.evicted: set = set()
        self.enabled = "evict" in actions

    def open(self, name: str) -> bool:
        """Whether block `name` can be evicted now."""
        return self.enabled and self.blocks[name].evictable and name not in self.evicted

    def live_neurons(self, name: str) -> int:
        return sum(self.groups[g].n for g in self.blocks[name].groups)

    def action(self, name: str, cost, rank_info) -> Action:
        """The eviction of block `name` under `cost`; ``rank_info(removed, p_init)``:
        its `costs.RankInfo`."""
        b, rep = self.blocks[name], self.reports[name]
        J = float(cost.evict(costs.EvictCandidate(
            np.array([self.groups[g].n for g in b.groups], dtype=np.float64),
            np.array([self.groups[g].C for g in b.groups]), rep.c_identity, rep.c_branch,
            rep.c_stream)))
        removed = self.live_neurons(name)
        dr = float(np.asarray(cost.rank(np.asarray(J), rank_info(removed, rep.p_init))))
        return Action("evict", name, -1, -1, J, dr, float(rep.p_init), int(removed))

    def freeze(self, name: str) -> None:
        """Block `name` is evicted: its groups frozen and empty."""
        self.evicted.add(name)
        for g in self.blocks[name].groups:
            gs = self.groups[g]
            gs.frozen, gs.n = True, 0
            gs.version += 1

    def evict_dead_branches(self, sizes):
        """Evicts the evictable blocks whose branch is dead already (an earlier run
        evicted them: `slim` drops them), in `sizes` too (recount the layers
        returned with `update`). Returns (touched layers, neurons removed)."""
        # slim's own test: an eviction into a final BN without scale or center zeroes
        # the producer too, and such a BN's γ (or β) is implicit, not zero.
        dead = evicted_blocks(self.graph.flat.model, self.graph)
        touched, removed = set(), 0
        for name, b in self.blocks.items():
            if b.evictable and name in dead and name not in self.evicted:
                touched |= set(b.branch_layers).union(*(sizes.layers_of[g] for g in b.groups))
                removed += self.live_neurons(name)
                sizes.evict(b.branch_layers, b.groups)
                self.freeze(name)
        return touched, removed
