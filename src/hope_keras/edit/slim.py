"""`slim`: rebuild a physically smaller keras.Model with the same outputs.

Needs nothing but a model: a channel of a group is removed when nothing reads it
(every reader's weights on it are exactly zero) — or, for a ``"neurons"`` group,
when its BN output is a constant ≤ 0 that the ReLU zeroes (e.g. γ = β = 0 as HOPE's
prune leaves it); an evictable residual block is removed when its branch outputs
exactly zero. So it also slims models edited by baselines or masked by hand.

The rebuilt model is one flat Functional model: nested sub-models are inlined
(their layers keep their names; a name repeated across sub-models gets its path,
``backbone/conv1``). Every layer is rebuilt from its config by the layer registry
(`hope_keras.layers`): units/filters, a Reshape's target shape, and every weight
sliced on its channel axes.
"""

from __future__ import annotations

from typing import Dict, Optional

import keras
import numpy as np

from hope_keras.graph import adapter as kg
from hope_keras.graph import walker as graph_lib
from hope_keras.graph import layers as layer_rules
from hope_keras.graph import operation_rules
from hope_keras.scoring.neurons import reader_slices


def _np(v) -> np.ndarray:
    return np.asarray(v.numpy())


def _constant_output(producer, bn) -> np.ndarray:
    """Per channel: the BN output when it is constant, NaN otherwise."""
    n = int(bn.moving_mean.shape[0])
    zero_filter = np.ones(n, dtype=bool)
    for w in layer_rules.get(producer).out_weights(producer):
        if w.attr == "bias":
            continue
        arr = np.moveaxis(_np(getattr(producer, w.attr)), w.axis, -1)
        zero_filter &= ~np.any(arr.reshape(-1, n) != 0, axis=0)
    bias = _np(producer.bias) if getattr(producer, "use_bias", False) else np.zeros(n)
    gamma = _np(bn.gamma) if bn.scale else np.ones(n)
    beta = _np(bn.beta) if bn.center else np.zeros(n)
    mean, var = _np(bn.moving_mean), _np(bn.moving_variance)
    out = np.full(n, np.nan)
    at_zero = gamma * (bias - mean) / np.sqrt(var + bn.epsilon) + beta
    out[zero_filter] = at_zero[zero_filter]
    out[gamma == 0] = beta[gamma == 0]
    return out


def live_channels(model, group: graph_lib.NeuronGroup, graph=None,
                  removed_layers=frozenset()) -> np.ndarray:
    """Boolean mask of the channels of `group` that `slim` keeps.

    Args:
        model: The model.
        group: One of its groups (``walk(model).groups``).
        graph: ``walk(model)`` (for nested layer lookups).
        removed_layers: Layers that will not exist in the slim model (evicted
            branches): their weights do not count as reading a channel.
    """
    get = graph.layer if graph is not None else model.get_layer
    dead = np.zeros(group.size, dtype=bool)
    if group.kind == "neurons":
        const = _constant_output(get(group.producer), get(group.bn))
        dead = ~np.isnan(const) & (const <= 0)
    read = np.zeros(group.size, dtype=bool)
    for c in group.readers:
        if c.layer in removed_layers:
            continue
        for rows in reader_slices(get(c.layer), c.positions):
            read |= np.any(rows != 0, axis=1)
    keep = ~dead & read
    if graph_lib.normalised_together(group, get):
        # A LayerNormalization counts every channel in its statistics: only channels
        # that are exactly zero wherever the group flows can go (they are then counted
        # as zeros by `ZeroPaddedLayerNormalization`).
        keep |= ~exactly_zero_channels(get, group, graph)
    if not keep.any():
        keep[0] = True  # a layer cannot be empty; this channel reads as zero anyway
    return keep


def _maps_zero_to_zero(fn) -> bool:
    try:
        return bool(np.all(np.asarray(fn(np.zeros((1, 1), "float32"))) == 0))
    except Exception:  # noqa: BLE001 - anything that cannot be checked does not count
        return False


