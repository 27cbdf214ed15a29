"""The built-in Gaussian activations and their look-up from Keras (docs/theory.md,
"Activations beyond ReLU").

The closed forms of the ReLU family (``max_value``, ``threshold``,
``negative_slope``), ELU and SELU, hard sigmoid and hard SiLU, and the quadrature
specs of the smooth activations; HOPE's view of the activation registry
(`register`, `names`, `get`, `from_layer`), whose look-up from Keras is
`hope_keras.activations.lookup` (shared with derivative matching).
`hope_keras.activations` gives all the names.
"""

from __future__ import annotations

import functools
from typing import Optional, Tuple

import numpy as np
from scipy import special
from scipy.special import ndtr

import keras

from hope_keras.activations import kernels
from hope_keras.graph import adapter as kg
from hope_keras.activations import lookup
from hope_keras.activations.gelu import (
    GELU_A as _GELU_A,
    GELU_C as _GELU_C,
    GELU_S as _GELU_S,
    gelu_approximate,
)
from hope_keras.activations.gaussian import GaussianActivation
from hope_keras.activations.gaussian_terms import Term, as_f64, normal_pdf


# --------------------------------------------------------------------------- #
# Built-in activations
# --------------------------------------------------------------------------- #


def _relu_forward(negative_slope, max_value, threshold):
    """numpy copy of ``keras.activations.relu`` (keras/src/activations/activations.py)."""

    def f(x):
        x = as_f64(x)
        if negative_slope != 0.0 and max_value is None and threshold == 0:
            return np.where(x > 0, x, negative_slope * x)
        neg = np.maximum(threshold - x, 0.0) if negative_slope != 0.0 else 0.0
        if threshold != 0:
            y = np.where(x > threshold, x, 0.0)
        else:
            y = np.maximum(x, 0.0)
        if max_value is not None:
            y = np.clip(y, 0.0, max_value)
        return y - negative_slope * neg

    return f


def _merge_terms(terms):
    """Adds the polynomials of terms with the same indicator; drops zero terms."""
    acc = {}
    order = []
    for t in terms:
        key = (t.direction, t.threshold if t.direction else 0.0, bool(t.exp_coef))
        if key not in acc:
            acc[key] = ([], 0.0)
            order.append(key)
        poly, e = acc[key]
        n = max(len(poly), len(t.poly))
        poly = [(poly[i] if i < len(poly) else 0.0) + (t.poly[i] if i < len(t.poly) else 0.0)
                for i in range(n)]
        acc[key] = (poly, e + t.exp_coef)
    out = []
    for key in order:
        poly, e = acc[key]
        while poly and poly[-1] == 0.0:
            poly.pop()
        if poly or e:
            out.append(Term(key[0], key[1], tuple(poly), e))
    return tuple(out)


def _relu_terms(negative_slope, max_value, threshold):
    ns, m, th = negative_slope, max_value, threshold
    terms = []
    # positive part P(x) = clip(x, 0, M) 1{x > th} (or x 1{x > th} without M)
    if m is None:
        terms.append(Term(1, th, (0.0, 1.0)))
    elif m == 0:
        pass
    elif th >= m:
        terms.append(Term(1, th, (m,)))
    else:
        lo = max(th, 0.0)
        terms.append(Term(1, lo, (0.0, 1.0)))
        terms.append(Term(1, m, (m, -1.0)))
    if ns:
        # ns (x - th) 1{x < th} = ns (x - th) - ns (x - th) 1{x > th}
        terms.append(Term(0, 0.0, (-ns * th, ns)))
        terms.append(Term(1, th, (ns * th, -ns)))
    return _merge_terms(terms)


