"""The layer registry: what hope_keras knows about each Keras layer type.

Every layer (or Keras operation) in a model is looked up here, by class (and its
base classes). Its `LayerRule` says how channels flow through it — the *role* —
and, for layers with weights, which weight axes hold which channels, so that the
walker, the editor, `slim`, the size counters and DEFT handle every layer through
one description:

* ``"source"`` — makes new channels from all of its input channels (Dense, ConvND,
  SeparableConvND, ConvNDTranspose): ``in_weights`` are sliced by input channel,
  ``out_weights`` by output channel.
* ``"channelwise"`` — channel ``c`` of its output depends on channel ``c`` of its
  (single) input only (BatchNormalization, activations, pooling, padding, dropout,
  DepthwiseConvND with multiplier 1, ``x + 3.0``…); ``channel_weights`` are sliced by
  channel.
* ``"merge"`` — elementwise over several inputs (Add, Multiply, …): channel ``c`` of
  every input is tied to channel ``c`` of the output.
* ``"concat"`` — Concatenate on the channel axis: inputs' channels at offsets.
* ``"flatten"`` — Flatten: channel ``c`` becomes positions ``c, c + C, …`` (with
  ``data_format="channels_first"`` Keras first moves axis 1 last: `FlattenRule.channel_map`).
* ``"unsupported"`` — anything else: its input channels cannot be removed (the
  walker pins them, with `LayerRule.reason`), its outputs are new, fixed channels.

A new layer type is one `register` call (and one parametrized test: prune → slim →
outputs equal). For example a custom per-channel scale layer:

>>> import keras
>>> from hope_keras import layers as hl
>>> class Scale(keras.layers.Layer):
...     def build(self, shape):
...         self.scale = self.add_weight(shape=(shape[-1],), initializer="ones")
...     def call(self, x):
...         return x * self.scale
>>> hl.register(Scale, hl.ChannelwiseRule(channel_weights=[hl.WeightAxis("scale", 0)]))
>>> hl.get(Scale()).role
'channelwise'
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Dict, List, Optional, Sequence

import keras
import numpy as np

from hope_keras.graph import adapter as kg

__all__ = [
    "WeightAxis", "LayerRule", "SourceRule", "ChannelwiseRule", "MergeRule",
    "ConcatRule", "FlattenRule", "ReshapeRule", "UnsupportedRule", "register", "get",
    "ROLES", "ZeroPaddedLayerNormalization",
]

ROLES = ("source", "channelwise", "merge", "concat", "flatten", "reshape", "unsupported")


@dataclasses.dataclass(frozen=True)
class WeightAxis:
    """One weight of a layer and the axis its channels index.

    Attributes:
        attr: The layer attribute holding the variable (``"kernel"``, ``"bias"``…).
        axis: The axis indexed by channels.
        expand: Entries per channel along that axis (a separable convolution's
            pointwise kernel has ``depth_multiplier`` rows per input channel).
    """

    attr: str
    axis: int
    expand: int = 1


def _shape_prod(shape) -> int:
    return int(np.prod([d for d in shape if d is not None] or [1]))


def _channels_last(layer) -> Optional[str]:
    fmt = getattr(layer, "data_format", None)
    if fmt not in (None, "channels_last"):
        return (f"{type(layer).__name__} with data_format='{fmt}' (hope_keras edits the "
                "last axis as the channel axis)")
    return None


class LayerRule:
    """How one layer type is handled (see the module docstring).

    Subclass one of the role classes rather than this one. The library asks every
    question about a layer's pattern of its rule, never of its Keras class, so a
    registered layer type answers them too.

    Attributes:
        role: One of `ROLES`.
        kind: Sources: how the channels are made (``"dense"``, ``"conv"``,
            ``"separable"``, ``"transpose"``).
        op: Merges (and operations such as ``x + y``): the elementwise operation
            (``"add"``, ``"subtract"``, ``"multiply"``, ...).
        normalization: ``"batch"`` for a batch normalisation with per-channel moving
            statistics (the layer HOPE reads its statistics from; it has
            BatchNormalization's ``moving_mean``, ``moving_variance``, ``gamma``,
            ``beta``, ``epsilon``, ``center``, ``scale`` and ``axis``), ``"layer"``
            for a normalisation over each example's channels, else None.
        depthwise: Channelwise layers with a depthwise kernel (`kernel_2d`).
        noise: The attribute that sets the strength of noise the layer adds in
            training only (Dropout's ``"rate"``, GaussianNoise's ``"stddev"``):
            `hope_keras.recover` sets it to 0 while it distils.
    """

    role = "unsupported"
    kind: Optional[str] = None
    op: Optional[str] = None
    normalization: Optional[str] = None
    depthwise: bool = False
    noise: Optional[str] = None

    def check(self, layer, rank=None) -> Optional[str]:
        """Why this layer instance cannot be handled by the rule (None if it can).

        ``rank`` is the rank of the layer's (first) input, batch axis included.
        """
        return None

    def in_weights(self, layer) -> List[WeightAxis]:
        """Weights indexed by input channel (sources)."""
        return []

    def out_weights(self, layer) -> List[WeightAxis]:
        """Weights indexed by output channel (sources)."""
        return []

    def channel_weights(self, layer) -> List[WeightAxis]:
        """Weights indexed by channel (channelwise layers)."""
        return []

    def activation(self, layer, node=None):
        """The elementwise activation the layer applies (channelwise activations,
        sources with a fused activation), as a Keras activation name or callable
        (``functools.partial(keras.activations.relu, max_value=6.0)`` for
        ``ReLU(max_value=6.0)``) that `hope_keras.activations` and derivative
        matching resolve; the layer itself when its activation has learned
        per-channel parameters (PReLU); None when it applies none (or the identity).
        """
        return None

    def affine(self, layer, node=None):
        """``(scale, shift)`` per channel (arrays, or scalars) if the layer is an
        affine map of its input at inference (BN, ``x * 2 + 1``), else None."""
        return None

    def flops(self, layer, node, in_live: int, out_live: int, in_shape, out_shape) -> int:
        """FLOPs per example (2 × multiply-adds) at the given live channel counts."""
        return 0

    def slim_config(self, layer, config: dict, in_live: int, out_live: int) -> dict:
        """The layer config of its slimmed copy."""
        return config

    def slim_class(self, layer, config: dict) -> type:
        """The class of its slimmed copy (built with ``from_config(config)``)."""
        return type(layer)

    def role_at(self, node) -> str:
        """The role at one call, `node` (None: any); operations may differ per node."""
        return self.role

    def is_passthrough(self, layer, node=None) -> bool:
        """A weightless, linear-in-value channelwise layer a dead channel stays dead
        through (pooling, padding, dropout, Flatten, identity)."""
        return False

    @property
    def reason(self) -> str:
        return "not supported"


class SourceRule(LayerRule):
    """Dense / ConvND / SeparableConvND: makes new channels from all inputs.

    Attributes:
        out_axis: The kernel axis of the output channels (-1; a transposed
            convolution's kernel holds them on -2).
    """

    role = "source"
    out_axis = -1

    def __init__(self, in_attr="kernel", in_axis=-2, out_attr="kernel", kind="conv"):
        self.in_attr, self.in_axis, self.out_attr, self.kind = in_attr, in_axis, out_attr, kind

    def check(self, layer, rank=None):
        if getattr(layer, "groups", 1) != 1:
            return f"a grouped convolution (groups={layer.groups})"
        return _channels_last(layer)

    def in_weights(self, layer):
        if self.kind == "separable":
            m = int(layer.depth_multiplier)
            return [WeightAxis("depthwise_kernel", -2), WeightAxis("pointwise_kernel", -2, m)]
        return [WeightAxis(self.in_attr, self.in_axis)]

    def out_weights(self, layer):
        out = [WeightAxis(self.out_attr if self.kind != "separable" else "pointwise_kernel",
                          self.out_axis)]
        if getattr(layer, "use_bias", False) and getattr(layer, "bias", None) is not None:
            out.append(WeightAxis("bias", 0))
        return out

    def activation(self, layer, node=None):
        act = getattr(layer, "activation", None)
        name = getattr(act, "__name__", None)
        return None if act is None or name == "linear" else act

    def flops(self, layer, node, in_live, out_live, in_shape, out_shape):
        positions = _shape_prod(out_shape[1:-1])
        if self.kind == "dense":
            return 2 * positions * in_live * out_live
        if self.kind == "separable":
            k = _shape_prod(layer.depthwise_kernel.shape[:-2])
            m = int(layer.depth_multiplier)
            return 2 * positions * (k * in_live * m + in_live * m * out_live)
        k = _shape_prod(layer.kernel.shape[:-2])
        groups = int(getattr(layer, "groups", 1) or 1)
        return 2 * positions * k * (in_live // groups) * out_live

    def slim_config(self, layer, config, in_live, out_live):
        config = dict(config)
        config["units" if self.kind == "dense" else "filters"] = int(out_live)
        return config

    def taps_per_output(self, layer) -> float:
        """How many kernel taps reach one output position on average: 1 of each
        (a convolution reads every tap at every position, borders aside)."""
        return 1.0


class _TransposedConvRule(SourceRule):
    """ConvNDTranspose: a source whose kernel is ``(*k, filters, in_channels)``.

    Every input position scatters the whole kernel onto the output, so an output
    position receives ``prod(k) / prod(strides)`` taps on average (`taps_per_output`):
    the moments and capacities read a transposed reader's kernel with that factor.
    """

    out_axis = -2

    def __init__(self):
        super().__init__("kernel", -1, "kernel", kind="transpose")

    def flops(self, layer, node, in_live, out_live, in_shape, out_shape):
        k = _shape_prod(layer.kernel.shape[:-2])
        return 2 * _shape_prod(in_shape[1:-1]) * k * in_live * out_live

    def taps_per_output(self, layer) -> float:
        return 1.0 / float(np.prod(layer.strides))


class ChannelwiseRule(LayerRule):
    """A layer whose output channel ``c`` reads input channel ``c`` only.

    Args:
        channel_weights: The weights indexed by channel.
        passthrough: See `LayerRule.is_passthrough`.
        activation: A Keras activation name, or a function of the layer giving the
            activation it applies (`LayerRule.activation`).
        data_format: Refuse a ``data_format`` other than ``"channels_last"``.
        noise: See `LayerRule`.
    """

    role = "channelwise"

    def __init__(self, channel_weights: Sequence[WeightAxis] = (), passthrough=False,
                 activation=None, data_format=True, noise: Optional[str] = None):
        self._weights = list(channel_weights)
        self._passthrough = passthrough
        self._activation = activation
        self._data_format = data_format
        self.noise = noise

    def check(self, layer, rank=None):
        return _channels_last(layer) if self._data_format else None

    def channel_weights(self, layer):
        return [w for w in self._weights if getattr(layer, w.attr, None) is not None]

    def is_passthrough(self, layer, node=None):
        return self._passthrough

    def activation(self, layer, node=None):
        return self._activation(layer) if callable(self._activation) else self._activation


class _PermuteRule(ChannelwiseRule):
    """`Permute` that keeps the channel axis last (MTCNN's ``Permute((2, 1, 3))``
    swaps height and width): channel ``c`` stays channel ``c``."""

    def check(self, layer, rank=None):
        dims = tuple(layer.dims)
        if dims and dims[-1] == len(dims):
            return None
        return f"a Permute{dims} that moves the channel axis"


class _BatchNormRule(ChannelwiseRule):
    normalization = "batch"

    def __init__(self):
        super().__init__([WeightAxis(a, 0) for a in
                          ("gamma", "beta", "moving_mean", "moving_variance")])

    def check(self, layer, rank=None):
        axis = layer.axis if isinstance(layer.axis, int) else (
            layer.axis[0] if len(layer.axis) == 1 else None)
        if axis is None or (axis != -1 and (rank is None or axis != rank - 1)):
            return f"a BatchNormalization on axis {layer.axis}, not the channel-last axis"
        return None

    def affine(self, layer, node=None):
        mean = np.asarray(layer.moving_mean.numpy(), dtype=np.float64)
        var = np.asarray(layer.moving_variance.numpy(), dtype=np.float64)
        gamma = (np.asarray(layer.gamma.numpy(), dtype=np.float64) if layer.scale
                 else np.ones_like(mean))
        beta = (np.asarray(layer.beta.numpy(), dtype=np.float64) if layer.center
                else np.zeros_like(mean))
        scale = gamma / np.sqrt(var + layer.epsilon)
        return scale, beta - scale * mean


class _DepthwiseRule(ChannelwiseRule):
    def __init__(self):
        super().__init__([WeightAxis("kernel", -2), WeightAxis("bias", 0)])

    def check(self, layer, rank=None):
        if int(getattr(layer, "depth_multiplier", 1)) != 1:
            return (f"a depthwise convolution with depth_multiplier={layer.depth_multiplier} "
                    "(only 1 is supported)")
        return _channels_last(layer)

    depthwise = True
    _channel_axis = -2  # of the kernel: DepthwiseConvND's is (*spatial, C, 1)

    def channel_weights(self, layer):
        out = [WeightAxis("kernel", self._channel_axis)]
        if getattr(layer, "use_bias", False) and getattr(layer, "bias", None) is not None:
            out.append(WeightAxis("bias", 0))
        return out

    def activation(self, layer, node=None):
        act = getattr(layer, "activation", None)
        return None if act is None or getattr(act, "__name__", "") == "linear" else act

    def flops(self, layer, node, in_live, out_live, in_shape, out_shape):
        k = _shape_prod(layer.kernel.shape[:-2])
        return 2 * _shape_prod(out_shape[1:-1]) * k * out_live

    def kernel_2d(self, layer) -> np.ndarray:
        """The kernel as ``(spatial positions, channels)``."""
        k = np.asarray(layer.kernel.numpy())
        return k.reshape(-1, k.shape[self._channel_axis])


class _GroupedDepthwiseRule(_DepthwiseRule):
    """A ConvND with ``groups == filters ==`` input channels (ConvNeXt's depthwise
    convolution): channel ``c`` reads channel ``c`` only, its kernel is
    ``(*spatial, 1, C)``. `get` gives this rule to such a layer instead of the
    convolution's `SourceRule`."""

    _channel_axis = -1

    def check(self, layer, rank=None):
        return _channels_last(layer)

    def slim_config(self, layer, config, in_live, out_live):
        config = dict(config)
        config["filters"] = config["groups"] = int(in_live)
        return config


def _is_grouped_depthwise(layer) -> bool:
    groups = int(getattr(layer, "groups", 1) or 1)
    kernel = getattr(layer, "kernel", None)
    return (groups > 1 and kernel is not None and int(kernel.shape[-2]) == 1
            and int(kernel.shape[-1]) == groups)


class _ActivationLayerRule(ChannelwiseRule):
    """keras.layers.Activation: channelwise unless it mixes channels (softmax)."""

    def check(self, layer, rank=None):
        name = getattr(layer.activation, "__name__", str(layer.activation))
        if name in ("softmax", "log_softmax"):
            return f"an Activation that applies {name} across channels"
        return None

    def is_passthrough(self, layer, node=None):
        return getattr(layer.activation, "__name__", "") == "linear"

    def activation(self, layer, node=None):
        return None if self.is_passthrough(layer) else layer.activation


@keras.saving.register_keras_serializable(package="hope_keras")
class ZeroPaddedLayerNormalization(keras.layers.LayerNormalization):
    """A LayerNormalization over the last axis whose mean and variance also count
    ``zero_channels`` channels that hold exact zeros and are not there.

    `hope_keras.slim` puts it in place of a LayerNormalization whose input lost
    channels that the compressed model held at exactly zero: the layer it replaces
    normalised over them too (a zero shifts the mean and the variance of the others),
    so the slim model keeps computing the same function. With ``zero_channels=0`` it
    is a LayerNormalization.

    Args:
        zero_channels: How many zero channels the statistics count (≥ 0).
        **kwargs: `keras.layers.LayerNormalization` arguments (``axis`` must be the
            last axis; ``rms_scaling`` is not supported).

    Example:

    >>> import numpy as np, keras
    >>> from hope_keras.graph.layers import ZeroPaddedLayerNormalization
    >>> x = np.array([[1.0, 2.0, 6.0]], "float32")
    >>> padded = np.concatenate([x, np.zeros((1, 2), "float32")], axis=1)
    >>> ln = keras.layers.LayerNormalization(epsilon=1e-3)
    >>> zp = ZeroPaddedLayerNormalization(zero_channels=2, epsilon=1e-3)
    >>> bool(np.allclose(zp(x), ln(padded)[:, :3], atol=1e-6))
    True
    """

    def __init__(self, zero_channels: int = 0, **kwargs):
        super().__init__(**kwargs)
        zero_channels = int(zero_channels)
        if zero_channels < 0:
            raise ValueError(f"zero_channels must be >= 0. Received: {zero_channels}")
        if self.rms_scaling and zero_channels:
            raise ValueError("ZeroPaddedLayerNormalization does not support rms_scaling.")
        self.zero_channels = zero_channels

    def call(self, inputs):
        if not self.zero_channels:
            return super().call(inputs)
        ops = keras.ops
        dtype = keras.backend.result_type(inputs.dtype, "float32")
        x = ops.cast(inputs, dtype)
        live = x.shape[-1]
        total = float(live + self.zero_channels)
        mean = ops.sum(x, axis=-1, keepdims=True) / total
        # Σ over live channels of (x − mean)², plus the zeros' (0 − mean)² each.
        var = (ops.sum(ops.square(x - mean), axis=-1, keepdims=True)
               + self.zero_channels * ops.square(mean)) / total
        out = (x - mean) * ops.rsqrt(var + self.epsilon)
        if self.scale:
            out = out * ops.cast(self.gamma, dtype)
        if self.center:
            out = out + ops.cast(self.beta, dtype)
        return ops.cast(out, self.compute_dtype)

    def get_config(self):
        return {**super().get_config(), "zero_channels": self.zero_channels}


class _LayerNormRule(ChannelwiseRule):
    """LayerNormalization over the channel (last) axis. Not channelwise in general
    (every output channel depends on the statistics of all input channels), but a
    channel that is exactly zero at its input, with γ = β = 0, outputs zero and
    only enters the others' statistics as a zero: a channel the editor removes
    (every coupled weight zeroed) is such a channel, and `slim` replaces the layer
    by a `ZeroPaddedLayerNormalization` that still counts it."""

    normalises_channels = True
    normalization = "layer"

    def __init__(self):
        super().__init__([WeightAxis("gamma", 0), WeightAxis("beta", 0)], data_format=False)

    def check(self, layer, rank=None):
        axis = layer.axis if isinstance(layer.axis, int) else (
            layer.axis[0] if len(layer.axis) == 1 else None)
        if axis is None or (axis != -1 and (rank is None or axis != rank - 1)):
            return (f"a LayerNormalization over axis {layer.axis}, not the channel (last) "
                    "axis alone: it normalises across other axes too")
        if getattr(layer, "rms_scaling", False):
            return "a LayerNormalization with rms_scaling (not supported)"
        if not layer.scale:
            return ("a LayerNormalization without scale (gamma): a removed channel "
                    "cannot be set to zero after it")
        return None

    def slim_config(self, layer, config, in_live, out_live):
        config = dict(config)
        removed = int(layer.gamma.shape[0]) - int(in_live)
        config["zero_channels"] = int(getattr(layer, "zero_channels", 0)) + removed
        return config

    def slim_class(self, layer, config):
        return ZeroPaddedLayerNormalization if config.get("zero_channels") else type(layer)


class _LayerScaleRule(ChannelwiseRule):
    """ConvNeXt's LayerScale: its config states its width (``projection_dim``)."""

    def slim_config(self, layer, config, in_live, out_live):
        config = dict(config)
        if "projection_dim" in config:
            config["projection_dim"] = int(in_live)
        return config


class _ReshapeRule(LayerRule):
    role = "reshape"

    def slim_config(self, layer, config, in_live, out_live):
        config = dict(config)
        config["target_shape"] = tuple(config["target_shape"][:-1]) + (int(out_live),)
        return config


ReshapeRule = _ReshapeRule


class MergeRule(LayerRule):
    """Add, Subtract, Multiply, Average, Maximum, Minimum: channel c of every input
    is tied to channel c of the output.

    Args:
        op: The elementwise operation (`LayerRule.op`).
        scales: For a layer that multiplies each input by a constant before `op`
            (keras.applications' Inception-ResNet ``CustomScaleLayer``:
            ``x + scale · r``), a function of the layer giving one factor per input;
            None: all 1.

    Example:

    >>> import keras
    >>> from hope_keras import layers as hl
    >>> class ScaledAdd(keras.layers.Layer):
    ...     def __init__(self, scale, **kwargs):
    ...         super().__init__(**kwargs)
    ...         self.scale = scale
    ...     def call(self, inputs):
    ...         return inputs[0] + inputs[1] * self.scale
    >>> hl.register(ScaledAdd, hl.MergeRule("add", scales=lambda layer: (1.0, layer.scale)))
    >>> hl.get(ScaledAdd(0.2)).input_scales(ScaledAdd(0.2), 2)
    (1.0, 0.2)
    """

    role = "merge"

    def __init__(self, op="add", scales=None):
        self.op = op
        self.scales = scales

    def input_scales(self, layer, n: int) -> tuple:
        """The factor of each of the layer's `n` inputs (`scales`)."""
        if self.scales is None:
            return (1.0,) * n
        out = tuple(float(s) for s in self.scales(layer))
        if len(out) != n:
            raise ValueError(f"The merge rule of layer '{layer.name}' gives {len(out)} "
                             f"input scale(s) for {n} inputs. Received: {out}")
        return out


class ConcatRule(LayerRule):
    role = "concat"

    def check(self, layer, rank=None):
        axis = getattr(layer, "axis", -1)
        if axis == -1 or (rank is not None and axis == rank - 1):
            return None
        return f"a Concatenate on axis {axis}, not the channel axis"


class FlattenRule(LayerRule):
    """Flatten: output position ``f`` carries input channel ``channel_map(...)[f]``."""

    role = "flatten"

    @staticmethod
    def channel_map(layer, in_shape) -> np.ndarray:
        """For each output position, the input channel it carries."""
        dims = [int(d) for d in in_shape[1:]]
        if len(dims) <= 1:
            return np.arange(dims[0] if dims else 1)
        grid = np.broadcast_to(np.arange(dims[-1]), dims)
        if getattr(layer, "data_format", "channels_last") == "channels_first":
            # Keras moves axis 1 last before flattening (it assumes channels-first).
            grid = np.moveaxis(grid, 0, -1)
        return np.ascontiguousarray(grid).reshape(-1)

    def is_passthrough(self, layer, node=None):
        return True


class UnsupportedRule(LayerRule):
    """A layer hope_keras cannot see through; `why` says why."""

    role = "unsupported"

    def __init__(self, why: str = ""):
        self.why = why

    def check(self, layer, rank=None):
        return (f"{type(layer).__name__}, which "
                f"{self.why or 'has no hope_keras layer rule (hope_keras.layers.register adds one)'}")


class _SoftmaxRule(UnsupportedRule):
    """`Softmax`: not channelwise, but its activation is read (a softmax head)."""

    def activation(self, layer, node=None):
        return "softmax"


# ------------------------------------------------------------------------ the table
_REGISTRY: Dict[type, LayerRule] = {}


def register(layer_class: type, rule: LayerRule, *, overwrite: bool = True) -> None:
    """Registers `rule` for `layer_class` (and its subclasses without a rule).

    Args:
        layer_class: A `keras.layers.Layer` (or `keras.Operation`) subclass.
        rule: A `LayerRule` (usually a `ChannelwiseRule`, `SourceRule`, `MergeRule`
            or `UnsupportedRule` instance).
        overwrite: Replace an existing rule (default) instead of raising.

    Raises:
        TypeError: if `rule` is not a `LayerRule`.
    """
    if not isinstance(rule, LayerRule):
        raise TypeError(f"rule must be a hope_keras.layers.LayerRule. Received: {rule!r}")
    if not overwrite and layer_class in _REGISTRY:
        raise ValueError(f"A rule for {layer_class.__name__} is already registered.")
    _REGISTRY[layer_class] = rule


def get(layer) -> LayerRule:
    """The rule for a layer (or operation) instance: its class's, else the nearest
    base class's, else an `UnsupportedRule`.

    Example:

    >>> import keras
    >>> from hope_keras import layers as hl
    >>> hl.get(keras.layers.Conv2D(4, 3)).role, hl.get(keras.layers.GroupNormalization()).role
    ('source', 'unsupported')
    """
    layer = getattr(layer, "wrapped_layer", layer)  # editor mirrors wrap the layer
    for cls in type(layer).__mro__:
        rule = _REGISTRY.get(cls)
        if rule is not None:
            if isinstance(rule, SourceRule) and rule.kind == "conv" \
                    and _is_grouped_depthwise(layer):
                return _GROUPED_DEPTHWISE
            return rule
    return _DEFAULT


def output_axis(layer) -> int:
    """The kernel axis of a source's output channels (`SourceRule.out_axis`; -1 for
    any other layer)."""
    return int(getattr(get(layer), "out_axis", -1))


def taps_per_output(layer) -> float:
    """A source's `SourceRule.taps_per_output` (1 for any other layer): the factor
    by which a transposed convolution's kernel counts in one output position."""
    taps = getattr(get(layer), "taps_per_output", None)
    return 1.0 if taps is None else float(taps(layer))


_DEFAULT = UnsupportedRule()
_GROUPED_DEPTHWISE = _GroupedDepthwiseRule()


def _register_builtins():
    L = keras.layers
    register(L.Dense, SourceRule("kernel", 0, "kernel", kind="dense"))
    for c in (L.Conv1D, L.Conv2D, L.Conv3D):
        register(c, SourceRule("kernel", -2, "kernel", kind="conv"))
    for c in (L.SeparableConv1D, L.SeparableConv2D):
        register(c, SourceRule(kind="separable"))
    for c in (L.Conv1DTranspose, L.Conv2DTranspose, L.Conv3DTranspose):
        register(c, _TransposedConvRule())
    register(L.BatchNormalization, _BatchNormRule())
    for c in (L.DepthwiseConv1D, L.DepthwiseConv2D):
        register(c, _DepthwiseRule())
    passthrough = [
        L.MaxPooling1D, L.MaxPooling2D, L.MaxPooling3D,
        L.AveragePooling1D, L.AveragePooling2D, L.AveragePooling3D,
        L.GlobalMaxPooling1D, L.GlobalMaxPooling2D, L.GlobalMaxPooling3D,
        L.GlobalAveragePooling1D, L.GlobalAveragePooling2D, L.GlobalAveragePooling3D,
        L.ZeroPadding1D, L.ZeroPadding2D, L.ZeroPadding3D,
        L.Cropping1D, L.Cropping2D, L.Cropping3D,
        L.UpSampling1D, L.UpSampling2D, L.UpSampling3D,
        L.Resizing,  # HED's side outputs: per-channel spatial resampling
    ]
    for c in passthrough:
        register(c, ChannelwiseRule(passthrough=True))
    for c, noise in ((L.Dropout, "rate"), (L.SpatialDropout1D, "rate"),
                     (L.SpatialDropout2D, "rate"), (L.SpatialDropout3D, "rate"),
                     (L.GaussianNoise, "stddev"), (L.GaussianDropout, "rate"),
                     (L.AlphaDropout, "rate"), (L.ActivityRegularization, None),
                     (L.Identity, None)):
        register(c, ChannelwiseRule(passthrough=True, data_format=False, noise=noise))
    register(L.Activation, _ActivationLayerRule(data_format=False))

    A = keras.activations
    # The activation layers as the Keras functions they call (what the activation
    # registry, `hope_keras.activations.lookup`, reads).
    register(L.ReLU, ChannelwiseRule(activation=lambda layer: functools.partial(
        A.relu, negative_slope=float(layer.negative_slope),
        max_value=None if layer.max_value is None else float(layer.max_value),
        threshold=float(layer.threshold)), data_format=False))
    register(L.LeakyReLU, ChannelwiseRule(activation=lambda layer: functools.partial(
        A.leaky_relu, negative_slope=float(layer.negative_slope)), data_format=False))
    register(L.ELU, ChannelwiseRule(activation=lambda layer: functools.partial(
        A.elu, alpha=float(layer.alpha)), data_format=False))
    # PReLU's slopes are learned per channel: no Keras function, the layer itself.
    register(L.PReLU, ChannelwiseRule([WeightAxis("alpha", -1)], activation=lambda l: l,
                                      data_format=False))
    register(L.Softmax, _SoftmaxRule("applies softmax across channels"))
    register(L.Flatten, FlattenRule())
    register(L.Permute, _PermuteRule(passthrough=True, data_format=False))
    register(L.Reshape, _ReshapeRule())
    for c, op in ((L.Add, "add"), (L.Subtract, "subtract"), (L.Multiply, "multiply"),
                  (L.Average, "average"), (L.Maximum, "maximum"), (L.Minimum, "minimum")):
        register(c, MergeRule(op))
    register(L.Concatenate, ConcatRule())
    register(L.LayerNormalization, _LayerNormRule())
    for c in (L.GroupNormalization, L.UnitNormalization):
        register(c, UnsupportedRule(
            "normalises across channels: removing a channel would change the others"))
    # ConvNeXt's per-channel scale and stochastic depth (keras.applications)
    convnext = kg.optional_classes("applications.convnext",
                                   ("LayerScale", "StochasticDepth"))
    if "LayerScale" in convnext:
        register(convnext["LayerScale"], _LayerScaleRule([WeightAxis("gamma", 0)],
                                                         data_format=False))
    if "StochasticDepth" in convnext:
        register(convnext["StochasticDepth"], ChannelwiseRule(passthrough=True,
                                                              data_format=False))
    # Inception-ResNet's residual sum, ``x + scale · r`` (keras.applications)
    scaled = kg.optional_classes("applications.inception_resnet_v2", ("CustomScaleLayer",))
    if "CustomScaleLayer" in scaled:
        register(scaled["CustomScaleLayer"],
                 MergeRule("add", scales=lambda layer: (1.0, float(layer.scale))))


def role_of(layer, node=None) -> str:
    """The layer's role at this call (`LayerRule.role_at`)."""
    return get(layer).role_at(node)


_register_builtins()



def weight_param_count(layer, rule: LayerRule, in_live: Optional[int], out_live: Optional[int],
                       ch_live: Optional[int]) -> int:
    """Parameters of `layer` once its channel axes hold the given live counts."""
    axes = {}
    if in_live is not None:
        for w in rule.in_weights(layer):
            axes[w.attr] = (w.axis, in_live * w.expand)
    if out_live is not None:
        for w in rule.out_weights(layer):
            var = getattr(layer, w.attr, None)
            if var is None:
                continue
            if w.attr in axes:  # the same kernel: both axes
                axes[w.attr] = (axes[w.attr], (w.axis, out_live))
            else:
                axes[w.attr] = (w.axis, out_live)
    if ch_live is not None:
        for w in rule.channel_weights(layer):
            axes[w.attr] = (w.axis, ch_live * w.expand)
    total = 0
    seen = set()
    for attr, spec in axes.items():
        var = getattr(layer, attr, None)
        if var is None:
            continue
        seen.add(id(var))
        shape = list(var.shape)
        specs = spec if isinstance(spec[0], tuple) else (spec,)
        for axis, n in specs:
            shape[axis] = n
        total += int(math.prod(shape))
    for var in layer.weights:
        if id(var) not in seen:
            total += int(math.prod(var.shape))
    return total
