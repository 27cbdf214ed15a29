"""`fold_batchnorm`: BatchNormalization layers folded into the layers that feed them.

At inference a BatchNormalization is a per-channel affine map, ``y = a · x + b`` with
``a = γ / √(σ² + ε)`` and ``b = β − a · μ`` (docs/theory.md, "Folding BatchNormalization").
When ``x`` is the output of a Dense, a convolution (plain, separable or depthwise) that
applies no activation of its own and feeds nothing else, the map can be moved into that
layer's weights: its kernel is scaled by ``a`` along the output channels and its bias
becomes ``a · bias + b``. The model computes the same function without the BN's two
passes over every activation. Keras runs those passes even inside ``tf.function``; a
TFLite conversion folds them already (`hope_keras.export_tflite`).

This is a deployment step, after `hope_keras.slim`: a folded model has no BN
statistics left for `hope_keras.compress`, `recover` or fine-tuning to read or
re-estimate.
"""

from __future__ import annotations

from typing import Dict, Optional

import keras
import numpy as np

from hope_keras.graph import adapter as kg
from hope_keras.graph import layers as layer_rules

__all__ = ["fold_batchnorm", "foldable_pairs"]


def _fold_target(layer, node) -> Optional[str]:
    """Why the layer at `node` cannot take a BN after it (None: it can)."""
    rule = layer_rules.get(layer)
    if not kg.is_layer(layer):
        return "an operation, not a layer with weights"
    if rule.role == "source":
        why = rule.check(layer)
    elif rule.role == "channelwise" and rule.depthwise:
        why = rule.check(layer)
    else:
        return f"a {type(layer).__name__} (only Dense and convolutions take a BN's scale)"
    if why is not None:
        return why
    if getattr(layer, "lora_enabled", False) or getattr(
            getattr(layer, "dtype_policy", None), "quantization_mode", None):
        return "its kernel is factored (LoRA) or quantized"
    if rule.activation(layer, node) is not None:
        return "it applies an activation before the BN"
    if "use_bias" not in layer.get_config():
        return f"a {type(layer).__name__} without a use_bias setting"
    return None


def foldable_pairs(model, graph=None) -> Dict[str, str]:
    """``{BN key: producer key}``: the BatchNormalization calls `fold_batchnorm` folds.

    A BN is folded into the layer whose output it reads when that layer is a Dense or
    a convolution (separable and depthwise ones too) without an activation of its own,
    both are called once, the BN normalises the channel (last) axis, and nothing else
    reads the layer's output (another reader, or a model output, would see the BN's
    scale). Keys are layer names (path-qualified where a name repeats across
    nested sub-models, as in `hope_keras.graph.adapter.flatten`).

    Args:
        model: A Functional or Sequential model.
        graph: ``hope_keras.graph.adapter.flatten(model)``, if already computed.

    Returns:
        A dict from each folded BN's key to its producer's key.

    Example:

    >>> import keras
    >>> from hope_keras.deploy.fold import foldable_pairs
    >>> inputs = keras.Input((8,))
    >>> x = keras.layers.Dense(4, name="dense")(inputs)
    >>> x = keras.layers.BatchNormalization(name="bn")(x)
    >>> foldable_pairs(keras.Model(inputs, keras.layers.ReLU()(x)))
    {'bn': 'dense'}
    """
    g = graph or kg.flatten(model)
    outputs = set(g.outputs)
    pairs = {}
    for node in g.nodes:
        rule = layer_rules.get(node.op)
        if rule.normalization != "batch" or not node.inputs or g.calls[node.key] != 1:
            continue
        source = node.inputs[0]
        rank = len(g.shapes[source])
        if rule.check(node.op, rank) is not None or source not in g.producer:
            continue
        producer = g.nodes[g.producer[source][0]]
        if (g.calls.get(producer.key) != 1 or len(producer.outputs) != 1
                or source in outputs or g.consumers.get(source) != [node.index]
                or _fold_target(producer.op, producer) is not None):
            continue
        pairs[node.key] = producer.key
    return pairs


