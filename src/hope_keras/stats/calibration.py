"""`calibrate`: let HOPE compress networks without BatchNorm (docs/theory.md §7).

HOPE's formulas read each neuron's pre-activation statistics from its BatchNorm: the
surrogate pre-activation has mean β and standard deviation |γ|. A network without
BatchNorm has no such statistics, so the paper measures them once on a small
unlabeled batch and uses ``γ := σ``, ``β := μ`` with the raw weights as the effective
ones.

`calibrate` realises this as an *equivalent model*: every Dense, ConvND or
SeparableConvND whose ReLU is fused (``activation="relu"``) or follows directly as
a ReLU layer, with no BatchNormalization in between, becomes

    producer (linear, same kernel and bias) → BatchNormalization → ReLU

where the BatchNormalization is the identity function with the measured statistics
of the producer's output ``z`` (its pre-activation), per channel:

    moving_mean = μ,  moving_variance = σ² − ε,  γ = σ,  β = μ.

Then ``BN(z) = γ (z − μ) / sqrt(σ² − ε + ε) + β = σ (z − μ)/σ + μ = z``: the model
computes the same function, and the BN folding of docs/theory.md §1 gives
``w_eff = w_raw``, ``b_eff = c`` (the producer's bias), mean β = μ and standard
deviation |γ| = σ, exactly the paper's substitution. `hope_keras.analyze`, `compress`
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

from hope_keras.graph import adapter as kg
from hope_keras.graph import layers as layer_rules
from hope_keras.stats import inputs as inputs_lib
from hope_keras.stats.bn_stats import check_finite_statistics
from hope_keras.activations import lookup as activation_lookup

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


def _activation_name(fn) -> str:
    # A function's own name (layer names stay plain), else the registry's (partials).
    return getattr(fn, "__name__", None) or activation_lookup.activation_name(fn) or str(fn)


def calibration_targets(model) -> Dict[str, str]:
    """Producers `calibrate` will split: ``{producer: "fused" | activation_layer}``.

    A target is a source layer (Dense, ConvND, SeparableConvND, ConvNDTranspose — not grouped,
    channels-last), called once, whose output is not a model output, and whose
    elementwise activation is
    fused into it (``"fused"``: any activation but linear and softmax) or is its only
    child, an activation layer (ReLU, LeakyReLU, ELU, PReLU, ``Activation(...)``),
    with no BatchNormalization before it.
    """
    fg = kg.flatten(model)
    out = {}
    for node in fg.nodes:
        layer = node.op
        rule = layer_rules.get(layer)
        if rule.kind not in ("dense", "conv", "separable", "transpose") or fg.calls[node.key] > 1:
            continue
        if rule.check(layer) is not None or fg.is_output(node.outputs[0]):
            continue
        act = getattr(layer, "activation", None)
        name = _activation_name(act)
        if name not in ("linear", "softmax", "log_softmax"):
            out[node.key] = "fused"
            continue
        if name != "linear":
            continue
        kids = fg.children(node)
        if len(kids) != 1 or fg.calls[kids[0].key] != 1:
            continue
        kid = kids[0]
        if layer_rules.role_of(kid.op, kid) == "channelwise" and \
                layer_rules.get(kid.op).activation(kid.op) is not None and \
                layer_rules.get(kid.op).normalization != "batch" and \
                layer_rules.get(kid.op).check(kid.op) is None:
            out[node.key] = kid.key
    return out


def _rebuild(model, targets: Dict[str, str], name: str):
    """The split model, with identity BNs (statistics filled in later)."""
    new_layers: Dict[str, keras.layers.Layer] = {}
    inserted: Dict[str, Tuple[str, str]] = {}
    used = set(kg.flatten(model).layers)

    def fresh(base):
        n, k = base, 1
        while n in used:
            n, k = f"{base}_{k}", k + 1
        used.add(n)
        return n

    fg = kg.flatten(model)

    def call_node(node, tensors):
        layer = node.op
        args, kwargs = node.call_args(tensors)
        if not kg.is_layer(layer):  # a stateless Keras operation
            return layer(*args, **kwargs)
        config = layer.get_config()
        config["name"] = kg.flat_name(node.key)
        target = targets.get(node.key)
        act = None
        if target == "fused":
            act = layer.activation
            config["activation"] = "linear"
        new = new_layers.get(node.key)
        if new is None:
            with kg.trusted_deserialization():
                new = new_layers[node.key] = layer.__class__.from_config(config)
        outputs = new(*args, **kwargs)
        if target is not None:
            bn_name = fresh(f"{layer.name}_calib_bn")
            z = keras.layers.BatchNormalization(
                epsilon=EPSILON, name=bn_name, dtype=layer.dtype_policy)(outputs)
            if target == "fused":
                act_name = fresh(f"{layer.name}_calib_{_activation_name(act)}")
                found = activation_lookup.resolve(act)
                plain_relu = found.name == "relu" and not found.params
                outputs = (keras.layers.ReLU(name=act_name) if plain_relu
                           else keras.layers.Activation(act, name=act_name))(z)
            else:
                act_name, outputs = target, z  # the existing activation layer follows
            inserted[kg.flat_name(node.key)] = (bn_name, act_name)
        return outputs

    result = kg.rebuild(model, call_node, name, graph=fg)
    for key, new in new_layers.items():
        old = fg.layers[key]
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
    σ² − ε inserted between it and its ReLU (docs/theory.md §7); see the module
    docstring. The input model is not changed.

    Args:
        model: A built Functional or Sequential `keras.Model` (flat).
        data: Unlabeled inputs: a numpy array (split into ``batch_size`` batches; a
            list or dict of arrays for a model of several inputs), or a
            ``tf.data.Dataset`` or iterable of batches (``x`` or ``(x, y, ...)``
            tuples): `hope_keras.stats.inputs`.
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
    >>> from hope_keras.stats.calibration import calibrate
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
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer. Received: "
                         f"batch_size={batch_size!r}")
    targets = calibration_targets(model)
    if not targets:
        has_bn = any(layer_rules.get(node.op).normalization == "batch"
                     for node in kg.flatten(model).nodes)
        raise ValueError(
            f"Model '{model.name}' has no Dense/Conv layer followed by an activation "
            "(fused or as the next layer) without a BatchNormalization between them: "
            "nothing to calibrate." + (
                " Its layers with a BatchNormalization are compressible as they are "
                "(hope_keras.analyze(model).summary() lists them)." if has_bn else ""))
    new, inserted = _rebuild(model, targets, name or f"{model.name}_calibrated")
    fused = {kg.flat_name(k): v == "fused" for k, v in targets.items()}
    producers = list(inserted)
    probe_inputs = new.inputs if len(new.inputs) > 1 else new.inputs[0]
    probe = keras.Model(probe_inputs, [new.get_layer(p).output for p in producers])
    count = np.zeros(len(producers))
    mean = [np.zeros(new.get_layer(p).output.shape[-1]) for p in producers]
    m2 = [np.zeros_like(m) for m in mean]
    seen = 0
    for x in inputs_lib.batches(model, data, batch_size):
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
    check_finite_statistics(producers, mean, m2, "calibrate: the statistics measured at",
                            "The model was not changed.")
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
        records.append(CalibratedLayer(p, bn_name, relu_name, fused[p], mu, var))
        if verbose:
            print(f"  calibrate {p}: {mu.shape[0]} channels, mean μ {mu.mean():.4g}, "
                  f"mean σ {np.sqrt(var).mean():.4g}, "
                  f"{int(np.sum(var <= eps))} near-constant")
    new.calibration = tuple(records)
    return new
