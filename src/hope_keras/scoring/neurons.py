"""Effective (BatchNorm-folded) neurons of a group, read from a Keras model.

docs/theory.md §1: neuron ``i`` of a group is output channel ``i`` of the producer. Its
folded input vector is ``v_i = [w_eff,i ; b_i]`` with

    w_eff,i = (γ_i / s_i) · w_raw,i,     b_i = β_i − γ_i (μ_i − c_i) / s_i,

``s_i = sqrt(σ²_i + ε)``, and its output vector ``u_i`` is the concatenation of the
consumer kernel slices that read channel ``i``. This module only reads weights; the
consumer-slice helpers are shared with `hope_keras.edit` and `hope_keras.slim`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import List, Tuple

import numpy as np


from hope_keras.graph import layers as layer_rules
from hope_keras._host_buffers import read_values
from hope_keras.graph.blocks import ResidualBlock
from hope_keras.graph.walker import Consumer, Coupling, NeuronGroup


def _part(arr: np.ndarray, coupling, axis: int) -> np.ndarray:
    """`arr` at a writer coupling's positions on `axis`: itself (no copy) when the
    writer's group holds all its outputs, in order, as it does unless an Add split
    them."""
    if coupling.in_order and len(coupling.positions) == arr.shape[axis]:
        return arr
    return np.take(arr, coupling.positions[:, 0], axis=axis)


def _np(variable) -> np.ndarray:
    return np.asarray(variable.numpy() if hasattr(variable, "numpy") else variable)


# `_np` without the copy where TensorFlow allows: for reads copied or reduced at
# once, never kept (the editor writes the variables in place).
_read = read_values


def consumer_rows(kernel: np.ndarray, kind: str, channels: int) -> np.ndarray:
    """Returns a consumer kernel as ``(channels, m)`` rows, one per input channel.

    For a conv kernel ``(*spatial, C, out)`` row ``c`` is ``kernel[..., c, :]``
    flattened (a transposed convolution's ``(*spatial, out, C)``: ``kernel[..., c]``,
    spatial axes first). For a Dense kernel ``(S·C, units)`` (``S = 1`` without a Flatten) row
    ``c`` gathers the kernel rows ``c, c + C, c + 2C, …`` (channel-last Flatten order).

    Example:

    >>> import numpy as np
    >>> k = np.arange(12.0).reshape(6, 2)        # Flatten of 3 positions × 2 channels
    >>> consumer_rows(k, "dense", 2)[0].tolist()   # rows 0, 2, 4
    [0.0, 1.0, 4.0, 5.0, 8.0, 9.0]
    """
    if kind in ("conv", "transpose"):
        return np.moveaxis(kernel, -2 if kind == "conv" else -1, 0).reshape(channels, -1)
    s = kernel.shape[0] // channels
    return kernel.reshape(s, channels, -1).transpose(1, 0, 2).reshape(channels, -1)


def rows_to_kernel(rows: np.ndarray, kind: str, shape: Tuple[int, ...]) -> np.ndarray:
    """Inverse of `consumer_rows`: rebuilds a kernel of `shape` from its rows."""
    channels = rows.shape[0]
    if kind in ("conv", "transpose"):
        kept = -1 if kind == "conv" else -2  # the output axis
        moved = rows.reshape((channels,) + tuple(shape[:-2]) + (shape[kept],))
        return np.moveaxis(moved, 0, -2 if kind == "conv" else -1)
    s = shape[0] // channels
    return rows.reshape(channels, s, -1).transpose(1, 0, 2).reshape(shape)


#: ``"neurons"`` groups at least this wide keep their output vectors ``u`` in the
#: readers' dtype: `hope_keras.scoring.cache_builders.build_group_cache` rounds them to float32 for its
#: Gram product there (`hope_keras.scoring.cache.FLOAT32_WIDTH`, the same width), and a float64
#: copy of a 4096 × 4096 reader is 128 MB of fresh memory, what a cold `analyze` pays
#: most for on a virtual machine (measured with `benchmarks/scale.py vgg16`).
NATIVE_U_WIDTH = 2048


@dataclasses.dataclass
class LayerState:
    """The arrays of one neuron group, float64, one row per neuron.

    Attributes:
        group: The `NeuronGroup` these arrays describe.
        w_raw: Producer filters, ``(n, d)``: of a ``"neurons"`` group in the
            producer kernel's dtype (`w_eff` and `v`, computed in float64 from it,
            hold the same values as from a float64 copy).
        bias: Producer bias ``c``, ``(n,)`` (zeros when the producer has none).
        gamma, beta, mean, var: BN scale, shift, moving mean and variance, ``(n,)``.
        eps: BN epsilon.
        u: Output vectors, ``(n, m)``: consumer slices concatenated; float64, or in
            the readers' dtype for a ``"neurons"`` group of `NATIVE_U_WIDTH` neurons
            or more (whose Gram products are float32: `hope_keras.scoring.cache`).
        u_split: Column offsets of each consumer's slice in ``u``.
        p_init: Static parameter footprint of each neuron (docs/theory.md §3).
    """

    group: NeuronGroup
    w_raw: np.ndarray
    bias: np.ndarray
    gamma: np.ndarray
    beta: np.ndarray
    mean: np.ndarray
    var: np.ndarray
    eps: float
    u: np.ndarray
    u_split: List[int]
    p_init: np.ndarray

    @property
    def size(self) -> int:
        return self.w_raw.shape[0]

    @property
    def scale(self) -> np.ndarray:
        """γ / sqrt(σ² + ε), the BN fold factor."""
        return self.gamma / np.sqrt(self.var + self.eps)

    @property
    def w_eff(self) -> np.ndarray:
        return self.scale[:, None] * self.w_raw

    @property
    def b_eff(self) -> np.ndarray:
        return self.beta - self.scale * (self.mean - self.bias)

    @property
    def v(self) -> np.ndarray:
        """Augmented folded input vectors ``[w_eff ; b]``, ``(n, d + 1)``."""
        return np.concatenate([self.w_eff, self.b_eff[:, None]], axis=1)

    def u_sq_norms(self) -> np.ndarray:
        """``‖u_i‖²`` of each neuron (float64)."""
        u = np.asarray(self.u, dtype=np.float64)
        return np.einsum("ij,ij->i", u, u)


def check_finite(layer_name: str, what: str, array: np.ndarray) -> None:
    # One float64 sum first (no boolean array of the weights' size): NaN or Inf
    # anywhere makes it NaN or ±Inf; a finite sum means every value is finite.
    with np.errstate(over="ignore", invalid="ignore"):  # float64 weights near 1e308
        if np.isfinite(np.sum(array, dtype=np.float64)):
            return
    if not np.all(np.isfinite(array)):
        bad = int(np.size(array) - np.count_nonzero(np.isfinite(array)))
        raise ValueError(
            f"Layer '{layer_name}' has {bad} NaN/Inf value(s) in its {what}. "
            "hope_keras cannot score such a layer: fix or re-train the weights first."
        )


def bn_arrays(bn) -> Tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, float]:
    """Returns ``(γ, β, moving mean, moving variance, ε)`` of a BN layer as float64.

    ``scale=False`` gives γ = 1 and ``center=False`` gives β = 0.
    """
    mean = _np(bn.moving_mean).astype(np.float64)
    var = _np(bn.moving_variance).astype(np.float64)
    gamma = _np(bn.gamma).astype(np.float64) if bn.scale else np.ones_like(mean)
    beta = _np(bn.beta).astype(np.float64) if bn.center else np.zeros_like(mean)
    for what, arr in (("gamma", gamma), ("beta", beta), ("moving mean", mean),
                      ("moving variance", var)):
        check_finite(bn.name, what, arr)
    if np.any(var < 0):
        raise ValueError(
            f"BatchNormalization '{bn.name}' has a negative moving variance "
            f"(min {var.min():.3g}); re-estimate its statistics."
        )
    return gamma, beta, mean, var, float(bn.epsilon)


def producer_arrays(layer, native: bool = False) -> Tuple[np.ndarray, np.ndarray]:
    """Returns the producer's filters ``(n, d)`` and bias ``(n,)`` as float64 (the
    filters a copy in the kernel's own dtype with ``native=True``)."""
    # native: half the bytes of a float64 copy for a float32 kernel; ResNet-50's
    # analyze spent a fifth of its time writing fresh float64 copies of its kernels.
    kernel = np.array(_read(layer.kernel)) if native else _read(layer.kernel).astype(np.float64)
    check_finite(layer.name, "kernel", kernel)
    kernel = np.moveaxis(kernel, layer_rules.output_axis(layer), -1)
    n = kernel.shape[-1]
    w = kernel.reshape(-1, n).T
    if getattr(layer, "use_bias", False) and layer.bias is not None:
        bias = _read(layer.bias).astype(np.float64)
        check_finite(layer.name, "bias", bias)
    else:
        bias = np.zeros(n)
    return w, bias


