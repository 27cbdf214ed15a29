"""`GaussianActivation`: an activation's Gaussian moments (docs/theory.md,
"Activations beyond ReLU").

The mean, second moment, variance and cross moment of ``ψ(z)`` for Gaussian
pre-activations, from closed forms where the activation is piecewise polynomial
or exponential (the `Term`s of `hope_keras.activations.gaussian_terms`) and from quadrature
otherwise. The built-in activations and their look-up are in
`hope_keras.activations.registry`; `hope_keras.activations` gives all the names.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Optional, Sequence, Tuple

import numpy as np

from hope_keras.activations.gaussian_terms import (BLOCK, FEATURE_X, Term, as_f64, blockwise,
                                       composite_nodes, composite_rule, gauss_hermite,
                                       lift, sorted_points, terms_cross, terms_mean,
                                       terms_second)


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
    terms: Optional[Tuple[Term, ...]] = None
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
        return self.forward(as_f64(x))

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
        mu, sigma = np.broadcast_arrays(as_f64(mu), np.abs(as_f64(sigma)))
        if self.mean_fn is not None:
            return as_f64(self.mean_fn(mu, sigma))
        pos = sigma > 0
        ss = np.where(pos, sigma, 1.0)
        if self.terms is not None:
            val = terms_mean(self.terms, mu, ss)
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
        mu, sigma = np.broadcast_arrays(as_f64(mu), np.abs(as_f64(sigma)))
        if self.second_moment_fn is not None:
            return as_f64(self.second_moment_fn(mu, sigma))
        pos = sigma > 0
        ss = np.where(pos, sigma, 1.0)
        if self.terms is not None:
            val = terms_second(self.terms, mu, ss)
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
        mu, sigma = np.broadcast_arrays(as_f64(mu), np.abs(as_f64(sigma)))
        pos = sigma > 0
        ss = np.where(pos, sigma, 1.0)
        c = self(mu)[..., None]
        x, w = composite_nodes(mu, ss, self.breakpoints + FEATURE_X)
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
        mu_i, sigma_i = np.broadcast_arrays(as_f64(mu_i), np.abs(as_f64(sigma_i)))
        mu_j, sigma_j = np.broadcast_arrays(as_f64(mu_j), np.abs(as_f64(sigma_j)))
        rho = np.clip(as_f64(rho), -1.0, 1.0)
        if self.cross_fn is not None:
            return as_f64(self.cross_fn(mu_i, sigma_i, mu_j, sigma_j, rho))
        shape = np.broadcast_shapes(mu_i.shape, mu_j.shape, rho.shape)
        ndim = max(1, len(shape))
        mu_i, sigma_i, mu_j, sigma_j, rho = (lift(a, ndim) for a in (mu_i, sigma_i, mu_j,
                                                                        sigma_j, rho))
        pi_, pj_ = sigma_i > 0, sigma_j > 0
        # Degenerate sides: sigma = 0 makes that side the constant psi(mu).
        f_i = np.where(pi_, 0.0, self(mu_i))
        f_j = np.where(pj_, 0.0, self(mu_j))
        mean_i = self.mean(mu_i, sigma_i)
        mean_j = self.mean(mu_j, sigma_j)
        ssi, ssj = np.where(pi_, sigma_i, 1.0), np.where(pj_, sigma_j, 1.0)
        if self.terms is not None:
            both = blockwise(self._cross_terms, mu_i, ssi, mu_j, ssj, rho)
        else:
            both = self._cross_mehler(mu_i, ssi, mu_j, ssj, rho)
        out = np.where(pi_ & pj_, both,
                       np.where(pj_, f_i * mean_j, np.where(pi_, f_j * mean_i, f_i * f_j)))
        # rho = 0: independent, exactly the product of the means.
        return np.where(rho == 0.0, mean_i * mean_j, out).reshape(shape)

    # --------------------------------------------------------------- internals

    def _quad(self, g, mu, sigma):
        x, w = composite_nodes(mu, sigma, self.breakpoints + FEATURE_X)
        return np.sum(w * g(self(x)), axis=-1)

    def _cross_terms(self, mu_i, s_i, mu_j, s_j, r):
        val, err = terms_cross(self.terms, self.terms, mu_i, s_i, mu_j, s_j, r)
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
        z, w = gauss_hermite(_INNER_GH)
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
        pts = sorted_points(self.breakpoints + FEATURE_X)
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
            c, w = composite_rule(zp)
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
        zp = (sorted_points(self.breakpoints + FEATURE_X) - mu[..., None]) / sigma[..., None]
        z, w = composite_rule(zp, zmax=zmax, gl=24)
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
        rows = max(1, BLOCK // max(1, int(np.prod(shape[1:]))))
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
