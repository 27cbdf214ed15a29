"""Gaussian-surrogate ReLU kernels (HOPE spec, section 2).

Pure numpy/scipy float64 math, no Keras. Every function is vectorised
elementwise over broadcastable arrays and returns finite values in the
degenerate cases (``gamma = 0``, ``|rho| = 1``, zero weight norms).

Under the surrogate a neuron's pre-activation ``y_i`` is Gaussian with mean
``beta_i`` and standard deviation ``|gamma_i|``; the kernels are moments of
``relu(y)``.
"""

from __future__ import annotations

import numpy as np
from scipy.special import ndtr, owens_t

try:  # the ufunc that np.clip calls, without its Python-level checks: same values,
    # a third of the time on the small arrays of the engine's steps
    from numpy._core.umath import clip as _clip
except ImportError:  # NumPy < 2
    from numpy.core.umath import clip as _clip

#: The same clip, for the cost formulas (`hope_keras.scoring.cost_formulas`).
fast_clip = _clip

__all__ = [
    "self_kernel",
    "relu_mean",
    "warped_correlation",
    "arccos_I",
    "cross_kernel_approx",
    "cross_kernel_exact",
    "bivariate_normal_cdf",
]

_INV_SQRT_2PI = 1.0 / np.sqrt(2.0 * np.pi)
#: |ρ| of the effective weights is clipped to this (`warped_correlation`).
RHO_CLIP = 1.0 - 1e-12
# Standardised arguments are clipped to this range; Phi(+-50) is exactly 1/0
# in float64 and phi(50) underflows, so the clip changes nothing measurable.
Z_CLIP = 50.0


def _f64(x):
    return np.asarray(x, dtype=np.float64)


def _phi(x):
    return _INV_SQRT_2PI * np.exp(-0.5 * x * x)


def _safe_div(num, den):
    """num / den where den != 0, 0 elsewhere (no warnings)."""
    num, den = _f64(num), _f64(den)
    ok = den != 0
    with np.errstate(over="ignore"):
        return np.where(ok, num / np.where(ok, den, 1.0), 0.0)


def self_kernel(gamma, beta):
    """Self-kernel ``K(i,i) = E[relu(y)^2]`` for ``y ~ N(beta, gamma^2)`` (eq. 3).

    Args:
        gamma: BN scale(s); only ``|gamma|`` (the standard deviation) matters.
        beta: BN shift(s), the mean of the pre-activation.

    Returns:
        ``(gamma^2 + beta^2) Phi(t) + beta |gamma| phi(t)`` with ``t = beta/|gamma|``,
        and ``relu(beta)^2`` where ``gamma == 0``. Broadcast float64 array (>= 0).

    Example:
        >>> float(self_kernel(1.0, 0.0))
        0.5
        >>> float(self_kernel(0.0, -2.0))
        0.0
    """
    g = np.abs(_f64(gamma))
    b = _f64(beta)
    g, b = np.broadcast_arrays(g, b)
    pos = g > 0
    t = _clip(_safe_div(b, np.where(pos, g, 1.0)), -Z_CLIP, Z_CLIP)
    k = (g * g + b * b) * ndtr(t) + b * g * _phi(t)
    k = np.where(pos, k, np.maximum(b, 0.0) ** 2)
    return np.maximum(k, 0.0)


def relu_mean(gamma, beta):
    """First moment ``E[relu(y)]`` for ``y ~ N(beta, gamma^2)``.

    Args:
        gamma: standard deviation (sign ignored).
        beta: mean.

    Returns:
        ``beta Phi(t) + |gamma| phi(t)``, ``t = beta/|gamma|``; ``relu(beta)``
        where ``gamma == 0``.

    Example:
        >>> round(float(relu_mean(1.0, 0.0)), 6)
        0.398942
    """
    g = np.abs(_f64(gamma))
    b = _f64(beta)
    g, b = np.broadcast_arrays(g, b)
    pos = g > 0
    t = _clip(_safe_div(b, np.where(pos, g, 1.0)), -Z_CLIP, Z_CLIP)
    m = b * ndtr(t) + g * _phi(t)
    return np.maximum(np.where(pos, m, np.maximum(b, 0.0)), 0.0)