def reader_slices(layer, positions: np.ndarray, native: bool = False) -> List[np.ndarray]:
    """A reader's weights for each channel: one ``(n, m)`` array per in-weight.

    ``positions`` is the reader coupling's ``(n, k)`` array of input positions; row
    ``c`` gathers every weight the reader applies to those positions (for a Dense
    after a Flatten, the rows ``c, c + C, …``; for a convolution, ``kernel[..., c, :]``).
    float64, or the weights' own dtype with ``native=True``.
    """
    rule = layer_rules.get(layer)
    out = []
    n = positions.shape[0]
    for w in rule.in_weights(layer):
        var = getattr(layer, w.attr, None)
        if var is None:
            continue
        arr = _read(var)  # gathered in its own dtype, then one float64 copy (exact)
        check_finite(layer.name, w.attr, arr)
        idx = positions if w.expand == 1 else (
            positions[..., None] * w.expand + np.arange(w.expand)).reshape(n, -1)
        flat = idx.reshape(-1)
        whole = flat.size == arr.shape[w.axis] and np.array_equal(flat, np.arange(flat.size))
        # Every channel in order: no gather copy (then copied below: no view of the
        # variable's buffer is kept).
        taken = np.moveaxis(arr if whole else np.take(arr, flat, axis=w.axis), w.axis, 0)
        if not native:
            taken = taken.astype(np.float64, order="C")
        elif whole:
            taken = np.array(taken, order="C")
        out.append(np.ascontiguousarray(taken).reshape(n, -1))
    return out