@functools.lru_cache(maxsize=None)
def relu(negative_slope: float = 0.0, max_value: Optional[float] = None,
         threshold: float = 0.0) -> GaussianActivation:
    """The Gaussian moments of ``keras.activations.relu`` / ``keras.layers.ReLU``.

    ``ψ(x) = clip(x, 0, max_value) 1{x > threshold} + negative_slope (x - threshold)
    1{x < threshold}``, exactly as Keras computes it. Default parameters return the
    plain ReLU, whose moments are :mod:`hope_keras.activations.kernels` (bit-identical).

    Args:
        negative_slope: Slope below the threshold (>= 0).
        max_value: Saturation value (``None``: no saturation).
        threshold: Threshold below which the output is damped.

    Returns:
        A :class:`GaussianActivation` with closed-form moments.

    Example:
        >>> from hope_keras import activations
        >>> activations.relu(max_value=6.0) is activations.get("relu6")
        True
        >>> activations.relu().positively_homogeneous
        True
    """
    ns = float(negative_slope)
    m = None if max_value is None else float(max_value)
    th = float(threshold)
    if ns < 0 or (m is not None and m < 0):
        raise ValueError(
            "relu needs negative_slope >= 0 and max_value >= 0. Received: "
            f"negative_slope={negative_slope!r}, max_value={max_value!r}")
    if ns == 0.0 and m is None and th == 0.0:
        return _RELU
    if ns == 0.0 and m == 6.0 and th == 0.0 and "_RELU6" in globals():
        return _RELU6
    if m is None and th == 0.0 and "_LEAKY" in globals() and ns in _LEAKY:
        return _LEAKY[ns]
    params = (("negative_slope", ns), ("max_value", m), ("threshold", th))
    homogeneous = m is None and th == 0.0
    slope = ns
    if homogeneous and keras.backend.backend() == "tensorflow":
        # keras' leaky path is tf.nn.leaky_relu, whose alpha is a float32 attribute
        slope = float(np.float32(ns))
    if m is None and th == 0.0:
        name = "leaky_relu"
        params = (("negative_slope", ns),)
    elif ns == 0.0 and m == 6.0 and th == 0.0:
        name, params = "relu6", ()
    else:
        name = "relu"
    bps = sorted({0.0, th} | ({m} if m is not None else set()))
    return GaussianActivation(
        name=name,
        forward=_relu_forward(slope, m, th),
        positively_homogeneous=homogeneous,
        breakpoints=tuple(bps),
        terms=_relu_terms(slope, m, th),
        params=params,
    )


def leaky_relu(negative_slope: float = 0.2) -> GaussianActivation:
    """``keras.activations.leaky_relu`` / ``keras.layers.LeakyReLU``: ``x`` or ``slope·x``.

    With the TensorFlow backend the slope is rounded to float32, as
    ``tf.nn.leaky_relu`` does (its ``alpha`` is a float32 attribute).

    Args:
        negative_slope: Slope for ``x < 0`` (Keras' defaults: 0.2 for the function,
            0.3 for the layer).

    Returns:
        A positively homogeneous :class:`GaussianActivation` with closed forms.

    Example:
        >>> from hope_keras import activations
        >>> act = activations.leaky_relu(0.1)
        >>> round(float(act(-2.0)), 6), act.positively_homogeneous
        (-0.2, True)
    """
    return relu(negative_slope=negative_slope)


@functools.lru_cache(maxsize=None)
def _elu(alpha: float, scale: float, name: str) -> GaussianActivation:
    def forward(x):
        x = as_f64(x)
        with np.errstate(over="ignore"):
            return scale * np.where(x > 0, x, alpha * np.expm1(np.minimum(x, 0.0)))

    # scale * [x 1{x>0} + alpha (e^x - 1) 1{x<0}]
    #   = scale * [-alpha + (x + alpha) 1{x>0} + alpha e^x 1{x<0}]
    terms = (
        Term(0, 0.0, (-scale * alpha,)),
        Term(1, 0.0, (scale * alpha, scale)),
        Term(-1, 0.0, (), scale * alpha),
    )
    params = (("alpha", alpha),) if name == "elu" else ()
    return GaussianActivation(name=name, forward=forward, breakpoints=(0.0,),
                              terms=_merge_terms(terms), params=params)


def elu(alpha: float = 1.0) -> GaussianActivation:
    """``keras.activations.elu`` / ``keras.layers.ELU``: ``x`` or ``alpha (e^x - 1)``.

    Args:
        alpha: Scale of the negative part (> 0).

    Returns:
        A :class:`GaussianActivation` with closed forms (exponential tilting).

    Example:
        >>> from hope_keras import activations
        >>> act = activations.elu(1.0)
        >>> round(float(act.mean(0.0, 1.0)), 6)  # e^{1/2} Φ(-1) - 1/2 + φ(0)
        0.160521
    """
    alpha = float(alpha)
    if not alpha > 0:
        raise ValueError(f"elu needs alpha > 0. Received: alpha={alpha!r}")
    return _elu(alpha, 1.0, "elu")


_SELU_ALPHA = 1.6732632423543772848170429916717
_SELU_SCALE = 1.0507009873554804934193349852946


def _gelu_forward(x):
    return x * ndtr(_GELU_S * x)


def _gelu_mean(mu, sigma):
    # E[x Φ(s x)] = mu Φ(s mu / t) + s sigma² φ(s mu / t) / t,  t = sqrt(1 + s² sigma²)
    mu, sigma = as_f64(mu), as_f64(sigma)
    t = np.sqrt(1.0 + (_GELU_S * sigma) ** 2)
    u = _GELU_S * mu / t
    return mu * ndtr(u) + _GELU_S * sigma * sigma * normal_pdf(u) / t


def _gelu_tanh_forward(x):
    return 0.5 * x * (1.0 + np.tanh(_GELU_C * (x + _GELU_A * (x * x * x))))


