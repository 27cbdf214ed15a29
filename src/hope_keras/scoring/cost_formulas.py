"""The HOPE cost formulas and the merged parent neuron (docs/theory.md §3, §4).

Pure numpy float64 math, no Keras, vectorised over arrays of neurons / pairs:
`j_prune`, `alpha_star`, `j_merge`, `j_merge_residual`, `j_evict`, the merge
direction (`merge_solution`, `merge_solution_one`) and the parent's coefficients
(`parent_coefficients`). The `Cost` objects that use them are in `hope_keras.costs`,
which re-exports every name here.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from hope_keras.activations.kernels import cross_kernel_approx, cross_kernel_exact, self_kernel
from hope_keras.activations.kernels import fast_clip as _clip
from hope_keras.scoring import pair_kernels

__all__ = [
    "FLOOR",
    "j_prune",
    "alpha_star",
    "j_merge",
    "j_merge_residual",
    "j_evict",
    "MergeSolution",
    "ParentCoefficients",
    "merge_solution",
    "parent_coefficients",
]

#: Floor applied to capacities used as denominators.
FLOOR = 1e-12
_EIG_RTOL = pair_kernels.EIG_RTOL


def _f64(x):
    return np.asarray(x, dtype=np.float64)


def _safe_div(num, den):
    num, den = _f64(num), _f64(den)
    ok = den != 0
    return np.where(ok, num / np.where(ok, den, 1.0), 0.0)


# --------------------------------------------------------------------------- costs


def j_prune(capacity, layer_capacity, n):
    """Prune cost ``J = n ||f_i|| / (C - ||f_i||)`` (eq. 6).

    Args:
        capacity: the neuron's capacity ``||f_i|| = ||u_i|| sqrt(K_ii)``.
        layer_capacity: the layer's live capacity ``C``.
        n: the layer's active neuron count before the action.

    Returns:
        float64 array; the denominator ``C - ||f_i||`` is floored at 1e-12.
        (The "last neuron is never pruned" rule is the caller's.)

    Example:
        >>> float(j_prune(1.0, 4.0, 3))
        1.0
    """
    cap = _f64(capacity)
    return _f64(n) * cap / np.maximum(_f64(layer_capacity) - cap, FLOOR)


def alpha_star(A, B, c_rem):
    """Optimal parent scale ``alpha* = (A + B C_rem) / (2 C_rem + B)`` (eq. 40).

    It minimises ``J(alpha) = sqrt(2 alpha^2 - 2 alpha B + A) / (C_rem + alpha)``.

    Args:
        A: ``||f_i||^2 + ||f_j||^2``.
        B: ``<phi, f_i + f_j>`` (the merge objective, >= 0).
        c_rem: ``C - ||f_i|| - ||f_j||``, floored at 1e-12.

    Returns:
        float64 array ``alpha*`` (0 where the denominator vanishes).

    Example:
        >>> float(alpha_star(2.0, 2.0, 1.0))
        1.0
    """
    c = np.maximum(_f64(c_rem), FLOOR)
    B = _f64(B)
    return _safe_div(_f64(A) + B * c, 2.0 * c + B)


def j_merge(A, B, c_rem, n):
    """Merge cost ``J = n sqrt(2a^2 - 2aB + A) / (C_rem + a)`` with ``a = alpha*`` (eq. 6).

    Args:
        A: ``||f_i||^2 + ||f_j||^2``.
        B: ``<phi, f_i + f_j>``.
        c_rem: ``C - ||f_i|| - ||f_j||`` (floored at 1e-12).
        n: active neuron count before the action.

    Returns:
        float64 array (the radicand is clamped at 0).

    Example:
        >>> float(j_merge(2.0, 2.0, 1.0, 3))  # two identical unit neurons: lossless
        0.0
        >>> round(float(j_merge(2.0, 1.0, 1.0, 3)), 6)
        2.12132
    """
    c = np.maximum(_f64(c_rem), FLOOR)
    A, B = _f64(A), _f64(B)
    a = alpha_star(A, B, c)
    num = np.sqrt(np.maximum(2.0 * a * a - 2.0 * a * B + A, 0.0))
    return _f64(n) * _safe_div(num, c + a)


def j_merge_residual(norm_sum_sq, B, c_rem, n):
    """Sum-consistent merge cost ``n sqrt(max(||f_i+f_j||^2 - B^2, 0)) / (C_rem + B)``.

    The cost of the sum-scale parent (output scale ``s = B``; docs/theory.md §3).

    Args:
        norm_sum_sq: ``||f_i + f_j||^2 = ||f_i||^2 + ||f_j||^2 + 2 <f_i, f_j>``.
        B: ``<phi, f_i + f_j>``.
        c_rem: ``C - ||f_i|| - ||f_j||`` (floored at 1e-12).
        n: active neuron count before the action.

    Returns:
        float64 array.

    Example:
        >>> float(j_merge_residual(4.0, 2.0, 1.0, 3))
        0.0
    """
    c = np.maximum(_f64(c_rem), FLOOR)
    B = _f64(B)
    num = np.sqrt(np.maximum(_f64(norm_sum_sq) - B * B, 0.0))
    return _f64(n) * _safe_div(num, c + B)


def j_evict(n_layers, c_layers, c_identity):
    """Block eviction cost ``sum_l n_l C_l / C_identity`` (eqs. 19, 20, 96).

    Args:
        n_layers: active counts of the block's internal neuron layers, shape (..., L).
        c_layers: their live capacities, shape (..., L).
        c_identity: ``sum_c sqrt(gamma_c^2 + beta_c^2)`` (or the fallback), shape (...);
            floored at 1e-12.

    Returns:
        float64 array of shape (...).

    Example:
        >>> float(j_evict([2, 3], [1.0, 2.0], 4.0))
        2.0
    """
    num = np.sum(_f64(n_layers) * _f64(c_layers), axis=-1)
    return num / np.maximum(_f64(c_identity), FLOOR)


# --------------------------------------------------------------------- merge math


class MergeSolution(NamedTuple):
    """The merged unit direction ``v = lam1 v_i + lam2 v_j`` (``||v|| = 1``).

    Attributes:
        lam1, lam2: coefficients on the children's augmented input vectors,
            normalised so ``lam^T G_v lam = 1``, sign chosen by the sign check
            (all zero when both input vectors are zero).
        B: objective ``||K(v,i) u_i + K(v,j) u_j|| / sqrt(K(v,v))`` (0 where K_vv = 0).
        gamma_v: std of ``y_v = lam1 y_i + lam2 y_j`` (>= 0).
        beta_v: mean of ``y_v``.
        k_vv: ``K(v,v)``.
        k_vi: ``K(v,i)``.
        k_vj: ``K(v,j)``.
    """

    lam1: np.ndarray
    lam2: np.ndarray
    B: np.ndarray
    gamma_v: np.ndarray
    beta_v: np.ndarray
    k_vv: np.ndarray
    k_vi: np.ndarray
    k_vj: np.ndarray


class ParentCoefficients(NamedTuple):
    """Physical parent ``v_k = a1 v_i + a2 v_j``, ``u_k = m1 u_i + m2 u_j``.

    Attributes:
        a1, a2: input coefficients (apply to ``w_eff`` for the filter; bias 0).
        m1, m2: output coefficients.
        gamma_k: std of the parent pre-activation, ``a * gamma_v`` (the BN gamma).
        beta_k: mean of the parent pre-activation, ``a * beta_v`` (the BN beta).
    """

    a1: np.ndarray
    a2: np.ndarray
    m1: np.ndarray
    m2: np.ndarray
    gamma_k: np.ndarray
    beta_k: np.ndarray


def _sym_eig2(a, c, b):
    """Closed-form eigen-decomposition of ``[[a, b], [b, c]]`` (diagonal first).

    Returns ``(l1, l2, cos, sin)`` with ``l1 >= l2``; eigenvector of ``l1`` is
    ``(cos, sin)``, of ``l2`` is ``(-sin, cos)``. The rotation angle
    ``0.5 atan2(2b, a - c)`` is numerically stable for every input.
    """
    m = 0.5 * (a + c)
    d = np.hypot(0.5 * (a - c), b)
    th = 0.5 * np.arctan2(2.0 * b, a - c)
    return m + d, m - d, np.cos(th), np.sin(th)


def _objective(k_vi, k_vj, k_vv, gu_ii, gu_jj, gu_ij):
    sq = k_vi * k_vi * gu_ii + k_vj * k_vj * gu_jj + 2.0 * k_vi * k_vj * gu_ij
    return _safe_div(np.sqrt(np.maximum(sq, 0.0)), np.sqrt(np.maximum(k_vv, 0.0)))


def _unit_kernels(mean_v, std_v, cov_vi, cov_vj, gi, bi, gj, bj, k_ii, k_jj, kernel):
    k_vv = self_kernel(std_v, mean_v)
    r_vi = _clip(_safe_div(cov_vi, std_v * gi), -1.0, 1.0)
    r_vj = _clip(_safe_div(cov_vj, std_v * gj), -1.0, 1.0)
    if kernel == "approx":
        k_vi = cross_kernel_approx(r_vi, k_vv, k_ii)
        k_vj = cross_kernel_approx(r_vj, k_vv, k_jj)
    else:
        k_vi = cross_kernel_exact(std_v, mean_v, gi, bi, r_vi)
        k_vj = cross_kernel_exact(std_v, mean_v, gj, bj, r_vj)
    return k_vv, k_vi, k_vj


def merge_solution(
    gv_ii,
    gv_jj,
    gv_ij,
    gu_ii,
    gu_jj,
    gu_ij,
    gamma_i,
    beta_i,
    gamma_j,
    beta_j,
    rho_tilde,
    kernel="approx",
    k_ii=None,
    k_jj=None,
):
    """Parent direction of a merge of neurons i, j (docs/theory.md §4, eq. 11).

    The direction is the principal right singular vector of
    ``M = u_i v_i^T + u_j v_j^T`` written as ``v = lam1 v_i + lam2 v_j``: it
    maximises ``lam^T G_v G_u G_v lam / lam^T G_v lam``. With the closed-form
    ``G_v = Q diag(L) Q^T`` and ``S = L^{1/2} Q^T G_u Q L^{1/2}``, ``lam =
    Q L^{+1/2} z`` for the principal eigenvector ``z`` of ``S``; eigenvalues of
    ``G_v`` below ``1e-12 * trace`` are treated as 0 (duplicated / collinear
    children), which keeps the result finite and in the span. The sign of ``v``
    is then chosen by evaluating the objective ``B`` for ``+-v`` under the
    pairwise Gaussian surrogate. All inputs broadcast to a common shape (...).

    Args:
        gv_ii, gv_jj, gv_ij: Gram entries of the augmented input vectors.
        gu_ii, gu_jj, gu_ij: Gram entries of the output vectors.
        gamma_i, beta_i, gamma_j, beta_j: BN scales (std, sign ignored) and shifts (means).
        rho_tilde: warped correlation of ``y_i, y_j``.
        kernel: ``"approx"`` (zero-bias approximation, the engine's) or ``"exact"``.
        k_ii, k_jj: The self-kernels ``K(i,i)``, ``K(j,j)`` when known (a cache's
            ``k_self``: the same values); computed from the BN statistics otherwise.

    Returns:
        MergeSolution of float64 arrays.

    Example:
        >>> s = merge_solution(4.0, 4.0, 4.0, 1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 1.0)
        >>> [round(float(x), 6) for x in (s.lam1, s.lam2, s.B)]  # duplicates, ||v_i|| = 2
        [0.25, 0.25, 1.414214]
    """
    if kernel not in ("approx", "exact"):
        raise ValueError(f"kernel must be 'approx' or 'exact', got {kernel!r}")
    arrs = [_f64(x) for x in (gv_ii, gv_jj, gv_ij, gu_ii, gu_jj, gu_ij,
                              gamma_i, beta_i, gamma_j, beta_j, rho_tilde)]
    if any(x.shape != arrs[0].shape for x in arrs):
        arrs = np.broadcast_arrays(*arrs)
    gv_ii, gv_jj, gv_ij, gu_ii, gu_jj, gu_ij, gi, bi, gj, bj, rt = arrs
    gi, gj = np.abs(gi), np.abs(gj)
    rt = _clip(rt, -1.0, 1.0)

    # --- direction: G_v = Q diag(l) Q^T, Q = [[c, -s], [s, c]]
    l1, l2, c, s = _sym_eig2(gv_ii, gv_jj, gv_ij)
    tol = _EIG_RTOL * np.maximum(gv_ii + gv_jj, 0.0)
    ok1 = l1 > tol
    ok2 = l2 > tol
    d1 = np.where(ok1, np.sqrt(np.where(ok1, l1, 0.0)), 0.0)
    d2 = np.where(ok2, np.sqrt(np.where(ok2, l2, 0.0)), 0.0)
    # H = Q^T G_u Q
    h11 = c * c * gu_ii + 2.0 * c * s * gu_ij + s * s * gu_jj
    h22 = s * s * gu_ii - 2.0 * c * s * gu_ij + c * c * gu_jj
    h12 = c * s * (gu_jj - gu_ii) + (c * c - s * s) * gu_ij
    _, _, zc, zs = _sym_eig2(d1 * d1 * h11, d2 * d2 * h22, d1 * d2 * h12)
    # lam = Q D^+ z
    y1 = _safe_div(zc, d1)
    y2 = _safe_div(zs, d2)
    lam1 = c * y1 - s * y2
    lam2 = s * y1 + c * y2
    nrm2 = lam1 * lam1 * gv_ii + 2.0 * lam1 * lam2 * gv_ij + lam2 * lam2 * gv_jj
    nrm = np.sqrt(np.maximum(nrm2, 0.0))
    lam1 = _safe_div(lam1, nrm)
    lam2 = _safe_div(lam2, nrm)

    # --- surrogate statistics of y_v = lam1 y_i + lam2 y_j
    c_ij = gi * gj * rt
    mean_v = lam1 * bi + lam2 * bj
    var_v = lam1 * lam1 * gi * gi + lam2 * lam2 * gj * gj + 2.0 * lam1 * lam2 * c_ij
    std_v = np.sqrt(np.maximum(var_v, 0.0))
    cov_vi = lam1 * gi * gi + lam2 * c_ij
    cov_vj = lam1 * c_ij + lam2 * gj * gj
    if k_ii is None or k_jj is None:
        k_ii, k_jj = self_kernel(np.stack([gi, gj]), np.stack([bi, bj]))
    else:
        k_ii, k_jj = _f64(k_ii), _f64(k_jj)

    # Both signs of v at once (leading axis: +v, −v): elementwise, the same values
    # as two calls, at half the calls' fixed cost.
    k_vv, k_vi, k_vj = _unit_kernels(np.stack([mean_v, -mean_v]), std_v,
                                     np.stack([cov_vi, -cov_vi]),
                                     np.stack([cov_vj, -cov_vj]),
                                     gi, bi, gj, bj, k_ii, k_jj, kernel)
    b_plus, b_minus = _objective(k_vi, k_vj, k_vv, gu_ii, gu_jj, gu_ij)
    flip = b_minus > b_plus
    sign = np.where(flip, -1.0, 1.0)
    return MergeSolution(
        lam1=sign * lam1,
        lam2=sign * lam2,
        B=np.where(flip, b_minus, b_plus),
        gamma_v=std_v,
        beta_v=sign * mean_v,
        k_vv=np.where(flip, k_vv[1], k_vv[0]),
        k_vi=np.where(flip, k_vi[1], k_vi[0]),
        k_vj=np.where(flip, k_vj[1], k_vj[0]),
    )


def merge_solution_one(gv_ii, gv_jj, gv_ij, gu_ii, gu_jj, gu_ij, gamma_i, beta_i,
                       gamma_j, beta_j, rho_tilde, k_ii, k_jj) -> MergeSolution:
    """`merge_solution` of one pair with the ``"approx"`` kernel, in Python floats.

    The same formulas, compiled for one pair (`hope_keras.scoring.pair_kernels`),
    without NumPy's fixed cost per operation: the engine solves the merge it executes
    with it. Equal to `merge_solution` to rounding (tests/test_costs.py).

    Example:
        >>> s = merge_solution_one(4.0, 4.0, 4.0, 1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.0,
        ...                        1.0, 0.5, 0.5)
        >>> [round(x, 6) for x in (s.lam1, s.lam2, s.B)]
        [0.25, 0.25, 1.414214]
    """
    return MergeSolution(*pair_kernels.merge_one(*map(float, (
        gv_ii, gv_jj, gv_ij, gu_ii, gu_jj, gu_ij, gamma_i, beta_i, gamma_j, beta_j,
        rho_tilde, k_ii, k_jj))))


def parent_coefficients(sol, scale, gv_ii, gv_jj, gu_ii, gu_jj, gu_ij):
    """Physical parent parameters for a merge (docs/theory.md §4, eqs. 15-18, 70).

    ``v_k = a (lam1 v_i + lam2 v_j)`` and ``u_k = b u_hat`` with
    ``u_hat = (K_vi u_i + K_vj u_j)/||.||``, where ``a, b > 0`` solve
    ``b sqrt(K(a v, a v)) = a b sqrt(K_vv) = scale`` (the self-kernel is
    2-homogeneous in v) and ``a / b = r = sqrt(gv_ii + gv_jj) / sqrt(gu_ii + gu_jj)``.

    Args:
        sol: a :class:`MergeSolution`.
        scale: the parent's capacity, ``alpha*`` (``merge_scale="paper"``) or
            ``sol.B`` (``"sum"``); negative values are treated as 0.
        gv_ii, gv_jj: diagonal Gram entries of the augmented input vectors.
        gu_ii, gu_jj, gu_ij: Gram entries of the output vectors.

    Returns:
        ParentCoefficients ``(a1, a2, m1, m2, gamma_k, beta_k)``; all zero where
        ``B = 0``, ``K_vv = 0`` or either Frobenius norm is 0.

    Example:
        >>> s = merge_solution(4.0, 4.0, 4.0, 1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 1.0)
        >>> p = parent_coefficients(s, s.B, 4.0, 4.0, 1.0, 1.0, 1.0)
        >>> [round(float(x), 6) for x in p]
        [0.707107, 0.707107, 0.707107, 0.707107, 1.414214, 0.0]
    """
    k_vv, k_vi, k_vj, B = (_f64(x) for x in (sol.k_vv, sol.k_vi, sol.k_vj, sol.B))
    scale = np.maximum(_f64(scale), 0.0)
    gv_ii, gv_jj, gu_ii, gu_jj, gu_ij = (_f64(x) for x in (gv_ii, gv_jj, gu_ii, gu_jj, gu_ij))
    fv = np.sqrt(np.maximum(gv_ii + gv_jj, 0.0))
    fu = np.sqrt(np.maximum(gu_ii + gu_jj, 0.0))
    sq_kvv = np.sqrt(np.maximum(k_vv, 0.0))
    nu = np.sqrt(
        np.maximum(k_vi * k_vi * gu_ii + k_vj * k_vj * gu_jj + 2.0 * k_vi * k_vj * gu_ij, 0.0)
    )
    valid = (B > 0) & (sq_kvv > 0) & (fv > 0) & (fu > 0) & (nu > 0)
    r = _safe_div(fv, fu)
    prod = _safe_div(scale, sq_kvv)  # a * b
    a = np.where(valid, np.sqrt(prod * r), 0.0)
    b = np.where(valid, np.sqrt(_safe_div(prod, np.where(valid, r, 1.0))), 0.0)
    mb = _safe_div(b, nu)
    return ParentCoefficients(
        a1=a * _f64(sol.lam1),
        a2=a * _f64(sol.lam2),
        m1=mb * k_vi,
        m2=mb * k_vj,
        gamma_k=a * _f64(sol.gamma_v),
        beta_k=a * _f64(sol.beta_v),
    )