def warped_correlation(rho_eff, gamma_i, wnorm_i, gamma_j, wnorm_j):
    """Warped pre-activation correlation ``rho_tilde`` (eqs. 4, 80, 81).

    ``kappa = rho/(1-rho^2) * (|gamma_i|/wnorm_i) * (|gamma_j|/wnorm_j)`` and
    ``rho_tilde = 2 kappa / (1 + sqrt(1 + 4 kappa^2))``, with ``rho_eff`` clipped
    to ``+-(1 - 1e-12)``. Odd in ``rho_eff``; tends to ``+-1`` as
    ``rho_eff -> +-1``.

    Args:
        rho_eff: cosine of the effective input weights (bias excluded).
        gamma_i: BN scale of neuron i.
        wnorm_i: Euclidean norm of ``w_eff,i``.
        gamma_j: BN scale of neuron j.
        wnorm_j: Euclidean norm of ``w_eff,j``.

    Returns:
        ``rho_tilde`` in ``[-1, 1]``; 0 where either norm is 0 (inactive neuron).

    Example:
        >>> float(warped_correlation(0.0, 1.0, 1.0, 1.0, 1.0))
        0.0
        >>> bool(warped_correlation(0.999999, 1.0, 1.0, 1.0, 1.0) > 0.9999)
        True
    """
    rho = _clip(_f64(rho_eff), -RHO_CLIP, RHO_CLIP)
    ni, nj = _f64(wnorm_i), _f64(wnorm_j)
    # Each side's |γ|/‖w‖ in its own shape (a row, a column: not n × n divisions),
    # the same value for every active pair; inactive pairs are 0 below.
    fi = _safe_div(np.abs(_f64(gamma_i)), np.where(ni > 0, ni, 1.0))
    fj = _safe_div(np.abs(_f64(gamma_j)), np.where(nj > 0, nj, 1.0))
    active = (ni > 0) & (nj > 0)
    with np.errstate(over="ignore", invalid="ignore"):
        ratio = fi * fj
        x = 2.0 * rho / ((1.0 - rho) * (1.0 + rho)) * ratio  # 2 kappa
    x = _clip(np.where(np.isnan(x), 0.0, x), -1e300, 1e300)  # ±inf → ±1e300
    rt = x / (1.0 + np.hypot(1.0, x))
    return np.where(active, _clip(rt, -1.0, 1.0), 0.0)


def arccos_I(rho):
    """Normalised arc-cosine kernel ``I(rho) = (sqrt(1-rho^2) + (pi - arccos rho) rho)/pi``.

    ``I(1) = 1``, ``I(0) = 1/pi``, ``I(-1) = 0``. Input clipped to ``[-1, 1]``.

    Args:
        rho: correlation(s).

    Returns:
        float64 array of ``I(rho)``.

    Example:
        >>> float(arccos_I(1.0))
        1.0
        >>> float(arccos_I(-1.0))
        0.0
    """
    r = _clip(_f64(rho), -1.0, 1.0)
    return _clip(
        (np.sqrt(np.maximum(1.0 - r * r, 0.0)) + (np.pi - np.arccos(r)) * r) / np.pi,
        0.0,
        1.0,
    )


def cross_kernel_approx(rho_tilde, k_ii, k_jj):
    """Zero-bias cross-kernel approximation ``I(rho_tilde) sqrt(K_ii K_jj)`` (eqs. 5, 85).

    Args:
        rho_tilde: warped correlation.
        k_ii: self-kernel of neuron i.
        k_jj: self-kernel of neuron j.

    Returns:
        float64 array ``K(i,j)`` (>= 0).

    Example:
        >>> float(cross_kernel_approx(1.0, 0.5, 0.5))
        0.5
    """
    kk = np.maximum(_f64(k_ii), 0.0) * np.maximum(_f64(k_jj), 0.0)
    return arccos_I(rho_tilde) * np.sqrt(kk)