def exactly_zero_channels(get, group, graph) -> np.ndarray:
    """Boolean mask of the channels of `group` that are exactly zero in every tensor
    of the group: every writer's output weights and every channelwise layer's
    weights (moving variance aside) are zero on them, as the editor's prune leaves
    them, and every layer between the group's tensors maps zero to zero (no fused
    or standalone activation with ``f(0) ≠ 0``, no ``x + 3``, no sum with a tensor
    outside the group). All False when some layer there does not keep zeros. A gate
    that only multiplies a tensor of the group (`_gate_tensors`) may hold ``f(0)``:
    the product is zero."""
    n = group.size
    zero = np.ones(n, dtype=bool)
    fg = graph.flat
    inside = set(group.tensors)
    gates = _gate_tensors(fg, inside)
    for c in group.couplings:
        layer = get(c.layer)
        rule = layer_rules.get(layer)
        if c.role == "in":
            continue
        act = rule.activation(layer)  # fused: f(zero weights · x) = f(0)
        if act is not None and not _maps_zero_to_zero(act) and not (
                c.role == "out" and set(_outputs_of(fg, c.layer)) <= gates):
            return np.zeros(n, dtype=bool)
        if c.role == "out":
            weights = rule.out_weights(layer)
        else:
            weights = [w for w in rule.channel_weights(layer) if w.attr != "moving_variance"]
        for w in weights:
            arr = np.moveaxis(_np(getattr(layer, w.attr)), w.axis, 0)
            idx = c.positions[:, :1].reshape(-1)
            if w.expand != 1:
                idx = (idx[:, None] * w.expand + np.arange(w.expand)).reshape(-1)
            zero &= ~np.any(arr[idx].reshape(n, -1) != 0, axis=1)
    for node in fg.nodes:
        if not node.outputs or node.outputs[0] not in inside or \
                not any(t in inside for t in node.inputs) or node.outputs[0] in gates:
            continue
        layer, rule = node.op, layer_rules.get(node.op)
        role = layer_rules.role_of(layer, node)
        if role == "merge":
            op = getattr(rule, "op", "add")
            if op != "multiply" and not all(t in inside for t in node.inputs):
                return np.zeros(n, dtype=bool)
        elif role == "channelwise" and not rule.channel_weights(layer) \
                and not rule.is_passthrough(layer, node):
            if isinstance(rule, operation_rules.ScalarOpRule):
                operand = operation_rules.scalar_operand(node)
                ok = operand is not None and (
                    (rule.op in ("add", "subtract") and operand[0] == 0.0)
                    or rule.op == "multiply" or (rule.op == "divide" and operand[1]))
            else:
                act = rule.activation(layer, node)
                ok = act is not None and _maps_zero_to_zero(act)
            if not ok:
                return np.zeros(n, dtype=bool)
    return zero


def _outputs_of(fg, key) -> list:
    """The output tensors of every call of layer `key`."""
    return [t for node in fg.nodes_of(key) for t in node.outputs]


def _gate_tensors(fg, inside) -> set:
    """Tensors of a group that only scale another of its tensors: every reader is a
    Multiply inside the group beside an operand of the group that is not such a
    gate, or a weightless channelwise layer (an activation, ``x + 3``, a reshape)
    whose output is one (a squeeze-and-excitation gate and the ops that make it). A
    removed channel is zero in that operand, so the product is zero whatever the
    gate holds there (``hard_sigmoid(0) = 0.5``)."""
    def is_multiply(u):
        return (layer_rules.role_of(u.op, u) == "merge"
                and getattr(layer_rules.get(u.op), "op", "add") == "multiply")

    def weightless(u):
        role = layer_rules.role_of(u.op, u)
        return role == "reshape" or (role == "channelwise" and not
                                     layer_rules.get(u.op).channel_weights(u.op))

    def users(t):
        return [fg.nodes[k] for k in fg.consumers.get(t, ())]

    gates = {t for t in inside if users(t) and not fg.is_output(t)}
    while True:
        changed = True
        while changed:  # the largest set that only flows into products
            changed = False
            for t in list(gates):
                if not all(u.outputs and u.outputs[0] in inside and (
                        is_multiply(u) or (weightless(u) and u.outputs[0] in gates))
                        for u in users(t)):
                    gates.discard(t)
                    changed = True
        # ... each product beside an operand that must be zero (not a gate).
        bad = {x for t in gates for u in users(t) if is_multiply(u)
               and not any(y in inside and y not in gates for y in u.inputs)
               for x in u.inputs if x in gates}
        if not bad:
            return gates
        gates -= bad


def evicted_blocks(model, graph) -> set:
    """Names of the evictable blocks whose branch outputs exactly zero."""
    get = graph.layer if graph.flat is not None else model.get_layer
    out = set()
    for b in graph.blocks:
        if not b.evictable:
            continue
        producer = get(b.final_producer)
        if b.final_bn is not None:
            const = _constant_output(producer, get(b.final_bn))
            if np.all(const == 0):
                out.add(b.name)
        else:
            weights = [_np(getattr(producer, w.attr)) for w in
                       layer_rules.get(producer).out_weights(producer)]
            if all(not np.any(w) for w in weights):
                out.add(b.name)
    return out


def _slice(arr: np.ndarray, axis: int, keep: np.ndarray, expand: int = 1) -> np.ndarray:
    if expand != 1:
        keep = np.repeat(keep, expand)
    return np.compress(keep, arr, axis=axis)


