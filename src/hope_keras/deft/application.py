"""Applying a DEFT plan: each reader's input drift, the masks, the merges replayed
(docs/theory.md §9).

`elasticities_and_drift` carries every neuron's elasticity through the layer
registry's roles to the drift of each kernel input (the masks of eq. 28, see
`hope_keras.deft.plan`'s module doc); `apply_plan` replays a `DeftPlan`'s merges on
the real model, re-initialises the freed vessels, applies the masks and, on request,
compensates the cut inputs by their data-free mean. `hope_keras.deft.plan` gives
these names too.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Dict, Optional

import numpy as np

from hope_keras.graph import adapter as kg
from hope_keras.graph import walker as graph_lib
from hope_keras.graph import layers as layer_rules
from hope_keras.graph.fingerprint import fingerprint
from hope_keras.search.trajectory import apply_step
from hope_keras.edit.editor import ModelEditor
from hope_keras.scoring import moments as moments_lib

if TYPE_CHECKING:
    from hope_keras.deft.plan import DeftPlan

COMPENSATIONS = ("none", "mean", "mean_var")


def as_vector(e, n: int) -> np.ndarray:
    """A layer's elasticity as one value per channel (a scalar is broadcast)."""
    arr = np.asarray(e, dtype=np.float64)
    if arr.ndim == 0:
        return np.full(n, float(arr))
    if arr.shape != (n,):
        raise ValueError(f"Elasticity of length {arr.shape} does not match {n} channels.")
    return arr


def check_compensate(compensate):
    """``compensate`` if it is one of `COMPENSATIONS`, else a ValueError."""
    if compensate not in COMPENSATIONS:
        raise ValueError(f"compensate must be one of {COMPENSATIONS}. Received: "
                         f"compensate={compensate!r}")
    return compensate


