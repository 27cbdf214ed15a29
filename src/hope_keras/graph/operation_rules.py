"""Rules of Keras operation nodes: what ``x + 3.0``, ``keras.ops.relu(x)`` or
``keras.ops.mean(x, axis=(1, 2))`` do to channels, in a Functional model or a traced
subclassed one (`hope_keras.graph.tracing`). Registered in `hope_keras.graph.layers`'
registry like the layers' rules, when this module is imported (by the `hope_keras.graph`
package, so before any model is walked).
"""

from __future__ import annotations

import functools

import keras
import numpy as np

from hope_keras.graph import adapter as kg
from hope_keras.graph import layers

__all__ = ["ScalarOpRule", "register_operations", "scalar_operand"]


class ScalarOpRule(layers.LayerRule):
    """A Keras operation node (``x + 3.0``, ``x * s``): channelwise with a scalar,
    a merge between tensors."""

    def __init__(self, op):
        self.op = op

    role = "channelwise"

    def role_at(self, node) -> str:
        if node is not None and len(node.inputs) >= 2:
            return "merge"
        if node is not None and scalar_operand(node) is None:
            return "unsupported"
        return "channelwise"

    def is_passthrough(self, layer, node=None):
        return False


def register_operations() -> None:
    """Registers the rules of the Keras operations hope_keras sees through."""
    ops = (("Add", "add"), ("Subtract", "subtract"), ("Multiply", "multiply"),
           ("Divide", "divide"), ("TrueDivide", "divide"))
    classes = kg.optional_classes("ops.numpy", [name for name, _ in ops])
    for name, op in ops:
        if name in classes:
            layers.register(classes[name], ScalarOpRule(op))
    _register_activation_ops()


def _register_activation_ops():
    """Elementwise activations called as `keras.ops` (``keras.ops.relu(x)`` in a
    traced subclassed model, or in a Functional one): channelwise, like the layers."""
    A = keras.activations
    fixed = {"Relu": A.relu, "Relu6": A.relu6, "Sigmoid": A.sigmoid, "Silu": A.silu,
             "Selu": A.selu, "Softplus": A.softplus, "HardSigmoid": A.hard_sigmoid,
             "HardSilu": A.hard_silu}
    nn = kg.optional_classes("ops.nn", list(fixed) + ["LeakyRelu", "Gelu"])
    for name, fn in fixed.items():
        if name in nn:
            layers.register(nn[name], layers.ChannelwiseRule(
                activation=lambda op, fn=fn: fn, data_format=False))
    if "LeakyRelu" in nn:
        layers.register(nn["LeakyRelu"], layers.ChannelwiseRule(
            activation=lambda op: functools.partial(
                A.leaky_relu, negative_slope=float(op.negative_slope)),
            data_format=False))
    if "Gelu" in nn:
        layers.register(nn["Gelu"], layers.ChannelwiseRule(
            activation=lambda op: functools.partial(A.gelu, approximate=bool(op.approximate)),
            data_format=False))
    resize = kg.optional_classes("ops.image", ["Resize"])
    if "Resize" in resize:  # keras.ops.image.resize: per-channel, like `Resizing`
        layers.register(resize["Resize"], layers.ChannelwiseRule(passthrough=True))
    reductions = ("Mean", "Sum", "Max", "Min", "Amax", "Amin")
    for cls in kg.optional_classes("ops.numpy", reductions).values():
        layers.register(cls, _ReduceRule())
    tanh = kg.optional_classes("ops.numpy", ["Tanh"])
    if "Tanh" in tanh:
        layers.register(tanh["Tanh"], layers.ChannelwiseRule(
            activation=lambda op: A.tanh, data_format=False))


class _ReduceRule(layers.ChannelwiseRule):
    """``keras.ops.mean``, ``sum``, ``max`` or ``min`` over axes other than the batch
    and channel axes (``keras.ops.mean(x, axis=(1, 2))``: a global pooling in a
    subclassed model): channel ``c`` of the output reads channel ``c`` only, and a
    zero channel stays zero, as through the pooling layers."""

    def __init__(self):
        super().__init__(passthrough=True, data_format=False)

    def check(self, layer, rank=None):
        name, axis = type(layer).__name__, getattr(layer, "axis", None)
        if axis is None:
            return f"{name} over every axis (it reduces across channels)"
        if getattr(layer, "initial", None) is not None:
            return f"{name} with initial={layer.initial!r} (a removed channel would hold it)"
        if rank is None:
            return f"{name} of an input of unknown rank"
        axes = {int(a) % rank for a in ((axis,) if np.ndim(axis) == 0 else axis)}
        if 0 in axes or rank - 1 in axes:
            return (f"{name} over axis {axis!r} of a rank-{rank} input (it reduces across "
                    f"{'the batch' if 0 in axes else 'channels'})")
        return None


def scalar_operand(node):
    """For an operation node of `ScalarOpRule`: ``(scalar, tensor_first)`` when it
    combines one tensor with a Python/numpy scalar, else None."""
    args = node.args
    if len(args) != 2:
        return None
    kinds = [isinstance(a, keras.KerasTensor) for a in args]
    if kinds == [True, False]:
        val, first = args[1], True
    elif kinds == [False, True]:
        val, first = args[0], False
    else:
        return None
    try:
        arr = np.asarray(val, dtype=np.float64)
    except (TypeError, ValueError):
        return None
    if arr.size != 1:
        return None
    return float(arr.ravel()[0]), first


register_operations()
