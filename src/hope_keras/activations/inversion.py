"""Moment inversion: from an activation's output mean and variance to the Gaussian
pre-activation that produces them (docs/theory.md, "Activations beyond ReLU").

`invert_moments` serves a BatchNormalization placed after the activation.
`hope_keras.activations` gives its names.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np

from hope_keras.activations.registry import get
from hope_keras.activations.gaussian_terms import FEATURE_X, as_f64, composite_nodes

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
    x, w = composite_nodes(mu, ss, spec.breakpoints + FEATURE_X)
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
    m, v = np.broadcast_arrays(as_f64(mean_out), as_f64(var_out))
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
