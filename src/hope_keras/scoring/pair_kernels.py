"""The pair values of a ReLU group, compiled with numba (docs/theory.md §2–§4).

The greedy search prices pairs in batches of a few to a few thousand: the warped
correlation ρ̃ (eq. 4), the zero-bias cross-kernel K(i,j) (eq. 5) and the merge
objective B of the best parent (eq. 11, the ``"approx"`` kernel). As NumPy
expressions each batch is about a hundred and fifty array operations, and on
ResNet-50 their fixed cost outweighs the arithmetic; here each pair is one pass of
scalar code. The formulas are those of `hope_keras.scoring.cost_formulas` and
`hope_keras.activations.kernels`, written for one pair; they agree with those
vectorised forms to rounding (tests/test_pair_kernels.py).

Compiled functions are cached on disk where numba can (`hope_keras._jit`).
"""

from __future__ import annotations

import math

import numba
import numpy as np

from hope_keras._jit import jit_options
from hope_keras.activations.kernels import RHO_CLIP, Z_CLIP

__all__ = ["merge_one", "pair_values_approx"]

_JIT = jit_options(__file__)

#: Relative threshold (times the trace) below which an eigenvalue of a merge's 2 × 2
#: Gram counts as 0 (duplicated or collinear children); `cost_formulas` uses it too.
EIG_RTOL = 1e-12
_SQRT_2 = math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


@numba.njit
def _pos(x):
    """``max(x, 0)`` with NaN kept (``np.maximum(x, 0.0)``)."""
    return 0.0 if x < 0.0 else x


@numba.njit
def _div(num, den):
    """``num / den``, 0 where ``den == 0``."""
    return 0.0 if den == 0.0 else num / den


@numba.njit
def _clip(x, lo, hi):
    """``np.clip`` of one float (NaN kept)."""
    if x < lo:
        return lo
    if x > hi:
        return hi
    return x


@numba.njit
def _eig2(a, c, b):
    """Eigen-decomposition of ``[[a, b], [b, c]]``: ``(l1, l2, cos, sin)``, l1 ≥ l2."""
    m = 0.5 * (a + c)
    d = math.hypot(0.5 * (a - c), b)
    th = 0.5 * math.atan2(2.0 * b, a - c)
    return m + d, m - d, math.cos(th), math.sin(th)


@numba.njit
def _self_kernel(g, b):
    """``K = E[relu(y)²]``, ``y ~ N(b, g²)``, ``g = |γ| ≥ 0`` (eq. 3)."""
    if not g > 0.0:
        return _pos(b) ** 2
    t = _clip(b / g, -Z_CLIP, Z_CLIP)
    cdf = 0.5 * math.erfc(-t / _SQRT_2)
    pdf = _INV_SQRT_2PI * math.exp(-0.5 * t * t)
    return _pos((g * g + b * b) * cdf + b * g * pdf)


@numba.njit
def _arccos_i(r):
    """``I(ρ) = (sqrt(1 − ρ²) + (π − arccos ρ) ρ) / π`` (eq. 5)."""
    r = _clip(r, -1.0, 1.0)
    v = (math.sqrt(_pos(1.0 - r * r)) + (math.pi - math.acos(r)) * r) / math.pi
    return _clip(v, 0.0, 1.0)


@numba.njit
def _warped(rho_eff, gi, ni, gj, nj):
    """ρ̃ from the cosine of the effective input weights (eqs. 4, 80, 81); 0 where
    either weight norm is 0."""
    if not (ni > 0.0 and nj > 0.0):
        return 0.0
    rho = _clip(rho_eff, -RHO_CLIP, RHO_CLIP)
    x = 2.0 * rho / ((1.0 - rho) * (1.0 + rho)) * ((abs(gi) / ni) * (abs(gj) / nj))
    if math.isnan(x):
        x = 0.0
    x = _clip(x, -1e300, 1e300)
    return _clip(x / (1.0 + math.hypot(1.0, x)), -1.0, 1.0)


@numba.njit
def _rho_kc(gw, i, j, gamma, wnorm, k_self):
    """ρ̃ and K(i,j) of the pair (i, j) from ⟨w_i, w_j⟩."""
    den = wnorm[i] * wnorm[j]
    rt = _warped(gw / den if den > 0.0 else 0.0, gamma[i], wnorm[i], gamma[j], wnorm[j])
    return rt, _arccos_i(rt) * math.sqrt(_pos(k_self[i]) * _pos(k_self[j]))


