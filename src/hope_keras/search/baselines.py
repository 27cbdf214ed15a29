"""Data-free structured baselines, through the same edit and slim path as HOPE.

The paper's three magnitude baselines (section 11.1) and Neuron Merging
(Kim et al., NeurIPS 2020), reimplemented from the papers' descriptions:

* ``"l1_input"`` — L1-norm input pruning (Li et al., 2017): a neuron's score is the
  l1 norm of its incoming filter (the producer's raw kernel slice);
* ``"l1_joint"`` — L1-norm joint pruning: the l1 norm of the concatenated incoming
  filter and outgoing vector ``u`` (every consumer slice that reads the neuron);
* ``"bn_scale"`` — BN-scale pruning (Liu et al., 2017, network slimming): ``|γ|``;
* `neuron_merging` — rank by the l1 or l2 norm of the incoming filter; each removed
  neuron is merged into its most cosine-similar kept neuron of the same layer, scaled
  by their norm ratio, the scale absorbed into the next layer: ``u_k += s·u_p``.

Every method works on the neurons `hope_keras.analyze` finds (``Analysis.graph``
groups): the residual stream and other pinned layers are untouched, as for HOPE.
By default the ranking is global across the network: the lowest scores are removed
until the target neuron density (active / initial compressible neurons, the same
``floor(density · N)`` HOPE reaches), skipping a neuron when it is the last active
one of its layer, so no layer is ever emptied. ``scope="layer"`` instead removes the
same fraction of every layer (the Neuron Merging paper's protocol).

Removal uses `hope_keras.edit.editor.ModelEditor.prune` (filter, bias, γ, β, moving mean and
consumer slices zeroed), so `hope_keras.slim` removes the channels afterwards.

Example:

>>> import keras, numpy as np
>>> from hope_keras import baselines
>>> inputs = keras.Input((6,))
>>> x = keras.layers.Dense(8, name="fc")(inputs)
>>> x = keras.layers.ReLU()(keras.layers.BatchNormalization()(x))
>>> model = keras.Model(inputs, keras.layers.Dense(2, name="head")(x))
>>> result = baselines.prune(model, density=0.5, method="l1_input")
>>> result.density, len(result.removed)
(0.5, 4)
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Dict, List, Optional, Tuple

import numpy as np

from hope_keras.scoring.analysis import Analysis, analyze
from hope_keras.edit.editor import ModelEditor
from hope_keras.graph import layers as layer_rules

__all__ = [
    "METHODS",
    "BaselineResult",
    "scores",
    "removal_order",
    "layer_removals",
    "prune",
    "neuron_merging",
]

METHODS = ("l1_input", "l1_joint", "bn_scale")
NM_CRITERIA = ("l1", "l2", "auto")


@dataclasses.dataclass
class BaselineResult:
    """What a baseline did.

    Attributes:
        method: Method name (e.g. ``"l1_input"``, ``"neuron_merging"``).
        density: Reached neuron density.
        removed: ``(group, neuron)`` pairs removed, in removal (score) order.
        merges: Neuron Merging only: ``(group, removed p, kept k, scale s, cosine)``
            for every removed neuron that was merged.
        seconds: Wall time of the whole call (scoring and editing).
        analysis: The `Analysis` the scores were read from.
    """

    method: str
    density: float
    removed: List[Tuple[str, int]]
    merges: List[Tuple[str, int, int, float, float]]
    seconds: float
    analysis: Analysis

    def __repr__(self) -> str:  # one line: not every removal and the analysis
        return (f"BaselineResult(method={self.method!r}, density={self.density:.4f}, "
                f"removed={len(self.removed)}, merges={len(self.merges)}, "
                f"seconds={self.seconds:.2f})")


# ----------------------------------------------------------------------- scoring
def _filter_norm(state, ord_: int) -> np.ndarray:
    return np.linalg.norm(np.asarray(state.w_raw, dtype=np.float64), ord=ord_, axis=1)


def scores(analysis: Analysis, method: str) -> Dict[str, np.ndarray]:
    """Per-group neuron scores (higher = more important) of a magnitude baseline.

    Args:
        analysis: `hope_keras.analyze(model)`.
        method: ``"l1_input"``, ``"l1_joint"``, ``"bn_scale"``, or the Neuron
            Merging criteria ``"l1"``, ``"l2"`` (norm of the incoming filter).
    """
    out = {}
    for name, st in analysis.states.items():
        if method in ("l1_input", "l1"):
            s = _filter_norm(st, 1)
        elif method == "l2":
            s = _filter_norm(st, 2)
        elif method == "l1_joint":
            s = (np.abs(np.asarray(st.w_raw, dtype=np.float64)).sum(axis=1)
                 + np.abs(np.asarray(st.u, dtype=np.float64)).sum(axis=1))
        elif method == "bn_scale":
            s = np.abs(st.gamma)
        else:
            raise ValueError(f"Unknown baseline score {method!r}. Known: "
                             f"{METHODS + ('l1', 'l2')}")
        out[name] = np.asarray(s, dtype=np.float64)
    return out


def removal_order(group_scores: Dict[str, np.ndarray]) -> List[Tuple[str, int]]:
    """Global removal sequence: ascending score, never a layer's last neuron.

    Ties break by group order, then neuron index (deterministic). The first ``k``
    entries are the neurons removed to go ``k`` neurons down, for every ``k``.
    """
    names = list(group_scores)
    flat = [(float(s), gi, i) for gi, n in enumerate(names)
            for i, s in enumerate(group_scores[n])]
    flat.sort()
    left = {n: len(group_scores[n]) for n in names}
    order = []
    for _, gi, i in flat:
        name = names[gi]
        if left[name] > 1:
            left[name] -= 1
            order.append((name, i))
    return order


def layer_removals(group_scores: Dict[str, np.ndarray],
                   density: float) -> List[Tuple[str, int]]:
    """Per-layer removal: each layer keeps ``max(1, round(density · n))`` neurons."""
    out = []
    for name, s in group_scores.items():
        keep = max(1, int(round(density * len(s))))
        idx = np.argsort(s, kind="stable")[: len(s) - keep]
        out += [(name, int(i)) for i in idx]
    return out


def _target_removed(num_neurons: int, density: float) -> int:
    if not 0.0 < density <= 1.0:
        raise ValueError(f"density must be in (0, 1]. Received: density={density}")
    return num_neurons - math.floor(density * num_neurons + 1e-9)


def _select(analysis, group_scores, density, scope):
    n = analysis.num_neurons
    if scope == "global":
        order = removal_order(group_scores)
        k = _target_removed(n, density)
        if k > len(order):
            raise ValueError(
                f"density={density} is out of reach: every layer keeps one neuron "
                f"(lowest density {(n - len(order)) / n:.4f}).")
        return order[:k]
    if scope == "layer":
        return layer_removals(group_scores, density)
    raise ValueError(f"scope must be 'global' or 'layer'. Received: scope={scope!r}")


def _analysis(model, analysis):
    if analysis is None:
        return analyze(model)
    analysis.check(model)
    return analysis


# ----------------------------------------------------------------------- actions
def prune(model, density: float, method: str = "l1_input", scope: str = "global",
          analysis: Optional[Analysis] = None,
          mean_compensation: bool = False) -> BaselineResult:
    """Prunes the lowest-scoring neurons of `model`, in place, to `density`.

    Args:
        model: A model `hope_keras.analyze` accepts (edited in place).
        density: Target neuron density in (0, 1].
        method: ``"l1_input"``, ``"l1_joint"`` or ``"bn_scale"``.
        scope: ``"global"`` (one ranking across the network) or ``"layer"``.
        analysis: A precomputed ``analyze(model)`` of this very model (optional).
        mean_compensation: Move each pruned neuron's mean output into its
            consumers' biases (as `hope_keras.compress(mean_compensation=True)`).

    Returns:
        A `BaselineResult`.
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}. Received: method={method!r}")
    t0 = time.perf_counter()
    a = _analysis(model, analysis)
    removed = _select(a, scores(a, method), density, scope)
    editor = ModelEditor(model, a.graph, mean_compensation=mean_compensation)
    for g, i in removed:
        with editor.step():
            editor.prune(g, i)
    editor.commit()
    return BaselineResult(method, (a.num_neurons - len(removed)) / a.num_neurons,
                          list(removed), [], time.perf_counter() - t0, a)


