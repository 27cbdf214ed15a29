"""`hope_keras.analyze`: what HOPE sees in a model, without changing it."""

from __future__ import annotations

import dataclasses
import io
from typing import Dict, List, Optional, Tuple

import numpy as np

from hope_keras import graph as graph_lib
from hope_keras.cache import GroupCache, build_group_cache
from hope_keras.neurons import LayerState, bn_arrays, eviction_p_init, extract_group
from hope_keras.progress import progress


@dataclasses.dataclass
class GroupReport:
    """One compressible group as `analyze` reports it.

    Attributes:
        name: Group name (the producer layer's name).
        size: Number of neurons.
        capacities: ‖f_i‖ of each neuron (float64 array).
        p_init: Static parameter footprint of each neuron.
        layers: Producer, BN, activation, pass-through layers and consumers.
        layer_capacity: Σ capacities.
        block: Name of the residual block that holds the group, if any.
    """

    name: str
    size: int
    capacities: np.ndarray
    p_init: np.ndarray
    layers: Tuple[str, ...]
    layer_capacity: float
    block: Optional[str]


@dataclasses.dataclass
class BlockReport:
    """One residual block as `analyze` reports it.

    Attributes:
        name: The Add layer's name.
        evictable: True for identity-shortcut blocks.
        groups: Names of its internal groups.
        input_bn: The BN conditioning the block input (None: appendix F.3 fallback).
        c_identity: Σ_c sqrt(γ_c² + β_c²) over that BN, or the fallback value.
        c_branch: Σ_c sqrt(γ_c² + β_c²) over the branch's final BN (the RMS the
            branch adds to the stream; the default cost's eviction numerator).
        p_init: Static footprint of evicting the block.
    """

    name: str
    evictable: bool
    groups: Tuple[str, ...]
    input_bn: Optional[str]
    c_identity: float
    c_branch: float
    p_init: float


@dataclasses.dataclass
class Analysis:
    """Everything `analyze` found: groups, residual blocks and pinned layers.

    Attributes:
        model_name: The analysed model's name.
        groups: `GroupReport` per compressible group, in topological order.
        blocks: `BlockReport` per residual block.
        pinned: `graph.Pinned` entries: layers that cannot be compressed, and why.
        graph: The `graph.ModelGraph` (for the engine).
        states: The extracted `LayerState` per group (for the engine).
        caches: The `GroupCache` per group (for the engine).
    """

    model_name: str
    groups: List[GroupReport]
    blocks: List[BlockReport]
    pinned: List[graph_lib.Pinned]
    graph: graph_lib.ModelGraph
    states: Dict[str, LayerState]
    caches: Dict[str, GroupCache]

    @property
    def num_neurons(self) -> int:
        """Number of compressible neurons (the denominator of neuron density)."""
        return int(sum(g.size for g in self.groups))

    def summary(self, print_fn=print) -> None:
        """Prints a table of the groups, blocks and pinned layers, like `model.summary()`."""
        out = io.StringIO()
        w = 34
        line = "─" * (w + 56)
        out.write(f'HOPE analysis of "{self.model_name}"\n{line}\n')
        out.write(f"{'Group (producer)':<{w}}{'neurons':>8}{'capacity':>12}"
                  f"{'mean P_init':>13}{'consumers':>11}  block\n{line}\n")
        for g in self.groups:
            consumers = len(self.graph.groups[g.name].consumers)
            out.write(
                f"{g.name:<{w}}{g.size:>8}{g.layer_capacity:>12.4g}"
                f"{g.p_init.mean():>13.1f}{consumers:>11}  {g.block or ''}\n"
            )
        out.write(f"{line}\nCompressible neurons: {self.num_neurons} in "
                  f"{len(self.groups)} groups\n")
        if self.blocks:
            out.write(f"{line}\n{'Residual block':<{w}}{'evictable':>10}{'groups':>8}"
                      f"{'C_identity':>12}  conditioning BN\n{line}\n")
            for b in self.blocks:
                out.write(f"{b.name:<{w}}{str(b.evictable):>10}{len(b.groups):>8}"
                          f"{b.c_identity:>12.4g}  {b.input_bn or '(fallback F.3)'}\n")
        if self.pinned:
            out.write(f"{line}\nPinned (not compressible)\n{line}\n")
            for p in self.pinned:
                out.write(f"{p.layer:<{w}}{p.reason}\n")
        out.write(line)
        print_fn(out.getvalue())


