"""Exact Taylor tables of real-analytic activations.

Derivative matching needs, for every hidden neuron, the Taylor coefficients
``a_m = σ^(m)(z0) / m!`` (``m = 0..k``) of its activation at the neuron's
pre-activation ``z0`` at the expansion center. This module computes them exactly
(up to float64 rounding), vectorised over ``z0``, from the ordinary differential
equation each activation satisfies:

* sigmoid ``s' = s (1 - s)`` and tanh ``t' = 1 - t²`` give quadratic
  (Cauchy-product) recurrences on the coefficients;
* softplus is the antiderivative of sigmoid, SiLU is ``x · sigmoid(x)``;
* exact GELU ``x Φ(x)`` uses ``φ' = -x φ`` for the normal density, the
  tanh-approximate GELU composes ``tanh`` with a cubic through ``T' = (1 - T²) u'``.

Activations are looked up in the library's one activation registry
(`hope_keras.activations.lookup`, keyed by the Keras activation callable and by its
name), whose entries HOPE's Gaussian moments share; :func:`register_activation`
adds new ones (for example a polynomial activation, see
:func:`polynomial_activation`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Optional, Sequence

import numpy as np
from scipy import special

import keras

from hope_keras.activations import lookup
from hope_keras.activations.gelu import GELU_A, GELU_C, GELU_S, gelu_approximate

__all__ = [
    "AnalyticActivation",
    "register_activation",
    "get_analytic_activation",
    "taylor_coefficients",
    "polynomial_activation",
    "gelu_approximate",
    "NON_ANALYTIC_ACTIVATIONS",
]

#: Keras activation names that are known not to be real-analytic everywhere.
NON_ANALYTIC_ACTIVATIONS = frozenset(
    {
        "relu",
        "relu6",
        "leaky_relu",
        "elu",
        "selu",
        "celu",
        "hard_sigmoid",
        "hard_silu",
        "hard_swish",
        "hard_tanh",
        "hard_shrink",
        "soft_shrink",
        "tanh_shrink_abs",
        "softsign",
        "sparse_plus",
        "sparsemax",
        "threshold",
        "squareplus_b0",
    }
)


@dataclasses.dataclass(frozen=True)
class AnalyticActivation:
    """A real-analytic activation known to derivative matching.

    Attributes:
        name: Display name (used in reports and error messages).
        taylor: ``taylor(z0, order) -> array (order + 1, *z0.shape)`` of Taylor
            coefficients ``σ^(m)(z0) / m!`` in float64.
        forward: Elementwise float64 numpy implementation of ``σ``.

    Example:

    ```python
    import numpy as np
    from hope_keras.derivative_matching import AnalyticActivation
    cube = AnalyticActivation(
        name="cube",
        taylor=lambda z, k: np.stack(
            [z**3, 3 * z**2, 3 * z, np.ones_like(z)] + [0 * z] * (k - 3))[: k + 1],
        forward=lambda z: z**3)
    ```
    """

    name: str
    taylor: Callable[[np.ndarray, int], np.ndarray]
    forward: Callable[[np.ndarray], np.ndarray]


# --------------------------------------------------------------------------- #
# Coefficient recurrences. All take z0 as a float64 array and return
# an array of shape (order + 1,) + z0.shape.
# --------------------------------------------------------------------------- #


def _cauchy(a: np.ndarray, b: np.ndarray, n: int) -> np.ndarray:
    """Coefficient ``n`` of the product of two series (first ``n+1`` terms used)."""
    return np.einsum("j...,j...->...", a[: n + 1], b[n::-1])


def _sigmoid_taylor(z0: np.ndarray, order: int) -> np.ndarray:
    s = np.zeros((order + 1,) + z0.shape)
    s[0] = special.expit(z0)
    for n in range(order):
        # s' = s - s^2  =>  (n+1) s_{n+1} = s_n - (s*s)_n
        s[n + 1] = (s[n] - _cauchy(s, s, n)) / (n + 1)
    return s


def _tanh_taylor(z0: np.ndarray, order: int) -> np.ndarray:
    t = np.zeros((order + 1,) + z0.shape)
    t[0] = np.tanh(z0)
    for n in range(order):
        # t' = 1 - t^2
        t[n + 1] = ((1.0 if n == 0 else 0.0) - _cauchy(t, t, n)) / (n + 1)
    return t


def _softplus_taylor(z0: np.ndarray, order: int) -> np.ndarray:
    s = _sigmoid_taylor(z0, max(order - 1, 0))
    out = np.zeros((order + 1,) + z0.shape)
    out[0] = np.logaddexp(0.0, z0)
    for n in range(order):
        out[n + 1] = s[n] / (n + 1)
    return out


def _times_x(z0: np.ndarray, f: np.ndarray) -> np.ndarray:
    """Coefficients of ``(z0 + h) · f(h)`` truncated to the length of ``f``."""
    out = z0 * f
    out[1:] += f[:-1]
    return out


def _silu_taylor(z0: np.ndarray, order: int) -> np.ndarray:
    return _times_x(z0, _sigmoid_taylor(z0, order))


_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)




def _gelu_taylor(z0: np.ndarray, order: int) -> np.ndarray:
    # gelu(x) = x Φ(s x). With u = s z0: Φ' = φ, φ' = -u φ
    #   =>  (n+1) φ_{n+1} = -(u φ_n + φ_{n-1});  then rescale the n-th term by s^n.
    u = GELU_S * z0
    phi = np.zeros((order + 1,) + z0.shape)
    phi[0] = _INV_SQRT_2PI * np.exp(-0.5 * u * u)
    for n in range(order):
        prev = phi[n - 1] if n >= 1 else 0.0
        phi[n + 1] = -(u * phi[n] + prev) / (n + 1)
    cdf = np.zeros_like(phi)
    cdf[0] = special.ndtr(u)
    cdf[1:] = phi[:-1] / np.arange(1, order + 1).reshape((-1,) + (1,) * z0.ndim)
    cdf *= (GELU_S ** np.arange(order + 1)).reshape((-1,) + (1,) * z0.ndim)
    return _times_x(z0, cdf)




def _gelu_tanh_taylor(z0: np.ndarray, order: int) -> np.ndarray:
    # u(h) = c (x + a x^3), x = z0 + h ; T = tanh(u) ; T' = (1 - T^2) u'
    du = np.stack(
        [
            GELU_C * (1.0 + 3.0 * GELU_A * z0 * z0),
            2.0 * GELU_C * 3.0 * GELU_A * z0,
            np.full_like(z0, 3.0 * GELU_C * GELU_A),
        ]
    )
    t = np.zeros((order + 1,) + z0.shape)
    v = np.zeros_like(t)  # v = 1 - T^2
    t[0] = np.tanh(GELU_C * (z0 + GELU_A * z0**3))
    for n in range(order):
        v[n] = (1.0 if n == 0 else 0.0) - _cauchy(t, t, n)
        acc = np.zeros_like(z0)
        for j in range(min(n, 2) + 1):
            acc = acc + v[n - j] * du[j]
        t[n + 1] = acc / (n + 1)
    half = 0.5 * t
    half[0] += 0.5
    return _times_x(z0, half)


def _linear_taylor(z0: np.ndarray, order: int) -> np.ndarray:
    out = np.zeros((order + 1,) + z0.shape)
    out[0] = z0
    if order >= 1:
        out[1] = 1.0
    return out


def _gelu_np(z):
    return z * special.ndtr(GELU_S * z)


def _gelu_tanh_np(z):
    return 0.5 * z * (1.0 + np.tanh(GELU_C * (z + GELU_A * z**3)))


def register_activation(
    activation, spec: AnalyticActivation, *, overwrite: bool = False
) -> None:
    """Make an activation usable by derivative matching.

    Derivative matching's view of the one activation registry
    (`hope_keras.activations.lookup`): `hope_keras.activations.register` sets the
    other view (the Gaussian moments HOPE reads) of the same entry.

    Args:
        activation: The Keras activation callable used in the layers and/or its
            registered name (a string). Both are accepted; pass the callable for
            custom functions.
        spec: Its :class:`AnalyticActivation` (Taylor table and numpy forward).
        overwrite: Replace an existing entry instead of raising.

    Raises:
        ValueError: If an entry already exists and ``overwrite`` is False.

    Example:

    ```python
    import keras
    from hope_keras.derivative_matching import (
        polynomial_activation, register_activation)
    quad, spec = polynomial_activation([0.0, 1.0, 0.5], name="quad")
    register_activation(quad, spec, overwrite=True)
    layer = keras.layers.Dense(16, activation=quad)
    ```
    """
    lookup.register(activation, "analytic", spec, overwrite=overwrite,
                    caller="register_activation")


def get_analytic_activation(activation) -> Optional[AnalyticActivation]:
    """Return the registered :class:`AnalyticActivation` or ``None``.

    Args:
        activation: A Keras activation callable or name (also a
            ``functools.partial`` of one, or an activation layer).

    Returns:
        The registry entry, or ``None`` if the activation is unknown.

    Example:

    ```python
    import keras
    from hope_keras.derivative_matching import get_analytic_activation
    spec = get_analytic_activation(keras.activations.tanh)
    assert spec.name == "tanh"
    ```
    """
    return lookup.lookup(activation, "analytic")[0]


def taylor_coefficients(activation, z0, order: int) -> np.ndarray:
    """Taylor coefficients ``σ^(m)(z0)/m!`` for ``m = 0..order``, exact, float64.

    Args:
        activation: A registered activation (callable or name, e.g. ``"gelu"``).
        z0: Expansion points (any shape).
        order: Highest order ``k >= 0``.

    Returns:
        Array of shape ``(order + 1,) + np.shape(z0)``; multiply row ``m`` by
        ``m!`` to get the derivative ``σ^(m)(z0)``.

    Raises:
        ValueError: If the activation is unknown or ``order < 0``.

    Example:

    ```python
    from hope_keras.derivative_matching import taylor_coefficients
    c = taylor_coefficients("sigmoid", [0.0], 3)
    # sigmoid(h) = 1/2 + h/4 - h^3/48 + ...
    assert abs(c[3, 0] + 1 / 48) < 1e-15
    ```
    """
    if int(order) != order or order < 0:
        raise ValueError(f"order must be a non-negative integer. Received: order={order!r}")
    spec = get_analytic_activation(activation)
    if spec is None:
        raise ValueError(
            f"Activation {lookup.activation_name(activation)!r} is not registered as "
            "real-analytic. Register it with "
            "hope_keras.derivative_matching.register_activation."
        )
    z0 = np.asarray(z0, dtype=np.float64)
    out = np.asarray(spec.taylor(z0, int(order)), dtype=np.float64)
    expected = (int(order) + 1,) + z0.shape
    if out.shape != expected:
        raise ValueError(
            f"The Taylor table of activation {spec.name!r} returned shape "
            f"{out.shape}; expected {expected}."
        )
    return out


def polynomial_activation(coefficients: Sequence[float], name: str = "polynomial"):
    """A polynomial activation ``σ(z) = Σ_j c_j z^j`` and its exact Taylor table.

    Polynomials are entire, so derivative matching applies; a network whose
    hidden features are polynomials of degree ``≤ k`` in the input is compressed
    with zero error at order ``k``.

    Args:
        coefficients: ``[c_0, c_1, …]``, lowest degree first.
        name: Name of the Keras function (also used for serialisation).

    Returns:
        ``(activation, spec)``: a Keras-compatible callable and its
        :class:`AnalyticActivation`. Register the pair with
        :func:`register_activation` before compressing.

    Example:

    ```python
    import keras
    from hope_keras.derivative_matching import (
        polynomial_activation, register_activation)
    quad, spec = polynomial_activation([0.0, 1.0, 0.3], name="quad")
    register_activation(quad, spec, overwrite=True)
    model = keras.Sequential([keras.Input((2,)),
                              keras.layers.Dense(32, activation=quad),
                              keras.layers.Dense(1)])
    ```
    """
    coeffs = [float(c) for c in coefficients]
    if not coeffs:
        raise ValueError("polynomial_activation needs at least one coefficient.")

    def activation(x):
        x = keras.ops.convert_to_tensor(x)
        out = keras.ops.zeros_like(x) + coeffs[-1]
        for c in reversed(coeffs[:-1]):
            out = out * x + c
        return out

    activation.__name__ = name

    def forward(z):
        return np.polynomial.polynomial.polyval(z, coeffs)

    def taylor(z0, order):
        out = np.zeros((order + 1,) + z0.shape)
        for n in range(min(order, len(coeffs) - 1) + 1):
            acc = np.zeros_like(z0)
            for j in range(n, len(coeffs)):
                acc = acc + coeffs[j] * math.comb(j, n) * z0 ** (j - n)
            out[n] = acc
        return out

    return activation, AnalyticActivation(name=name, taylor=taylor, forward=forward)


def _register_builtins() -> None:
    entries = [
        ("sigmoid", _sigmoid_taylor, special.expit),
        ("tanh", _tanh_taylor, np.tanh),
        ("softplus", _softplus_taylor, lambda z: np.logaddexp(0.0, z)),
        ("silu", _silu_taylor, lambda z: z * special.expit(z)),
        ("gelu", _gelu_taylor, _gelu_np),
        ("linear", _linear_taylor, lambda z: z),
        ("gelu_approximate", _gelu_tanh_taylor, _gelu_tanh_np),
    ]
    for name, taylor, forward in entries:  # Keras' callables resolve to the same entries
        spec = AnalyticActivation(name=name, taylor=taylor, forward=forward)
        lookup.register(name, "analytic", spec, overwrite=True)
    lookup.register(gelu_approximate, "analytic", lookup.lookup("gelu_approximate",
                                                                "analytic")[0],
                    overwrite=True)


_register_builtins()