def _merge_vectors(state, bn_aware: bool) -> np.ndarray:
    """What Neuron Merging compares: the neuron's input map.

    ``bn_aware`` (their BN variant): the BN-folded augmented vector
    ``[γ w/s ; β − γ(μ − c)/s]`` (γ, β, μ, σ all enter), whose proportionality
    ``v_p = s·v_k`` (s > 0) is exactly the condition for ``ReLU(BN(·))`` outputs to
    be proportional. Otherwise the raw filter and bias ``[w ; c]``.
    """
    if bn_aware:
        return state.v
    return np.concatenate([np.asarray(state.w_raw, dtype=np.float64), state.bias[:, None]],
                          axis=1)


def neuron_merging(model, density: float, criterion: str = "auto", bn_aware: bool = True,
                   threshold: float = 0.0, scope: str = "global",
                   analysis: Optional[Analysis] = None) -> BaselineResult:
    """Neuron Merging (Kim et al., NeurIPS 2020), data-free, in place.

    1. Rank neurons by the ``criterion`` norm of their incoming filter (globally or
       per layer, as `prune`) and pick the removed set ``R`` of each layer; the rest
       ``K`` is kept.
    2. For each removed ``p``: ``k = argmax_{k ∈ K} cos(v_p, v_k)`` over the same
       layer's kept neurons (``v`` from `_merge_vectors`). If the cosine exceeds
       ``threshold`` (and is positive, so the scale is positive and commutes with
       ReLU), ``s = ‖v_p‖ / ‖v_k‖`` and the next layer absorbs it:
       ``u_k ← u_k + s·u_p`` (``ReLU(y_p) ≈ ReLU(s·y_k) = s·ReLU(y_k)``).
    3. Every removed neuron is pruned (`ModelEditor.prune`).

    All merge decisions are computed from the original weights (the paper's
    decomposition matrix), so several removed neurons may merge into one kept neuron.

    Args:
        model: Edited in place.
        density: Target neuron density.
        criterion: ``"l1"``, ``"l2"`` or ``"auto"`` (l1 for conv producers, l2 for
            Dense, as the paper used for its conv nets and LeNet).
        bn_aware: Compare BN-folded neurons (default; identical to the raw ones for a
            `hope_keras.calibrate`-d BN-free model).
        threshold: Minimum cosine similarity for a merge (the paper's ``t``).
        scope: ``"global"`` or ``"layer"``.
        analysis: Optional precomputed ``analyze(model)``.
    """
    if criterion not in NM_CRITERIA:
        raise ValueError(f"criterion must be one of {NM_CRITERIA}. "
                         f"Received: criterion={criterion!r}")
    t0 = time.perf_counter()
    a = _analysis(model, analysis)
    group_scores = {}
    for name, st in a.states.items():
        crit = criterion
        if crit == "auto":
            dense = layer_rules.get(a.graph.layer(st.group.producer)).kind == "dense"
            crit = "l2" if dense else "l1"
        group_scores[name] = _filter_norm(st, 1 if crit == "l1" else 2)
    removed = _select(a, group_scores, density, scope)
    by_group: Dict[str, List[int]] = {}
    for g, i in removed:
        by_group.setdefault(g, []).append(i)
    editor = ModelEditor(model, a.graph)
    merges = []
    for g, rem in by_group.items():
        st = a.states[g]
        grp = a.graph.groups[g]
        rem = np.asarray(rem)
        keep = np.setdiff1d(np.arange(st.size), rem)
        v = _merge_vectors(st, bn_aware)
        norms = np.linalg.norm(v, axis=1)
        safe = np.where(norms > 0, norms, 1.0)
        unit = v / safe[:, None]
        cos = unit[rem] @ unit[keep].T  # (|R|, |K|)
        best = np.argmax(cos, axis=1)
        coef = np.zeros((len(rem), st.size))  # u_k += Σ_p coef[p, k] u_p
        for r, p in enumerate(rem):
            k = int(keep[best[r]])
            c = float(cos[r, best[r]])
            if norms[p] > 0 and norms[k] > 0 and c > max(threshold, 0.0):
                s = float(norms[p] / norms[k])
                coef[r, k] = s
                merges.append((g, int(p), k, s, c))
        with editor.step():
            # u_k += s·u_p in every reader, at the channels' positions (Flatten rows,
            # concatenation offsets, separable kernels alike).
            for r, k in zip(*np.nonzero(coef)):
                p = int(rem[r])
                for reader in grp.readers:
                    slices = editor._slices(reader, int(k))
                    if len(slices) != 1:  # a separable reader: no linear merge exists
                        continue
                    for (attr, idx_k), (_, idx_p) in zip(slices,
                                                         editor._slices(reader, p)):
                        arr = editor.array(reader.layer, attr)
                        value = arr[idx_k].astype(np.float64) + coef[r, k] * arr[idx_p]
                        editor._write(reader.layer, attr, idx_k, value.astype(arr.dtype))
            for p in rem:
                editor.prune(g, int(p))
    editor.commit()
    return BaselineResult("neuron_merging", (a.num_neurons - len(removed)) / a.num_neurons,
                          list(removed), merges, time.perf_counter() - t0, a)
