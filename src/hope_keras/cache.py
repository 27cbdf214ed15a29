"""Per-group capacities and Gram tables (spec sections 2, 3 and 5).

For each ``"neurons"`` group the cache holds:

* per neuron, in float64: surrogate scale γ and shift β, ‖w_eff‖, self-kernel K(i,i),
  and the capacity ‖f_i‖ = ‖u_i‖·sqrt(K(i,i));
* the Gram matrices of the augmented inputs ``v``, the effective inputs ``w_eff``
  and the outputs ``u``, computed with TensorFlow (on a GPU when there is one, in
  row chunks so temporaries stay bounded): float64 for groups narrower than
  `FLOAT32_WIDTH`, float32 above (4096 × 4096 float32 tables are 64 MB each);
  entries are read back as float64 for the pair math.

Pair quantities (the warped correlation ρ̃, the cross-kernel K(i,j) and the merge
objective ``B`` of the best parent) are not stored as n × n tables: `pair_values`
computes them for any list of pairs in O(1) kernel work each, from two Gram
entries per table. The engine keeps only each neuron's best merge partners
(`hope_keras.candidates`). ``B``, ``rho`` and ``k_cross`` are still available as
full tables, computed on access, for inspection and tests.

Everything a merge changes is a linear combination of two Gram rows, so
`GroupCache.replace_with_parent` refreshes one row in O(n).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Optional

import numpy as np

from hope_keras import costs, kernels
from hope_keras.neurons import LayerState

# Rows per chunk: bounds the temporaries of the pair computations to a few MB per
# array whatever the layer width.
CHUNK_ROWS = 256

#: Groups at least this wide keep their Gram tables in float32 (half the memory,
#: twice the matmul speed); narrower ones in float64.
FLOAT32_WIDTH = 2048


def gram(x: np.ndarray, chunk_rows: int = CHUNK_ROWS * 4, dtype=np.float64) -> np.ndarray:
    """``x @ x.T`` with TensorFlow (on a GPU when there is one), in ``dtype``.

    Up to `chunk_rows` rows: one matmul. Wider: the upper triangle in row chunks,
    mirrored (about half the multiply-adds), so temporaries stay bounded.

    Example:

    >>> import numpy as np
    >>> x = np.arange(6.0).reshape(3, 2)
    >>> np.allclose(gram(x), x @ x.T)
    True
    >>> x = np.random.default_rng(0).normal(size=(50, 7))
    >>> np.allclose(gram(x, chunk_rows=16), x @ x.T)
    True
    """
    import tensorflow as tf

    n = x.shape[0]
    tf_dtype = tf.float64 if np.dtype(dtype) == np.float64 else tf.float32
    xt = tf.constant(np.asarray(x, dtype=dtype), dtype=tf_dtype)
    if n <= chunk_rows:
        return tf.matmul(xt, xt, transpose_b=True).numpy()
    out = np.empty((n, n), dtype=dtype)
    step = max(chunk_rows // 2, 1)
    for start in range(0, n, step):
        stop = min(n, start + step)
        block = tf.matmul(xt[start:stop], xt[start:], transpose_b=True).numpy()
        out[start:stop, start:] = block
        out[stop:, start:stop] = block[:, stop - start:].T
    return out


class PairValues(NamedTuple):
    """Pair quantities of a list of pairs (see `GroupCache.pair_values`).

    Attributes:
        rho: Warped correlation ρ̃.
        k_cross: Cross-kernel K(i,j).
        B: Merge objective of the best parent.
        gram_u: ⟨u_i, u_j⟩.
    """

    rho: np.ndarray
    k_cross: np.ndarray
    B: np.ndarray
    gram_u: np.ndarray


@dataclasses.dataclass
class GroupCache:
    """Capacities and Gram tables of one group (see module docstring).

    Attributes:
        gamma, beta: Surrogate std and mean of each neuron's pre-activation.
        wnorm: ‖w_eff,i‖ (0 marks an inactive neuron: no pair terms).
        k_self: K(i,i).
        capacity: ‖f_i‖.
        gram_v, gram_w, gram_u: Gram matrices of v, w_eff and u (float64, or float32
            for groups of `FLOAT32_WIDTH` neurons or more).
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
    kernel: str = "approx"
    _shared: bool = dataclasses.field(default=False, repr=False, compare=False)

    @property
    def size(self) -> int:
        return self.gamma.shape[0]

    def copy(self) -> "GroupCache":
        """An independent copy; the Gram tables are shared until a merge writes
        them (copy on write: a run that only prunes never copies them)."""
        new = dataclasses.replace(self, _shared=True)
        for f in ("gamma", "beta", "wnorm", "k_self", "capacity"):
            setattr(new, f, getattr(self, f).copy())
        return new

    def _own_grams(self) -> None:
        if self._shared:
            self.gram_v, self.gram_w, self.gram_u = (
                self.gram_v.copy(), self.gram_w.copy(), self.gram_u.copy())
            self._shared = False

    @property
    def u_norm(self) -> np.ndarray:
        """‖u_i‖ of each neuron."""
        return np.sqrt(np.maximum(self.gram_diag("u"), 0.0))

    mergeable = True

    def gram_diag(self, which: str) -> np.ndarray:
        """The diagonal of ``gram_<which>`` (``"v"``, ``"w"`` or ``"u"``) in float64."""
        return np.diag(getattr(self, "gram_" + which)).astype(np.float64)

    def layer_capacity(self, active: Optional[np.ndarray] = None) -> float:
        """C(layer) = Σ over active neurons of ‖f_i‖."""
        cap = self.capacity if active is None else self.capacity[active]
        return float(cap.sum())

    def pair_values(self, a, b, with_B: bool = True) -> PairValues:
        """ρ̃, K(i,j), B and ⟨u_i, u_j⟩ of the pairs ``(a[p], b[p])``, elementwise.

        ``B`` depends (in its last bits) on which neuron of the pair comes first;
        ρ̃ and K(i,j) do not. ``with_B=False`` skips the merge solution (B is None).

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
        >>> pv = cache.pair_values([0, 1], [2, 3])
        >>> bool(pv.B[0] == cache.B[0, 2])
        True
        """
        a = np.asarray(a, dtype=np.intp)
        b = np.asarray(b, dtype=np.intp)
        g, be, wn = self.gamma, self.beta, self.wnorm
        gw = self.gram_w[a, b].astype(np.float64)
        denom = wn[a] * wn[b]
        rho_eff = np.where(denom > 0, gw / np.where(denom > 0, denom, 1.0), 0.0)
        rho = kernels.warped_correlation(rho_eff, g[a], wn[a], g[b], wn[b])
        if self.kernel == "exact":
            kc = kernels.cross_kernel_exact(g[a], be[a], g[b], be[b], rho)
        else:
            kc = kernels.cross_kernel_approx(rho, self.k_self[a], self.k_self[b])
        gu = self.gram_u[a, b].astype(np.float64)
        if not with_B:
            return PairValues(rho, kc, None, gu)
        dv, du = self.gram_diag("v"), self.gram_diag("u")
        sol = costs.merge_solution(
            dv[a], dv[b], self.gram_v[a, b].astype(np.float64), du[a], du[b], gu,
            g[a], be[a], g[b], be[b], rho, kernel=self.kernel,
        )
        return PairValues(rho, kc, sol.B, gu)

    def _pair_rows(self, rows: np.ndarray):
        """ρ̃, K(i,j) and B for pairs (rows × all neurons), each row first."""
        rows = np.asarray(rows, dtype=np.intp)
        n = self.size
        a = np.repeat(rows, n)
        b = np.tile(np.arange(n), rows.size)
        pv = self.pair_values(a, b)
        shape = (rows.size, n)
        return pv.rho.reshape(shape), pv.k_cross.reshape(shape), pv.B.reshape(shape)

    def _table(self, which: int) -> np.ndarray:
        n = self.size
        out = np.zeros((n, n))
        for start in range(0, n, CHUNK_ROWS):
            rows = np.arange(start, min(n, start + CHUNK_ROWS))
            out[rows] = self._pair_rows(rows)[which]
        return out

    @property
    def rho(self) -> np.ndarray:
        """Warped correlation ρ̃ (n, n), computed on access (inspection, tests)."""
        return self._table(0)

    @property
    def k_cross(self) -> np.ndarray:
        """Cross-kernel K(i,j) (n, n), computed on access."""
        return self._table(1)

    @property
    def B(self) -> np.ndarray:
        """Merge objective of the best parent (n, n), row neuron first, computed on
        access."""
        return self._table(2)

    def solve_pair(self, i: int, j: int):
        """Merge solution of pair (i, j): `costs.MergeSolution` for the engine/editor."""
        dv, du = self.gram_diag("v"), self.gram_diag("u")
        rho = self.pair_values([i], [j]).rho[0]
        return costs.merge_solution(
            dv[i], dv[j], float(self.gram_v[i, j]), du[i], du[j], float(self.gram_u[i, j]),
            self.gamma[i], self.beta[i], self.gamma[j], self.beta[j], rho,
            kernel=self.kernel,
        )

    def replace_with_parent(self, i: int, j: int, a1, a2, m1, m2, gamma_k, beta_k) -> None:
        """Writes the merged parent into slot `i` and clears slot `j` (O(n) work).

        Pair values involving `i` change: callers recompute them (`pair_values`).
        """
        self._own_grams()
        for gm, (c1, c2) in ((self.gram_v, (a1, a2)), (self.gram_w, (a1, a2)),
                             (self.gram_u, (m1, m2))):
            row = c1 * gm[i].astype(np.float64) + c2 * gm[j].astype(np.float64)
            diag = c1 * row[i] + c2 * row[j]
            gm[i], gm[:, i] = row, row
            gm[i, i] = diag
        for gm in (self.gram_v, self.gram_w, self.gram_u):
            gm[j], gm[:, j] = 0.0, 0.0
        self.gamma[i], self.beta[i] = abs(gamma_k), beta_k
        self.gamma[j], self.beta[j] = 0.0, 0.0
        self.wnorm[i] = np.sqrt(max(float(self.gram_w[i, i]), 0.0))
        self.wnorm[j] = 0.0
        self.k_self[[i, j]] = kernels.self_kernel(self.gamma[[i, j]], self.beta[[i, j]])
        du = np.array([self.gram_u[i, i], self.gram_u[j, j]], dtype=np.float64)
        unorm = np.sqrt(np.maximum(du, 0.0))
        self.capacity[[i, j]] = unorm * np.sqrt(self.k_self[[i, j]])

    def clear(self, j: int) -> None:
        """Marks neuron `j` as removed (zero output): no more pair terms.

        Its Gram rows are left as they are (O(1)): nothing reads a removed
        neuron's entries (pairs need ``wnorm > 0``).
        """
        self.gamma[j] = self.beta[j] = self.wnorm[j] = 0.0
        self.k_self[j] = self.capacity[j] = 0.0


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

    def copy(self) -> "PruneCache":
        return PruneCache(self.capacity.copy(), self.k_self.copy(), self.u_norm.copy(),
                          self.gamma.copy())


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
    >>> cache.gram_u.shape, cache.capacity.shape
    ((16, 16), (16,))
    """
    if kernel not in ("approx", "exact"):
        raise ValueError(f"kernel must be 'approx' or 'exact'. Received: kernel={kernel!r}")
    n = state.size
    dtype = np.float32 if n >= FLOAT32_WIDTH else np.float64
    w_eff = state.w_eff
    b = state.b_eff
    gram_w = gram(w_eff, dtype=dtype)
    del w_eff
    gram_v = gram_w + np.outer(b, b).astype(dtype)
    gram_u = gram(state.u, dtype=dtype)
    gamma = np.abs(state.gamma).astype(np.float64)
    beta = state.beta.astype(np.float64).copy()
    wnorm = np.sqrt(np.maximum(np.diag(gram_w).astype(np.float64), 0.0))
    k_self = kernels.self_kernel(gamma, beta)
    capacity = np.sqrt(np.maximum(np.diag(gram_u).astype(np.float64), 0.0)) * np.sqrt(k_self)
    return GroupCache(
        gamma=gamma, beta=beta, wnorm=wnorm, k_self=k_self, capacity=capacity,
        gram_v=gram_v, gram_w=gram_w, gram_u=gram_u, kernel=kernel,
    )