def elasticities_and_drift(model, graph, elasticity, head, pinned):
    """Per-layer parameter elasticity and per-reader input drift (see module doc).

    Channels flow through the layer registry's roles (`hope_keras.layers`): a source
    layer's outputs drift where it is elastic; a channelwise layer passes its input's
    drift on (and adds its own elasticity when it has weights); merges take the
    channelwise maximum, Concatenate concatenates, Flatten repeats; any other layer
    (or a shared one) is treated conservatively (any drifting input makes every
    output channel drift).
    """
    fg = graph.flat if getattr(graph, "flat", None) is not None else kg.flatten(model)
    writer_e: Dict[str, np.ndarray] = {}
    channel_e: Dict[str, np.ndarray] = {}
    for name, grp in graph.groups.items():
        e = elasticity.get(name)
        if e is None:
            continue
        for c in grp.couplings:
            if c.role == "out":  # the group's part of the writer's outputs
                vec = writer_e.setdefault(
                    c.layer, np.full(_channels_of(fg, c.tensor), float(pinned)))
                vec[c.positions[:, 0]] = np.asarray(e, dtype=np.float64)
            elif c.role == "channel":
                vec = channel_e.setdefault(c.layer, np.zeros(_width(fg, c.layer)))
                vec[c.positions[:, 0]] = np.asarray(e, dtype=np.float64)
    layer_e: Dict[str, object] = {}
    drift: Dict[str, np.ndarray] = {}
    input_drift: Dict[str, np.ndarray] = {}
    for key, _ in fg.inputs:
        drift[key] = np.zeros(_channels_of(fg, key))
    for node in fg.nodes:
        layer = node.op
        key = node.key
        rule = layer_rules.get(layer)
        role = layer_rules.role_of(layer, node)
        parents = [drift.get(t) for t in node.inputs]
        parents = [p for p in parents if p is not None]
        out_t = node.outputs[0] if node.outputs else None
        n_out = _channels_of(fg, out_t) if out_t is not None else 0
        any_in = any(np.any(p > 0) for p in parents)
        conservative = np.full(n_out, float(any_in))
        has_weights = bool(getattr(layer, "weights", None))
        # A shared layer, or one its rule refuses: frozen. The rank: a
        # BatchNormalization on axis 3 of a 4-D tensor (keras.applications' ResNets,
        # DenseNets, Inceptions) is on the channel axis.
        rank = len(fg.shapes[node.inputs[0]]) if node.inputs else None
        if fg.calls[key] > 1 or rule.check(layer, rank) is not None and role != "unsupported":
            if has_weights:
                layer_e[key] = 0.0
            drift[out_t] = conservative
            continue
        if role == "source":
            if key in writer_e:
                e = writer_e[key]
            elif key == head:
                e = np.ones(n_out)
            else:
                e = np.full(n_out, pinned)
            layer_e[key] = e if key in writer_e else (float(e[0]) if n_out else pinned)
            n_in = _channels_of(fg, node.inputs[0])
            d_in = parents[0] if parents else np.zeros(n_in)
            if d_in.shape != (n_in,):
                d_in = np.full(n_in, float(any_in))
            input_drift[key] = d_in.astype(np.float32)
            drift[out_t] = (e > 0).astype(np.float64)
        elif role == "channelwise":
            d_in = parents[0] if parents and parents[0].shape == (n_out,) else conservative
            if getattr(rule, "normalises_channels", False):
                d_in = conservative  # its statistics mix every channel (LayerNormalization)
            if has_weights:
                if key in channel_e:
                    e = channel_e[key]
                    layer_e[key] = e
                else:
                    src = fg.producer_node(node.inputs[0])
                    if (src is not None and src.key in layer_e and src.key != head
                            and layer_rules.role_of(src.op, src) == "source"
                            and len(fg.children(src)) == 1):
                        e = as_vector(layer_e[src.key], n_out)
                        layer_e[key] = float(e[0]) if np.all(e == e[0]) else e
                    else:
                        e = np.zeros(n_out)
                        layer_e[key] = 0.0
                drift[out_t] = np.maximum(d_in, (e > 0).astype(np.float64))
            else:
                drift[out_t] = d_in
        elif role == "reshape":
            d = parents[0] if parents else conservative
            drift[out_t] = d if d.shape == (n_out,) else conservative
        elif role == "flatten":
            d = parents[0] if parents else np.zeros(_channels_of(fg, node.inputs[0]))
            drift[out_t] = d[layer_rules.FlattenRule.channel_map(layer, fg.shapes[node.inputs[0]])]
        elif role == "merge":
            full = [p for p in parents if p.shape == (n_out,)]
            drift[out_t] = (np.max(np.stack(full), axis=0) if len(full) == len(parents)
                            and full else conservative)
        elif role == "concat":
            cat = np.concatenate(parents) if parents else np.zeros(0)
            drift[out_t] = cat if cat.shape == (n_out,) else conservative
        else:
            if has_weights:
                layer_e[key] = 0.0  # unsupported layer with weights: frozen
            drift[out_t] = conservative
        for t in node.outputs[1:]:
            drift[t] = np.full(_channels_of(fg, t), float(any_in))
    return layer_e, input_drift


def variable_elasticities(fg, layer_e) -> Dict[str, object]:
    """``{"layer/variable": elasticity}`` for the variables of a per-channel layer
    elasticity whose channels are not on their last axis (`ElasticOptimizer` scales
    a layer's other variables on that axis).

    A depthwise convolution keeps its channels on its kernel's axis −2 (``(*spatial,
    C, 1)``), a transposed convolution too (``(*spatial, C, inputs)``): the entry is
    the channels' elasticities shaped ``(C, 1)``, broadcast over what follows. A separable
    convolution's depthwise kernel feeds every output channel through the pointwise
    one: it moves only when every output is elastic (the smallest elasticity), so a
    core output keeps its depthwise filters.
    """
    out: Dict[str, object] = {}
    for key, e in layer_e.items():
        vec = np.asarray(e, dtype=np.float64)
        if vec.ndim == 0:
            continue  # one value for every variable: nothing to place
        node = fg.node_of(key)
        layer = node.op
        rule = layer_rules.get(layer)
        weights = (rule.out_weights(layer) if layer_rules.role_of(layer, node) == "source"
                   else rule.channel_weights(layer))
        axis_of = {id(getattr(layer, w.attr, None)): w.axis for w in weights}
        for var in layer.trainable_weights:
            name = f"{key}/{var.path.split('/')[-1]}"
            ndim = len(var.shape)
            axis = axis_of.get(id(var))
            if axis is None:  # not indexed by the channels: moves with all of them
                out[name] = float(vec.min())
            elif axis % ndim != ndim - 1:  # the channels, then axes they broadcast over
                trailing = ndim - 1 - axis % ndim
                if var.shape[axis] != vec.size:
                    out[name] = float(vec.min())
                else:
                    out[name] = vec.reshape((vec.size,) + (1,) * trailing)
    return out