def consumer_u(model, consumers: Tuple[Consumer, ...], channels: int, positions=None):
    """Concatenated output vectors ``(channels, m)`` and the consumers' column splits.

    ``positions`` maps a consumer name to its ``(channels, k)`` input positions
    (default: the channel-last Flatten interleaving of `consumer_rows`).
    """
    parts, split = [], [0]
    for c in consumers:
        layer = model.get_layer(c.layer)
        if positions is not None and c.layer in positions:
            rows = np.concatenate(reader_slices(layer, positions[c.layer]), axis=1)
        else:
            kernel = _read(layer.kernel).astype(np.float64)
            check_finite(c.layer, "kernel", kernel)
            rows = consumer_rows(kernel, c.kind, channels)
        parts.append(rows)
        split.append(split[-1] + rows.shape[1])
    return np.concatenate(parts, axis=1), split


def _lookup(model, graph):
    if graph is not None and getattr(graph, "flat", None) is not None:
        return graph.layer
    return model.get_layer


def extract_group(model, group: NeuronGroup, graph=None) -> LayerState:
    """Reads one group's effective neurons from the model (never modifies it).

    For a ``"neurons"`` group these are the paper's arrays (BN-folded producer
    filters, consumer slices, ``P_init``). For a ``"coupled"`` group, ``w_raw``
    concatenates every writer's filter, ``gamma``/``beta``/``mean``/``var`` are
    those of its first BatchNormalization (ones and zeros without one), ``u``
    concatenates every reader's slices, and ``p_init`` counts the non-zero weights
    of every coupled slice (4 per BatchNormalization channel).

    Example:

    >>> import keras
    >>> from hope_keras.graph.walker import walk
    >>> inputs = keras.Input((8,))
    >>> x = keras.layers.Dense(16)(inputs)
    >>> x = keras.layers.ReLU()(keras.layers.BatchNormalization()(x))
    >>> model = keras.Model(inputs, keras.layers.Dense(2)(x))
    >>> group = next(iter(walk(model).groups.values()))
    >>> state = extract_group(model, group)
    >>> state.v.shape, state.u.shape, int(state.p_init[0])
    ((16, 9), (16, 2), 15)
    """
    get = _lookup(model, graph)
    if group.kind == "neurons":
        producer = get(group.producer)
        w_raw, bias = producer_arrays(producer, native=True)
        gamma, beta, mean, var, eps = bn_arrays(get(group.bn))
        n = w_raw.shape[0]
        positions = {c.layer: c.positions for c in group.readers}
        u, split = _reader_u(get, group, positions, native=n >= NATIVE_U_WIDTH) \
            if positions else consumer_u(_Getter(get), group.consumers, n)
        has_bias = 1 if getattr(producer, "use_bias", False) else 0
        p_init = (
            np.count_nonzero(w_raw, axis=1) + has_bias + np.count_nonzero(u, axis=1) + 4
        ).astype(np.float64)
        return LayerState(group, w_raw, bias, gamma, beta, mean, var, eps, u, split, p_init)
    return _extract_coupled(get, group)