def _folded_weights(producer, bn) -> Dict[str, np.ndarray]:
    """``{attr: value}`` of the producer's kernel(s) and bias with `bn` folded in,
    computed in float64 and cast to each variable's dtype."""
    scale, shift = layer_rules.get(bn).affine(bn)
    rule = layer_rules.get(producer)
    kernels = (rule.out_weights(producer) if rule.role == "source"
               else rule.channel_weights(producer))
    out = {}
    for w in kernels:
        if w.attr == "bias":
            continue
        var = getattr(producer, w.attr)
        arr = np.asarray(var.numpy(), np.float64)
        shape = [1] * arr.ndim
        shape[w.axis] = -1
        out[w.attr] = (arr * scale.reshape(shape)).astype(var.dtype)
    bias = (np.asarray(producer.bias.numpy(), np.float64)
            if getattr(producer, "use_bias", False) and producer.bias is not None
            else np.zeros_like(scale))
    out["bias"] = (scale * bias + shift).astype(bn.moving_mean.dtype)
    return out


def fold_batchnorm(model, name: Optional[str] = None) -> keras.Model:
    """Returns a new model with each foldable BatchNormalization folded into the
    layer that feeds it (the module docstring has the formula).

    Which BNs fold is `foldable_pairs`; the others stay as they are. The input
    model is not changed; nested sub-models are inlined as `hope_keras.slim` does
    (a name repeated across sub-models gets its path). Outputs are the
    same up to float rounding (the folding is computed in float64).

    Args:
        model: A Functional or Sequential model, typically ``hope_keras.slim(model)``
            (a subclassed model's ``call`` is traced first, as `hope_keras.slim`
            traces it).
        name: Name of the new model (default: ``"<name>_folded"``).

    Returns:
        A new Functional `keras.Model`.

    Raises:
        ValueError: If a BN to fold has non-finite or negative statistics (the
            layer is named; nothing is built).

    Example:

    >>> import keras, numpy as np, hope_keras
    >>> inputs = keras.Input((8, 8, 3))
    >>> x = keras.layers.Conv2D(4, 3, use_bias=False, name="conv")(inputs)
    >>> x = keras.layers.BatchNormalization(name="bn")(x)
    >>> model = keras.Model(inputs, keras.layers.ReLU(name="relu")(x))
    >>> folded = hope_keras.fold_batchnorm(model)
    >>> [layer.name for layer in folded.layers[1:]]
    ['conv', 'relu']
    >>> x = np.random.rand(2, 8, 8, 3).astype("float32")
    >>> bool(np.allclose(folded(x), model(x), atol=1e-5))
    True
    """
    g = kg.flatten(model)
    pairs = foldable_pairs(model, g)
    producers = {p: bn for bn, p in pairs.items()}
    weights = {}
    for bn_key, p_key in pairs.items():  # every check before anything is built
        bn = g.layers[bn_key]
        mean, var = np.asarray(bn.moving_mean.numpy()), np.asarray(bn.moving_variance.numpy())
        if not (np.all(np.isfinite(mean)) and np.all(np.isfinite(var)) and np.all(var >= 0)):
            raise ValueError(f"fold_batchnorm: BatchNormalization '{bn_key}' has non-finite "
                             f"or negative moving statistics; re-estimate them first "
                             f"(hope_keras.reestimate_batchnorm_statistics).")
        weights[p_key] = _folded_weights(g.layers[p_key], bn)
    new_layers = {}

    def call_node(node, tensors):
        if node.key in pairs:  # the BN: its output is its producer's (folded) output
            return tensors[node.inputs[0]]
        args, kwargs = node.call_args(tensors)
        if not kg.is_layer(node.op):
            return node.op(*args, **kwargs)
        layer = node.op
        new = new_layers.get(node.key)
        if new is None:
            config = layer.get_config()
            config["name"] = kg.flat_name(node.key)
            if node.key in producers:
                config["use_bias"] = True
            with kg.trusted_deserialization():
                new = type(layer).from_config(config)
            new_layers[node.key] = new
        return new(*args, **kwargs)

    result = kg.rebuild(model, call_node, name or f"{model.name}_folded", graph=g)
    for key, new in new_layers.items():
        old = g.layers[key]
        if key not in weights:
            for v_old, v_new in zip(old.weights, new.weights):
                v_new.assign(v_old.numpy())
            continue
        # A folded producer may have gained a bias: its other weights by attribute.
        for attr, value in weights[key].items():
            getattr(new, attr).assign(value)
        for attr in ("kernel", "depthwise_kernel", "pointwise_kernel"):
            if attr not in weights[key] and getattr(old, attr, None) is not None:
                getattr(new, attr).assign(getattr(old, attr).numpy())
    return result
