"""`hope_keras.analyze`: what HOPE sees in a model, without changing it."""

from __future__ import annotations

import dataclasses
import io
from typing import Dict, List, Optional, Tuple

import numpy as np

from hope_keras.graph import walker as graph_lib
from hope_keras.scoring import moments as moments_lib
from hope_keras.scoring import cache_builders
from hope_keras.scoring.cache import GroupCache, PruneCache
from hope_keras.scoring.cache_builders import build_group_cache
from hope_keras.graph import layers as layer_rules
from hope_keras.scoring.neurons import (LayerState, bn_arrays, coupled_capacity, eviction_p_init,
                                        extract_group)
from hope_keras.progress import progress, resolve_verbose
from hope_keras.graph.fingerprint import fingerprint


#: Values of each weight in `Analysis.fingerprint` (a full hash of ResNet-50 @224's
#: weights costs about 0.1 s, a third of `analyze`'s budget).
SIGNATURE_VALUES = 4096


@dataclasses.dataclass
class GroupReport:
    """One compressible group as `analyze` reports it.

    Attributes:
        name: Group name (its first writer's layer name).
        size: Number of channels.
        capacities: ‖f_i‖ of each channel (float64 array).
        p_init: Static parameter footprint of each channel.
        layers: The layers the group spans (writers, channelwise layers, readers).
        layer_capacity: Σ capacities.
        block: Name of the residual block that holds the group, if any.
        kind: ``"neurons"`` (mergeable) or ``"coupled"`` (pruned only).
        note: Why a ``"coupled"`` group is pruned only.
    """

    name: str
    size: int
    capacities: np.ndarray
    p_init: np.ndarray
    layers: Tuple[str, ...]
    layer_capacity: float
    block: Optional[str]
    kind: str = "neurons"
    note: str = ""

    def __repr__(self) -> str:  # the arrays are per channel: their sizes only
        block = f", block={self.block!r}" if self.block else ""
        return (f"GroupReport(name={self.name!r}, size={self.size}, kind={self.kind!r}, "
                f"layers={len(self.layers)}, layer_capacity={self.layer_capacity:.6g}{block})")