class _Getter:
    def __init__(self, get):
        self.get_layer = get


def _columns(arrays):
    """``np.concatenate(arrays, axis=1)``, without a copy of a single array (a
    ResNet-50 reads 100 MB of kernels: each float64 copy of them is time)."""
    return arrays[0] if len(arrays) == 1 else np.concatenate(arrays, axis=1)


def _reader_u(get, group, positions, native: bool = False):
    parts, split = [], [0]
    for c in group.consumers:
        rows = _columns(reader_slices(get(c.layer), positions[c.layer], native=native))
        parts.append(rows)
        split.append(split[-1] + rows.shape[1])
    return _columns(parts), split


class CoupledState(LayerState):
    """The `LayerState` of a ``"coupled"`` group. Its float64 ``w_raw`` and ``u``
    (every writer's filters, every reader's slices: on a residual stream the
    largest arrays of a network) are built on first access from the weights as
    read at extraction; `analyze` needs only their non-zero counts and row norms."""

    def __init__(self, group, filters, bias, gamma, beta, mean, var, eps, parts, split,
                 p_init):  # noqa: D107 - not the dataclass init
        self.group, self.bias, self.eps = group, bias, eps
        self.gamma, self.beta, self.mean, self.var = gamma, beta, mean, var
        self.u_split, self.p_init = split, p_init
        self._filters, self._parts = filters, parts  # (n, ·) arrays in their own dtype

    @property
    def size(self) -> int:
        return self.group.size

    @staticmethod
    def _joined(arrays, n, rows=slice(None)):
        if not arrays:
            return np.zeros((n, 0))[rows]
        return np.concatenate([a[rows].astype(np.float64) for a in arrays], axis=1)

    @functools.cached_property
    def w_raw(self) -> np.ndarray:
        return self._joined(self._filters, self.size)

    @functools.cached_property
    def u(self) -> np.ndarray:
        return self._joined(self._parts, self.size)

    def u_sq_norms(self) -> np.ndarray:
        if "u" in self.__dict__:
            return super().u_sq_norms()
        out = np.empty(self.size)
        for start in range(0, self.size, 256):  # row blocks: no full float64 copy
            rows = slice(start, min(self.size, start + 256))
            block = self._joined(self._parts, self.size, rows)
            out[rows] = np.einsum("ij,ij->i", block, block)
        return out

    def __repr__(self) -> str:
        return f"CoupledState(group={self.group.name!r}, size={self.size})"


def _extract_coupled(get, group: NeuronGroup) -> LayerState:
    n = group.size
    filters, p_init = [], np.zeros(n)
    bias = np.zeros(n)
    parts = []  # each reader coupling's slices, read once (p_init, then u)
    for c in group.couplings:
        layer = get(c.layer)
        rule = layer_rules.get(layer)
        if c.role == "out":
            for w in rule.out_weights(layer):
                arr = _np(getattr(layer, w.attr))
                check_finite(layer.name, w.attr, arr)
                cols = np.moveaxis(arr, w.axis, 0).reshape(arr.shape[w.axis], -1)
                cols = _part(cols, c, 0)  # the group's part of its outputs
                p_init += np.count_nonzero(cols, axis=1)
                if w.attr == "bias":
                    bias = bias + cols[:, 0].astype(np.float64)
                else:
                    filters.append(cols)
        elif c.role == "channel":
            for w in rule.channel_weights(layer):
                arr = _np(getattr(layer, w.attr))
                check_finite(layer.name, w.attr, arr)
                p_init += np.take(arr, c.positions[:, :1].reshape(-1), axis=w.axis).reshape(
                    n, -1).shape[1]
        else:
            for rows in reader_slices(layer, c.positions, native=True):
                p_init += np.count_nonzero(rows, axis=1)
                parts.append((c, rows))
    bn_coupling = next((c for c in group.couplings if c.role == "channel"
                        and layer_rules.get(get(c.layer)).normalization == "batch"), None)
    if bn_coupling is not None:
        idx = bn_coupling.positions[:, 0]
        gamma, beta, mean, var, eps = (a[idx] if isinstance(a, np.ndarray) else a
                                       for a in bn_arrays(get(bn_coupling.layer)))
    else:
        gamma, beta, mean, var, eps = np.ones(n), np.zeros(n), np.zeros(n), np.ones(n), 0.0
    split = [0]
    for c in group.readers:  # one split per reader coupling (all its in-weights)
        split.append(split[-1] + sum(rows.shape[1] for r, rows in parts if r is c))
    return CoupledState(group, filters, bias, gamma, beta, mean, var, float(eps),
                        [rows for _, rows in parts], split, p_init.astype(np.float64))


