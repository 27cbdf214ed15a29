"""Data-free first and second moments of every channel (the BN surrogate, propagated).

HOPE's surrogate reads each BatchNormalization output as Gaussian with mean β and
standard deviation |γ| (docs/theory.md §1). `propagate` carries that per-channel
description through the whole graph, call by call, so that a channel can be scored
where it is read — after an activation, a residual ``Add``, a pooling or a
depthwise convolution — and so that a removed channel's mean can be moved into its
readers' biases (mean compensation):

* BatchNormalization: mean β, variance γ² (whatever its input; the surrogate).
* LayerNormalization: the same per channel (β, γ²).
* an elementwise activation ψ: the Gaussian moments ``E[ψ(z)]``, ``E[ψ(z)²]`` of
  ``z ~ N(mean, variance)`` (`hope_keras.activations`; carried unchanged for an
  activation it does not know, such as PReLU).
* sources (Dense, ConvND, ...) and depthwise convolutions: linear maps of
  independent inputs, ``mean = Σ w·mean_in + b``, ``variance = Σ w²·variance_in``.
* Add / Subtract / Average: sums of means and variances (independent inputs);
  Multiply: products of means and second moments.
* pooling, padding, dropout, Flatten, Reshape, Concatenate: carried unchanged.
* model inputs and layers the registry does not know: mean 0, variance 1 (also a
  layer whose moments fail to compute, with an `UnknownMomentsWarning`).

Everything is float64 numpy, one array per tensor, over the tensor's channel
positions.
"""

from __future__ import annotations

import warnings
from typing import Dict, Tuple

import numpy as np

from hope_keras.graph import layers as layer_rules
from hope_keras.graph import operation_rules
from hope_keras._host_buffers import read_values
from hope_keras import activations as acts

__all__ = ["propagate", "activation_moments"]

Moments = Tuple[np.ndarray, np.ndarray]  # (mean, variance) per channel position


def _np(v) -> np.ndarray:
    """A variable's values in float64 (read through `read_values`: no float32 copy
    first; read-only when the variable is float64 already)."""
    return np.asarray(read_values(v) if hasattr(v, "numpy") else v, dtype=np.float64)


def activation_moments(activation, mean, var):
    """``(E[ψ(z)], Var[ψ(z)])`` for ``z ~ N(mean, var)``; ψ a Keras activation
    (name, callable or activation layer).

    Example:

    >>> import numpy as np
    >>> m, v = activation_moments("relu", np.array([0.0]), np.array([1.0]))
    >>> round(float(m[0]), 6), round(float(v[0] + m[0] ** 2), 6)
    (0.398942, 0.5)
    """
    mean = np.asarray(mean, dtype=np.float64)
    std = np.sqrt(np.maximum(np.asarray(var, dtype=np.float64), 0.0))
    spec = _gaussian_spec(activation)
    if spec is None:
        return mean, std ** 2  # unknown activation: carried unchanged
    m1 = np.asarray(spec.mean(mean, std), dtype=np.float64)
    m2 = np.asarray(spec.second_moment(mean, std), dtype=np.float64)
    return m1, np.maximum(m2 - m1 * m1, 0.0)


def _gaussian_spec(activation):
    """The `hope_keras.activations.GaussianActivation` of a Keras activation (name,
    callable or activation layer), or None when it has none (moments then pass
    through unchanged)."""
    try:
        return acts.get(activation)  # a layer too: the activation its rule names
    except ValueError:  # UnsupportedActivationError: PReLU, softmax, unknown functions
        return None


# Rows of a Dense kernel converted to float64 at a time (`_linear_source`).
_DENSE_ROWS = 1024


