"""`slim`: rebuild a physically smaller keras.Model with the same outputs.

Needs nothing but a model: a channel of a neuron group is removed when its output
is exactly zero (constant pre-activation ≤ 0 after BN, e.g. γ = β = 0 as HOPE's
prune leaves it) or when nothing downstream reads it (all-zero consumer slices);
an evictable residual block is removed when its branch's final BN outputs exactly
zero. So it also slims models edited by baselines or masked by hand.
"""

from __future__ import annotations

from typing import Dict

import keras
import numpy as np

from hope_keras import graph as graph_lib
from hope_keras.neurons import consumer_u


def _np(v) -> np.ndarray:
    return np.asarray(v.numpy())


def _constant_output(producer, bn) -> np.ndarray:
    """Per channel: the BN output when it is constant, NaN otherwise."""
    kernel = _np(producer.kernel)
    n = kernel.shape[-1]
    zero_filter = ~np.any(kernel.reshape(-1, n) != 0, axis=0)
    bias = _np(producer.bias) if getattr(producer, "use_bias", False) else np.zeros(n)
    gamma = _np(bn.gamma) if bn.scale else np.ones(n)
    beta = _np(bn.beta) if bn.center else np.zeros(n)
    mean, var = _np(bn.moving_mean), _np(bn.moving_variance)
    out = np.full(n, np.nan)
    at_zero = gamma * (bias - mean) / np.sqrt(var + bn.epsilon) + beta
    out[zero_filter] = at_zero[zero_filter]
    out[gamma == 0] = beta[gamma == 0]
    return out


def live_channels(model, group: graph_lib.NeuronGroup) -> np.ndarray:
    """Boolean mask of the channels of `group` that `slim` keeps."""
    const = _constant_output(model.get_layer(group.producer), model.get_layer(group.bn))
    dead = ~np.isnan(const) & (const <= 0)
    u, _ = consumer_u(model, group.consumers, group.size)
    dead |= ~np.any(u != 0, axis=1)
    keep = ~dead
    if not keep.any():
        keep[0] = True  # a layer cannot be empty; this channel reads as zero anyway
    return keep


def evicted_blocks(model, graph) -> set:
    """Names of the evictable blocks whose branch outputs exactly zero."""
    out = set()
    for b in graph.blocks:
        if not b.evictable:
            continue
        const = _constant_output(model.get_layer(b.final_producer), model.get_layer(b.final_bn))
        if np.all(const == 0):
            out.add(b.name)
    return out


def _slice_weight(name, value, out_keep, in_keep, kind):
    """Slices one weight array by output channels and/or input channels."""
    if out_keep is not None:
        value = value[..., out_keep] if name in ("kernel", "bias") else value[out_keep]
    if in_keep is not None and name == "kernel":
        if kind == "conv":
            value = value[..., in_keep, :]
        else:
            c = in_keep.shape[0]
            units = value.shape[-1]
            value = value.reshape(-1, c, units)[:, in_keep, :].reshape(-1, units)
    return value


def slim(model, name: str = None) -> keras.Model:
    """Returns a new, physically smaller model with the same outputs.

    Removes every dead channel of every neuron group (producer filters, BN
    channels, consumer input slices, Flatten→Dense rows) and every evicted
    residual block (the ``Add`` becomes its shortcut). The input model is not
    changed.

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
    evicted = evicted_blocks(model, g)
    removed_layers = set()
    frozen_groups = set()
    for b in g.blocks:
        if b.name in evicted:
            removed_layers |= set(b.branch_layers)
            frozen_groups |= set(b.groups)
    out_keep: Dict[str, np.ndarray] = {}
    in_keep: Dict[str, tuple] = {}
    for gname, grp in g.groups.items():
        if gname in frozen_groups:
            continue
        keep = live_channels(model, grp)
        if keep.all():
            continue
        out_keep[grp.producer] = keep
        out_keep[grp.bn] = keep
        for c in grp.consumers:
            in_keep[c.layer] = (keep, c.kind)

    new_layers: Dict[str, keras.layers.Layer] = {}
    blocks = {b.name: b for b in g.blocks}

    def call_node(node, tensors):
        layer = node.operation
        if layer.name in removed_layers:
            return None
        if layer.name in evicted:
            # The Add of an evicted block: its output is the shortcut input.
            branch_end = blocks[layer.name].final_bn
            sources = [t for t in node.input_tensors
                       if t._keras_history.operation.name != branch_end]
            return tensors[id(sources[0])]
        new = new_layers.get(layer.name)
        if new is None:  # a shared layer stays one (shared) layer
            config = layer.get_config()
            if layer.name in out_keep and isinstance(layer, graph_lib._KERNEL_TYPES):
                n = int(out_keep[layer.name].sum())
                config["units" if isinstance(layer, keras.layers.Dense) else "filters"] = n
            new = layer.__class__.from_config(config)
            new_layers[layer.name] = new
        args, kwargs = node.arguments.fill_in(tensors)
        return new(*args, **kwargs)

    result = graph_lib.rebuild(model, call_node, name or f"{model.name}_slim")
    for lname, new in new_layers.items():
        old = model.get_layer(lname)
        ok = out_keep.get(lname)
        ik, kind = in_keep.get(lname, (None, None))
        for v_new, v_old in zip(new.weights, old.weights):
            vname = v_old.name.split("/")[-1]
            v_new.assign(_slice_weight(vname, _np(v_old), ok, ik, kind))
    return result