def slim(model, name: Optional[str] = None) -> keras.Model:
    """Returns a new, physically smaller model with the same outputs.

    Removes every dead channel of every group (writers' filters, channelwise
    layers' channels, readers' input slices, Flatten→Dense rows, concatenated
    slices) and every evicted residual block (the ``Add`` becomes its shortcut).
    The input model is not changed; nested sub-models are inlined (see the module
    docstring).

    Args:
        model: A Functional or Sequential model, e.g. after `hope_keras.compress`.
        name: Name of the new model (default: ``"<name>_slim"``).

    Returns:
        A new Functional `keras.Model`.

    Example:

    >>> import keras, numpy as np, hope_keras
    >>> inputs = keras.Input((8,))
    >>> x = keras.layers.Dense(16, name="hidden")(inputs)
    >>> x = keras.layers.ReLU()(keras.layers.BatchNormalization()(x))
    >>> model = keras.Model(inputs, keras.layers.Dense(2)(x))
    >>> _ = hope_keras.compress(model, density=0.5, verbose=False)
    >>> small = hope_keras.slim(model)
    >>> small.get_layer("hidden").units
    8
    >>> x = np.random.rand(4, 8).astype("float32")
    >>> bool(np.allclose(small(x), model(x), atol=1e-5))
    True
    """
    g = graph_lib.walk(model)
    fg = g.flat
    evicted = evicted_blocks(model, g)
    removed_layers = set()
    frozen_groups = set()
    blocks = {b.name: b for b in g.blocks}
    for b in g.blocks:
        if b.name in evicted:
            removed_layers |= set(b.branch_layers)
            frozen_groups |= set(b.groups)
    keep_of: Dict[str, np.ndarray] = {}
    for gname, grp in g.groups.items():
        if gname in frozen_groups:
            continue
        keep = live_channels(model, grp, g, removed_layers)
        if keep.all():
            continue
        for t, positions in grp.tensors.items():
            if t not in keep_of:
                keep_of[t] = np.ones(int(fg.shapes[t][-1]), dtype=bool)
            keep_of[t][positions[~keep].reshape(-1)] = False

    def keep(t):
        return keep_of.get(t)

    new_layers: Dict[str, object] = {}

    def call_node(node, tensors):
        layer = node.op
        if node.key in removed_layers:
            return None
        if node.key in evicted:
            # The Add of an evicted block: its output is the shortcut input.
            branch_end = _branch_end_tensor(fg, blocks[node.key], node)
            sources = [t for t in node.inputs if t != branch_end]
            return tensors[sources[0]]
        args, kwargs = node.call_args(tensors)
        if not kg.is_layer(layer):  # a stateless Keras operation
            return layer(*args, **kwargs)
        new = new_layers.get(node.key)
        if new is None:
            new = _slim_layer(layer, node, fg, keep)
            new_layers[node.key] = new
        return new(*args, **kwargs)

    result = kg.rebuild(model, call_node, name or f"{model.name}_slim", graph=fg)
    for key, new in new_layers.items():
        _copy_weights(fg.layers[key], new, fg.node_of(key), keep)
    return result


def _branch_end_tensor(fg, block, add_node) -> str:
    inside = set(block.branch_layers)
    for t in add_node.inputs:
        p = fg.producer_node(t)
        if p is not None and p.key in inside:
            return t
    return add_node.inputs[-1]


def _live(t, keep, fg) -> int:
    k = keep(t)
    return int(k.sum()) if k is not None else int(fg.shapes[t][-1] or 0)


def _slim_layer(layer, node, fg, keep):
    config = layer.get_config()
    config["name"] = kg.flat_name(node.key)
    rule = layer_rules.get(layer)
    role = layer_rules.role_of(layer, node)
    t_in = node.inputs[0] if node.inputs else None
    t_out = node.outputs[0] if node.outputs else None
    changed = (t_in is not None and keep(t_in) is not None) or (
        t_out is not None and keep(t_out) is not None)
    if changed and role in ("source", "reshape", "channelwise"):
        config = rule.slim_config(layer, config, _live(t_in, keep, fg), _live(t_out, keep, fg))
    with kg.trusted_deserialization():
        return rule.slim_class(layer, config).from_config(config)


def _copy_weights(old, new, node, keep) -> None:
    rule = layer_rules.get(old)
    role = layer_rules.role_of(old, node)
    t_in = node.inputs[0] if node.inputs else None
    t_out = node.outputs[0] if node.outputs else None
    k_in = keep(t_in) if t_in is not None else None
    k_out = keep(t_out) if t_out is not None else None
    values = {id(v): _np(v) for v in old.weights}
    if role == "source":
        for w in rule.in_weights(old):
            var = getattr(old, w.attr, None)
            if var is not None and k_in is not None:
                values[id(var)] = _slice(values[id(var)], w.axis, k_in, w.expand)
        for w in rule.out_weights(old):
            var = getattr(old, w.attr, None)
            if var is not None and k_out is not None:
                values[id(var)] = _slice(values[id(var)], w.axis, k_out)
    elif role == "channelwise" and k_in is not None:
        for w in rule.channel_weights(old):
            var = getattr(old, w.attr, None)
            if var is not None:
                values[id(var)] = _slice(values[id(var)], w.axis, k_in, w.expand)
    for v_old, v_new in zip(old.weights, new.weights):
        v_new.assign(values[id(v_old)])
