"""Gaussian moments of elementwise activations: HOPE beyond ReLU.

HOPE's kernels are moments of an activation ``ψ`` of Gaussian pre-activations
(docs/theory.md §1, §8): for ``z ~ N(μ, σ²)`` the mean ``E[ψ(z)]`` and the self-kernel
``E[ψ(z)²]``, and for a jointly Gaussian pair with correlation ``ρ`` the cross
moment ``E[ψ(z_i) ψ(z_j)]``. This module gives them for the activations Keras
models use, as pure float64 numpy/scipy math vectorised by broadcasting (Keras is
only touched by the look-up functions :func:`get` and :func:`from_layer`):

* ReLU delegates to :mod:`hope_keras.kernels` (bit-identical to the engine's kernels).
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

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from typing import Callable, NamedTuple, Optional, Sequence, Tuple

import numpy as np
from scipy import special
from scipy.special import log_ndtr, ndtr

import keras

from hope_keras import kernels
from hope_keras.derivative_matching.activations import (
    _GELU_A,
    _GELU_C,
    _GELU_S,
    gelu_approximate,
)

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

_SQRT_2PI = math.sqrt(2.0 * math.pi)
# Standardised arguments are clipped here (as in kernels.py): Phi(+-50) is exactly
# 1/0 in float64 and phi(50) underflows, so nothing measurable changes.
_Z_CLIP = 50.0
# Elements of a broadcast larger than this are processed in blocks along axis 0
# (bounds the memory of the quadrature and closed-form temporaries).
_BLOCK = 1 << 20


def _f64(x):
    return np.asarray(x, dtype=np.float64)


def _phi(x):
    return np.exp(-0.5 * x * x) / _SQRT_2PI


# --------------------------------------------------------------------------- #
# Quadrature rules
# --------------------------------------------------------------------------- #


@functools.lru_cache(maxsize=None)
def _gauss_hermite(n: int):
    """Probabilists' Gauss–Hermite rule: ``E[f(Z)] ≈ Σ w f(x)``, weights sum to 1."""
    x, w = np.polynomial.hermite_e.hermegauss(n)
    return x, w / w.sum()


@functools.lru_cache(maxsize=None)
def _gauss_legendre(n: int):
    return np.polynomial.legendre.leggauss(n)


# Composite rule for one-dimensional Gaussian expectations E[f(mu + sigma Z)].
# Panels: Z in [-10, 10] cut every 2 units, plus the activation's breakpoints and
# "feature points" mapped to Z. Each panel gets 16 Gauss–Legendre nodes. Between
# cuts the integrand is analytic: the Gaussian is resolved to round-off on panels
# 2 wide, and an activation with poles at distance >= pi/2 from the real axis
# (tanh; sigmoid, softplus, SiLU: pi) is resolved to ~1e-10 on the feature panels,
# which are at most 16 wide in x beyond |x| = 16 (where the activation is within
# e^-16 of its asymptote) and at most 1 wide near 0.
_Z_MAX = 10.0
_FEATURE_X = (0.0, -0.5, 0.5, -1.0, 1.0, -2.0, 2.0, -4.0, 4.0, -8.0, 8.0, -16.0, 16.0, -32.0, 32.0)
_GL_NODES = 16


def _composite_rule(zpoints, zmax=_Z_MAX, gl=_GL_NODES):
    """Nodes ``z`` and probability weights ``w`` of ``E[g(Z)]``, Z standard normal.

    ``zpoints`` (shape ``(..., P)``) are extra panel cuts per element (clipped to
    ``[-zmax, zmax]``); the rule has shape ``(..., (P + n_base - 1) * gl)``.
    """
    base = np.arange(-zmax, zmax + 1e-9, 2.0)
    zp = np.clip(np.nan_to_num(zpoints, nan=0.0), -zmax, zmax)
    zb = np.broadcast_to(base, zp.shape[:-1] + base.shape)
    z = np.sort(np.concatenate([zb, zp], axis=-1), axis=-1)
    a, b = z[..., :-1], z[..., 1:]
    half = 0.5 * (b - a)
    mid = 0.5 * (a + b)
    gx, gw = _gauss_legendre(gl)
    zz = mid[..., None] + half[..., None] * gx
    w = half[..., None] * gw * _phi(zz)
    shape = zp.shape[:-1] + (-1,)
    return zz.reshape(shape), w.reshape(shape)


def _points(points):
    return np.asarray(sorted(set(float(p) for p in points)), dtype=np.float64)


def _composite_nodes(mu, sigma, points, zmax=_Z_MAX, gl=_GL_NODES):
    """Nodes ``x = mu + sigma z`` and weights of ``E[f(mu + sigma Z)]`` (``mu.shape + (P,)``)."""
    zp = (_points(points) - mu[..., None]) / sigma[..., None]
    z, w = _composite_rule(zp, zmax, gl)
    return mu[..., None] + sigma[..., None] * z, w


# --------------------------------------------------------------------------- #
# Truncated Gaussian moments (closed forms)
# --------------------------------------------------------------------------- #


def _upper_moments(z, m, log_scale=None):
    """``[E[W^l 1{W > z}] for l = 0..m]``, W standard normal, times ``exp(log_scale)``.

    ``M_0 = Φ(-z)``, ``M_1 = φ(z)``, ``M_l = z^(l-1) φ(z) + (l-1) M_(l-2)``. With a
    ``log_scale`` the two seeds are formed in log space (no overflow of the scale).
    """
    if log_scale is None:
        z = np.clip(z, -_Z_CLIP, _Z_CLIP)
        tail, dens = ndtr(-z), _phi(z)
    else:
        # no clipping here: a large scale can make far-tail values matter
        with np.errstate(over="ignore", under="ignore"):
            tail = np.exp(log_scale + log_ndtr(-z))
            dens = np.exp(log_scale - 0.5 * z * z) / _SQRT_2PI
    out = [tail]
    if m >= 1:
        out.append(dens)
    for l in range(2, m + 1):
        out.append(z ** (l - 1) * dens + (l - 1) * out[l - 2])
    return out


def _gaussian_moment(l):
    """``E[W^l]`` for W standard normal."""
    return 0.0 if l % 2 else float(math.prod(range(l - 1, 0, -2)))


def _shifted_moments(c, s, thr, m):
    """``[E[T^l 1{T > thr}] for l = 0..m]`` for ``T ~ N(c, s²)`` (``s >= 0``).

    ``thr=None`` means no truncation. ``s = 0`` gives the point mass at ``c``.
    """
    if thr is None:
        mom = [_gaussian_moment(j) for j in range(m + 1)]
    else:
        d = thr - c
        pos = s > 0
        with np.errstate(divide="ignore", invalid="ignore"):
            z = np.where(pos, d / np.where(pos, s, 1.0),
                         np.where(d > 0, np.inf, np.where(d < 0, -np.inf, 0.0)))
        mom = _upper_moments(z, m)
    out = []
    for l in range(m + 1):
        acc = 0.0
        for j in range(l + 1):
            if thr is None and j % 2:
                continue
            acc = acc + math.comb(l, j) * c ** (l - j) * s**j * mom[j]
        out.append(acc)
    return out


def _orthant_table(h, k, r, pmax, qmax):
    """``L[p][q] = E[U^p V^q 1{U > h} 1{V > k}]`` for (U, V) standard, correlation r.

    ``h`` or ``k`` None means no truncation on that variable. Stein's identity
    ``E[U g] = E[∂_U g] + r E[∂_V g]`` applied to ``g = U^(p-1) V^q 1{U>h} 1{V>k}``
    (the indicator's derivative is a point mass) gives::

        L[p][q] = (p-1) L[p-2][q] + h^(p-1) φ(h) E[V^q 1{V>k} | U=h]
                  + r q L[p-1][q-1] + r k^q φ(k) E[U^(p-1) 1{U>h} | V=k]

    seeded by ``L[0][0] = Φ₂(-h, -k; r)``; the conditionals are univariate
    truncated moments of ``N(r h, 1 - r²)``. ``|r| = 1`` is the point-mass limit.
    """
    s = np.sqrt(np.maximum((1.0 - r) * (1.0 + r), 0.0))
    if h is not None:
        h = np.clip(h, -_Z_CLIP, _Z_CLIP)
    if k is not None:
        k = np.clip(k, -_Z_CLIP, _Z_CLIP)
    if h is None and k is None:
        l00 = np.ones_like(r)
    elif h is None:
        l00 = ndtr(-k)
    elif k is None:
        l00 = ndtr(-h)
    else:
        l00 = kernels.bivariate_normal_cdf(-h, -k, r)
    phi_h = None if h is None else _phi(h)
    phi_k = None if k is None else _phi(k)
    # E[V^m 1{V > k} | U = h] and E[U^m 1{U > h} | V = k]
    cv = _shifted_moments(r * h, s, k, qmax) if h is not None else None
    cu = _shifted_moments(r * k, s, h, max(pmax - 1, 0)) if k is not None else None
    L = {(0, 0): l00}
    for p in range(pmax + 1):
        for q in range(qmax + 1):
            if p == 0 and q == 0:
                continue
            val = 0.0
            if p >= 1:
                if p >= 2:
                    val = val + (p - 1) * L[p - 2, q]
                if h is not None:
                    val = val + h ** (p - 1) * phi_h * cv[q]
                if q >= 1:
                    val = val + r * q * L[p - 1, q - 1]
                if k is not None:
                    val = val + r * k**q * phi_k * cu[p - 1]
            else:
                if q >= 2:
                    val = val + (q - 1) * L[0, q - 2]
                if k is not None:
                    val = val + k ** (q - 1) * phi_k * cu[0]
                if h is not None:
                    val = val + r * phi_h * cv[q - 1]
            L[p, q] = val
    return L


