"""Effective (BatchNorm-folded) neurons of a group, read from a Keras model.

Spec section 1: neuron ``i`` of a group is output channel ``i`` of the producer. Its
folded input vector is ``v_i = [w_eff,i ; b_i]`` with

    w_eff,i = (γ_i / s_i) · w_raw,i,     b_i = β_i − γ_i (μ_i − c_i) / s_i,

``s_i = sqrt(σ²_i + ε)``, and its output vector ``u_i`` is the concatenation of the
consumer kernel slices that read channel ``i``. This module only reads weights; the
consumer-slice helpers are shared with `hope_keras.edit` and `hope_keras.slim`.
"""

from __future__ import annotations

import dataclasses
from typing import List, Tuple

import numpy as np

from hope_keras.graph import Consumer, NeuronGroup, ResidualBlock


def _np(variable) -> np.ndarray:
    return np.asarray(variable.numpy() if hasattr(variable, "numpy") else variable)


def consumer_rows(kernel: np.ndarray, kind: str, channels: int) -> np.ndarray:
    """Returns a consumer kernel as ``(channels, m)`` rows, one per input channel.

    For a conv kernel ``(*spatial, C, out)`` row ``c`` is ``kernel[..., c, :]``
    flattened. For a Dense kernel ``(S·C, units)`` (``S = 1`` without a Flatten) row
    ``c`` gathers the kernel rows ``c, c + C, c + 2C, …`` (channel-last Flatten order).

    Example:

    >>> import numpy as np
    >>> k = np.arange(12.0).reshape(6, 2)        # Flatten of 3 positions × 2 channels
    >>> consumer_rows(k, "dense", 2)[0].tolist()   # rows 0, 2, 4
    [0.0, 1.0, 4.0, 5.0, 8.0, 9.0]
    """
    if kind == "conv":
        return np.moveaxis(kernel, -2, 0).reshape(channels, -1)
    s = kernel.shape[0] // channels
    return kernel.reshape(s, channels, -1).transpose(1, 0, 2).reshape(channels, -1)


def rows_to_kernel(rows: np.ndarray, kind: str, shape: Tuple[int, ...]) -> np.ndarray:
    """Inverse of `consumer_rows`: rebuilds a kernel of `shape` from its rows."""
    channels = rows.shape[0]
    if kind == "conv":
        moved = rows.reshape((channels,) + tuple(shape[:-2]) + (shape[-1],))
        return np.moveaxis(moved, 0, -2)
    s = shape[0] // channels
    return rows.reshape(channels, s, -1).transpose(1, 0, 2).reshape(shape)


@dataclasses.dataclass
class LayerState:
    """The arrays of one neuron group, float64, one row per neuron.

    Attributes:
        group: The `NeuronGroup` these arrays describe.
        w_raw: Producer filters, ``(n, d)``.
        bias: Producer bias ``c``, ``(n,)`` (zeros when the producer has none).
        gamma, beta, mean, var: BN scale, shift, moving mean and variance, ``(n,)``.
        eps: BN epsilon.
        u: Output vectors, ``(n, m)``: consumer slices concatenated.
        u_split: Column offsets of each consumer's slice in ``u``.
        p_init: Static parameter footprint of each neuron (spec section 4).
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


def _check_finite(layer_name: str, what: str, array: np.ndarray) -> None:
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
        _check_finite(bn.name, what, arr)
    if np.any(var < 0):
        raise ValueError(
            f"BatchNormalization '{bn.name}' has a negative moving variance "
            f"(min {var.min():.3g}); re-estimate its statistics."
        )
    return gamma, beta, mean, var, float(bn.epsilon)


def producer_arrays(layer) -> Tuple[np.ndarray, np.ndarray]:
    """Returns the producer's filters ``(n, d)`` and bias ``(n,)`` as float64."""
    kernel = _np(layer.kernel).astype(np.float64)
    _check_finite(layer.name, "kernel", kernel)
    n = kernel.shape[-1]
    w = kernel.reshape(-1, n).T
    if getattr(layer, "use_bias", False) and layer.bias is not None:
        bias = _np(layer.bias).astype(np.float64)
        _check_finite(layer.name, "bias", bias)
    else:
        bias = np.zeros(n)
    return w, bias


def consumer_u(model, consumers: Tuple[Consumer, ...], channels: int):
    """Concatenated output vectors ``(channels, m)`` and the consumers' column splits."""
    parts, split = [], [0]
    for c in consumers:
        layer = model.get_layer(c.layer)
        kernel = _np(layer.kernel).astype(np.float64)
        _check_finite(c.layer, "kernel", kernel)
        rows = consumer_rows(kernel, c.kind, channels)
        parts.append(rows)
        split.append(split[-1] + rows.shape[1])
    return np.concatenate(parts, axis=1), split


def extract_group(model, group: NeuronGroup) -> LayerState:
    """Reads one group's effective neurons from the model (never modifies it).

    Example:

    >>> import keras
    >>> from hope_keras.graph import walk
    >>> inputs = keras.Input((8,))
    >>> x = keras.layers.Dense(16)(inputs)
    >>> x = keras.layers.ReLU()(keras.layers.BatchNormalization()(x))
    >>> model = keras.Model(inputs, keras.layers.Dense(2)(x))
    >>> group = next(iter(walk(model).groups.values()))
    >>> state = extract_group(model, group)
    >>> state.v.shape, state.u.shape, int(state.p_init[0])
    ((16, 9), (16, 2), 15)
    """
    producer = model.get_layer(group.producer)
    w_raw, bias = producer_arrays(producer)
    gamma, beta, mean, var, eps = bn_arrays(model.get_layer(group.bn))
    n = w_raw.shape[0]
    u, split = consumer_u(model, group.consumers, n)
    has_bias = 1 if getattr(producer, "use_bias", False) else 0
    p_init = (
        np.count_nonzero(w_raw, axis=1) + has_bias + np.count_nonzero(u, axis=1) + 4
    ).astype(np.float64)
    return LayerState(group, w_raw, bias, gamma, beta, mean, var, eps, u, split, p_init)


def eviction_p_init(model, block: ResidualBlock, groups) -> float:
    """Static footprint of evicting a block (spec section 4, appendix B.2.2).

    Non-zero weights (kernels and biases) of the block's internal producers plus
    4 × the channels of every BN in the block, the final BN included. The final
    producer's kernel is not counted.
    """
    total = 0
    bn_names = [groups[g].bn for g in block.groups] + [block.final_bn]
    for g in block.groups:
        layer = model.get_layer(groups[g].producer)
        total += np.count_nonzero(_np(layer.kernel))
        if getattr(layer, "use_bias", False) and layer.bias is not None:
            total += np.count_nonzero(_np(layer.bias))
    for name in bn_names:
        total += 4 * int(_np(model.get_layer(name).moving_mean).shape[0])
    return float(total)