def _linear_source(layer, rule, mean, var):
    """Moments of a source's (pre-activation) output from independent inputs."""
    kind = getattr(rule, "kind", "conv")
    if kind == "separable":
        dk = _np(layer.depthwise_kernel)  # (*k, C, m)
        m_ = dk.shape[-1]
        dm = (mean[:, None] * dk.reshape(-1, *dk.shape[-2:]).sum(0)).reshape(-1)
        dv = (var[:, None] * (dk.reshape(-1, *dk.shape[-2:]) ** 2).sum(0)).reshape(-1)
        pk = _np(layer.pointwise_kernel).reshape(-1, _np(layer.pointwise_kernel).shape[-1])
        mean, var = dm, dv
        w_sum, w_sq = pk, pk ** 2
        del m_
    elif kind == "dense":
        # Row blocks of the float32 kernel in float64: a wide Dense's float64 kernel
        # and its square would be 16 bytes per weight at once (1 GB at 8192²).
        kernel = read_values(layer.kernel)  # no copy where TensorFlow allows
        w = kernel.reshape(-1, kernel.shape[-1])
        if w.shape[0] != mean.shape[0]:  # a shape we cannot map: unknown
            return np.zeros(w.shape[1]), np.ones(w.shape[1])
        m, v = np.zeros(w.shape[1]), np.zeros(w.shape[1])
        for s in range(0, w.shape[0], _DENSE_ROWS):
            block = np.asarray(w[s:s + _DENSE_ROWS], dtype=np.float64)
            m += mean[s:s + _DENSE_ROWS] @ block
            v += var[s:s + _DENSE_ROWS] @ (block * block)
        return _with_bias(layer, m, v)
    else:
        kernel = read_values(layer.kernel)  # no copy where TensorFlow allows
        if kind == "transpose":  # (*k, out, in): as (*k, in, out)
            kernel = np.swapaxes(kernel, -1, -2)
        n_out = kernel.shape[-1]
        k = kernel.reshape(-1, kernel.shape[-2], n_out)
        # Summed over the kernel's positions one (C_in, C_out) slice at a time in
        # float64, in the order k.sum(0) adds them (the same values): no float64 copy
        # of the kernel and its square (ResNet-50: 400 MB of fresh memory).
        w_sum = k[0].astype(np.float64)  # a fresh array: summed into in place
        w_sq = w_sum * w_sum
        for pos in range(1, k.shape[0]):
            block = k[pos].astype(np.float64)
            w_sum += block
            w_sq += block * block
    if w_sum.shape[0] != mean.shape[0]:  # a shape we cannot map: unknown
        n = w_sum.shape[1]
        return np.zeros(n), np.ones(n)
    # A transposed convolution's output position receives a fraction of the taps.
    taps = layer_rules.taps_per_output(layer)
    return _with_bias(layer, taps * (mean @ w_sum), taps * (var @ w_sq))


def _with_bias(layer, m, v):
    if getattr(layer, "use_bias", False) and getattr(layer, "bias", None) is not None:
        m = m + _np(layer.bias)
    return m, np.maximum(v, 0.0)


def _channelwise(node, rule, layer, m, v) -> Moments:
    if rule.normalization == "batch":
        gamma = _np(layer.gamma) if layer.scale else np.ones_like(m)
        beta = _np(layer.beta) if layer.center else np.zeros_like(m)
        return beta.copy(), gamma ** 2
    if rule.depthwise:  # DepthwiseConvND, or a ConvND with groups = C
        k = rule.kernel_2d(layer)
        m2, v2 = m * k.sum(0), v * (k ** 2).sum(0)
        if getattr(layer, "use_bias", False) and layer.bias is not None:
            m2 = m2 + _np(layer.bias)
        act = rule.activation(layer)
        return activation_moments(act, m2, v2) if act is not None else (m2, v2)
    if isinstance(rule, operation_rules.ScalarOpRule):
        found = operation_rules.scalar_operand(node)
        if found is None:
            return m, v
        c, tensor_first = found
        if rule.op == "add":
            return m + c, v
        if rule.op == "subtract":
            return (m - c, v) if tensor_first else (c - m, v)
        if rule.op == "multiply":
            return m * c, v * c * c
        if rule.op == "divide" and tensor_first and c != 0:
            return m / c, v / (c * c)
        return m, v
    weights = rule.channel_weights(layer)
    if weights and weights[0].attr == "gamma":  # a per-channel scale (LayerScale)
        g = _np(getattr(layer, "gamma")).reshape(-1)
        if g.shape == m.shape:
            return m * g, v * g * g
    act = rule.activation(layer)
    if act is not None:
        return activation_moments(act, m, v)
    return m, v


class UnknownMomentsWarning(UserWarning):
    """`propagate` met a layer whose moments it could not compute (they are then
    unknown: mean 0, variance 1). The tests turn it into an error."""