@numba.njit(**_JIT)
def merge_one(gv_ii, gv_jj, gv_ij, gu_ii, gu_jj, gu_ij, gamma_i, beta_i, gamma_j,
              beta_j, rho_tilde, k_ii, k_jj):
    """The merge solution of one pair with the ``"approx"`` kernel (docs/theory.md
    §4, eq. 11): ``(lam1, lam2, B, gamma_v, beta_v, k_vv, k_vi, k_vj)``, the fields of
    `cost_formulas.MergeSolution`.

    The parent direction ``v = lam1 v_i + lam2 v_j`` is the principal right singular
    vector of ``u_i v_iᵀ + u_j v_jᵀ`` (2 × 2 eigenproblems in closed form, eigenvalues
    of G_v below ``1e-12 · trace`` taken as 0), its sign the one of larger B.

    Example:
        >>> s = merge_one(4.0, 4.0, 4.0, 1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 1.0, 0.5, 0.5)
        >>> [round(x, 6) for x in s[:3]]
        [0.25, 0.25, 1.414214]
    """
    gi, gj = abs(gamma_i), abs(gamma_j)
    rt = _clip(rho_tilde, -1.0, 1.0)
    l1, l2, c, s = _eig2(gv_ii, gv_jj, gv_ij)
    tol = EIG_RTOL * _pos(gv_ii + gv_jj)
    d1 = math.sqrt(l1) if l1 > tol else 0.0
    d2 = math.sqrt(l2) if l2 > tol else 0.0
    h11 = c * c * gu_ii + 2.0 * c * s * gu_ij + s * s * gu_jj
    h22 = s * s * gu_ii - 2.0 * c * s * gu_ij + c * c * gu_jj
    h12 = c * s * (gu_jj - gu_ii) + (c * c - s * s) * gu_ij
    _, _, zc, zs = _eig2(d1 * d1 * h11, d2 * d2 * h22, d1 * d2 * h12)
    y1, y2 = _div(zc, d1), _div(zs, d2)
    lam1, lam2 = c * y1 - s * y2, s * y1 + c * y2
    nrm = math.sqrt(_pos(lam1 * lam1 * gv_ii + 2.0 * lam1 * lam2 * gv_ij
                         + lam2 * lam2 * gv_jj))
    lam1, lam2 = _div(lam1, nrm), _div(lam2, nrm)
    c_ij = gi * gj * rt
    mean_v = lam1 * beta_i + lam2 * beta_j
    std_v = math.sqrt(_pos(lam1 * lam1 * gi * gi + lam2 * lam2 * gj * gj
                           + 2.0 * lam1 * lam2 * c_ij))
    cov_vi, cov_vj = lam1 * gi * gi + lam2 * c_ij, lam1 * c_ij + lam2 * gj * gj
    kk_i, kk_j = _pos(k_ii), _pos(k_jj)
    # +v, then −v: the sign of larger B (+v on a tie).
    best = (0.0, 0.0, 0.0, 0.0)
    sign = 1.0
    for side in range(2):
        sg = 1.0 if side == 0 else -1.0
        k_vv = _self_kernel(std_v, sg * mean_v)
        r_vi = _clip(_div(sg * cov_vi, std_v * gi), -1.0, 1.0)
        r_vj = _clip(_div(sg * cov_vj, std_v * gj), -1.0, 1.0)
        k_vi = _arccos_i(r_vi) * math.sqrt(_pos(k_vv) * kk_i)
        k_vj = _arccos_i(r_vj) * math.sqrt(_pos(k_vv) * kk_j)
        sq = k_vi * k_vi * gu_ii + k_vj * k_vj * gu_jj + 2.0 * k_vi * k_vj * gu_ij
        b = _div(math.sqrt(_pos(sq)), math.sqrt(_pos(k_vv)))
        if side == 0 or b > best[0]:
            best = (b, k_vv, k_vi, k_vj)
            sign = sg
    return (sign * lam1, sign * lam2, best[0], std_v, sign * mean_v,
            best[1], best[2], best[3])


@numba.njit(**_JIT)
def pair_values_approx(a, b, gw, gv, gu, gamma, beta, wnorm, k_self, dv, du, with_b):
    """ρ̃, K(i,j) and (with `with_b`) B of the pairs ``(a[p], b[p])``, first neuron
    ``a[p]``: `hope_keras.scoring.cache.GroupCache.pair_values` for the ``"approx"``
    kernel.

    Args:
        a, b: the pairs' neurons (intp).
        gw, gv, gu: the pairs' Gram entries ⟨w_a, w_b⟩, ⟨v_a, v_b⟩, ⟨u_a, u_b⟩.
        gamma, beta, wnorm, k_self: per neuron, γ, β, ‖w_eff‖ and K(i,i).
        dv, du: per neuron, ‖v‖² and ‖u‖² (the Gram diagonals).
        with_b: whether to solve the merge (B); an empty B otherwise.

    Returns:
        ``(rho, k_cross, B)`` float64 arrays.

    Example:
        >>> import numpy as np
        >>> one, ones = np.array([0, 0]), np.ones(2)
        >>> rho, kc, B = pair_values_approx(one, np.array([1, 1]), ones, 4 * ones, ones,
        ...                                 ones, 0 * ones, ones, 0.5 * ones, 4 * ones,
        ...                                 ones, True)
        >>> round(float(rho[0]), 6), round(float(kc[0]), 6), round(float(B[0]), 6)
        (1.0, 0.5, 1.414214)
    """
    n = a.shape[0]
    rho = np.empty(n)
    kc = np.empty(n)
    out_b = np.empty(n if with_b else 0)
    for p in range(n):
        i, j = a[p], b[p]
        rt, kc[p] = _rho_kc(np.float64(gw[p]), i, j, gamma, wnorm, k_self)
        rho[p] = rt
        if with_b:
            out_b[p] = merge_one(dv[i], dv[j], gv[p], du[i], du[j], gu[p], gamma[i],
                                 beta[i], gamma[j], beta[j], rt, k_self[i], k_self[j])[2]
    return rho, kc, out_b