def _bn_rms(bn) -> float:
    """Σ_c sqrt(γ_c² + β_c²): the summed RMS of a BN's outputs under the surrogate."""
    gamma, beta, _, _, _ = bn_arrays(bn)
    return float(np.sqrt(gamma**2 + beta**2).sum())


def _c_identity(model, block, caches) -> float:
    if block.input_bn is not None:
        value = _bn_rms(model.get_layer(block.input_bn))
        if value > 0:
            return value
    # Appendix F.3 fallback: the block's initial internal capacity.
    return float(sum(caches[g].layer_capacity() for g in block.groups))


def _zero_variance_reason(state: LayerState) -> Optional[str]:
    bad = np.flatnonzero((state.var <= 0) & (state.gamma != 0))
    if bad.size:
        return (
            f"BatchNormalization '{state.group.bn}' has zero moving variance on "
            f"{bad.size} live channel(s) (first: {int(bad[0])}); the statistics look "
            "uncalibrated: re-estimate them with "
            "hope_keras.reestimate_batchnorm_statistics(model, data)"
        )
    return None


def analyze(model, kernel: str = "approx", verbose: bool = False) -> Analysis:
    """Finds every neuron HOPE can compress and scores it, data-free.

    Walks the model (`hope_keras.graph.walk`), folds each group's BatchNorm into
    effective neurons, and builds the capacity and pair tables (spec sections 1, 2
    and 5). The model is only read.

    Args:
        model: A built Functional or Sequential `keras.Model`.
        kernel: Cross-kernel: ``"approx"`` (the paper's, default) or ``"exact"``.
        verbose: Show a progress bar while the caches are built.

    Returns:
        An `Analysis` with ``groups``, ``blocks``, ``pinned`` and ``summary()``.

    Raises:
        ValueError: if the model has no compressible group, or a weight involved is
            NaN/Inf (the message names the layer).

    Example:

    >>> import keras, hope_keras
    >>> inputs = keras.Input((8,))
    >>> x = keras.layers.Dense(16, name="hidden")(inputs)
    >>> x = keras.layers.ReLU()(keras.layers.BatchNormalization()(x))
    >>> model = keras.Model(inputs, keras.layers.Dense(2)(x))
    >>> analysis = hope_keras.analyze(model)
    >>> [(g.name, g.size) for g in analysis.groups]
    [('hidden', 16)]
    """
    g = graph_lib.walk(model)
    pinned = list(g.pinned)
    states: Dict[str, LayerState] = {}
    groups: Dict[str, graph_lib.NeuronGroup] = {}
    for name, group in g.groups.items():
        state = extract_group(model, group)
        reason = _zero_variance_reason(state)
        if reason:
            pinned.append(graph_lib.Pinned(name, reason))
            continue
        states[name] = state
        groups[name] = group
    if not groups:
        reasons = "; ".join(f"'{p.layer}': {p.reason}" for p in pinned) or "no Dense/Conv layers"
        raise ValueError(
            f"Model '{model.name}' has no compressible neuron group (Dense/Conv → "
            f"BatchNormalization → ReLU → layer with a kernel). Pinned: {reasons}"
        )
    # Blocks whose groups were pinned after extraction are dropped.
    blocks = tuple(b for b in g.blocks if all(x in groups for x in b.groups))
    g = graph_lib.ModelGraph(groups=groups, blocks=blocks, pinned=tuple(pinned),
                             bn_after=g.bn_after)
    caches: Dict[str, GroupCache] = {}
    for name in progress(list(groups), verbose=verbose, what="cache"):
        caches[name] = build_group_cache(states[name], kernel=kernel)
    block_of = g.block_of_group()
    reports = [
        GroupReport(
            name=name, size=states[name].size, capacities=caches[name].capacity.copy(),
            p_init=states[name].p_init.copy(), layers=groups[name].layers,
            layer_capacity=caches[name].layer_capacity(), block=block_of.get(name),
        )
        for name in groups
    ]
    block_reports = [
        BlockReport(
            name=b.name, evictable=b.evictable, groups=b.groups, input_bn=b.input_bn,
            c_identity=_c_identity(model, b, caches),
            c_branch=_bn_rms(model.get_layer(b.final_bn)),
            p_init=eviction_p_init(model, b, groups),
        )
        for b in blocks
    ]
    return Analysis(model.name, reports, block_reports, pinned, g, states, caches)