def _channels_of(fg, tensor) -> int:
    shape = fg.shapes[tensor]
    return int(shape[-1]) if len(shape) > 1 and shape[-1] else 1


def _width(fg, key) -> int:
    node = fg.node_of(key)
    return _channels_of(fg, node.inputs[0])


# ----------------------------------------------------------------------- applying
def apply_plan(model, plan: DeftPlan, merges: bool = True, mask: bool = True,
               reinit_vessels: bool = True, seed: int = 0, check: bool = True,
               compensate: Optional[str] = None):
    """Applies a `DeftPlan` to `model` in place (see `DeftPlan.apply`).

    With ``compensate="mean"`` every cut (drifting input ``a`` → core output ``b``)
    is replaced by its data-free mean: ``Σ_a W[…, a, b] E[x_a]`` (``E[x]`` from
    `hope_keras.scoring.moments.propagate` on the merged model, kernel positions summed) goes
    into ``b``'s bias, or is subtracted from the moving mean of the BatchNormalization
    that alone follows the layer. ``"mean_var"`` also multiplies that BN's moving
    variance by the share of the surrogate variance ``Σ W² Var[x_a]`` that was kept,
    so the core neuron's normalised output keeps unit variance on source data. Only
    non-trainable statistics and the core's own bias change; the core stays frozen.

    Example:

    >>> import keras
    >>> from hope_keras import deft
    >>> inputs = keras.Input((8,))
    >>> x = keras.layers.Dense(16, use_bias=False)(inputs)
    >>> x = keras.layers.ReLU()(keras.layers.BatchNormalization()(x))
    >>> model = keras.Model(inputs, keras.layers.Dense(3, name="head")(x))
    >>> p = deft.plan(model, percentile=50)
    >>> _ = deft.apply_plan(model, p)
    """
    g = graph_lib.walk(model)
    missing = [n for n in plan.groups if n not in g.groups]
    wrong = [n for n in plan.groups if n in g.groups and g.groups[n].size != plan.groups[n]]
    if missing or wrong:
        raise ValueError(
            f"Model '{model.name}' does not match the plan: groups missing {missing}, "
            f"groups of another size {wrong}."
        )
    plan.validate()  # before any edit: an inconsistent plan leaves the model as it is
    g = g.with_groups({k: g.groups[k] for k in plan.groups}, blocks=())
    if check and fingerprint(model, g) != plan.fingerprint:
        raise ValueError(
            f"The weights of model '{model.name}' are not those the plan was made from "
            "(fingerprint mismatch; was the plan already applied?). Apply a plan once, "
            "to the source model it was computed on, or pass check=False."
        )
    editor = ModelEditor(model, g)
    if merges:
        for s in plan.merges:
            with editor.step():
                apply_step(editor, s)
        if reinit_vessels:
            rng = np.random.default_rng(seed)
            for name, slots in plan.vessels.items():
                for j in slots:
                    _reinit_vessel(editor, g.groups[name], j, rng)
        editor.commit()
    if compensate is None:
        compensate = plan.options.get("compensate", "none")
    check_compensate(compensate)
    if mask:
        cuts, pointwise = {}, {}
        for name in plan.input_drift:
            layer = g.layer(name)
            if getattr(layer, "kernel", None) is not None:
                m = plan.mask(name, tuple(layer.kernel.shape),
                              out_axis=layer_rules.output_axis(layer))
                if m is not None:
                    cuts[name] = m
            elif getattr(layer, "pointwise_kernel", None) is not None:
                # A separable convolution: the pointwise rows of a drifting channel
                # (one per depthwise output) into core outputs; left uncompensated
                # (the surrogate has no moments of the depthwise outputs).
                m = plan.mask(name, tuple(layer.pointwise_kernel.shape),
                              expand=int(layer.depth_multiplier))
                if m is not None:
                    pointwise[name] = m
        if compensate != "none" and cuts:
            _compensate_cuts(g.flat, cuts, compensate)
        for name, m in cuts.items():
            layer = g.layer(name)
            layer.kernel.assign(layer.kernel.numpy() * m)
        for name, m in pointwise.items():
            layer = g.layer(name)
            layer.pointwise_kernel.assign(layer.pointwise_kernel.numpy() * m)
    return model