def _softplus(x):
    return np.logaddexp(0.0, x)


def _silu(x):
    return x * special.expit(x)


def _mish(x):
    return x * np.tanh(np.logaddexp(0.0, x))


def _hard_sigmoid_forward(x):
    # keras (TF backend): relu6(x + 3) / 6
    return np.clip(as_f64(x) + 3.0, 0.0, 6.0) / 6.0


def _hard_silu_forward(x):
    x = as_f64(x)
    return x * _hard_sigmoid_forward(x)


def _relu_cross(mu_i, s_i, mu_j, s_j, rho):
    return kernels.cross_kernel_exact(s_i, mu_i, s_j, mu_j, rho)


_RELU = GaussianActivation(
    name="relu",
    forward=lambda x: np.maximum(as_f64(x), 0.0),
    positively_homogeneous=True,
    breakpoints=(0.0,),
    terms=(Term(1, 0.0, (0.0, 1.0)),),
    mean_fn=lambda mu, sigma: kernels.relu_mean(sigma, mu),
    second_moment_fn=lambda mu, sigma: kernels.self_kernel(sigma, mu),
    cross_fn=_relu_cross,
)
_RELU6 = relu(max_value=6.0)
_LEAKY = {0.2: relu(negative_slope=0.2), 0.3: relu(negative_slope=0.3)}
_LINEAR = GaussianActivation(
    name="linear",
    forward=lambda x: as_f64(x),
    positively_homogeneous=True,
    terms=(Term(0, 0.0, (0.0, 1.0)),),
)
_ELU = elu(1.0)
_SELU = _elu(_SELU_ALPHA, _SELU_SCALE, "selu")
_HARD_SIGMOID = GaussianActivation(
    name="hard_sigmoid",
    forward=_hard_sigmoid_forward,
    breakpoints=(-3.0, 3.0),
    terms=(Term(1, -3.0, (0.5, 1.0 / 6.0)), Term(1, 3.0, (0.5, -1.0 / 6.0))),
)
_HARD_SILU = GaussianActivation(
    name="hard_silu",
    forward=_hard_silu_forward,
    breakpoints=(-3.0, 3.0),
    # x (x + 3) / 6 on x > -3, then + (x - x (x + 3) / 6) on x > 3
    terms=(Term(1, -3.0, (0.0, 0.5, 1.0 / 6.0)), Term(1, 3.0, (0.0, 0.5, -1.0 / 6.0))),
)
_SIGMOID = GaussianActivation.from_function("sigmoid", special.expit)
_TANH = GaussianActivation.from_function("tanh", np.tanh)
_SOFTPLUS = GaussianActivation.from_function("softplus", _softplus)
_SILU = GaussianActivation.from_function("silu", _silu)
_MISH = GaussianActivation.from_function("mish", _mish)
_GELU = GaussianActivation.from_function("gelu", _gelu_forward, mean_fn=_gelu_mean)
_GELU_TANH = GaussianActivation.from_function("gelu_approximate", _gelu_tanh_forward)


# --------------------------------------------------------------------------- #
# HOPE's view of the activation registry (`hope_keras.activations.lookup`)
# --------------------------------------------------------------------------- #


class UnsupportedActivationError(ValueError):
    """An activation (or layer) whose Gaussian moments are not known.

    Attributes:
        reason: Why, in words (also the start of the message).
    """

    def __init__(self, reason: str, hint: str = ""):
        super().__init__(reason + (". " + hint if hint else ""))
        self.reason = reason


def register(activation, spec: GaussianActivation, *, overwrite: bool = False) -> None:
    """Make an activation known to :func:`get` and :func:`from_layer`.

    HOPE's view of the one activation registry: derivative matching's
    ``hope_keras.derivative_matching.register_activation`` sets the other view (the
    Taylor table) of the same entry.

    Args:
        activation: The Keras activation callable used in the layers, or its name.
        spec: Its :class:`GaussianActivation`.
        overwrite: Replace an existing entry instead of raising.

    Raises:
        ValueError: If an entry exists and ``overwrite`` is False, or ``activation``
            is neither a string nor a callable.

    Example:
        >>> import numpy as np
        >>> from hope_keras import activations
        >>> def softsign(x):
        ...     return x / (1 + abs(x))
        >>> spec = activations.GaussianActivation.from_function(
        ...     "softsign", lambda x: x / (1.0 + np.abs(x)), breakpoints=(0.0,))
        >>> activations.register(softsign, spec, overwrite=True)
        >>> activations.get(softsign) is spec
        True
    """
    if not isinstance(spec, GaussianActivation):
        raise ValueError(f"register expects a GaussianActivation. Received: spec={spec!r}")
    lookup.register(activation, "gaussian", spec, overwrite=overwrite)