def bivariate_normal_cdf(h, k, rho):
    """Standard bivariate normal CDF ``Phi_2(h, k; rho) = P(X <= h, Y <= k)``.

    Owen's (1956) T-function formula, vectorised with varying correlation:
    ``Phi_2 = Phi(h)/2 + Phi(k)/2 - T(h, a_h) - T(k, a_k) - beta``, with
    ``a_h = (k - rho h)/(h sqrt(1-rho^2))`` (symmetrically ``a_k``) and
    ``beta = 1/2`` iff ``hk < 0`` or (``hk = 0`` and ``h + k < 0``). The cases
    ``h = 0`` and/or ``k = 0`` use the limits of T, ``|rho| = 1`` the degenerate
    distributions (``Phi(min(h,k))`` and ``max(0, Phi(h) + Phi(k) - 1)``).

    Args:
        h: first upper limit(s).
        k: second upper limit(s).
        rho: correlation(s), clipped to ``[-1, 1]``.

    Returns:
        float64 array in ``[0, 1]``.

    Example:
        >>> float(bivariate_normal_cdf(0.0, 0.0, 0.0))
        0.25
        >>> round(float(bivariate_normal_cdf(1.0, -0.5, 0.3)), 6)
        0.283138
    """
    h = _clip(_f64(h), -Z_CLIP, Z_CLIP)
    k = _clip(_f64(k), -Z_CLIP, Z_CLIP)
    r = _clip(_f64(rho), -1.0, 1.0)
    h, k, r = np.broadcast_arrays(h, k, r)
    s = np.sqrt(np.maximum((1.0 - r) * (1.0 + r), 0.0))
    degenerate = s == 0.0
    s_safe = np.where(degenerate, 1.0, s)
    h0, k0 = h == 0.0, k == 0.0
    h_safe = np.where(h0, 1.0, h)
    k_safe = np.where(k0, 1.0, k)

    # T(h, a_h); as h -> 0 (k != 0), a_h -> sign(k) inf and T -> sign(k)/4.
    a_h = (k - r * h) / (h_safe * s_safe)
    t_h = np.where(h0, 0.25 * np.sign(k), owens_t(h, a_h))
    a_k = (h - r * k) / (k_safe * s_safe)
    t_k = np.where(k0, 0.25 * np.sign(h), owens_t(k, a_k))
    hk = h * k
    corr = np.where((hk < 0) | ((hk == 0) & (h + k < 0)), 0.5, 0.0)
    p = 0.5 * ndtr(h) + 0.5 * ndtr(k) - t_h - t_k - corr
    # both zero: 1/4 + arcsin(rho)/(2 pi)
    p = np.where(h0 & k0, 0.25 + np.arcsin(r) / (2.0 * np.pi), p)
    p_pos = ndtr(np.minimum(h, k))
    p_neg = np.maximum(ndtr(h) + ndtr(k) - 1.0, 0.0)
    p = np.where(degenerate, np.where(r > 0, p_pos, p_neg), p)
    return _clip(p, 0.0, 1.0)


def _standard_cross(a_i, a_j, r):
    """``E[relu(a_i + X) relu(a_j + Y)]`` for standard (X, Y) with correlation r."""
    a_i, a_j, r = np.broadcast_arrays(a_i, a_j, r)
    s2 = np.maximum((1.0 - r) * (1.0 + r), 0.0)
    s = np.sqrt(s2)
    # K is Lipschitz in r (dK/dr = P(y_i > 0, y_j > 0) <= 1 in standard units), so
    # the |r| = 1 closed forms are within s^2/2 <= 5e-13 of the truth for s < 1e-6,
    # where the general formula loses accuracy (terms of order s cancel).
    deg = s < 1e-6
    s_safe = np.where(deg, 1.0, s)
    p2 = bivariate_normal_cdf(a_i, a_j, r)
    q = a_i * a_i - 2.0 * r * a_i * a_j + a_j * a_j
    # (1 - r^2) phi_2 = s exp(-q / (2 s^2)) / (2 pi); q >= 0 up to round-off
    with np.errstate(over="ignore", under="ignore"):
        e = np.exp(-np.maximum(q, 0.0) / (2.0 * np.where(deg, 1.0, s2)))
    gen = (
        (a_i * a_j + r) * p2
        + a_i * _phi(a_j) * ndtr((a_i - r * a_j) / s_safe)
        + a_j * _phi(a_i) * ndtr((a_j - r * a_i) / s_safe)
        + s * e / (2.0 * np.pi)
    )
    # rho = +1: same z. (a_i a_j + 1) Phi(m) + max(a_i, a_j) phi(m), m = min.
    m = np.minimum(a_i, a_j)
    plus = (a_i * a_j + 1.0) * ndtr(m) + np.maximum(a_i, a_j) * _phi(m)
    # rho = -1: Y = -X. Nonzero only on (-a_i, a_j).
    minus = (a_i * a_j - 1.0) * (ndtr(a_j) - ndtr(-a_i)) + a_j * _phi(a_i) + a_i * _phi(a_j)
    minus = np.where(a_i + a_j > 0, minus, 0.0)
    out = np.where(deg, np.where(r > 0, plus, minus), gen)
    return np.maximum(out, 0.0)