def propagate(flat, unknown=(0.0, 1.0), anchored: Dict[str, np.ndarray] = None
              ) -> Dict[str, Moments]:
    """Per-tensor ``(mean, variance)`` arrays over the channel positions.

    Args:
        flat: The model's `hope_keras.graph.adapter.FlatGraph` (``walk(model).flat``).
        unknown: ``(mean, variance)`` used where nothing is known.
        anchored: If a dict is given, it is filled with ``{tensor key: bool array}``:
            whether each position's moments derive from a BatchNormalization or
            LayerNormalization upstream (True) or only from the model input's
            placeholder moments (False: the channel needs `hope_keras.calibrate`).

    Returns:
        ``{tensor key: (mean, variance)}``.
    """
    out: Dict[str, Moments] = {}
    known: Dict[str, np.ndarray] = {} if anchored is None else anchored

    def filler(t):
        n = int(flat.shapes[t][-1]) if len(flat.shapes[t]) > 1 and flat.shapes[t][-1] else 1
        return np.full(n, float(unknown[0])), np.full(n, float(unknown[1]))

    for key, _ in flat.inputs:
        out[key] = filler(key)
        known[key] = np.zeros(out[key][0].shape[0], dtype=bool)
    for node in flat.nodes:
        layer = node.op
        rule = layer_rules.get(layer)
        role = layer_rules.role_of(layer, node)
        ins = [out.get(t) for t in node.inputs]
        if not node.outputs:
            continue
        t_out = node.outputs[0]
        try:
            res = _node_moments(node, rule, role, layer, ins, flat, t_out)
        except Exception as e:  # noqa: BLE001 - a layer we cannot read: unknown, not fatal
            warnings.warn(UnknownMomentsWarning(
                f"The moments of layer '{node.key}' ({type(layer).__name__}) could not "
                f"be propagated ({type(e).__name__}: {e}); its output is read as "
                "unknown (mean 0, variance 1), so the channels it reaches are scored "
                "less well. A custom layer may need a rule (hope_keras.layers.register)."),
                stacklevel=2)
            res = None
        if res is None or res[0].shape[0] != filler(t_out)[0].shape[0]:
            res = filler(t_out)
        out[t_out] = (np.asarray(res[0], dtype=np.float64),
                      np.maximum(np.asarray(res[1], dtype=np.float64), 0.0))
        known[t_out] = _known(node, role, layer, [known.get(t) for t in node.inputs],
                              out[t_out][0].shape[0], flat)
        for t in node.outputs[1:]:
            out[t] = filler(t)
            known[t] = np.zeros(out[t][0].shape[0], dtype=bool)
    return out


def _known(node, role, layer, ins, n, flat) -> np.ndarray:
    if layer_rules.get(layer).normalization is not None:  # batch or layer norm
        return np.ones(n, dtype=bool)
    if any(k is None for k in ins) or not ins:
        return np.zeros(n, dtype=bool)
    if role == "source":
        return np.full(n, bool(np.all(ins[0])))
    if role in ("channelwise", "reshape") and ins[0].shape[0] == n:
        return ins[0]
    if role == "flatten":
        return ins[0][layer_rules.FlattenRule.channel_map(layer, flat.shapes[node.inputs[0]])]
    if role == "concat":
        cat = np.concatenate(ins)
        return cat if cat.shape[0] == n else np.zeros(n, dtype=bool)
    if role == "merge":
        full = [k for k in ins if k.shape[0] == n]
        small = [k for k in ins if k.shape[0] != n]
        res = np.logical_and.reduce(full) if full else np.zeros(n, dtype=bool)
        return res & all(bool(np.all(k)) for k in small)
    return np.zeros(n, dtype=bool)


def _node_moments(node, rule, role, layer, ins, flat, t_out):
    if any(x is None for x in ins) or not ins:
        return None
    if rule.normalization == "layer":
        gamma = _np(layer.gamma) if layer.scale else np.ones(ins[0][0].shape[0])
        beta = _np(layer.beta) if layer.center else np.zeros(ins[0][0].shape[0])
        return beta.copy(), gamma ** 2
    if role == "source":
        m, v = _linear_source(layer, rule, *ins[0])
        act = rule.activation(layer)
        return activation_moments(act, m, v) if act is not None else (m, v)
    if role in ("channelwise", "reshape"):
        m, v = ins[0]
        return _channelwise(node, rule, layer, m, v)
    if role == "flatten":
        m, v = ins[0]
        cmap = layer_rules.FlattenRule.channel_map(layer, flat.shapes[node.inputs[0]])
        return m[cmap], v[cmap]
    if role == "concat":
        return np.concatenate([x[0] for x in ins]), np.concatenate([x[1] for x in ins])
    if role == "merge":
        n = max(x[0].shape[0] for x in ins)
        ms = [np.broadcast_to(x[0], (n,)) for x in ins]
        vs = [np.broadcast_to(x[1], (n,)) for x in ins]
        if isinstance(rule, layer_rules.MergeRule):  # inputs scaled before the op
            scales = rule.input_scales(layer, len(ins))
            ms = [s * m for s, m in zip(scales, ms)]
            vs = [s * s * v for s, v in zip(scales, vs)]
        op = getattr(rule, "op", "add")
        if op == "add":
            return sum(ms), sum(vs)
        if op == "subtract":
            return ms[0] - sum(ms[1:]), sum(vs)
        if op == "average":
            k = len(ms)
            return sum(ms) / k, sum(vs) / (k * k)
        if op == "multiply":
            m = np.prod(ms, axis=0)
            s2 = np.prod([v + mm * mm for v, mm in zip(vs, ms)], axis=0)
            return m, s2 - m * m
        return ms[0], vs[0]  # maximum / minimum: the first input's, roughly
    return None
