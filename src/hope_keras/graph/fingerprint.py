"""A model's weight fingerprint: which weights a trajectory or an analysis was made from.

A trajectory records the fingerprint of the model it starts from and refuses to
replay onto other weights (`hope_keras.Trajectory.replay`); an `Analysis` keeps a
sampled one to notice that the model changed under it (`Analysis.check`).
"""

from __future__ import annotations

import hashlib
from typing import Optional

import numpy as np

from hope_keras.graph.adapter import weight_view


def fingerprint(model, graph, sample: Optional[int] = None) -> str:
    """sha256 of every weight HOPE reads (every coupled layer of every group, and
    each block's branch end).

    ``sample``: hash at most about this many evenly spaced values of each weight (and
    its shape) instead of all of them: a cheap signature that any compression step
    changes (a step rewrites a channel's BN parameters, which are hashed whole up to
    that size), for `hope_keras.Analysis.check`; not a proof of identity."""
    names = []
    for g in graph.groups.values():
        names += [c.layer for c in g.couplings] if g.couplings else (
            [g.producer, g.bn] + [c.layer for c in g.consumers])
    for b in graph.blocks:
        names.append(b.final_bn if b.final_bn is not None else b.final_producer)
    get = graph.layer if getattr(graph, "flat", None) is not None else model.get_layer
    h = hashlib.sha256()
    for name in sorted(set(names)):
        h.update(name.encode())
        for w in get(name).weights:
            if sample is not None:
                arr = weight_view(w).reshape(-1)
                h.update(str(tuple(w.shape)).encode())
                h.update(np.ascontiguousarray(arr[::max(1, arr.size // sample)]).view(np.uint8))
                continue
            # Its bytes in place (any dtype): no copy of a large kernel.
            h.update(np.ascontiguousarray(weight_view(w)).reshape(-1).view(np.uint8))
    return h.hexdigest()