def cross_kernel_exact(gamma_i, beta_i, gamma_j, beta_j, rho_tilde):
    """Exact cross-kernel ``E[relu(y_i) relu(y_j)]`` (eq. 83).

    ``(y_i, y_j)`` bivariate Gaussian with means ``beta``, standard deviations
    ``|gamma|`` and correlation ``rho_tilde``. With ``a = beta/|gamma|``::

        K = |g_i g_j| [ (a_i a_j + r) Phi_2 + a_i phi(a_j) Phi((a_i - r a_j)/s)
                        + a_j phi(a_i) Phi((a_j - r a_i)/s) + s^2 phi_2 ]

    ``s = sqrt(1 - r^2)``. ``|rho_tilde| = 1`` uses the degenerate closed forms;
    ``gamma_i = 0`` gives ``relu(beta_i) E[relu(y_j)]`` (and symmetrically), both
    zero give ``relu(beta_i) relu(beta_j)``.

    Args:
        gamma_i: std (sign ignored) of ``y_i``.
        beta_i: mean of ``y_i``.
        gamma_j: std (sign ignored) of ``y_j``.
        beta_j: mean of ``y_j``.
        rho_tilde: correlation, clipped to ``[-1, 1]``.

    Returns:
        float64 array ``K(i,j)`` (>= 0).

    Example:
        >>> round(float(cross_kernel_exact(1.0, 0.0, 1.0, 0.0, 1.0)), 12)
        0.5
        >>> round(float(cross_kernel_exact(0.0, 2.0, 1.0, 0.0, 0.3)), 6)  # 2 * phi(0)
        0.797885
    """
    gi = np.abs(_f64(gamma_i))
    gj = np.abs(_f64(gamma_j))
    bi, bj, r = _f64(beta_i), _f64(beta_j), _clip(_f64(rho_tilde), -1.0, 1.0)
    gi, bi, gj, bj, r = np.broadcast_arrays(gi, bi, gj, bj, r)
    pi_, pj_ = gi > 0, gj > 0
    raw_i = _safe_div(bi, np.where(pi_, gi, 1.0))
    raw_j = _safe_div(bj, np.where(pj_, gj, 1.0))
    a_i = _clip(raw_i, -Z_CLIP, Z_CLIP)
    a_j = _clip(raw_j, -Z_CLIP, Z_CLIP)
    both = gi * gj * _standard_cross(a_i, a_j, r)
    # Beyond |β/γ| = 50 a ReLU is linear (or dead) almost surely: the linear limit,
    # E[y_i relu(y_j)] = β_i E[relu(y_j)] + ρ|γ_i γ_j| Φ(a_j) (Stein's lemma).
    lin_i, lin_j = pi_ & (raw_i > Z_CLIP), pj_ & (raw_j > Z_CLIP)
    dead = (pi_ & (raw_i < -Z_CLIP)) | (pj_ & (raw_j < -Z_CLIP))
    cov = r * gi * gj
    lin_both = bi * bj + cov
    lin_first = bi * relu_mean(gj, bj) + cov * ndtr(a_j)
    lin_second = bj * relu_mean(gi, bi) + cov * ndtr(a_i)
    both = np.where(lin_i & lin_j, lin_both,
                    np.where(lin_i, lin_first, np.where(lin_j, lin_second, both)))
    both = np.where(dead, 0.0, both)
    only_j = np.maximum(bi, 0.0) * relu_mean(gj, bj)  # gamma_i == 0
    only_i = np.maximum(bj, 0.0) * relu_mean(gi, bi)  # gamma_j == 0
    none = np.maximum(bi, 0.0) * np.maximum(bj, 0.0)
    out = np.where(
        pi_ & pj_, both, np.where(pj_, only_j, np.where(pi_, only_i, none))
    )
    return np.maximum(out, 0.0)