def names() -> Tuple[str, ...]:
    """The registered activation names.

    Returns:
        Sorted tuple of names accepted by :func:`get`.

    Example:
        >>> from hope_keras import activations
        >>> "gelu" in activations.names()
        True
    """
    return lookup.names("gaussian")


def get(identifier) -> GaussianActivation:
    """The :class:`GaussianActivation` of a Keras activation (``keras.activations.get`` style).

    Args:
        identifier: A name (``"relu"``, ``"swish"``, …), a Keras activation callable
            (also ``functools.partial(keras.activations.relu, max_value=…)``), a
            serialised activation dict, a Keras activation layer, a
            :class:`GaussianActivation` (returned as is), or ``None`` (linear).

    Returns:
        The registered :class:`GaussianActivation`.

    Raises:
        UnsupportedActivationError: For unknown or non-elementwise activations
            (a ``ValueError``), with what to do.

    Example:
        >>> import keras
        >>> from hope_keras import activations
        >>> activations.get(keras.activations.silu).name
        'silu'
        >>> activations.get(None).name
        'linear'
    """
    if isinstance(identifier, GaussianActivation):
        return identifier
    if kg.is_layer(identifier):
        return from_layer(identifier)
    spec, found = lookup.lookup(identifier, "gaussian")
    if spec is None:
        raise _unsupported(found)
    return spec


def _unsupported(found, where: str = "") -> UnsupportedActivationError:
    """Why `found` (`activation_lookup.Resolved`) has no Gaussian moments."""
    prefix = f"{where}: " if where else ""
    if found.problem == "applies no activation":
        return UnsupportedActivationError(f"{where} {found.problem}")
    if found.problem:
        return UnsupportedActivationError(prefix + found.problem)
    if found.name in lookup.NOT_ELEMENTWISE:
        return UnsupportedActivationError(prefix + lookup.NOT_ELEMENTWISE[found.name])
    with_params = f" with parameters {dict(found.params)}" if found.params else ""
    return UnsupportedActivationError(
        f"{prefix}No Gaussian moments are registered for activation {found.name!r}"
        f"{with_params}",
        "Build them with hope_keras.activations.GaussianActivation.from_function(name, "
        "numpy_fn) and hope_keras.activations.register(activation, spec). Known: "
        + ", ".join(names()))


def from_layer(layer) -> GaussianActivation:
    """The activation applied by a Keras layer, as a :class:`GaussianActivation`.

    Reads the activation the layer registry says the layer applies
    (``keras.layers.ReLU`` with its ``max_value``, ``negative_slope`` and
    ``threshold``, ``LeakyReLU``, ``ELU``, ``Activation``; `hope_keras.layers`), else
    the fused ``activation`` of Dense, convolution and other layers that have one.

    Args:
        layer: A Keras layer.

    Returns:
        The :class:`GaussianActivation`.

    Raises:
        UnsupportedActivationError: For PReLU (learned slopes), Softmax, layers
            without an activation, and unknown activations; the message names the
            layer.

    Example:
        >>> import keras
        >>> from hope_keras import activations
        >>> activations.from_layer(keras.layers.ReLU(max_value=6.0)).name
        'relu6'
        >>> activations.from_layer(keras.layers.Dense(3, activation="tanh")).name
        'tanh'
    """
    where = f"layer {getattr(layer, 'name', layer)!r} ({type(layer).__name__})"
    spec, found = lookup.lookup(layer, "gaussian")
    if spec is None:
        raise _unsupported(found, where)
    return spec


def _register_builtins() -> None:
    entries = [
        ("relu", _RELU),
        ("relu6", _RELU6),
        ("leaky_relu", _LEAKY[0.2]),
        ("elu", _ELU),
        ("selu", _SELU),
        ("hard_sigmoid", _HARD_SIGMOID),
        ("hard_silu", _HARD_SILU),
        ("sigmoid", _SIGMOID),
        ("tanh", _TANH),
        ("softplus", _SOFTPLUS),
        ("silu", _SILU),
        ("gelu", _GELU),
        ("mish", _MISH),
        ("linear", _LINEAR),
        ("gelu_approximate", _GELU_TANH),
    ]
    for name, spec in entries:  # Keras' callables resolve to the same entries
        lookup.register(name, "gaussian", spec, overwrite=True)
    lookup.register(gelu_approximate, "gaussian", _GELU_TANH, overwrite=True)
    # ReLU(max_value=…), LeakyReLU(negative_slope=…), ELU(alpha=…) and the partials
    for name, family in (("relu", relu), ("leaky_relu", leaky_relu), ("elu", elu)):
        lookup.register_family(name, "gaussian", family)


_register_builtins()
