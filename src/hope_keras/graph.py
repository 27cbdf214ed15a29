"""Keras graph walkers: find the neurons HOPE may cut, and why others are pinned.

A *neuron group* is a producer with a kernel (Dense, Conv1D/2D/3D) followed only by
a channel-last BatchNormalization, followed only by a ReLU, whose output reaches one
or more consumers with kernels through channel-preserving layers only (spec
section 1). Every kernel layer that does not start such a group is reported as
*pinned*, with the reason. A *residual block* is an ``Add`` of an identity (or
projection) shortcut and a branch of neuron groups ending in producer + BN
(spec section 3).

The walkers only read the model; they never change it.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Tuple

import keras

# Layers that carry channel c of their input to channel c of their output, with no
# weights: a dead (exactly zero) channel stays dead through them.
_PASSTHROUGH_TYPES = (
    keras.layers.MaxPooling1D,
    keras.layers.MaxPooling2D,
    keras.layers.MaxPooling3D,
    keras.layers.AveragePooling1D,
    keras.layers.AveragePooling2D,
    keras.layers.AveragePooling3D,
    keras.layers.GlobalMaxPooling1D,
    keras.layers.GlobalMaxPooling2D,
    keras.layers.GlobalMaxPooling3D,
    keras.layers.GlobalAveragePooling1D,
    keras.layers.GlobalAveragePooling2D,
    keras.layers.GlobalAveragePooling3D,
    keras.layers.ZeroPadding1D,
    keras.layers.ZeroPadding2D,
    keras.layers.ZeroPadding3D,
    keras.layers.Dropout,
    keras.layers.SpatialDropout1D,
    keras.layers.SpatialDropout2D,
    keras.layers.SpatialDropout3D,
    keras.layers.Flatten,
    keras.layers.Identity,
)
_CONV_TYPES = (keras.layers.Conv1D, keras.layers.Conv2D, keras.layers.Conv3D)
_KERNEL_TYPES = (keras.layers.Dense,) + _CONV_TYPES


@dataclasses.dataclass(frozen=True)
class Consumer:
    """A layer that reads a group's channels through its kernel.

    Attributes:
        layer: Name of the consumer layer (Dense or ConvND).
        kind: ``"conv"`` (the kernel's input-channel axis is ``-2``) or ``"dense"``
            (kernel rows; after a Flatten the rows of channel ``c`` are
            ``c, c + C, c + 2C, ...``).
    """

    layer: str
    kind: str


@dataclasses.dataclass(frozen=True)
class NeuronGroup:
    """One compressible layer of neurons: producer → BN → ReLU → consumers.

    Attributes:
        name: The group's name (the producer layer's name).
        producer: Name of the Dense/ConvND layer whose output channels are the neurons.
        bn: Name of the BatchNormalization layer that follows it.
        activation: Name of the ReLU (or ``Activation("relu")``) layer.
        consumers: The kernel layers that read the group's output channels.
        passthrough: Channel-preserving layers between activation and consumers.
        size: Number of neurons (output channels) at walk time.
    """

    name: str
    producer: str
    bn: str
    activation: str
    consumers: Tuple[Consumer, ...]
    passthrough: Tuple[str, ...]
    size: int

    @property
    def layers(self) -> Tuple[str, ...]:
        """Every layer name involved in the group, producer first."""
        return (self.producer, self.bn, self.activation) + self.passthrough + tuple(
            c.layer for c in self.consumers
        )


@dataclasses.dataclass(frozen=True)
class ResidualBlock:
    """A residual block ``Add([shortcut, branch])``.

    Attributes:
        name: The block's name (the ``Add`` layer's name).
        add: Name of the Add layer.
        groups: Internal neuron groups of the branch, input side first.
        final_producer: The branch's last kernel layer (its output is not a group).
        final_bn: The BatchNormalization that ends the branch; evicting the block
            sets its γ = β = 0 so the branch outputs exactly zero.
        shortcut: ``"identity"`` or ``"projection"``.
        evictable: True for identity shortcuts (only those can be evicted).
        input_bn: The BN that conditions the block input (spec section 3), or None
            when there is none (the engine then uses the appendix F.3 fallback).
        block_input: The layer whose output is the block input.
        branch_layers: Every layer of the branch, from the first producer to the
            final BN (what ``slim`` removes when the block is evicted).
    """

    name: str
    add: str
    groups: Tuple[str, ...]
    final_producer: str
    final_bn: str
    shortcut: str
    evictable: bool
    input_bn: Optional[str]
    block_input: str
    branch_layers: Tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Pinned:
    """A kernel layer whose output channels cannot be compressed, and why."""

    layer: str
    reason: str


@dataclasses.dataclass(frozen=True)
class ModelGraph:
    """Result of walking a model: its groups, residual blocks and pinned layers."""

    groups: Dict[str, NeuronGroup]
    blocks: Tuple[ResidualBlock, ...]
    pinned: Tuple[Pinned, ...]
    #: Consumer layer → the BatchNormalization that is its only child (where a
    #: bias-free consumer's mean compensation goes).
    bn_after: Dict[str, str] = dataclasses.field(default_factory=dict)

    def block_of_group(self) -> Dict[str, str]:
        """Maps each internal group name to the name of the block that holds it."""
        return {g: b.name for b in self.blocks for g in b.groups}


class _LayerGraph:
    """The model's layers as a DAG of names (a shared layer is one node with the edges
    of all its calls)."""

    def __init__(self, model: keras.Model):
        functional = _functional_of(model)
        self.model = model
        self.layers: Dict[str, keras.layers.Layer] = {}
        self.parents: Dict[str, List[str]] = {}
        self.children: Dict[str, List[str]] = {}
        self.calls: Dict[str, int] = {}
        self.order: List[str] = []
        depths = sorted(functional._nodes_by_depth.keys(), reverse=True)
        for depth in depths:
            for node in functional._nodes_by_depth[depth]:
                layer = node.operation
                name = layer.name
                if isinstance(layer, keras.Model) and not isinstance(
                    layer, keras.layers.InputLayer
                ):
                    raise ValueError(
                        f"Model '{model.name}' contains the nested model '{name}'. "
                        "hope_keras walks flat models only: rebuild the model without "
                        "nesting (call the inner model's layers directly on the outer "
                        f"inputs). Received: nested model '{name}' of type "
                        f"{type(layer).__name__}."
                    )
                self.calls[name] = self.calls.get(name, 0) + 1
                if name not in self.layers:
                    self.layers[name] = layer
                    self.order.append(name)
                    self.parents[name] = []
                    self.children.setdefault(name, [])
                # Every call's edges: a group feeding any call of a shared layer is pinned.
                for t in node.input_tensors:
                    parent = t._keras_history.operation.name
                    self.parents[name].append(parent)
                    self.children.setdefault(parent, []).append(name)
        self.outputs = {t._keras_history.operation.name for t in functional.outputs}

    def only_child(self, name: str) -> Optional[str]:
        kids = self.children.get(name, [])
        return kids[0] if len(kids) == 1 else None


def _functional_of(model: keras.Model):
    if isinstance(model, keras.Sequential):
        functional = getattr(model, "_functional", None)
        if functional is None:
            raise ValueError(
                f"Sequential model '{model.name}' is not built. Build it first, e.g. "
                "by giving it a `keras.Input(shape)` as first layer or calling "
                "`model.build(input_shape)`."
            )
        return functional
    if not hasattr(model, "_nodes_by_depth"):
        raise ValueError(
            "hope_keras needs a Functional or Sequential keras.Model; subclassed "
            f"models have no static graph to walk. Received: {type(model).__name__} "
            f"'{getattr(model, 'name', model)}'."
        )
    return model


def _is_relu(layer) -> bool:
    if isinstance(layer, keras.layers.ReLU):
        return (
            layer.max_value is None
            and float(layer.negative_slope) == 0.0
            and float(layer.threshold) == 0.0
        )
    if isinstance(layer, keras.layers.Activation):
        return getattr(layer.activation, "__name__", "") == "relu"
    return False


def _is_passthrough(layer) -> bool:
    if isinstance(layer, _PASSTHROUGH_TYPES):
        return True
    if isinstance(layer, keras.layers.Activation):
        return getattr(layer.activation, "__name__", "") == "linear"
    return False


def _activation_name(layer) -> str:
    act = getattr(layer, "activation", None)
    return getattr(act, "__name__", str(act))


def _kernel_problem(layer) -> Optional[str]:
    """Why a kernel layer cannot have its input channels sliced (None if it can)."""
    if isinstance(layer, _CONV_TYPES):
        if getattr(layer, "groups", 1) != 1:
            return f"'{layer.name}' is a grouped convolution (groups={layer.groups})"
        if getattr(layer, "data_format", "channels_last") != "channels_last":
            return f"'{layer.name}' uses data_format='{layer.data_format}'"
    return None


def _bn_is_channel_last(bn) -> bool:
    axis = bn.axis if isinstance(bn.axis, int) else (
        bn.axis[0] if len(bn.axis) == 1 else None
    )
    if axis is None:
        return False
    rank = len(bn.input.shape) if hasattr(bn, "input") else None
    return axis == -1 or (rank is not None and axis == rank - 1)


def _trace_consumers(g: _LayerGraph, start: str):
    """Follows `start`'s output through pass-through layers to kernel consumers.

    Returns ``(consumers, passthrough, problem)`` where ``problem`` is a reason
    string when the output reaches anything else.
    """
    consumers: List[Consumer] = []
    passthrough: List[str] = []
    frontier = [start]
    seen = set()
    while frontier:
        name = frontier.pop()
        if name in g.outputs:
            return [], [], f"the output of '{name}' is a model output"
        for child in g.children.get(name, []):
            if child in seen:
                continue
            seen.add(child)
            layer = g.layers[child]
            if g.calls[child] > 1:
                return [], [], (
                    f"it reaches the shared layer '{child}' (called {g.calls[child]} times)"
                )
            if isinstance(layer, _KERNEL_TYPES):
                problem = _kernel_problem(layer)
                if problem:
                    return [], [], f"its consumer {problem}"
                kind = "dense" if isinstance(layer, keras.layers.Dense) else "conv"
                consumers.append(Consumer(child, kind))
            elif _is_passthrough(layer):
                passthrough.append(child)
                frontier.append(child)
            else:
                return [], [], (
                    f"it feeds '{child}' ({type(layer).__name__}), which does not "
                    "preserve channels"
                )
    if not consumers:
        return [], [], "its output reaches no layer with a kernel"
    return consumers, passthrough, None


def _try_group(g: _LayerGraph, name: str):
    """Returns a NeuronGroup for producer `name`, or a Pinned with the reason."""
    layer = g.layers[name]
    if g.calls[name] > 1:
        return Pinned(name, f"shared layer called {g.calls[name]} times")
    problem = _kernel_problem(layer)
    if problem:
        return Pinned(name, problem)
    if _activation_name(layer) != "linear":
        return Pinned(
            name,
            f"activation '{_activation_name(layer)}' is fused into the producer; "
            "use a linear producer followed by BatchNormalization and ReLU layers",
        )
    if name in g.outputs:
        return Pinned(name, "its output is a model output")
    kids = g.children.get(name, [])
    bn_name = g.only_child(name)
    if bn_name is None or not isinstance(g.layers[bn_name], keras.layers.BatchNormalization):
        what = ", ".join(f"'{k}'" for k in kids) or "nothing"
        return Pinned(
            name, f"not followed by a single BatchNormalization (it feeds {what})"
        )
    bn = g.layers[bn_name]
    if g.calls[bn_name] > 1:
        return Pinned(name, f"its BatchNormalization '{bn_name}' is shared")
    if not _bn_is_channel_last(bn):
        return Pinned(name, f"BatchNormalization '{bn_name}' is not on the channel-last axis")
    if bn_name in g.outputs:
        return Pinned(name, f"its BatchNormalization '{bn_name}' is a model output")
    act_name = g.only_child(bn_name)
    if act_name is None:
        what = ", ".join(f"'{k}'" for k in g.children.get(bn_name, [])) or "nothing"
        return Pinned(name, f"its BatchNormalization '{bn_name}' feeds {what}, not a single ReLU")
    act = g.layers[act_name]
    if isinstance(act, keras.layers.Add):
        return Pinned(name, f"feeds the Add '{act_name}' (residual branch end)")
    if isinstance(act, (keras.layers.Concatenate, keras.layers.Multiply)):
        return Pinned(name, f"feeds the {type(act).__name__} '{act_name}'")
    if isinstance(act, keras.layers.LeakyReLU) or (
        isinstance(act, keras.layers.ReLU) and float(act.negative_slope) != 0.0
    ):
        return Pinned(name, f"LeakyReLU '{act_name}' is not supported yet (ReLU only)")
    if not _is_relu(act):
        return Pinned(
            name,
            f"'{act_name}' ({type(act).__name__}) after BN '{bn_name}' is not a plain ReLU",
        )
    if g.calls[act_name] > 1:
        return Pinned(name, f"its activation '{act_name}' is shared")
    consumers, passthrough, problem = _trace_consumers(g, act_name)
    if problem:
        return Pinned(name, problem)
    size = int(layer.filters if isinstance(layer, _CONV_TYPES) else layer.units)
    return NeuronGroup(
        name=name,
        producer=name,
        bn=bn_name,
        activation=act_name,
        consumers=tuple(consumers),
        passthrough=tuple(passthrough),
        size=size,
    )


def _back(g: _LayerGraph, name: str) -> str:
    """Walks backward through single-input pass-through layers."""
    while _is_passthrough(g.layers[name]) and len(g.parents[name]) == 1:
        name = g.parents[name][0]
    return name


def _try_block(g, add_name, side, other, groups_by_act, blocks_by_add):
    """Tries `side` as the branch and `other` as the shortcut of an Add."""
    bn_name = side
    if not isinstance(g.layers[bn_name], keras.layers.BatchNormalization):
        return None
    if len(g.parents[bn_name]) != 1 or g.only_child(bn_name) != add_name:
        return None
    producer = g.parents[bn_name][0]
    if not isinstance(g.layers[producer], _KERNEL_TYPES) or g.only_child(producer) != bn_name:
        return None
    chain: List[str] = []
    branch_layers = [bn_name, producer]
    current = producer
    while True:
        t = _back(g, g.parents[current][0])
        group = groups_by_act.get(t)
        if group is None or [c.layer for c in group.consumers] != [current]:
            break
        chain.append(group.name)
        branch_layers.extend(
            [group.activation, group.bn, group.producer] + list(group.passthrough)
        )
        current = group.producer
    block_input = _back(g, g.parents[current][0])
    if not chain:
        return None
    shortcut = _back(g, other)
    if shortcut == block_input:
        kind = "identity"
    elif (
        isinstance(g.layers[other], keras.layers.BatchNormalization)
        and isinstance(g.layers[g.parents[other][0]], _KERNEL_TYPES)
        and _back(g, g.parents[g.parents[other][0]][0]) == block_input
    ):
        kind = "projection"
    else:
        return None
    # The BN that conditions the block input (spec section 3).
    input_bn = None
    src = g.layers[block_input]
    if isinstance(src, keras.layers.BatchNormalization):
        input_bn = block_input
    elif _is_relu(src) and len(g.parents[block_input]) == 1:
        p = g.parents[block_input][0]
        if isinstance(g.layers[p], keras.layers.BatchNormalization):
            input_bn = p
        elif p in blocks_by_add:
            input_bn = blocks_by_add[p].final_bn
    chain.reverse()
    # A branch layer used outside the branch would make eviction change other paths.
    internal = set(branch_layers)
    for lname in branch_layers:
        for kid in g.children.get(lname, []):
            if kid not in internal and kid != add_name:
                return None
    return ResidualBlock(
        name=add_name,
        add=add_name,
        groups=tuple(chain),
        final_producer=producer,
        final_bn=bn_name,
        shortcut=kind,
        evictable=kind == "identity",
        input_bn=input_bn,
        block_input=block_input,
        branch_layers=tuple(reversed(branch_layers)),
    )


def walk(model: keras.Model) -> ModelGraph:
    """Finds the neuron groups, residual blocks and pinned layers of a model.

    Args:
        model: A built Functional or Sequential Keras model (not nested).

    Returns:
        A `ModelGraph` with ``groups`` (by producer name, in topological order),
        ``blocks`` and ``pinned``.

    Raises:
        ValueError: for subclassed, unbuilt or nested models.

    Example:

    >>> import keras
    >>> from hope_keras.graph import walk
    >>> inputs = keras.Input((8,))
    >>> x = keras.layers.Dense(16)(inputs)
    >>> x = keras.layers.BatchNormalization()(x)
    >>> x = keras.layers.ReLU()(x)
    >>> outputs = keras.layers.Dense(2)(x)
    >>> graph = walk(keras.Model(inputs, outputs))
    >>> [(g.size, len(g.consumers)) for g in graph.groups.values()]
    [(16, 1)]
    """
    g = _LayerGraph(model)
    groups: Dict[str, NeuronGroup] = {}
    pinned: List[Pinned] = []
    for name in g.order:
        layer = g.layers[name]
        if not isinstance(layer, _KERNEL_TYPES):
            if isinstance(
                layer,
                (
                    keras.layers.DepthwiseConv1D,
                    keras.layers.DepthwiseConv2D,
                    keras.layers.SeparableConv1D,
                    keras.layers.SeparableConv2D,
                    keras.layers.Conv1DTranspose,
                    keras.layers.Conv2DTranspose,
                    keras.layers.Conv3DTranspose,
                ),
            ):
                pinned.append(Pinned(name, f"{type(layer).__name__} is not supported"))
            continue
        result = _try_group(g, name)
        if isinstance(result, NeuronGroup):
            groups[name] = result
        else:
            pinned.append(result)
    groups_by_act = {grp.activation: grp for grp in groups.values()}
    blocks: Dict[str, ResidualBlock] = {}
    for name in g.order:
        if not isinstance(g.layers[name], keras.layers.Add) or len(g.parents[name]) != 2:
            continue
        a, b = g.parents[name]
        block = _try_block(g, name, a, b, groups_by_act, blocks) or _try_block(
            g, name, b, a, groups_by_act, blocks
        )
        if block is not None:
            blocks[name] = block
    bn_after = {}
    for grp in groups.values():
        for c in grp.consumers:
            kid = g.only_child(c.layer)
            if kid is not None and isinstance(g.layers[kid], keras.layers.BatchNormalization) \
                    and g.calls[kid] == 1 and _bn_is_channel_last(g.layers[kid]):
                bn_after[c.layer] = kid
    return ModelGraph(groups=groups, blocks=tuple(blocks.values()), pinned=tuple(pinned),
                      bn_after=bn_after)


def rebuild(model: keras.Model, call_node, name: str) -> keras.Model:
    """Rebuilds a Functional model node by node (shared by `slim` and `calibrate`).

    Args:
        model: The Functional or Sequential model to rebuild (not changed).
        call_node: ``call_node(node, tensors)`` returns the new output(s) of ``node``
            (usually a new layer called on ``node.arguments.fill_in(tensors)``), or
            None to drop the node. ``tensors`` maps ``id(old tensor)`` to new tensors.
        name: Name of the new model.

    Returns:
        A new Functional `keras.Model` with fresh inputs of the same shapes.
    """
    functional = _functional_of(model)
    tensors: Dict[int, object] = {}
    for depth in sorted(functional._nodes_by_depth, reverse=True):
        for node in functional._nodes_by_depth[depth]:
            layer = node.operation
            if isinstance(layer, keras.layers.InputLayer):
                tensors[id(node.outputs[0])] = keras.Input(
                    batch_shape=layer.batch_shape, dtype=layer.dtype, name=layer.name)
                continue
            outputs = call_node(node, tensors)
            if outputs is None:
                continue
            for old_t, new_t in zip(node.outputs, keras.tree.flatten(outputs)):
                tensors[id(old_t)] = new_t
    outputs = [tensors[id(t)] for t in functional.outputs]
    inputs = [tensors[id(t)] for t in functional.inputs]
    return keras.Model(inputs=inputs if len(inputs) > 1 else inputs[0],
                       outputs=outputs if len(outputs) > 1 else outputs[0], name=name)
