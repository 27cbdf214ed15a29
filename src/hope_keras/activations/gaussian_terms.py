"""Gaussian expectations of piecewise and smooth functions: the rules behind
`hope_keras.activations` (docs/theory.md, "Activations beyond ReLU").

Quadrature (Gauss–Hermite, Gauss–Legendre, the composite rule over an activation's
feature points), truncated and bivariate truncated Gaussian moments (Stein
recursion, one bivariate normal CDF per pair of breakpoints), and the algebra of
`Term`s (a polynomial, optionally times an exponential, on an interval) whose
sums, products and expectations give the closed-form moments. Pure float64
numpy/scipy, vectorised by broadcasting.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple, Optional, Tuple

import numpy as np
from scipy.special import log_ndtr, ndtr

from hope_keras.activations import kernels

_SQRT_2PI = math.sqrt(2.0 * math.pi)
# Standardised arguments are clipped here (as in kernels.py): Phi(+-50) is exactly
# 1/0 in float64 and phi(50) underflows, so nothing measurable changes.
_Z_CLIP = 50.0
# Elements of a broadcast larger than this are processed in blocks along axis 0
# (bounds the memory of the quadrature and closed-form temporaries).
BLOCK = 1 << 20


def as_f64(x):
    return np.asarray(x, dtype=np.float64)


def normal_pdf(x):
    return np.exp(-0.5 * x * x) / _SQRT_2PI


# --------------------------------------------------------------------------- #
# Quadrature rules
# --------------------------------------------------------------------------- #


@functools.lru_cache(maxsize=None)
def gauss_hermite(n: int):
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
FEATURE_X = (0.0, -0.5, 0.5, -1.0, 1.0, -2.0, 2.0, -4.0, 4.0, -8.0, 8.0, -16.0, 16.0, -32.0, 32.0)
_GL_NODES = 16


def composite_rule(zpoints, zmax=_Z_MAX, gl=_GL_NODES):
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
    w = half[..., None] * gw * normal_pdf(zz)
    shape = zp.shape[:-1] + (-1,)
    return zz.reshape(shape), w.reshape(shape)


def sorted_points(points):
    return np.asarray(sorted(set(float(p) for p in points)), dtype=np.float64)


def composite_nodes(mu, sigma, points, zmax=_Z_MAX, gl=_GL_NODES):
    """Nodes ``x = mu + sigma z`` and weights of ``E[f(mu + sigma Z)]`` (``mu.shape + (P,)``)."""
    zp = (sorted_points(points) - mu[..., None]) / sigma[..., None]
    z, w = composite_rule(zp, zmax, gl)
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
        tail, dens = ndtr(-z), normal_pdf(z)
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
    phi_h = None if h is None else normal_pdf(h)
    phi_k = None if k is None else normal_pdf(k)
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
class Term:
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


def _standardise(term: Term, mu, sigma):
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


def _x_term(term: Term, mu, sigma) -> _XTerm:
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


def terms_mean(terms, mu, sigma):
    return sum(_x_expect(_x_term(t, mu, sigma)) for t in terms)


def terms_second(terms, mu, sigma):
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


def terms_cross(terms_i, terms_j, mu_i, s_i, mu_j, s_j, r):
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


def blockwise(fn, *arrays):
    """``fn(*arrays)`` on the broadcast, in blocks along axis 0 when it is large."""
    shape = np.broadcast_shapes(*(a.shape for a in arrays))
    size = int(np.prod(shape)) if shape else 1
    if size <= BLOCK or len(shape) == 0 or shape[0] == 1:
        return np.broadcast_to(fn(*arrays), shape)
    out = np.empty(shape)
    rows = max(1, BLOCK // max(1, size // shape[0]))
    for start in range(0, shape[0], rows):
        sl = slice(start, start + rows)
        parts = [a if a.shape[0] == 1 else a[sl] for a in arrays]
        out[sl] = fn(*parts)
    return out


def lift(a, ndim):
    return a.reshape((1,) * (ndim - a.ndim) + a.shape)