def coupled_capacity(get, group: NeuronGroup, moments) -> Tuple[np.ndarray, np.ndarray]:
    """``(capacity, second moment)`` of each channel of a group from its readers.

    ``‖f_c‖² = Σ_readers Σ_positions ‖w_p‖² · E[x_p²]``: every reader's weights on the
    channel's positions, times the channel's second moment there (`moments`, the
    data-free propagation of `hope_keras.scoring.moments.propagate`). A separable reader's
    gain is its depthwise norm times its pointwise norm. The second moment returned
    is the capacity-weighted mean ``E[x²]`` over the readers.
    """
    n = group.size
    cap2 = np.zeros(n)
    unorm2 = np.zeros(n)
    for c in group.readers:
        layer = get(c.layer)
        mean, var = moments[c.tensor]
        s2 = (var + mean * mean)[c.positions]  # (n, k)
        gain = np.ones(c.positions.shape)
        for rows in reader_slices(layer, c.positions):
            per = (rows ** 2).reshape(n, c.positions.shape[1], -1).sum(axis=2)
            gain = gain * per
        gain = gain * layer_rules.taps_per_output(layer)
        cap2 += (gain * s2).sum(axis=1)
        unorm2 += gain.sum(axis=1)
    second = np.where(unorm2 > 0, cap2 / np.where(unorm2 > 0, unorm2, 1.0), 0.0)
    return np.sqrt(cap2), second


def reader_means(get, coupling: Coupling, moments) -> np.ndarray:
    """``(n, out)``: what each channel adds on average to each of the reader's
    outputs (its weights times the channel's mean), for mean compensation."""
    layer = get(coupling.layer)
    rule = layer_rules.get(layer)
    mean, _ = moments[coupling.tensor]
    m = mean[coupling.positions]  # (n, k)
    n, k = coupling.positions.shape
    weights = rule.in_weights(layer)
    if getattr(rule, "kind", "") == "separable":
        dw = np.take(_np(layer.depthwise_kernel).astype(np.float64),
                     coupling.positions.reshape(-1), axis=-2)  # (*ks, n·k, mult)
        gain = np.moveaxis(dw, -2, 0).reshape(n * k, -1, dw.shape[-1]).sum(axis=1)
        pw = _np(layer.pointwise_kernel).astype(np.float64)
        pw = pw.reshape(-1, pw.shape[-1])  # rows c·mult + j
        mult = dw.shape[-1]
        rows = pw.reshape(-1, mult, pw.shape[-1])[coupling.positions.reshape(-1)]
        out = np.einsum("pj,pjo->po", gain, rows).reshape(n, k, -1)
        return (out * m[:, :, None]).sum(axis=1)
    w = weights[0]
    arr = _np(getattr(layer, w.attr)).astype(np.float64)
    moved = np.moveaxis(np.take(arr, coupling.positions.reshape(-1), axis=w.axis), w.axis, 0)
    rows = moved.reshape(n, k, -1, moved.shape[-1]).sum(axis=2)  # (n, k, outputs)
    return layer_rules.taps_per_output(layer) * (rows * m[:, :, None]).sum(axis=1)


def eviction_p_init(get, block: ResidualBlock, groups) -> float:
    """Static footprint of evicting a block (docs/theory.md §3, appendix B.2.2).

    Non-zero weights (kernels and biases) of the block's internal producers plus
    4 × the channels of every BN in the block, the final BN included. The final
    producer's kernel is not counted. ``get`` looks a layer up by key.
    """
    total = 0
    bns = []
    for g in block.groups:
        grp = groups[g]
        for c in grp.couplings:
            layer = get(c.layer)
            if c.role == "out":
                for w in layer_rules.get(layer).out_weights(layer):
                    total += np.count_nonzero(_part(_np(getattr(layer, w.attr)), c,
                                                    w.axis))
            elif c.role == "channel" and layer_rules.get(layer).normalization == "batch":
                bns.append(layer)
    if block.final_bn is not None:
        bns.append(get(block.final_bn))
    for bn in bns:
        total += 4 * int(_np(bn.moving_mean).shape[0])
    return float(total)