def _compose(coefs, a, b):
    """Coefficients of ``P(a + b u)`` in ``u`` for ``P = Σ c_k x^k`` (arrays allowed)."""
    out = []
    for m in range(len(coefs)):
        acc = 0.0
        for k in range(m, len(coefs)):
            if np.isscalar(coefs[k]) and coefs[k] == 0.0:
                continue
            acc = acc + coefs[k] * math.comb(k, m) * a ** (k - m) * b**m
        out.append(acc)
    return out


# --------------------------------------------------------------------------- #
# Piecewise closed forms
# --------------------------------------------------------------------------- #


@dataclasses.dataclass(frozen=True)
class _Term:
    """One term of a piecewise activation, in x: ``P(x)`` or ``e·exp(x)``, times an indicator.

    ``direction`` +1: ``1{x > threshold}``; -1: ``1{x < threshold}``; 0: everywhere.
    ``poly`` holds the coefficients of ``x^0, x^1, …``; ``exp_coef`` (when nonzero,
    with an empty ``poly``) the factor of ``exp(x)``.
    """

    direction: int
    threshold: float
    poly: Tuple[float, ...] = ()
    exp_coef: float = 0.0


class _Std(NamedTuple):
    """A term seen in standard coordinates ``U = d X``, ``x = mu + sigma X``."""

    h: Optional[np.ndarray]  # threshold on U (None: no truncation)
    d: float  # U = d X
    poly: list  # coefficients in U (arrays)
    log_c: Optional[np.ndarray]  # exp term: log|coef| + mu
    sign: float
    kappa: Optional[np.ndarray]  # exp term: tilt, exp(x) ∝ exp(kappa U)


def _standardise(term: _Term, mu, sigma):
    d = -1.0 if term.direction < 0 else 1.0
    h = None if term.direction == 0 else d * (term.threshold - mu) / sigma
    if term.exp_coef:
        return _Std(h, d, [], np.log(abs(term.exp_coef)) + mu, math.copysign(1.0, term.exp_coef),
                    d * sigma)
    return _Std(h, d, _compose(list(term.poly), mu, d * sigma), None, 1.0, None)


class _XTerm(NamedTuple):
    """A term in the standard variable X (``x = mu + sigma X``): ``f(X) 1{lo < X < hi}``.

    ``f`` is ``Σ poly[l] X^l`` times ``sign · exp(log_c + kappa X)`` when ``log_c`` is set.
    """

    lo: Optional[np.ndarray]
    hi: Optional[np.ndarray]
    poly: list
    log_c: Optional[np.ndarray] = None
    sign: float = 1.0
    kappa: Optional[np.ndarray] = None


def _x_term(term: _Term, mu, sigma) -> _XTerm:
    a = None if term.direction == 0 else (term.threshold - mu) / sigma
    lo, hi = (a, None) if term.direction > 0 else (None, a)
    if term.exp_coef:
        return _XTerm(lo, hi, [1.0], np.log(abs(term.exp_coef)) + mu,
                      math.copysign(1.0, term.exp_coef), sigma)
    return _XTerm(lo, hi, _compose(list(term.poly), mu, sigma))


def _poly_mul(a, b):
    out = [0.0] * (len(a) + len(b) - 1)
    for i, x in enumerate(a):
        for j, y in enumerate(b):
            out[i + j] = out[i + j] + x * y
    return out


def _x_product(a: _XTerm, b: _XTerm) -> _XTerm:
    def pick(u, v, f):
        return v if u is None else u if v is None else f(u, v)

    lo = pick(a.lo, b.lo, np.maximum)
    hi = pick(a.hi, b.hi, np.minimum)
    log_c = pick(a.log_c, b.log_c, np.add)
    kappa = pick(a.kappa, b.kappa, np.add)
    return _XTerm(lo, hi, _poly_mul(a.poly, b.poly), log_c, a.sign * b.sign, kappa)


def _interval_moments(lo, hi, m, log_scale=None):
    """``[E[W^l 1{lo < W < hi}] for l = 0..m]`` times ``exp(log_scale)``; None bounds are infinite.

    Intervals centred left of 0 are mirrored (``W -> -W``) so that the difference of
    upper-tail moments never cancels two values close to 1.
    """
    if lo is None and hi is None:
        scale = 1.0 if log_scale is None else np.exp(log_scale)
        return [_gaussian_moment(l) * scale for l in range(m + 1)]
    if hi is None:
        return _upper_moments(lo, m, log_scale)
    if lo is None:
        mom = _upper_moments(-hi, m, log_scale)
        return [(-1) ** l * v for l, v in enumerate(mom)]
    flip = lo + hi < 0
    a = np.where(flip, -hi, lo)
    b = np.where(flip, -lo, hi)
    ma = _upper_moments(a, m, log_scale)
    mb = _upper_moments(b, m, log_scale)
    empty = lo >= hi
    return [np.where(empty, 0.0, np.where(flip & (l % 2 == 1), -1.0, 1.0) * (x - y))
            for l, (x, y) in enumerate(zip(ma, mb))]


def _x_expect(t: _XTerm):
    """``E[f(X) 1{lo < X < hi}]`` in closed form (exponential tilting for exp terms)."""
    poly, lo, hi, ls = t.poly, t.lo, t.hi, None
    if t.log_c is not None:
        # e^{kappa X} phi(X) = e^{kappa²/2} phi(X - kappa): shift the polynomial and bounds.
        k = t.kappa
        poly = _compose(poly, k, 1.0)
        lo = None if lo is None else lo - k
        hi = None if hi is None else hi - k
        ls = t.log_c + 0.5 * k * k
    mom = _interval_moments(lo, hi, len(poly) - 1, ls)
    with np.errstate(over="ignore", invalid="ignore"):
        return t.sign * sum(c * mom[l] for l, c in enumerate(poly))


def _terms_mean(terms, mu, sigma):
    return sum(_x_expect(_x_term(t, mu, sigma)) for t in terms)


def _terms_second(terms, mu, sigma):
    xs = [_x_term(t, mu, sigma) for t in terms]
    return sum(_x_expect(_x_product(a, b)) for a in xs for b in xs)


