"""Per-group capacity and pair tables (spec sections 2, 3 and 5).

For each neuron group the cache holds, in float64:

* per neuron: surrogate scale γ and shift β, ‖w_eff‖, self-kernel K(i,i), ‖u_i‖
  and the capacity ‖f_i‖ = ‖u_i‖·sqrt(K(i,i));
* per pair: the Gram matrices of the augmented inputs ``v``, the effective inputs
  ``w_eff`` and the outputs ``u`` (computed with TensorFlow, so on a GPU when there
  is one, in row chunks so memory stays bounded), the warped correlation ρ̃, the
  cross-kernel K(i,j) and the merge objective ``B`` of the best parent.

Everything the engine needs after a merge is a linear combination of two Gram rows,
so `GroupCache.replace_with_parent` refreshes one row in O(n) kernel work.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np

from hope_keras import costs, kernels
from hope_keras.neurons import LayerState

# Rows per chunk: bounds the temporaries of the pair computations to a few MB per
# array whatever the layer width.
CHUNK_ROWS = 256


def gram(x: np.ndarray, chunk_rows: int = CHUNK_ROWS * 4) -> np.ndarray:
    """``x @ x.T`` in float64 with TensorFlow, in row chunks.

    Example:

    >>> import numpy as np
    >>> x = np.arange(6.0).reshape(3, 2)
    >>> np.allclose(gram(x), x @ x.T)
    True
    """
    import tensorflow as tf

    n = x.shape[0]
    xt = tf.constant(x, dtype=tf.float64)
    out = np.empty((n, n), dtype=np.float64)
    for start in range(0, n, chunk_rows):
        stop = min(n, start + chunk_rows)
        out[start:stop] = tf.matmul(xt[start:stop], xt, transpose_b=True).numpy()
    return out


@dataclasses.dataclass
class GroupCache:
    """Capacities and pair tables of one group (see module docstring).

    Attributes:
        gamma, beta: Surrogate std and mean of each neuron's pre-activation.
        wnorm: ‖w_eff,i‖ (0 marks an inactive neuron: no pair terms).
        k_self: K(i,i).
        capacity: ‖f_i‖.
        gram_v, gram_w, gram_u: Gram matrices of v, w_eff and u.
        rho: Warped correlation ρ̃ (n, n).
        k_cross: Cross-kernel K(i,j) (n, n).
        B: Merge objective of the best parent for each pair (n, n), symmetric.
        kernel: ``"approx"`` or ``"exact"``.
    """

    gamma: np.ndarray
    beta: np.ndarray
    wnorm: np.ndarray
    k_self: np.ndarray
    capacity: np.ndarray
    gram_v: np.ndarray
    gram_w: np.ndarray
    gram_u: np.ndarray
    rho: np.ndarray
    k_cross: np.ndarray
    B: np.ndarray
    kernel: str = "approx"

    @property
    def size(self) -> int:
        return self.gamma.shape[0]

    @property
    def u_norm(self) -> np.ndarray:
        """‖u_i‖ of each neuron."""
        return np.sqrt(np.maximum(np.diag(self.gram_u), 0.0))

    mergeable = True

    def layer_capacity(self, active: Optional[np.ndarray] = None) -> float:
        """C(layer) = Σ over active neurons of ‖f_i‖."""
        cap = self.capacity if active is None else self.capacity[active]
        return float(cap.sum())

    def _pair_rows(self, rows: np.ndarray):
        """ρ̃, K(i,j) and B for pairs (rows × all neurons)."""
        g, b, wn = self.gamma, self.beta, self.wnorm
        gi, bi, wi = g[rows, None], b[rows, None], wn[rows, None]
        gw = self.gram_w[rows]
        denom = wi * wn[None, :]
        rho_eff = np.where(denom > 0, gw / np.where(denom > 0, denom, 1.0), 0.0)
        rho = kernels.warped_correlation(rho_eff, gi, wi, g[None, :], wn[None, :])
        if self.kernel == "exact":
            kc = kernels.cross_kernel_exact(gi, bi, g[None, :], b[None, :], rho)
        else:
            kc = kernels.cross_kernel_approx(rho, self.k_self[rows, None], self.k_self[None, :])
        dv = np.diag(self.gram_v)
        du = np.diag(self.gram_u)
        sol = costs.merge_solution(
            dv[rows, None], dv[None, :], self.gram_v[rows],
            du[rows, None], du[None, :], self.gram_u[rows],
            gi, bi, g[None, :], b[None, :], rho, kernel=self.kernel,
        )
        return rho, kc, sol.B

    def solve_pair(self, i: int, j: int):
        """Merge solution of pair (i, j): `costs.MergeSolution` for the engine/editor."""
        dv, du = self.gram_v, self.gram_u
        return costs.merge_solution(
            dv[i, i], dv[j, j], dv[i, j], du[i, i], du[j, j], du[i, j],
            self.gamma[i], self.beta[i], self.gamma[j], self.beta[j], self.rho[i, j],
            kernel=self.kernel,
        )

    def refresh_rows(self, rows: np.ndarray) -> None:
        """Recomputes the pair tables of `rows` (and the mirrored columns)."""
        rows = np.asarray(rows, dtype=int)
        rho, kc, B = self._pair_rows(rows)
        self.rho[rows], self.k_cross[rows], self.B[rows] = rho, kc, B
        self.rho[:, rows], self.k_cross[:, rows], self.B[:, rows] = rho.T, kc.T, B.T

    def replace_with_parent(self, i: int, j: int, a1, a2, m1, m2, gamma_k, beta_k) -> None:
        """Writes the merged parent into slot `i` and clears slot `j` (O(n) work)."""
        for gm, (c1, c2) in ((self.gram_v, (a1, a2)), (self.gram_w, (a1, a2)),
                             (self.gram_u, (m1, m2))):
            row = c1 * gm[i] + c2 * gm[j]
            diag = c1 * row[i] + c2 * row[j]
            gm[i], gm[:, i] = row, row
            gm[i, i] = diag
        for gm in (self.gram_v, self.gram_w, self.gram_u):
            gm[j], gm[:, j] = 0.0, 0.0
        self.gamma[i], self.beta[i] = abs(gamma_k), beta_k
        self.gamma[j], self.beta[j] = 0.0, 0.0
        self.wnorm[i] = np.sqrt(max(self.gram_w[i, i], 0.0))
        self.wnorm[j] = 0.0
        self.k_self[[i, j]] = kernels.self_kernel(self.gamma[[i, j]], self.beta[[i, j]])
        unorm = np.sqrt(np.maximum(np.diag(self.gram_u)[[i, j]], 0.0))
        self.capacity[[i, j]] = unorm * np.sqrt(self.k_self[[i, j]])
        self.refresh_rows(np.array([i, j]))

    def clear(self, j: int) -> None:
        """Marks neuron `j` as removed (zero output): no more pair terms."""
        for gm in (self.gram_v, self.gram_w, self.gram_u):
            gm[j], gm[:, j] = 0.0, 0.0
        self.gamma[j] = self.beta[j] = self.wnorm[j] = 0.0
        self.k_self[j] = self.capacity[j] = 0.0
        for t in (self.rho, self.k_cross, self.B):
            t[j], t[:, j] = 0.0, 0.0


@dataclasses.dataclass
class PruneCache:
    """Capacities of a group that is pruned only (``"coupled"`` groups).

    Attributes:
        capacity: ‖f_c‖ from the readers and the propagated moments
            (`hope_keras.neurons.coupled_capacity`).
        k_self: the channel's second moment where it is read.
        u_norm: the norm of its reader weights.
        gamma: NaN (no single pre-activation BN).
    """

    capacity: np.ndarray
    k_self: np.ndarray
    u_norm: np.ndarray
    gamma: np.ndarray
    mergeable = False

    @property
    def size(self) -> int:
        return self.capacity.shape[0]

    @property
    def wnorm(self) -> np.ndarray:
        return np.zeros(self.size)  # no pair terms

    def layer_capacity(self, active: Optional[np.ndarray] = None) -> float:
        cap = self.capacity if active is None else self.capacity[active]
        return float(cap.sum())

    def clear(self, j: int) -> None:
        self.capacity[j] = self.k_self[j] = self.u_norm[j] = 0.0


def build_group_cache(state: LayerState, kernel: str = "approx") -> GroupCache:
    """Builds the cache of one group from its extracted neurons.

    Args:
        state: The group's `LayerState` (BN-folded neurons and output vectors).
        kernel: ``"approx"`` (the engine's zero-bias cross-kernel) or ``"exact"``.

    Returns:
        A `GroupCache`.

    Example:

    >>> import keras
    >>> from hope_keras.graph import walk
    >>> from hope_keras.neurons import extract_group
    >>> inputs = keras.Input((8,))
    >>> x = keras.layers.Dense(16)(inputs)
    >>> x = keras.layers.ReLU()(keras.layers.BatchNormalization()(x))
    >>> model = keras.Model(inputs, keras.layers.Dense(2)(x))
    >>> group = next(iter(walk(model).groups.values()))
    >>> cache = build_group_cache(extract_group(model, group))
    >>> cache.B.shape
    (16, 16)
    """
    if kernel not in ("approx", "exact"):
        raise ValueError(f"kernel must be 'approx' or 'exact'. Received: kernel={kernel!r}")
    gram_w = gram(state.w_eff)
    b = state.b_eff
    gram_v = gram_w + np.outer(b, b)
    gram_u = gram(state.u)
    gamma = np.abs(state.gamma).astype(np.float64)
    beta = state.beta.astype(np.float64).copy()
    wnorm = np.sqrt(np.maximum(np.diag(gram_w), 0.0))
    k_self = kernels.self_kernel(gamma, beta)
    capacity = np.sqrt(np.maximum(np.diag(gram_u), 0.0)) * np.sqrt(k_self)
    n = state.size
    cache = GroupCache(
        gamma=gamma, beta=beta, wnorm=wnorm, k_self=k_self, capacity=capacity,
        gram_v=gram_v, gram_w=gram_w, gram_u=gram_u,
        rho=np.zeros((n, n)), k_cross=np.zeros((n, n)), B=np.zeros((n, n)),
        kernel=kernel,
    )
    for start in range(0, n, CHUNK_ROWS):
        rows = np.arange(start, min(n, start + CHUNK_ROWS))
        cache.rho[rows], cache.k_cross[rows], cache.B[rows] = cache._pair_rows(rows)
    return cache