def _compensate_cuts(fg, cuts, compensate):
    """Moves the first (and second) moment of every cut signal into its core neuron
    (see `apply_plan`); `cuts` maps a kernel layer to its eq.-28 mask. A transposed
    convolution's kernel (outputs on axis −2) counts by its taps per output position
    (`layer_rules.taps_per_output`), as the moment propagation counts it."""
    table = moments_lib.propagate(fg)
    for name, m in cuts.items():
        layer = fg.layers[name]
        node = fg.node_of(name)
        kernel = np.asarray(layer.kernel.numpy(), dtype=np.float64)
        m = np.asarray(m)
        if layer_rules.output_axis(layer) % kernel.ndim != kernel.ndim - 1:
            kernel, m = np.swapaxes(kernel, -1, -2), np.swapaxes(m, -1, -2)
        n_in, n_out = kernel.shape[-2], kernel.shape[-1]
        k = kernel.reshape(-1, n_in, n_out)
        taps = layer_rules.taps_per_output(layer)
        cut = np.broadcast_to(m.reshape(-1, n_out) == 0, (n_in, n_out))
        mean, var = table[node.inputs[0]]
        if mean.shape != (n_in,):
            continue  # positions we cannot map: leave uncompensated
        shift = taps * (np.where(cut, k.sum(0), 0.0) * mean[:, None]).sum(0)
        kids = fg.children(node)
        bn = (kids[0].op if len(kids) == 1 and fg.calls[kids[0].key] == 1
              and layer_rules.get(kids[0].op).normalization == "batch" else None)
        if getattr(layer, "use_bias", False) and getattr(layer, "bias", None) is not None:
            b = layer.bias.numpy()
            layer.bias.assign((b + shift).astype(b.dtype))
        elif bn is not None:
            mm = bn.moving_mean.numpy()
            bn.moving_mean.assign((mm - shift).astype(mm.dtype))
        if compensate == "mean_var" and bn is not None:
            sq = taps * (k ** 2).sum(0) * var[:, None]
            total = sq.sum(0)
            kept = np.where(total > 0, 1.0 - np.where(cut, sq, 0.0).sum(0) /
                            np.where(total > 0, total, 1.0), 1.0)
            mv = bn.moving_variance.numpy()
            bn.moving_variance.assign((mv * np.clip(kept, 1e-2, 1.0)).astype(mv.dtype))


def _reinit_vessel(editor, group, j, rng):
    producer = editor.layer(group.producer)
    kernel = editor.array(group.producer, "kernel")
    axis = layer_rules.output_axis(producer) % kernel.ndim  # not the last when transposed
    index = tuple(j if a == axis else slice(None) for a in range(kernel.ndim))
    fan_in = kernel.size // kernel.shape[axis]
    col = rng.normal(0.0, math.sqrt(2.0 / fan_in), size=kernel[index].shape)
    editor._write(group.producer, "kernel", index, col.astype(kernel.dtype))
    if getattr(producer, "use_bias", False) and producer.bias is not None:
        editor._write(group.producer, "bias", j, 0.0)
    bn = editor.layer(group.bn)
    if bn.scale:
        editor._write(group.bn, "gamma", j, 1.0)
    if bn.center:
        editor._write(group.bn, "beta", j, 0.0)
    editor._write(group.bn, "moving_mean", j, 0.0)
    editor._write(group.bn, "moving_variance", j, 1.0)