def _term_pair(ti: _Std, tj: _Std, r):
    """``E[term_i(X) term_j(Y)]`` and a bound on its round-off (for exp terms)."""
    rr = ti.d * tj.d * r
    ki = ti.kappa if ti.log_c is not None else 0.0
    kj = tj.kappa if tj.log_c is not None else 0.0
    if ti.log_c is None and tj.log_c is None:
        L = _orthant_table(ti.h, tj.h, rr, len(ti.poly) - 1, len(tj.poly) - 1)
        val = 0.0
        for p, a in enumerate(ti.poly):
            for q, b in enumerate(tj.poly):
                val = val + a * b * L[p, q]
        return val, None
    # Exponential tilting: e^{k1 U + k2 V} phi_2(U, V; r)
    #   = e^{(k1² + 2 r k1 k2 + k2²)/2} phi_2(U - m1, V - m2; r), m1 = k1 + r k2, m2 = k2 + r k1.
    m1 = ki + rr * kj
    m2 = kj + rr * ki
    log_f = 0.5 * (ki * ki + 2.0 * rr * ki * kj + kj * kj)
    sign = 1.0
    pa = [1.0] if ti.log_c is not None else _compose(ti.poly, m1, 1.0)
    pb = [1.0] if tj.log_c is not None else _compose(tj.poly, m2, 1.0)
    if ti.log_c is not None:
        log_f = log_f + ti.log_c
        sign *= ti.sign
    if tj.log_c is not None:
        log_f = log_f + tj.log_c
        sign *= tj.sign
    h = None if ti.h is None else ti.h - m1
    k = None if tj.h is None else tj.h - m2
    L = _orthant_table(h, k, rr, len(pa) - 1, len(pb) - 1)
    acc = 0.0
    for p, a in enumerate(pa):
        for q, b in enumerate(pb):
            acc = acc + a * b * L[p, q]
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
        scale = np.exp(log_f)
        val = sign * scale * acc
        # Owen's-T evaluation of Φ₂ is accurate to ~1e-16 of its marginals, not of
        # Φ₂ itself: the absolute round-off of this term is about
        # scale · 1e-16 · max(Φ(-h), Φ(-k)).
        tails = [log_ndtr(-x) for x in (h, k) if x is not None]
        log_marg = functools.reduce(np.maximum, tails) if tails else 0.0
        err = np.exp(log_f + log_marg) * 1e-16 * (1.0 + np.abs(m1) + np.abs(m2)) ** 2
        # beyond the clip of the thresholds the closed form is not trusted
        for x in (h, k):
            if x is not None:
                err = np.where((np.abs(x) > _Z_CLIP - 10.0) & (log_f > 0.0), np.inf, err)
    val = np.where(np.isfinite(val), val, np.inf)
    return val, err


def _terms_cross(terms_i, terms_j, mu_i, s_i, mu_j, s_j, r):
    si = [_standardise(t, mu_i, s_i) for t in terms_i]
    sj = [_standardise(t, mu_j, s_j) for t in terms_j]
    val, err = 0.0, 0.0
    for a in si:
        for b in sj:
            v, e = _term_pair(a, b, r)
            val = val + v
            if e is not None:
                err = err + e
    return val, err


# --------------------------------------------------------------------------- #
# Broadcasting helpers
# --------------------------------------------------------------------------- #