@dataclasses.dataclass
class BlockReport:
    """One residual block as `analyze` reports it.

    Attributes:
        name: The Add layer's name.
        evictable: True for identity-shortcut blocks.
        groups: Names of its internal groups.
        input_bn: The BN conditioning the block input (None: see ``c_identity``).
        c_identity: Σ_c sqrt(γ_c² + β_c²) over that BN; for a pre-activation block
            Σ_c sqrt(μ_c² + σ_c²) over the moving statistics of the BN that reads
            the block input; otherwise the appendix F.3 fallback (the block's
            initial internal capacity).
        c_branch: The summed RMS of the branch output: Σ_c sqrt(γ_c² + β_c²) over the
            branch's final BN, or from the propagated moments when the branch ends
            in a convolution, times the factor the sum applies to the branch (the
            default cost's eviction numerator).
        p_init: Static footprint of evicting the block.
        c_stream: The summed RMS of the stream the branch is added to, Σ_c
            sqrt(μ_c² + σ_c²) of the block input under the propagated moments (the
            default cost's eviction denominator; NaN where the moments do not reach
            the block input, and the cost falls back to ``c_identity``).
    """

    name: str
    evictable: bool
    groups: Tuple[str, ...]
    input_bn: Optional[str]
    c_identity: float
    c_branch: float
    p_init: float
    c_stream: float = float("nan")


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
        caches: The `GroupCache` (``"neurons"`` groups) or `PruneCache` per group.
        moments: Per-tensor ``(mean, variance)`` of the data-free moment
            propagation (`hope_keras.scoring.moments`).
        kernel: The cross-kernel its caches were built with (``analyze``'s).
        fingerprint: A signature of the weights it read (`SIGNATURE_VALUES` values of
            each, `hope_keras.graph.fingerprint.fingerprint`): `check` refuses a model
            whose weights changed since.
    """

    model_name: str
    groups: List[GroupReport]
    blocks: List[BlockReport]
    pinned: List[graph_lib.Pinned]
    graph: graph_lib.ModelGraph
    states: Dict[str, LayerState]
    caches: Dict[str, object]
    moments: Dict[str, tuple] = dataclasses.field(default_factory=dict, repr=False)
    fingerprint: str = dataclasses.field(default="", repr=False)
    kernel: str = "approx"

    def check(self, model) -> str:
        """Raises ValueError unless this is an analysis of `model` as it is now.

        Returns:
            The model's weight signature (see ``fingerprint``).
        """
        flat = getattr(self.graph, "flat", None)
        if flat is not None and flat.model is not model:
            raise ValueError(
                f"This analysis was made of another model object ('{self.model_name}'); "
                f"received model '{getattr(model, 'name', type(model).__name__)}'. Analyze "
                "the model you pass: hope_keras.analyze(model). Nothing was changed.")
        current = fingerprint(model, self.graph, sample=SIGNATURE_VALUES)
        if self.fingerprint and current != self.fingerprint:
            raise ValueError(
                f"Model '{model.name}' changed since this analysis was made (its weights "
                "differ from those `analyze` read, e.g. after an earlier compress of it): "
                "the analysis is stale. Analyze the model again, or leave analysis= out. "
                "Nothing was changed.")
        return current

    def __repr__(self) -> str:
        # One line whatever the model's size (the default repr printed every cache:
        # megabytes for a ResNet-50, the last line of a notebook cell); `summary`
        # gives the table.
        mergeable = sum(g.kind == "neurons" for g in self.groups)
        evictable = sum(b.evictable for b in self.blocks)
        return (f"Analysis(model_name={self.model_name!r}, groups={len(self.groups)} "
                f"({mergeable} mergeable), channels={self.num_neurons}, "
                f"blocks={len(self.blocks)} ({evictable} evictable), "
                f"pinned={len(self.pinned)})")

    @property
    def num_neurons(self) -> int:
        """Number of compressible channels (the denominator of neuron density)."""
        return int(sum(g.size for g in self.groups))

    def coverage(self) -> float:
        """Share of the hidden channels (outputs of Dense/Conv/SeparableConv layers
        that are not model outputs) that HOPE can remove."""
        sizes = {g.name: g.size for g in self.groups}
        n = sum(sizes[name] * len(grp.writers) for name, grp in self.graph.groups.items()
                if name in sizes)
        h = self.graph.hidden_channels
        return n / h if h else 0.0

    def summary(self, print_fn=print, max_pinned: int = 40, show_notes: bool = True) -> None:
        """Prints the groups, blocks and pinned layers, like `model.summary()`.

        Args:
            print_fn: Where to print.
            max_pinned: List at most this many pinned layers (the rest are counted).
            show_notes: Under each pruned-only group, say why it cannot merge.
        """
        out = io.StringIO()
        w = 34
        line = "─" * (w + 64)
        out.write(f'HOPE analysis of "{self.model_name}"\n{line}\n')
        out.write(f"{'Group (first writer)':<{w}}{'kind':>9}{'channels':>9}{'capacity':>12}"
                  f"{'mean P_init':>13}{'layers':>8}  block\n{line}\n")
        for g in self.groups:
            out.write(
                f"{g.name:<{w}}{g.kind:>9}{g.size:>9}{g.layer_capacity:>12.4g}"
                f"{g.p_init.mean():>13.1f}{len(g.layers):>8}  {g.block or ''}\n"
            )
            if g.note and show_notes:
                out.write(f"{'':<4}{_short(g.note, w + 60)}\n")
        # A coupled group's channel is written by several layers (a residual stream:
        # every block's last convolution): the coverage counts layer outputs.
        out.write(f"{line}\nCompressible channels: {self.num_neurons} in "
                  f"{len(self.groups)} groups, written by layers that hold "
                  f"{100 * self.coverage():.1f}% of the {self.graph.hidden_channels} hidden "
                  f"channels (the outputs of every Dense/Conv layer but the model's)\n")
        if self.blocks:
            out.write(f"{line}\n{'Residual block':<{w}}{'evictable':>10}{'groups':>8}"
                      f"{'C_identity':>12}{'C_stream':>12}{'C_branch':>12}  conditioning BN\n"
                      f"{line}\n")
            for b in self.blocks:
                out.write(f"{b.name:<{w}}{str(b.evictable):>10}{len(b.groups):>8}"
                          f"{b.c_identity:>12.4g}{b.c_stream:>12.4g}{b.c_branch:>12.4g}  "
                          f"{b.input_bn or '(see BlockReport.c_identity)'}\n")
        if self.pinned:
            out.write(f"{line}\nPinned (not compressible): {len(self.pinned)} layers\n{line}\n")
            for p in self.pinned[:max_pinned]:
                out.write(f"{p.layer:<{w}}{_short(p.reason)}\n")
            if len(self.pinned) > max_pinned:
                out.write(f"... and {len(self.pinned) - max_pinned} more "
                          "(Analysis.pinned lists them all)\n")
        out.write(line)
        print_fn(out.getvalue())

    def pinned_summary(self, limit: int = 5) -> str:
        """A short text naming the first pinned layers and their reasons."""
        parts = [f"'{p.layer}': {_short(p.reason, 120)}" for p in self.pinned[:limit]]
        more = len(self.pinned) - limit
        return "; ".join(parts) + (f"; and {more} more" if more > 0 else "")


def _short(text: str, limit: int = 160) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _bn_rms(bn) -> float:
    """Σ_c sqrt(γ_c² + β_c²): the summed RMS of a BN's outputs under the surrogate."""
    gamma, beta, _, _, _ = bn_arrays(bn)
    return float(np.sqrt(gamma**2 + beta**2).sum())


def _stream_rms(bn) -> float:
    """Σ_c sqrt(μ_c² + σ_c²): the summed RMS of a BN's *input*, read from its moving
    statistics (pre-activation layouts)."""
    _, _, mean, var, _ = bn_arrays(bn)
    return float(np.sqrt(mean**2 + var).sum())


def _c_identity(get, block, caches) -> float:
    if block.input_bn is not None:
        value = _bn_rms(get(block.input_bn))
        if value > 0:
            return value
    if block.input_reader_bn is not None:
        value = _stream_rms(get(block.input_reader_bn))
        if value > 0:
            return value
    # Appendix F.3 fallback: the block's initial internal capacity.
    return float(sum(caches[g].layer_capacity() for g in block.groups))


def _c_branch(graph, block, moments) -> float:
    """The branch's summed RMS as the sum adds it (times `ResidualBlock.branch_scale`)."""
    get = graph.layer
    if block.final_bn is not None:
        rms = _bn_rms(get(block.final_bn))
    else:
        rms = _moments_rms(moments, graph.flat.node_of(block.final_producer).outputs[0])
    return abs(block.branch_scale) * rms


def _moments_rms(moments, key) -> float:
    """Σ_c sqrt(μ_c² + σ_c²) of tensor `key` under the propagated moments."""
    mean, var = moments[key]
    return float(np.sqrt(np.asarray(mean) ** 2 + np.maximum(np.asarray(var), 0.0)).sum())


def _c_stream(block, moments) -> float:
    """Σ_c sqrt(μ_c² + σ_c²) of the block input (the stream the branch is added to)
    under the propagated moments; NaN when they do not reach it."""
    key = block.input_tensor
    if key is None or key not in moments:
        return float("nan")
    value = _moments_rms(moments, key)
    return value if np.isfinite(value) and value > 0 else float("nan")


def _zero_variance_reason(state: LayerState, get) -> Optional[str]:
    bns = [c for c in state.group.couplings if c.role == "channel"
           and layer_rules.get(get(c.layer)).normalization == "batch"]
    for c in bns:
        gamma, _, _, var, _ = bn_arrays(get(c.layer))
        idx = c.positions[:, 0]
        bad = np.flatnonzero((var[idx] <= 0) & (gamma[idx] != 0))
        if bad.size:
            return (
                f"BatchNormalization '{c.layer}' has zero moving variance on "
                f"{bad.size} live channel(s) (first: {int(bad[0])}); the statistics look "
                "uncalibrated: re-estimate them with "
                "hope_keras.reestimate_batchnorm_statistics(model, data)"
            )
    return None


def _uncalibrated_reason(group, anchored) -> Optional[str]:
    """Why a group cannot be scored data-free: a reader sees channels whose
    statistics no BatchNormalization (or LayerNormalization) describes."""
    if group.kind == "neurons":
        return None
    for c in group.readers:
        if not np.all(anchored[c.tensor][c.positions]):
            return ("no BatchNormalization describes its statistics (read by "
                    f"'{c.layer}'): insert them with hope_keras.calibrate(model, data) "
                    "(docs/theory.md §7)")
    return None


def analyze(model, kernel: str = "approx", verbose="auto") -> Analysis:
    """Finds every channel HOPE can compress and scores it, data-free.

    Walks the model (`hope_keras.graph.walker.walk`, nested models included), folds each
    group's BatchNorm into effective neurons, propagates the BN surrogate's moments
    through the graph (`hope_keras.scoring.moments`) and builds the capacity (and, for
    ``"neurons"`` groups, pair) tables (docs/theory.md §1 and §4). The model is only
    read, and any model `walk` can read is reported on: a layer that cannot be
    compressed (or has NaN weights, or uncalibrated BN statistics) is listed in
    ``pinned`` with the reason; `hope_keras.compress` is what refuses a model with
    nothing to compress.

    Args:
        model: A built Functional or Sequential `keras.Model`.
        kernel: Cross-kernel: ``"approx"`` (the paper's, default) or ``"exact"``.
        verbose: ``"auto"`` (default: a progress bar while the caches are built,
            when standard output is a terminal or a notebook), True or False.

    Returns:
        An `Analysis` with ``groups``, ``blocks``, ``pinned``, ``coverage()`` and
        ``summary()``.

    Raises:
        ValueError: for unbuilt models, and (`hope_keras.graph.tracing.TracingError`) for
            subclassed models whose `call` cannot be traced into a Functional model.

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
    if kernel not in ("approx", "exact"):
        raise ValueError(f"kernel must be 'approx' or 'exact'. Received: kernel={kernel!r}")
    g = graph_lib.walk(model)
    get = g.layer
    pinned = list(g.pinned)
    states: Dict[str, LayerState] = {}
    groups: Dict[str, graph_lib.NeuronGroup] = {}
    sketched: Dict[str, GroupCache] = {}
    for name, group in g.groups.items():
        try:
            if group.kind == "neurons" and group.readers and cache_builders.use_sketch(
                    *cache_builders.group_dims(get, group)):
                # Too wide for n × n tables: sketched, never held in float64.
                sketched[name], extras = cache_builders.build_sketch_cache(get, group, kernel)
                state = cache_builders.OnDemandState(g, group, extras)
            else:
                state = extract_group(model, group, graph=g)
        except ValueError as e:  # NaN/Inf weights, negative variances: reported
            pinned.append(graph_lib.Pinned(name, str(e)))
            continue
        reason = _zero_variance_reason(state, get)
        if reason:
            pinned.append(graph_lib.Pinned(name, reason))
            continue
        states[name] = state
        groups[name] = group
    anchored: Dict[str, np.ndarray] = {}
    moments = moments_lib.propagate(g.flat, anchored=anchored)
    for name in list(groups):
        reason = _uncalibrated_reason(groups[name], anchored)
        if reason:
            pinned.append(graph_lib.Pinned(name, reason))
            del groups[name], states[name]
    # Blocks whose groups were pinned after extraction are dropped.
    blocks = tuple(b for b in g.blocks if all(x in groups for x in b.groups))
    g = g.with_groups(groups, blocks=blocks, pinned=pinned)
    caches: Dict[str, object] = {}
    if resolve_verbose(verbose):
        print(f"Analyzing '{model.name}': pricing the neurons of {len(groups)} groups "
              "from their weights and BatchNormalization statistics.")
    for name in progress(list(groups), verbose=verbose, what="group"):
        if name in sketched:
            caches[name] = sketched[name]
        elif groups[name].kind == "neurons":
            caches[name] = build_group_cache(states[name], kernel=kernel)
        else:
            cap, second = coupled_capacity(get, groups[name], moments)
            unorm = np.sqrt(np.maximum(states[name].u_sq_norms(), 0.0))
            caches[name] = PruneCache(cap, second, unorm, np.full(cap.shape, np.nan))
    block_of = g.block_of_group()
    reports = [
        GroupReport(
            name=name, size=states[name].size, capacities=caches[name].capacity.copy(),
            p_init=states[name].p_init.copy(), layers=groups[name].layers,
            layer_capacity=caches[name].layer_capacity(), block=block_of.get(name),
            kind=groups[name].kind, note=groups[name].note,
        )
        for name in groups
    ]
    block_reports = [
        BlockReport(
            name=b.name, evictable=b.evictable, groups=b.groups, input_bn=b.input_bn,
            c_identity=_c_identity(get, b, caches),
            c_branch=_c_branch(g, b, moments),
            p_init=eviction_p_init(get, b, groups),
            c_stream=_c_stream(b, moments),
        )
        for b in blocks
    ]
    return Analysis(model.name, reports, block_reports, pinned, g, states, caches, moments,
                    fingerprint=fingerprint(model, g, sample=SIGNATURE_VALUES), kernel=kernel)
