"""`calibrate`: let HOPE compress networks without BatchNorm (spec section 7).

HOPE's formulas read each neuron's pre-activation statistics from its BatchNorm: the
surrogate pre-activation has mean β and standard deviation |γ|. A network without
BatchNorm has no such statistics, so the paper measures them once on a small
unlabeled batch and uses ``γ := σ``, ``β := μ`` with the raw weights as the effective
ones.

`calibrate` realises this as an *equivalent model*: every Dense/ConvND whose ReLU is
fused (``activation="relu"``) or follows directly as a ReLU layer, with no
BatchNormalization in between, becomes

    producer (linear, same kernel and bias) → BatchNormalization → ReLU

where the BatchNormalization is the identity function with the measured statistics
of the producer's output ``z`` (its pre-activation), per channel:

    moving_mean = μ,  moving_variance = σ² − ε,  γ = σ,  β = μ.

Then ``BN(z) = γ (z − μ) / sqrt(σ² − ε + ε) + β = σ (z − μ)/σ + μ = z``: the model
computes the same function, and the BN folding of spec section 1 gives
``w_eff = w_raw``, ``b_eff = c`` (the producer's bias), mean β = μ and standard
deviation |γ| = σ, exactly the spec's substitution. `hope_keras.analyze`, `compress`
and `slim` then work unchanged, and HOPE's merges write their parent's statistics
into the inserted BN like in any BN network.

A channel whose measured variance is below ``epsilon`` (e.g. a constant
pre-activation) gets ``moving_variance = epsilon · 1e-3`` and ``γ = sqrt(that + ε)``
(≈ sqrt(ε), the function is still the identity); a zero moving variance would make
`analyze` pin the layer as uncalibrated.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Tuple

import keras
import numpy as np

from hope_keras import graph as graph_lib

__all__ = ["calibrate", "CalibratedLayer", "calibration_targets"]

#: Epsilon of the inserted BatchNormalization layers (small so that γ = σ holds
#: for every channel with σ² > ε; float32 keeps the identity to ~1e-7 relative).
EPSILON = 1e-6


@dataclasses.dataclass(frozen=True)
class CalibratedLayer:
    """One producer that `calibrate` split (``model.calibration`` lists them)."""

    producer: str
    bn: str
    relu: str
    fused: bool
    mean: np.ndarray
    var: np.ndarray


def _is_relu_activation(fn) -> bool:
    return getattr(fn, "__name__", "") == "relu"


def calibration_targets(model) -> Dict[str, str]:
    """Producers `calibrate` will split: ``{producer: "fused" | relu_layer_name}``.

    A target is a Dense/ConvND (not grouped, channels-last), called once, whose
    output is not a model output, and whose ReLU is fused into it (``"fused"``) or
    is its only child, a plain ReLU layer, with no BatchNormalization before it.
    """
    g = graph_lib._LayerGraph(model)
    out = {}
    for name in g.order:
        layer = g.layers[name]
        if not isinstance(layer, graph_lib._KERNEL_TYPES) or g.calls[name] > 1:
            continue
        if graph_lib._kernel_problem(layer) is not None or name in g.outputs:
            continue
        act = getattr(layer, "activation", None)
        if _is_relu_activation(act):
            out[name] = "fused"
        elif getattr(act, "__name__", "") == "linear":
            child = g.only_child(name)
            if child is not None and graph_lib._is_relu(g.layers[child]) \
                    and g.calls[child] == 1:
                out[name] = child
    return out


def _iter_batches(data, batch_size):
    if isinstance(data, (np.ndarray,)) or hasattr(data, "shape"):
        x = np.asarray(data)
        for k in range(0, len(x), batch_size):
            yield x[k:k + batch_size]
        return
    for item in data:
        if isinstance(item, tuple):
            item = item[0]
        yield item


def _rebuild(model, targets: Dict[str, str], name: str):
    """The split model, with identity BNs (statistics filled in later)."""
    new_layers: Dict[str, keras.layers.Layer] = {}
    inserted: Dict[str, Tuple[str, str]] = {}
    used = {layer.name for layer in model.layers}

    def fresh(base):
        n, k = base, 1
        while n in used:
            n, k = f"{base}_{k}", k + 1
        used.add(n)
        return n

    def call_node(node, tensors):
        layer = node.operation
        config = layer.get_config()
        target = targets.get(layer.name)
        if target == "fused":
            config["activation"] = "linear"
        new = layer.__class__.from_config(config)
        args, kwargs = node.arguments.fill_in(tensors)
        outputs = new(*args, **kwargs)
        new_layers[layer.name] = new
        if target is not None:
            bn_name = fresh(f"{layer.name}_calib_bn")
            z = keras.layers.BatchNormalization(
                epsilon=EPSILON, name=bn_name, dtype=layer.dtype_policy)(outputs)
            if target == "fused":
                relu_name = fresh(f"{layer.name}_calib_relu")
                outputs = keras.layers.ReLU(name=relu_name)(z)
            else:
                relu_name, outputs = target, z  # the existing ReLU layer follows
            inserted[layer.name] = (bn_name, relu_name)
        return outputs

    result = graph_lib.rebuild(model, call_node, name)
    for lname, new in new_layers.items():
        old = model.get_layer(lname)
        if old.weights:
            new.set_weights(old.get_weights())
    return result, inserted


def calibrate(model, data, batch_size: int = 256, batches: Optional[int] = None,
              name: Optional[str] = None, verbose: bool = False):
    """Returns an equivalent model whose BN-free ReLU neurons HOPE can compress.

    One forward pass over ``data`` (a small unlabeled batch suffices; a few hundred
    inputs are plenty) measures the mean μ and the population (divide-by-N) variance
    σ² of every target producer's output, per channel (over the batch and, for
    convolutions, all positions), in float64. Each target gets a
    BatchNormalization with ``γ = σ, β = μ``, moving mean μ and moving variance
    σ² − ε inserted between it and its ReLU (spec section 7); see the module
    docstring. The input model is not changed.

    Args:
        model: A built Functional or Sequential `keras.Model` (flat).
        data: Unlabeled inputs: a numpy array (split into ``batch_size`` batches) or
            an iterable of batches (``x`` or ``(x, y, ...)`` tuples).
        batch_size: Batch size for a numpy array.
        batches: Use at most this many batches.
        name: Name of the new model (default ``"<name>_calibrated"``).
        verbose: Print one line per calibrated layer.

    Returns:
        The calibrated `keras.Model`. Its attribute ``calibration`` lists the
        `CalibratedLayer` records (producer, inserted BN and ReLU names, μ, σ²).

    Raises:
        ValueError: if the model has no BN-free ReLU producer, or ``data`` is empty.

    Example:

    >>> import keras, numpy as np, hope_keras
    >>> from hope_keras.calibration import calibrate
    >>> inputs = keras.Input((8,))
    >>> h = keras.layers.Dense(16, activation="relu", name="fc")(inputs)
    >>> model = keras.Model(inputs, keras.layers.Dense(2, name="head")(h))
    >>> x = np.random.default_rng(0).normal(size=(256, 8)).astype("float32")
    >>> calibrated = calibrate(model, x)
    >>> bool(np.allclose(calibrated(x), model(x), atol=1e-5))
    True
    >>> [g.name for g in hope_keras.analyze(calibrated).groups]
    ['fc']
    """
    targets = calibration_targets(model)
    if not targets:
        raise ValueError(
            f"Model '{model.name}' has no Dense/Conv layer with a ReLU (fused or as the "
            "next layer) and no BatchNormalization: nothing to calibrate."
        )
    new, inserted = _rebuild(model, targets, name or f"{model.name}_calibrated")
    producers = list(inserted)
    probe_inputs = new.inputs if len(new.inputs) > 1 else new.inputs[0]
    probe = keras.Model(probe_inputs, [new.get_layer(p).output for p in producers])
    count = np.zeros(len(producers))
    mean = [np.zeros(new.get_layer(p).output.shape[-1]) for p in producers]
    m2 = [np.zeros_like(m) for m in mean]
    seen = 0
    for x in _iter_batches(data, batch_size):
        if batches is not None and seen >= batches:
            break
        outs = probe(x, training=False)
        if len(producers) == 1:
            outs = [outs]
        for k, z in enumerate(outs):
            z = np.asarray(z, dtype=np.float64).reshape(-1, mean[k].shape[0])
            nb = z.shape[0]
            mb = z.mean(axis=0)
            m2b = ((z - mb) ** 2).sum(axis=0)
            total = count[k] + nb
            delta = mb - mean[k]
            mean[k] = mean[k] + delta * (nb / total)
            m2[k] = m2[k] + m2b + delta ** 2 * (count[k] * nb / total)
            count[k] = total
        seen += 1
    if seen == 0:
        raise ValueError("calibrate: data yielded no batches.")
    records: List[CalibratedLayer] = []
    for k, p in enumerate(producers):
        bn_name, relu_name = inserted[p]
        bn = new.get_layer(bn_name)
        mu, var = mean[k], m2[k] / count[k]
        eps = float(bn.epsilon)
        moving_var = np.where(var > eps, var - eps, eps * 1e-3)
        gamma = np.sqrt(moving_var + eps)  # = σ wherever σ² > ε
        dtype = bn.moving_mean.dtype
        bn.gamma.assign(gamma.astype(dtype))
        bn.beta.assign(mu.astype(dtype))
        bn.moving_mean.assign(mu.astype(dtype))
        bn.moving_variance.assign(moving_var.astype(dtype))
        records.append(CalibratedLayer(p, bn_name, relu_name, targets[p] == "fused",
                                       mu, var))
        if verbose:
            print(f"  calibrate {p}: {mu.shape[0]} channels, mean μ {mu.mean():.4g}, "
                  f"mean σ {np.sqrt(var).mean():.4g}, "
                  f"{int(np.sum(var <= eps))} near-constant")
    new.calibration = tuple(records)
    return new