def _blockwise(fn, *arrays):
    """``fn(*arrays)`` on the broadcast, in blocks along axis 0 when it is large."""
    shape = np.broadcast_shapes(*(a.shape for a in arrays))
    size = int(np.prod(shape)) if shape else 1
    if size <= _BLOCK or len(shape) == 0 or shape[0] == 1:
        return np.broadcast_to(fn(*arrays), shape)
    out = np.empty(shape)
    rows = max(1, _BLOCK // max(1, size // shape[0]))
    for start in range(0, shape[0], rows):
        sl = slice(start, start + rows)
        parts = [a if a.shape[0] == 1 else a[sl] for a in arrays]
        out[sl] = fn(*parts)
    return out


def _lift(a, ndim):
    return a.reshape((1,) * (ndim - a.ndim) + a.shape)


# --------------------------------------------------------------------------- #
# The activation object
# --------------------------------------------------------------------------- #


@dataclasses.dataclass(frozen=True, eq=False)
class GaussianActivation:
    """An elementwise activation ``ψ`` with its Gaussian moments.

    All moment methods take broadcastable float arrays and return float64 arrays;
    ``sigma`` is a standard deviation (its sign is ignored), ``rho`` is clipped to
    ``[-1, 1]``. Degenerate inputs give the limits: ``sigma = 0`` gives ``ψ(mu)``,
    ``|rho| = 1`` the perfectly (anti-)correlated pair.

    Attributes:
        name: Display name (used in reports and error messages).
        forward: Elementwise float64 numpy implementation of ``ψ``.
        positively_homogeneous: ``ψ(c x) = c ψ(x)`` for ``c > 0`` (ReLU, leaky ReLU,
            linear). HOPE's merge parent relies on it.
        breakpoints: Points where ``ψ`` has a kink or a jump (quadrature cuts there).
        terms: Closed-form piecewise representation (internal; ``None`` for
            quadrature-based activations).
        mean_fn: Optional closed form ``(mu, sigma) -> E[ψ(mu + sigma Z)]``; it is also
            the inner step of :meth:`cross` for quadrature-based activations.
        second_moment_fn: Optional closed form of ``E[ψ²]``.
        cross_fn: Optional closed form of the cross moment.
        params: Parameters, for display (e.g. ``(("alpha", 1.0),)``).

    Example:
        >>> import numpy as np
        >>> from hope_keras.activations import GaussianActivation
        >>> cube = GaussianActivation.from_function("cube", lambda x: x**3)
        >>> round(float(cube.second_moment(0.0, 1.0)), 8)  # E[Z^6] = 15
        15.0
        >>> round(float(cube.cross(0.0, 1.0, 0.0, 1.0, 0.5)), 8)  # 9 r + 6 r^3
        5.25
    """

    name: str
    forward: Callable[[np.ndarray], np.ndarray]
    positively_homogeneous: bool = False
    breakpoints: Tuple[float, ...] = ()
    terms: Optional[Tuple[_Term, ...]] = None
    mean_fn: Optional[Callable] = None
    second_moment_fn: Optional[Callable] = None
    cross_fn: Optional[Callable] = None
    params: Tuple[Tuple[str, float], ...] = ()

    # ------------------------------------------------------------ construction

    @classmethod
    def from_function(
        cls,
        name: str,
        fn: Callable[[np.ndarray], np.ndarray],
        *,
        breakpoints: Sequence[float] = (),
        positively_homogeneous: bool = False,
        mean_fn: Optional[Callable] = None,
    ) -> "GaussianActivation":
        """Quadrature moments for any elementwise numpy function.

        The mean and self-kernel use the composite rule, the cross kernel Mehler's
        sum with its certificate. A kinked ``ψ`` has slowly decaying Hermite
        coefficients, so its strongly correlated pairs go to the slower common-factor
        route; closed forms (as for the built-in piecewise activations) are faster.

        Args:
            name: Display name.
            fn: Vectorised float64 numpy function ``ψ``.
            breakpoints: Where ``ψ`` has kinks or jumps (the one-dimensional
                quadrature cuts its panels there; without them accuracy near a kink
                drops to a few digits).
            positively_homogeneous: Declare ``ψ(c x) = c ψ(x)``, ``c > 0``.
            mean_fn: Optional closed form of ``E[ψ(mu + sigma Z)]`` (speeds up and
                sharpens :meth:`cross`).

        Returns:
            A :class:`GaussianActivation`; register it with :func:`register`.

        Example:
            >>> import numpy as np
            >>> from hope_keras.activations import GaussianActivation
            >>> softsign = GaussianActivation.from_function(
            ...     "softsign", lambda x: x / (1.0 + np.abs(x)), breakpoints=(0.0,))
            >>> float(softsign.mean(0.0, 1.0))
            0.0
        """
        return cls(
            name=name,
            forward=fn,
            positively_homogeneous=bool(positively_homogeneous),
            breakpoints=tuple(float(b) for b in breakpoints),
            mean_fn=mean_fn,
        )

    # ----------------------------------------------------------------- basics

    def __call__(self, x):
        """The numpy forward ``ψ(x)`` (float64)."""
        return self.forward(_f64(x))

    def __repr__(self):
        args = ", ".join(f"{k}={v!r}" for k, v in self.params)
        return f"GaussianActivation({self.name!r}{', ' if args else ''}{args})"

    @property
    def value_at_zero(self) -> float:
        """``ψ(0)``."""
        return float(self(0.0))

    @property
    def closed_form(self) -> bool:
        """True when all three moments are closed forms (no quadrature)."""
        return self.terms is not None or self.cross_fn is not None

    # ----------------------------------------------------------------- moments

    def mean(self, mu, sigma):
        """``E[ψ(z)]`` for ``z ~ N(mu, sigma²)``.

        Args:
            mu: Mean(s) of the pre-activation.
            sigma: Standard deviation(s) (sign ignored).

        Returns:
            Broadcast float64 array.

        Example:
            >>> from hope_keras import activations
            >>> float(activations.get("tanh").mean(0.0, 2.0))
            0.0
        """
        mu, sigma = np.broadcast_arrays(_f64(mu), np.abs(_f64(sigma)))
        if self.mean_fn is not None:
            return _f64(self.mean_fn(mu, sigma))
        pos = sigma > 0
        ss = np.where(pos, sigma, 1.0)
        if self.terms is not None:
            val = _terms_mean(self.terms, mu, ss)
        else:
            val = self._quad(lambda v: v, mu, ss)
        return np.where(pos, val, self(mu))

    def second_moment(self, mu, sigma):
        """``E[ψ(z)²]`` for ``z ~ N(mu, sigma²)``: HOPE's self-kernel ``K(i, i)``.

        Args:
            mu: Mean(s) of the pre-activation.
            sigma: Standard deviation(s) (sign ignored).

        Returns:
            Broadcast float64 array (>= 0).

        Example:
            >>> from hope_keras import activations
            >>> float(activations.get("linear").second_moment(1.0, 2.0))
            5.0
        """
        mu, sigma = np.broadcast_arrays(_f64(mu), np.abs(_f64(sigma)))
        if self.second_moment_fn is not None:
            return _f64(self.second_moment_fn(mu, sigma))
        pos = sigma > 0
        ss = np.where(pos, sigma, 1.0)
        if self.terms is not None:
            val = _terms_second(self.terms, mu, ss)
        else:
            val = self._quad(lambda v: v * v, mu, ss)
        return np.maximum(np.where(pos, val, self(mu) ** 2), 0.0)

    def variance(self, mu, sigma):
        """``Var[ψ(z)]``, computed around ``ψ(mu)`` (accurate also for tiny ``sigma``).

        Args:
            mu: Mean(s) of the pre-activation.
            sigma: Standard deviation(s) (sign ignored).

        Returns:
            Broadcast float64 array (>= 0).

        Example:
            >>> from hope_keras import activations
            >>> round(float(activations.get("linear").variance(3.0, 1e-6)), 20)
            1e-12
        """
        mu, sigma = np.broadcast_arrays(_f64(mu), np.abs(_f64(sigma)))
        pos = sigma > 0
        ss = np.where(pos, sigma, 1.0)
        c = self(mu)[..., None]
        x, w = _composite_nodes(mu, ss, self.breakpoints + _FEATURE_X)
        dev = self(x) - c
        m1 = np.sum(w * dev, axis=-1)
        m2 = np.sum(w * dev * dev, axis=-1)
        return np.where(pos, np.maximum(m2 - m1 * m1, 0.0), 0.0)

    def cross(self, mu_i, sigma_i, mu_j, sigma_j, rho):
        """Cross moment ``E[ψ(z_i) ψ(z_j)]`` of a jointly Gaussian pair.

        Args:
            mu_i: Mean of ``z_i``.
            sigma_i: Standard deviation of ``z_i`` (sign ignored).
            mu_j: Mean of ``z_j``.
            sigma_j: Standard deviation of ``z_j`` (sign ignored).
            rho: Correlation of ``(z_i, z_j)``, clipped to ``[-1, 1]``.

        Returns:
            Broadcast float64 array. All inputs broadcast; the per-neuron work
            (``ψ`` at the outer nodes) is done on ``mu_i``'s own shape, so pass
            ``mu_i[:, None]``, ``mu_j[None, :]`` and an ``(n, n)`` ``rho`` for a layer.

        Example:
            >>> from hope_keras import activations
            >>> act = activations.get("hard_sigmoid")
            >>> m = float(act.mean(0.5, 2.0))
            >>> abs(float(act.cross(0.5, 2.0, 0.5, 2.0, 0.0)) - m * m) < 1e-12
            True
        """
        mu_i, sigma_i = np.broadcast_arrays(_f64(mu_i), np.abs(_f64(sigma_i)))
        mu_j, sigma_j = np.broadcast_arrays(_f64(mu_j), np.abs(_f64(sigma_j)))
        rho = np.clip(_f64(rho), -1.0, 1.0)
        if self.cross_fn is not None:
            return _f64(self.cross_fn(mu_i, sigma_i, mu_j, sigma_j, rho))
        shape = np.broadcast_shapes(mu_i.shape, mu_j.shape, rho.shape)
        ndim = max(1, len(shape))
        mu_i, sigma_i, mu_j, sigma_j, rho = (_lift(a, ndim) for a in (mu_i, sigma_i, mu_j,
                                                                        sigma_j, rho))
        pi_, pj_ = sigma_i > 0, sigma_j > 0
        # Degenerate sides: sigma = 0 makes that side the constant psi(mu).
        f_i = np.where(pi_, 0.0, self(mu_i))
        f_j = np.where(pj_, 0.0, self(mu_j))
        mean_i = self.mean(mu_i, sigma_i)
        mean_j = self.mean(mu_j, sigma_j)
        ssi, ssj = np.where(pi_, sigma_i, 1.0), np.where(pj_, sigma_j, 1.0)
        if self.terms is not None:
            both = _blockwise(self._cross_terms, mu_i, ssi, mu_j, ssj, rho)
        else:
            both = self._cross_mehler(mu_i, ssi, mu_j, ssj, rho)
        out = np.where(pi_ & pj_, both,
                       np.where(pj_, f_i * mean_j, np.where(pi_, f_j * mean_i, f_i * f_j)))
        # rho = 0: independent, exactly the product of the means.
        return np.where(rho == 0.0, mean_i * mean_j, out).reshape(shape)

    # --------------------------------------------------------------- internals

    def _quad(self, g, mu, sigma):
        x, w = _composite_nodes(mu, sigma, self.breakpoints + _FEATURE_X)
        return np.sum(w * g(self(x)), axis=-1)

    def _cross_terms(self, mu_i, s_i, mu_j, s_j, r):
        val, err = _terms_cross(self.terms, self.terms, mu_i, s_i, mu_j, s_j, r)
        if np.ndim(err) == 0:
            return val
        # Exponential terms at large sigma: the round-off of Owen's T times e^{sigma²}
        # can swamp the value; those elements take the (slower) common-factor route.
        val, err = np.broadcast_arrays(val, err)
        scale = np.sqrt(self.second_moment(mu_i, s_i) * self.second_moment(mu_j, s_j))
        bad = ~(err <= _CROSS_TOL * scale) | ~np.isfinite(val)
        if not bad.any():
            return val
        val = np.array(val)
        idx = np.nonzero(bad)
        sub = [np.broadcast_to(a, val.shape)[idx] for a in (mu_i, s_i, mu_j, s_j, r)]
        val[idx] = self._cross_common_factor(*sub)
        return val

    def _inner_mean(self, m, b):
        """``E[ψ(m + b W)]`` for the cross moment's inner step (``b`` may be 0)."""
        if self.mean_fn is not None or self.terms is not None:
            return self.mean(m, b)
        z, w = _gauss_hermite(_INNER_GH)
        keep = w > 1e-16 * w.max()
        return np.sum(w[keep] * self(m[..., None] + b[..., None] * z[keep]), axis=-1)

    def _cross_common_factor(self, mu_i, s_i, mu_j, s_j, r):
        """Robust route for flat arrays of pairs.

        With ``a = sqrt|r|``: ``X = a C + sqrt(1 - |r|) E_1``, ``±Y = a C + sqrt(1 - |r|) E_2``
        (C, E_1, E_2 independent), so ``E[ψ(x_i) ψ(x_j)] = E_C[m_i(C) m_j(C)]`` where
        ``m`` are Gaussian means of ψ (closed form, or an inner Gauss–Hermite sum of
        width ``sigma sqrt(1 - |r|)``, narrow exactly when this route is used). The C
        integral is the composite rule cut where either argument crosses ψ's features.
        """
        out = np.empty(mu_i.shape)
        pts = _points(self.breakpoints + _FEATURE_X)
        chunk = 256
        for start in range(0, mu_i.size, chunk):
            sl = slice(start, start + chunk)
            mi, si, mj, sj, rr = mu_i[sl], s_i[sl], mu_j[sl], s_j[sl], r[sl]
            ra = np.abs(rr)
            sg = np.where(rr < 0, -1.0, 1.0)
            ai, bi = si * np.sqrt(ra), si * np.sqrt(1.0 - ra)
            aj, bj = sg * sj * np.sqrt(ra), sj * np.sqrt(1.0 - ra)
            with np.errstate(divide="ignore", invalid="ignore"):
                zp = np.concatenate([(pts - mi[:, None]) / ai[:, None],
                                     (pts - mj[:, None]) / aj[:, None]], axis=-1)
            c, w = _composite_rule(zp)
            fi = self._inner_mean(mi[:, None] + ai[:, None] * c,
                                  np.broadcast_to(bi[:, None], c.shape))
            fj = self._inner_mean(mj[:, None] + aj[:, None] * c,
                                  np.broadcast_to(bj[:, None], c.shape))
            out[sl] = np.sum(w * fi * fj, axis=-1)
        return out

    def _hermite(self, mu, sigma, order, m2):
        """Normalised Hermite coefficients ``a_k = E[ψ(mu + sigma Z) He_k(Z)] / sqrt(k!)``.

        Returns ``(a, tails)`` of shape ``mu.shape + (order + 1,)``; ``tails[..., K] =
        E[ψ²] - Σ_(k<=K) a_k²`` (>= 0) is the energy a truncation after order K leaves
        out. The rule spans ``|Z| <= 20`` (``<= 28`` above order 64) so that the
        Hermite polynomials stay orthonormal on it to round-off.
        """
        zmax = 20.0 if order <= 64 else 28.0
        zp = (_points(self.breakpoints + _FEATURE_X) - mu[..., None]) / sigma[..., None]
        z, w = _composite_rule(zp, zmax=zmax, gl=24)
        f = self(mu[..., None] + sigma[..., None] * z) * w
        a = np.empty(mu.shape + (order + 1,))
        h_prev, h = np.zeros_like(z), np.ones_like(z)
        for k in range(order + 1):
            a[..., k] = np.sum(f * h, axis=-1)
            h_prev, h = h, (z * h - math.sqrt(k) * h_prev) / math.sqrt(k + 1)
        tails = np.maximum(m2[..., None] - np.cumsum(a * a, axis=-1), 0.0)
        return a, tails

    def _cross_mehler(self, mu_i, s_i, mu_j, s_j, r):
        """Mehler's formula ``E[f(X) g(Y)] = Σ_k a_k b_k r^k`` with a certified remainder.

        The per-neuron coefficients come from the composite rule; the sum is a
        Horner loop over the broadcast. Cauchy–Schwarz bounds the dropped terms by
        ``|r|^(K+1) sqrt(tail_i tail_j)``; elements where that exceeds
        ``_CROSS_TOL sqrt(E[ψ_i²] E[ψ_j²])`` are recomputed by the common-factor route.
        """
        mu_i, s_i = np.broadcast_arrays(mu_i, s_i)
        mu_j, s_j = np.broadcast_arrays(mu_j, s_j)
        same = mu_i.size == mu_j.size and np.array_equal(mu_i.ravel(), mu_j.ravel()) \
            and np.array_equal(s_i.ravel(), s_j.ravel())
        m2_i = self.second_moment(mu_i, s_i)
        m2_j = m2_i.reshape(mu_j.shape) if same else self.second_moment(mu_j, s_j)
        for order in _MEHLER_ORDERS:
            ai, ti = self._hermite(mu_i, s_i, order, m2_i)
            if same:
                aj = ai.reshape(mu_j.shape + ai.shape[-1:])
                tj = ti.reshape(mu_j.shape + ti.shape[-1:])
            else:
                aj, tj = self._hermite(mu_j, s_j, order, m2_j)
            worst = np.maximum(
                np.max((ti / np.maximum(m2_i, 1e-300)[..., None]).reshape(-1, order + 1), axis=0),
                np.max((tj / np.maximum(m2_j, 1e-300)[..., None]).reshape(-1, order + 1), axis=0))
            ok = np.nonzero(worst <= _CROSS_TOL)[0]
            if ok.size:
                order = int(ok[0])
                break
        ti, tj = ti[..., order], tj[..., order]
        shape = np.broadcast_shapes(mu_i.shape, mu_j.shape, r.shape)
        out = np.empty(shape)
        rows = max(1, _BLOCK // max(1, int(np.prod(shape[1:]))))
        for start in range(0, shape[0], rows):
            sl = slice(start, start + rows)
            ca, cb, rr = (x if x.shape[0] == 1 else x[sl] for x in (ai, aj, r))
            acc = ca[..., order] * cb[..., order]
            for k in range(order - 1, -1, -1):
                acc = acc * rr + ca[..., k] * cb[..., k]
            out[sl] = acc
        bound = np.abs(r) ** (order + 1) * np.sqrt(ti * tj)
        scale = np.sqrt(m2_i * m2_j)
        bad = np.broadcast_to(bound > _CROSS_TOL * scale, shape)
        if bad.any():
            idx = np.nonzero(bad)
            sub = [np.broadcast_to(a, shape)[idx] for a in (mu_i, s_i, mu_j, s_j, r)]
            out[idx] = self._cross_common_factor(*sub)
        return out


# Cross moments by quadrature aim at this relative accuracy (of sqrt(K_ii K_jj)).
_CROSS_TOL = 1e-9
# Mehler tables computed in turn (the second only when the first's tails are too
# large); the sum stops at the first order whose tails all meet _CROSS_TOL.
_MEHLER_ORDERS = (64, 128)
# Inner Gauss–Hermite nodes of the common-factor route (its inner widths are small).
_INNER_GH = 48


# --------------------------------------------------------------------------- #
# Built-in activations
# --------------------------------------------------------------------------- #


def _relu_forward(negative_slope, max_value, threshold):
    """numpy copy of ``keras.activations.relu`` (keras/src/activations/activations.py)."""

    def f(x):
        x = _f64(x)
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
            out.append(_Term(key[0], key[1], tuple(poly), e))
    return tuple(out)


def _relu_terms(negative_slope, max_value, threshold):
    ns, m, th = negative_slope, max_value, threshold
    terms = []
    # positive part P(x) = clip(x, 0, M) 1{x > th} (or x 1{x > th} without M)
    if m is None:
        terms.append(_Term(1, th, (0.0, 1.0)))
    elif m == 0:
        pass
    elif th >= m:
        terms.append(_Term(1, th, (m,)))
    else:
        lo = max(th, 0.0)
        terms.append(_Term(1, lo, (0.0, 1.0)))
        terms.append(_Term(1, m, (m, -1.0)))
    if ns:
        # ns (x - th) 1{x < th} = ns (x - th) - ns (x - th) 1{x > th}
        terms.append(_Term(0, 0.0, (-ns * th, ns)))
        terms.append(_Term(1, th, (ns * th, -ns)))
    return _merge_terms(terms)


@functools.lru_cache(maxsize=None)
def relu(negative_slope: float = 0.0, max_value: Optional[float] = None,
         threshold: float = 0.0) -> GaussianActivation:
    """The Gaussian moments of ``keras.activations.relu`` / ``keras.layers.ReLU``.

    ``ψ(x) = clip(x, 0, max_value) 1{x > threshold} + negative_slope (x - threshold)
    1{x < threshold}``, exactly as Keras computes it. Default parameters return the
    plain ReLU, whose moments are :mod:`hope_keras.kernels` (bit-identical).

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
        x = _f64(x)
        with np.errstate(over="ignore"):
            return scale * np.where(x > 0, x, alpha * np.expm1(np.minimum(x, 0.0)))

    # scale * [x 1{x>0} + alpha (e^x - 1) 1{x<0}]
    #   = scale * [-alpha + (x + alpha) 1{x>0} + alpha e^x 1{x<0}]
    terms = (
        _Term(0, 0.0, (-scale * alpha,)),
        _Term(1, 0.0, (scale * alpha, scale)),
        _Term(-1, 0.0, (), scale * alpha),
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
    mu, sigma = _f64(mu), _f64(sigma)
    t = np.sqrt(1.0 + (_GELU_S * sigma) ** 2)
    u = _GELU_S * mu / t
    return mu * ndtr(u) + _GELU_S * sigma * sigma * _phi(u) / t


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
    return np.clip(_f64(x) + 3.0, 0.0, 6.0) / 6.0


def _hard_silu_forward(x):
    x = _f64(x)
    return x * _hard_sigmoid_forward(x)


def _relu_cross(mu_i, s_i, mu_j, s_j, rho):
    return kernels.cross_kernel_exact(s_i, mu_i, s_j, mu_j, rho)


_RELU = GaussianActivation(
    name="relu",
    forward=lambda x: np.maximum(_f64(x), 0.0),
    positively_homogeneous=True,
    breakpoints=(0.0,),
    terms=(_Term(1, 0.0, (0.0, 1.0)),),
    mean_fn=lambda mu, sigma: kernels.relu_mean(sigma, mu),
    second_moment_fn=lambda mu, sigma: kernels.self_kernel(sigma, mu),
    cross_fn=_relu_cross,
)
_RELU6 = relu(max_value=6.0)
_LEAKY = {0.2: relu(negative_slope=0.2), 0.3: relu(negative_slope=0.3)}
_LINEAR = GaussianActivation(
    name="linear",
    forward=lambda x: _f64(x),
    positively_homogeneous=True,
    terms=(_Term(0, 0.0, (0.0, 1.0)),),
)
_ELU = elu(1.0)
_SELU = _elu(_SELU_ALPHA, _SELU_SCALE, "selu")
_HARD_SIGMOID = GaussianActivation(
    name="hard_sigmoid",
    forward=_hard_sigmoid_forward,
    breakpoints=(-3.0, 3.0),
    terms=(_Term(1, -3.0, (0.5, 1.0 / 6.0)), _Term(1, 3.0, (0.5, -1.0 / 6.0))),
)
_HARD_SILU = GaussianActivation(
    name="hard_silu",
    forward=_hard_silu_forward,
    breakpoints=(-3.0, 3.0),
    # x (x + 3) / 6 on x > -3, then + (x - x (x + 3) / 6) on x > 3
    terms=(_Term(1, -3.0, (0.0, 0.5, 1.0 / 6.0)), _Term(1, 3.0, (0.0, 0.5, -1.0 / 6.0))),
)
_SIGMOID = GaussianActivation.from_function("sigmoid", special.expit)
_TANH = GaussianActivation.from_function("tanh", np.tanh)
_SOFTPLUS = GaussianActivation.from_function("softplus", _softplus)
_SILU = GaussianActivation.from_function("silu", _silu)
_MISH = GaussianActivation.from_function("mish", _mish)
_GELU = GaussianActivation.from_function("gelu", _gelu_forward, mean_fn=_gelu_mean)
_GELU_TANH = GaussianActivation.from_function("gelu_approximate", _gelu_tanh_forward)


# --------------------------------------------------------------------------- #
# Registry and Keras look-up
# --------------------------------------------------------------------------- #

_BY_NAME: dict = {}
_BY_CALLABLE: dict = {}

#: Keras activations that are not elementwise, or not supported, with the reason.
_UNSUPPORTED = {
    "softmax": "softmax is not elementwise (it normalises over an axis)",
    "log_softmax": "log_softmax is not elementwise (it normalises over an axis)",
    "sparsemax": "sparsemax is not elementwise (it projects over an axis)",
    "glu": "glu is not elementwise (it gates one half of the channels by the other)",
}


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

    A separate registry from ``hope_keras.derivative_matching.register_activation``
    (that one holds Taylor tables).

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
    if isinstance(activation, str):
        table, key = _BY_NAME, activation
    elif callable(activation):
        table, key = _BY_CALLABLE, activation
    else:
        raise ValueError(
            "register expects a callable or a string name. "
            f"Received: activation={activation!r}")
    if key in table and table[key] is not spec and not overwrite:
        raise ValueError(
            f"Activation {key!r} is already registered as {table[key].name!r}; "
            "pass overwrite=True to replace it.")
    table[key] = spec


def names() -> Tuple[str, ...]:
    """The registered activation names.

    Returns:
        Sorted tuple of names accepted by :func:`get`.

    Example:
        >>> from hope_keras import activations
        >>> "gelu" in activations.names()
        True
    """
    return tuple(sorted(_BY_NAME))


def _callable_name(fn) -> Optional[str]:
    try:
        with warnings.catch_warnings():  # keras warns when it serialises a lambda
            warnings.simplefilter("ignore")
            name = keras.activations.serialize(fn)
    except Exception:
        name = None
    if isinstance(name, dict):
        name = name.get("config", name.get("class_name"))
    if not isinstance(name, str):
        name = getattr(fn, "__name__", None)
    return name


def _from_partial(fn) -> Optional[GaussianActivation]:
    """``functools.partial(keras.activations.relu, max_value=6.0)`` and friends."""
    kw = dict(fn.keywords or {})
    if fn.args:
        return None
    base = fn.func
    try:
        if base is keras.activations.relu:
            return relu(**kw)
        if base is keras.activations.leaky_relu:
            return leaky_relu(**kw)
        if base is keras.activations.elu:
            return elu(**kw)
        if base is keras.activations.gelu and set(kw) <= {"approximate"}:
            return _GELU_TANH if kw.get("approximate", False) else _GELU
    except TypeError:
        return None
    return None


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
    if identifier is None:
        return _LINEAR
    if isinstance(identifier, keras.layers.Layer):
        return from_layer(identifier)
    if isinstance(identifier, dict):
        try:
            identifier = keras.activations.deserialize(identifier)
        except Exception as exc:
            raise UnsupportedActivationError(
                f"Could not deserialise the activation {identifier!r}: {exc}") from None
    if isinstance(identifier, functools.partial):
        spec = _from_partial(identifier)
        if spec is not None:
            return spec
    if callable(identifier):
        try:
            if identifier in _BY_CALLABLE:
                return _BY_CALLABLE[identifier]
        except TypeError:  # unhashable
            pass
        name = _callable_name(identifier)
    elif isinstance(identifier, str):
        name = identifier
    else:
        raise UnsupportedActivationError(
            f"Could not interpret the activation identifier. Received: {identifier!r}")
    if name in _BY_NAME:
        return _BY_NAME[name]
    if name in _UNSUPPORTED:
        raise UnsupportedActivationError(_UNSUPPORTED[name])
    raise UnsupportedActivationError(
        f"No Gaussian moments are registered for activation {name!r}",
        "Build them with hope_keras.activations.GaussianActivation.from_function(name, "
        "numpy_fn) and hope_keras.activations.register(activation, spec). Known: "
        + ", ".join(names()))


def from_layer(layer) -> GaussianActivation:
    """The activation applied by a Keras layer, as a :class:`GaussianActivation`.

    Reads ``keras.layers.ReLU`` (``max_value``, ``negative_slope``, ``threshold``),
    ``LeakyReLU``, ``ELU``, ``Activation`` and the fused ``activation`` of Dense,
    convolution and other layers that have one.

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
    L = keras.layers
    where = f"layer {getattr(layer, 'name', layer)!r} ({type(layer).__name__})"
    try:
        if isinstance(layer, L.ReLU):
            return relu(
                negative_slope=float(layer.negative_slope),
                max_value=None if layer.max_value is None else float(layer.max_value),
                threshold=float(layer.threshold),
            )
        if isinstance(layer, L.LeakyReLU):
            return leaky_relu(float(layer.negative_slope))
        if isinstance(layer, L.ELU):
            return elu(float(layer.alpha))
        if isinstance(layer, L.PReLU):
            raise UnsupportedActivationError(
                f"{where}: PReLU has learned per-channel slopes, not supported")
        if isinstance(layer, L.Softmax):
            raise UnsupportedActivationError(f"{where}: softmax is not elementwise")
        if hasattr(layer, "activation"):
            return get(layer.activation)
    except UnsupportedActivationError as exc:
        if str(exc).startswith(where):
            raise
        raise UnsupportedActivationError(f"{where}: {exc}") from None
    raise UnsupportedActivationError(f"{where} applies no activation")


def _register_builtins() -> None:
    A = keras.activations
    entries = [
        ("relu", A.relu, _RELU),
        ("relu6", A.relu6, _RELU6),
        ("leaky_relu", A.leaky_relu, _LEAKY[0.2]),
        ("elu", A.elu, _ELU),
        ("selu", A.selu, _SELU),
        ("hard_sigmoid", A.hard_sigmoid, _HARD_SIGMOID),
        ("hard_silu", A.hard_silu, _HARD_SILU),
        ("sigmoid", A.sigmoid, _SIGMOID),
        ("tanh", A.tanh, _TANH),
        ("softplus", A.softplus, _SOFTPLUS),
        ("silu", A.silu, _SILU),
        ("gelu", A.gelu, _GELU),
        ("mish", A.mish, _MISH),
        ("linear", A.linear, _LINEAR),
        ("gelu_approximate", gelu_approximate, _GELU_TANH),
    ]
    for name, fn, spec in entries:
        register(name, spec, overwrite=True)
        register(fn, spec, overwrite=True)
    for alias, name in [("swish", "silu"), ("hard_swish", "hard_silu"),
                        ("hope_keras>gelu_approximate", "gelu_approximate")]:
        _BY_NAME[alias] = _BY_NAME[name]
    for alias, name in [("swish", "silu"), ("hard_swish", "hard_silu")]:
        fn = getattr(A, alias, None)
        if fn is not None:
            _BY_CALLABLE[fn] = _BY_NAME[name]


_register_builtins()


# --------------------------------------------------------------------------- #
# Moment inversion: output moments -> Gaussian pre-activation
# --------------------------------------------------------------------------- #


class MomentInversion(NamedTuple):
    """Result of :func:`invert_moments` (arrays of the broadcast shape).

    Attributes:
        mu: Pre-activation means.
        sigma: Pre-activation standard deviations (>= 0).
        failed: True where the target moments are not attained (to ``rtol``); there
            ``mu``, ``sigma`` are the fallback described in :func:`invert_moments`.
    """

    mu: np.ndarray
    sigma: np.ndarray
    failed: np.ndarray


# |mu/sigma| range of the homogeneous search, and its fallback for unattainable targets.
_T_MAX = 30.0
_T_FALLBACK = 4.0
# mu grid (sinh-spaced, dense near 0) for sigma = 0 roots and the 2-D starting table.
_MU_GRID = np.sinh(np.linspace(-np.arcsinh(60.0), np.arcsinh(60.0), 2001))
_SIGMA_GRID = np.logspace(-4, 2, 61)


def _bisect(f, lo, hi, iters=200):
    """Vectorised bisection for ``f(x) = 0`` with ``sign f(lo) != sign f(hi)``."""
    f_lo = f(lo)
    for _ in range(iters):
        mid = 0.5 * (lo + hi)
        if np.all((mid == lo) | (mid == hi)):
            break
        f_mid = f(mid)
        left = np.sign(f_mid) == np.sign(f_lo)
        lo = np.where(left, mid, lo)
        f_lo = np.where(left, f_mid, f_lo)
        hi = np.where(left, hi, mid)
    return 0.5 * (lo + hi)


def _invert_deterministic(spec, m):
    """``sigma = 0``: the root of ``ψ(mu) = m`` of smallest ``|mu|`` (grid, then bisection)."""
    g = _MU_GRID
    f = spec(g)[None, :] - m[:, None]
    zero = f == 0.0
    # brackets: a sign change, or a zero at exactly one end (the edge of a flat run)
    bracket = (f[:, :-1] * f[:, 1:] < 0) | (zero[:, :-1] ^ zero[:, 1:])
    # exact zeros first, so that they win ties
    dist = np.concatenate([
        np.where(zero, np.abs(g)[None, :], np.inf),
        np.where(bracket, np.minimum(np.abs(g[:-1]), np.abs(g[1:]))[None, :], np.inf)], axis=1)
    k = np.argmin(dist, axis=1)
    rows = np.arange(m.size)
    found = np.isfinite(dist[rows, k])
    is_zero = k < g.size
    kz = np.where(is_zero, k, 0)
    kb = np.where(is_zero, 0, k - g.size)
    root = _bisect(lambda x: spec(x) - m, g[kb].copy(), g[kb + 1].copy())
    mu = np.where(is_zero, g[kz], root)
    # unattainable: the grid point with the closest value
    closest = g[np.argmin(np.abs(f), axis=1)]
    return np.where(found, mu, closest), ~found


def _invert_homogeneous(spec, m, v):
    second = v + m * m
    n = m.size
    mu, sigma, failed = np.zeros(n), np.zeros(n), np.zeros(n, bool)
    pos = second > 0
    g_target = np.where(pos, m / np.sqrt(np.where(pos, second, 1.0)), 0.0)

    def g(t):
        return spec.mean(t, 1.0) / np.sqrt(spec.second_moment(t, 1.0))

    lo_g, hi_g = float(g(-_T_MAX)), float(g(_T_MAX))
    inside = pos & (g_target > lo_g) & (g_target < hi_g)
    t = _bisect(lambda x: g(x) - g_target, np.full(n, -_T_MAX), np.full(n, _T_MAX))
    bad = pos & ~inside
    t = np.where(bad, np.where(g_target <= lo_g, -_T_FALLBACK, _T_FALLBACK), t)
    s = np.sqrt(np.where(pos, second, 0.0) / spec.second_moment(t, 1.0))
    mu, sigma = t * s, s
    failed |= bad
    # zero variance with an attainable value: sigma = 0 exactly (covers t = +-inf)
    return mu, sigma, failed


def _mean_sd(spec, mu, sigma):
    """Mean and standard deviation of ``ψ(mu + sigma Z)`` with one evaluation of ψ."""
    pos = sigma > 0
    ss = np.where(pos, sigma, 1.0)
    x, w = _composite_nodes(mu, ss, spec.breakpoints + _FEATURE_X)
    c = spec(mu)
    dev = spec(x) - c[..., None]
    m1 = np.sum(w * dev, axis=-1)
    var = np.where(pos, np.maximum(np.sum(w * dev * dev, axis=-1) - m1 * m1, 0.0), 0.0)
    closed = spec.mean_fn is not None or spec.terms is not None
    mean = spec.mean(mu, sigma) if closed else np.where(pos, c + m1, c)
    return mean, np.sqrt(var)


@functools.lru_cache(maxsize=32)
def _moment_table(spec):
    """(mu, sigma, mean, sd) on a grid: mu-grid x sigma-grid and (mu/sigma)-grid x sigma-grid."""
    mu1, s1 = np.meshgrid(_MU_GRID[::10], _SIGMA_GRID, indexing="ij")
    t2, s2 = np.meshgrid(np.linspace(-8.0, 8.0, 161), _SIGMA_GRID, indexing="ij")
    mu = np.concatenate([mu1.ravel(), (t2 * s2).ravel()])
    s = np.concatenate([s1.ravel(), s2.ravel()])
    return (mu, s) + _mean_sd(spec, mu, s)


def _levenberg_marquardt(spec, x, m, sd, scale_m, rtol, max_iter):
    """Damped Gauss–Newton on scaled moment residuals in ``(mu, log sigma)``, vectorised.

    Residuals: ``(mean - m) / scale_m`` and ``(sd(mu, sigma) - sd) / sd``. Returns the
    final points and the squared residual norms with the mean scaled by ``sd``.
    """
    scale = np.maximum(sd, 1e-300)

    def resid(xx, idx):
        mean, sdev = _mean_sd(spec, xx[:, 0], np.exp(xx[:, 1]))
        return np.stack([(mean - m[idx]) / scale_m[idx], (sdev - sd[idx]) / scale[idx]], axis=1)

    x = x.copy()
    f = resid(x, np.arange(m.size))
    lam = np.full(m.size, 1e-3)
    active = np.ones(m.size, bool)
    for _ in range(max_iter):
        active &= np.sum(f * f, axis=1) > rtol * rtol
        ids = np.nonzero(active)[0]
        if ids.size == 0:
            break
        xa, fa = x[ids], f[ids]
        h = np.stack([1e-6 * np.maximum(np.exp(xa[:, 1]), 1e-3), np.full(ids.size, 1e-6)], axis=1)
        jac = np.empty((ids.size, 2, 2))
        for c in range(2):
            e = np.zeros_like(xa)
            e[:, c] = h[:, c]
            jac[:, :, c] = (resid(xa + e, ids) - resid(xa - e, ids)) / (2 * h[:, c:c + 1])
        jtj = np.einsum("nki,nkj->nij", jac, jac)
        jtf = np.einsum("nki,nk->ni", jac, fa)
        diag = np.diagonal(jtj, axis1=1, axis2=2)
        a = jtj + lam[ids, None, None] * (np.eye(2) * (diag[:, :, None] + 1e-12))
        det = a[:, 0, 0] * a[:, 1, 1] - a[:, 0, 1] * a[:, 1, 0]
        det = np.where(det == 0, 1e-300, det)
        step = -np.stack([a[:, 1, 1] * jtf[:, 0] - a[:, 0, 1] * jtf[:, 1],
                          a[:, 0, 0] * jtf[:, 1] - a[:, 1, 0] * jtf[:, 0]], axis=1) / det[:, None]
        step = np.nan_to_num(step)
        step[:, 1] = np.clip(step[:, 1], -2.0, 2.0)
        xn = xa + step
        xn[:, 0] = np.clip(xn[:, 0], -1e4, 1e4)
        xn[:, 1] = np.clip(xn[:, 1], np.log(1e-10), np.log(1e4))
        fn = resid(xn, ids)
        better = np.sum(fn * fn, axis=1) < np.sum(fa * fa, axis=1)
        x[ids] = np.where(better[:, None], xn, xa)
        f[ids] = np.where(better[:, None], fn, fa)
        lam[ids] = np.where(better, lam[ids] / 3.0, lam[ids] * 4.0)
        active[ids] &= lam[ids] < 1e12
    f[:, 0] *= scale_m / scale
    return x, np.sum(f * f, axis=1)


def _invert_general(spec, m, sd, rtol, max_iter=60, starts=6):
    n = m.size
    tmu, ts, tmean, tsd = _moment_table(spec)
    scale = np.maximum(sd, 1e-300)
    # Starting points: per sigma of the table, the entry nearest in (mean - m)/sd,
    # log sd and the "shape" asinh(mean/sd / 1e-6) (which separates near-dead channels
    # whose tiny mean/sd ratios differ by orders of magnitude); then the `starts`
    # best of those, so that distant branches of a non-monotone ψ all get a start.
    with np.errstate(divide="ignore", invalid="ignore"):
        log_tsd = np.log(tsd)
        shape_t = np.arcsinh(np.nan_to_num(tmean / tsd, posinf=1e300, neginf=-1e300) * 1e6)
    shape_m = np.arcsinh(m / scale * 1e6)
    rows = np.searchsorted(_SIGMA_GRID, ts * (1 - 1e-9))
    groups = [np.nonzero(rows == g)[0] for g in range(_SIGMA_GRID.size)]
    order = np.empty((n, starts), dtype=int)
    for a in range(0, n, 256):
        b = slice(a, a + 256)
        d = ((tmean[None, :] - m[b, None]) / scale[b, None]) ** 2 \
            + (log_tsd[None, :] - np.log(scale[b, None])) ** 2 \
            + (shape_t[None, :] - shape_m[b, None]) ** 2
        best_d = np.stack([d[:, gi].min(axis=1) for gi in groups], axis=1)
        best_i = np.stack([gi[np.argmin(d[:, gi], axis=1)] for gi in groups], axis=1)
        pick = np.argsort(best_d, axis=1)[:, :starts]
        order[b] = np.take_along_axis(best_i, pick, axis=1)
    x0 = np.stack([tmu, np.log(ts)], axis=1)
    dpsi = np.diff(spec(_MU_GRID))
    if np.any(dpsi > 1e-12) and np.any(dpsi < -1e-12):
        # non-monotone ψ (SiLU, GELU, hard SiLU): several (mu, sigma) can give the same
        # moments. Solve from every start and keep the converged one of smallest sigma
        # (the least spread pre-activation), else the best.
        xa, ea = _levenberg_marquardt(spec, x0[order.ravel()], np.repeat(m, starts),
                                      np.repeat(sd, starts), np.repeat(scale, starts), rtol,
                                      max_iter)
        xa, ea = xa.reshape(n, starts, 2), ea.reshape(n, starts)
        key = np.where(ea <= (10 * rtol) ** 2, xa[:, :, 1], np.inf)
        pick = np.where(np.isfinite(key.min(axis=1)), np.argmin(key, axis=1), np.argmin(ea, axis=1))
        x, err = xa[np.arange(n), pick], ea[np.arange(n), pick]
    else:
        x, err = _levenberg_marquardt(spec, x0[order[:, 0]], m, sd, scale, rtol, max_iter)
    # Channels that did not converge: near-dead or saturated ones (mean within a
    # hair of an edge of ψ's range, far below sd) are ill-conditioned when the mean is
    # matched relative to sd; match it relative to its distance to that edge, from
    # every start, and keep the best.
    retry = np.nonzero(err > rtol * rtol)[0]
    if retry.size:
        g = spec(_MU_GRID)
        edges = np.array([g.min(), g.max(), g[0], g[-1]])
        gap = np.min(np.abs(m[retry, None] - edges[None, :]), axis=1)
        k = starts
        mr, sr = np.repeat(m[retry], k), np.repeat(sd[retry], k)
        scale_r = np.repeat(np.clip(gap, 1e-4 * scale[retry], scale[retry]), k)
        xr, er = _levenberg_marquardt(spec, x0[order[retry].ravel()], mr, sr, scale_r, rtol,
                                      max_iter)
        er = er.reshape(-1, k)
        best = np.argmin(er, axis=1)
        er_best = er[np.arange(retry.size), best]
        xr_best = xr.reshape(-1, k, 2)[np.arange(retry.size), best]
        take = er_best < err[retry]
        x[retry[take]] = xr_best[take]
        err[retry[take]] = er_best[take]
    failed = err > (100 * rtol) ** 2
    return x[:, 0], np.exp(x[:, 1]), failed


def invert_moments(activation, mean_out, var_out, *, rtol: float = 1e-8) -> MomentInversion:
    """The Gaussian pre-activation ``N(mu, sigma²)`` whose ``ψ`` has given output moments.

    For a BatchNormalization placed after the activation: its moving mean and
    variance are ``E[ψ(z)]`` and ``Var[ψ(z)]``, and HOPE needs ``z``'s Gaussian
    surrogate. Vectorised over channels.

    * Positively homogeneous ``ψ`` (ReLU, leaky ReLU, linear): ``E[ψ]/sqrt(E[ψ²])``
      depends on ``t = mu/sigma`` only and increases with it, so ``t`` is a 1-D
      bisection and ``sigma`` the scale matching ``E[ψ²]``.
    * Other ``ψ``: a 2-D problem, solved by Levenberg–Marquardt in ``(mu, log sigma)``
      started from the nearest entries of a precomputed ``(mu, sigma)`` table (one
      per sigma row, the best six rows), retrying the unconverged channels with the
      mean matched relative to its distance to the nearest edge of ``ψ``'s range
      (near-dead and saturated channels). A non-monotone ``ψ`` (SiLU, GELU, hard
      SiLU, mish) can have several solutions: all six starts are solved and the
      converged solution of smallest ``sigma`` is returned.
    * ``var_out = 0``: ``sigma = 0`` and ``mu`` the root of ``ψ(mu) = mean_out`` of
      smallest ``|mu|`` (ReLU with mean 0 gives ``mu = 0``).

    Unattainable targets (a ReLU mean ``<= 0`` with positive variance, a sigmoid mean
    outside ``(0, 1)``, a variance larger than the activation's range allows, a
    negative variance) never give NaN: they are flagged in ``failed`` and get the
    closest point the solver reached (for homogeneous ``ψ``: ``|mu/sigma| = 4`` at the
    violated end, scaled to match ``E[ψ²]``; for ``var_out = 0``: the grid value of
    ``mu`` with the closest ``ψ(mu)``).

    Args:
        activation: A :class:`GaussianActivation` or anything :func:`get` accepts.
        mean_out: Target output mean(s).
        var_out: Target output variance(s) (negative values are treated as 0 and
            flagged).
        rtol: Relative tolerance on the output mean and standard deviation
            (relative to the target standard deviation); ``failed`` marks misses by
            more than 100 times this.

    Returns:
        :class:`MomentInversion` ``(mu, sigma, failed)`` of the broadcast shape.

    Example:
        >>> from hope_keras import activations
        >>> relu = activations.get("relu")
        >>> m, v = float(relu.mean(0.5, 2.0)), float(relu.variance(0.5, 2.0))
        >>> mu, sigma, failed = activations.invert_moments(relu, m, v)
        >>> round(float(mu), 8), round(float(sigma), 8), bool(failed)
        (0.5, 2.0, False)
    """
    spec = get(activation)
    m, v = np.broadcast_arrays(_f64(mean_out), _f64(var_out))
    shape = m.shape
    m, v = m.ravel().astype(np.float64), v.ravel().astype(np.float64)
    finite = np.isfinite(m) & np.isfinite(v)
    m = np.where(finite, m, 0.0)
    neg = ~(v >= 0) | ~finite
    v = np.where(neg, 0.0, v)
    mu, sigma, failed = np.zeros(m.size), np.zeros(m.size), neg.copy()
    det = v == 0
    if det.any():
        mu_d, fail_d = _invert_deterministic(spec, m[det])
        mu[det], failed[det] = mu_d, failed[det] | fail_d
    rnd = ~det
    if rnd.any():
        if spec.positively_homogeneous:
            mu_r, s_r, f_r = _invert_homogeneous(spec, m[rnd], v[rnd])
        else:
            mu_r, s_r, f_r = _invert_general(spec, m[rnd], np.sqrt(v[rnd]), rtol)
        mu[rnd], sigma[rnd], failed[rnd] = mu_r, s_r, failed[rnd] | f_r
    return MomentInversion(mu.reshape(shape), sigma.reshape(shape), failed.reshape(shape))
