"""Gaussian moments of elementwise activations: HOPE beyond ReLU.

HOPE's kernels are moments of an activation ``ψ`` of Gaussian pre-activations
(docs/theory.md §1, §8): for ``z ~ N(μ, σ²)`` the mean ``E[ψ(z)]`` and the self-kernel
``E[ψ(z)²]``, and for a jointly Gaussian pair with correlation ``ρ`` the cross
moment ``E[ψ(z_i) ψ(z_j)]``. This module gives them for the activations Keras
models use, as pure float64 numpy/scipy math vectorised by broadcasting (Keras is
only touched by the look-up functions :func:`get` and :func:`from_layer`):

* ReLU delegates to :mod:`hope_keras.activations.kernels` (bit-identical to the engine's kernels).
* Piecewise-polynomial and exponential activations (ReLU with ``max_value`` /
  ``threshold`` / ``negative_slope``, ReLU6, leaky ReLU, hard sigmoid, hard SiLU, ELU,
  SELU, linear) use closed forms: truncated Gaussian moments, and for the cross
  moment bivariate truncated moments built from one bivariate normal CDF per pair
  of breakpoints (Stein recursion, exponential tilting for ELU).
* Smooth activations (sigmoid, tanh, softplus, SiLU/swish, GELU exact and tanh,
  mish, and any function given to :meth:`GaussianActivation.from_function`) use a
  composite Gauss–Legendre rule for the one-dimensional moments and the
  one-dimensional conditional trick with Gauss–Hermite sums for the cross moment
  (closed-form inner mean for GELU).

:func:`invert_moments` goes the other way: from an activation's output mean and
variance (a BatchNormalization placed after the activation) to the Gaussian
pre-activation that produces them. The formulas are in docs/theory.md,
"Activations beyond ReLU".

Example:
    >>> from hope_keras import activations
    >>> silu = activations.get("swish")
    >>> round(float(silu.mean(0.0, 1.0)), 6)
    0.206621
    >>> round(float(activations.get("relu6").cross(1.0, 2.0, 1.0, 2.0, 1.0)), 9) == \
round(float(activations.get("relu6").second_moment(1.0, 2.0)), 9)
    True
"""

from hope_keras.activations.registry import (
    UnsupportedActivationError,
    elu,
    from_layer,
    get,
    leaky_relu,
    names,
    register,
    relu,
)
from hope_keras.activations.gaussian import GaussianActivation
from hope_keras.activations.inversion import MomentInversion, invert_moments

__all__ = [
    "GaussianActivation",
    "MomentInversion",
    "UnsupportedActivationError",
    "from_layer",
    "get",
    "invert_moments",
    "names",
    "register",
    "relu",
    "leaky_relu",
    "elu",
]
