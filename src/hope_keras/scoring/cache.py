"""Per-group capacities and Gram tables (docs/theory.md §1, §3 and §4).

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
(`hope_keras.search.candidates`). ``B``, ``rho`` and ``k_cross`` are still available as
full tables, computed on access, for inspection and tests.

Everything a merge changes is a linear combination of two Gram rows, so
`GroupCache.replace_with_parent` refreshes one row in O(n).

The caches are built from a model's weights by `hope_keras.scoring.cache_builders`
(`build_group_cache`, `build_sketch_cache`, `extract_rows`, ...), whose names this
module also gives; the sizes below are read by both.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
from typing import NamedTuple, Optional

import numpy as np

from hope_keras.scoring import costs
from hope_keras.activations import kernels
from hope_keras.scoring import pair_kernels

# Rows per chunk: bounds the temporaries of the pair computations to a few MB per
# array whatever the layer width.
CHUNK_ROWS = 256

#: Groups at least this wide keep their Gram tables in float32 (half the memory,
#: twice the matmul speed); narrower ones in float64.
FLOAT32_WIDTH = 2048

#: Groups at least this wide, or whose Gram products would cost more than
#: `SKETCH_WORK` multiply-adds, get a `SketchCache` (no n × n tables).
SKETCH_WIDTH = 6144
SKETCH_WORK = 3e11
#: Columns of the random projections of a `SketchCache`.
SKETCH_DIM = 256
#: Seed of those projections (a run is reproducible; another seed is another
#: estimate, docs/hope.md "Very wide groups").
SKETCH_SEED = 0
#: A `SketchCache` estimates a set of pairs from whole rows of ``S Sᵀ`` (one matrix
#: product per distinct first neuron) once the pairs average this many per row:
#: on these CPUs a row of 8192 by BLAS costs about as much as 100 gathered pairs.
PRODUCT_ROW_PAIRS = 96


#: Where `gram` multiplies: ``"auto"`` (TensorFlow when it sees a GPU, else NumPy),
#: ``"tensorflow"`` or ``"numpy"``. On these 2 CPU cores NumPy's BLAS computes
#: ResNet-50's float64 Gram products 2–4× faster than TensorFlow's matmul (and skips
#: the copies into tensors): 2.5 / 16.5 / 7.7 ms against 9.5 / 37.3 / 19.1 ms for its
#: 256 × 2304, 512 × 4608 and 512 × 2048 Grams.
GRAM_BACKEND = "auto"


@functools.lru_cache(maxsize=None)
def _tf_has_gpu() -> bool:
    import tensorflow as tf

    return bool(tf.config.list_physical_devices("GPU"))


def multiplies_on_tensorflow(backend: Optional[str] = None) -> bool:
    """Whether the caches' matrix products run on TensorFlow: `backend` (default
    `GRAM_BACKEND`) ``"tensorflow"``, or ``"auto"`` with a GPU in sight."""
    backend = backend or GRAM_BACKEND
    if backend not in ("auto", "tensorflow", "numpy"):
        raise ValueError(f"backend must be 'auto', 'tensorflow' or 'numpy'. "
                         f"Received: backend={backend!r}")
    return backend == "tensorflow" or (backend == "auto" and _tf_has_gpu())


def gram(x: np.ndarray, chunk_rows: int = CHUNK_ROWS * 4, dtype=np.float64,
         backend: Optional[str] = None) -> np.ndarray:
    """``x @ x.T`` in ``dtype``, with TensorFlow on a GPU, else with NumPy.

    Up to `chunk_rows` rows: one matmul. Wider: the upper triangle in row chunks,
    mirrored (about half the multiply-adds), so temporaries stay bounded.
    ``backend`` overrides `GRAM_BACKEND` (``"auto"``, ``"tensorflow"``, ``"numpy"``).

    Example:

    >>> import numpy as np
    >>> x = np.arange(6.0).reshape(3, 2)
    >>> np.allclose(gram(x), x @ x.T)
    True
    >>> x = np.random.default_rng(0).normal(size=(50, 7))
    >>> np.allclose(gram(x, chunk_rows=16, backend="tensorflow"), x @ x.T)
    True
    """
    n = x.shape[0]
    if not multiplies_on_tensorflow(backend):
        xn = np.asarray(x, dtype=dtype)

        def matmul(a, b):
            return a @ b.T
    else:
        import tensorflow as tf

        xn = tf.constant(np.asarray(x, dtype=dtype),
                         dtype=tf.float64 if np.dtype(dtype) == np.float64 else tf.float32)

        def matmul(a, b):
            return tf.matmul(a, b, transpose_b=True).numpy()
    if n <= chunk_rows:
        return np.asarray(matmul(xn, xn), dtype=dtype)
    out = np.empty((n, n), dtype=dtype)
    step = max(chunk_rows // 2, 1)
    for start in range(0, n, step):
        stop = min(n, start + step)
        block = matmul(xn[start:stop], xn[start:])
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

    def entries(self, which: str, a, b) -> np.ndarray:
        """Gram entries ``⟨x_a, x_b⟩`` of ``which`` (``"v"``, ``"w"``, ``"u"``) in
        float64, elementwise."""
        return getattr(self, "gram_" + which)[a, b].astype(np.float64)

    def gram_rows(self, which: str, rows, cols=None) -> np.ndarray:
        """Rows of a Gram matrix, (len(rows), n) float64 (or its columns `cols`)."""
        g = getattr(self, "gram_" + which)[rows]
        return (g if cols is None else np.take(g, cols, axis=1)).astype(np.float64)

    def _gram_block(self, which: str, rows, cols=None) -> np.ndarray:
        """`gram_rows` in the Gram matrix's own dtype (read as float64 by the
        compiled kernels: the same values, without a float64 copy)."""
        g = getattr(self, "gram_" + which)[rows]
        return g if cols is None else np.take(g, cols, axis=1)

    def max_cosine(self, rows, ok, which: str = "u", absolute: bool = False) -> np.ndarray:
        """Per row, the largest cosine ``⟨x_r, x_l⟩/(‖x_r‖‖x_l‖)`` (or its absolute
        value) of ``which`` (``"w"`` or ``"u"``) over the partners ``l`` in `ok`
        (−1 when none)."""
        rows = np.asarray(rows, dtype=np.intp)
        g = self.gram_rows(which, rows)
        un = np.sqrt(np.maximum(self.gram_diag(which), 0.0))
        den = un[rows, None] * un[None, :]
        cos = np.where(den > 0, g / np.where(den > 0, den, 1.0), 0.0)
        if absolute:
            cos = np.abs(cos)
        valid = ok[None, :] & (np.arange(self.size)[None, :] != rows[:, None])
        return np.max(np.where(valid, cos, -1.0), axis=1)

    def merge_terms(self, i: int, j: int):
        """Exact ``(gv_ii, gv_jj, gv_ij, gw_ij, gu_ii, gu_jj, gu_ij)`` of a pair."""
        gv, gw, gu = self.gram_v, self.gram_w, self.gram_u
        return (float(gv[i, i]), float(gv[j, j]), float(gv[i, j]), float(gw[i, j]),
                float(gu[i, i]), float(gu[j, j]), float(gu[i, j]))

    def _gram_pair(self, a, b):
        """``(gw, gv, gu)`` entries of the pairs, float64."""
        return self.entries("w", a, b), self.entries("v", a, b), self.entries("u", a, b)

    def _rho(self, a, b, gw):
        g, wn = self.gamma, self.wnorm
        denom = wn[a] * wn[b]
        rho_eff = np.where(denom > 0, gw / np.where(denom > 0, denom, 1.0), 0.0)
        return kernels.warped_correlation(rho_eff, g[a], wn[a], g[b], wn[b])

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
        >>> from hope_keras.graph.walker import walk
        >>> from hope_keras.scoring.neurons import extract_group
        >>> from hope_keras.scoring.cache_builders import build_group_cache
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
        a = np.ascontiguousarray(a, dtype=np.intp)
        b = np.ascontiguousarray(b, dtype=np.intp)
        g, be = self.gamma, self.beta
        gw, gv, gu = self._gram_pair(a, b)
        # The Gram diagonals only where the merge is solved (the bounds' calls skip them).
        dv, du = ((self.gram_diag("v"), self.gram_diag("u")) if with_B
                  else (np.zeros(0), np.zeros(0)))
        if self.kernel == "approx":  # the engine's: one compiled pass over the pairs
            rho, kc, B = pair_kernels.pair_values_approx(
                a, b, *(np.ascontiguousarray(x, dtype=np.float64) for x in (
                    gw, gv, gu, g, be, self.wnorm, self.k_self, dv, du)), bool(with_B))
            return PairValues(rho, kc, B if with_B else None, gu)
        rho = self._rho(a, b, gw)
        kc = kernels.cross_kernel_exact(g[a], be[a], g[b], be[b], rho)
        if not with_B:
            return PairValues(rho, kc, None, gu)
        sol = costs.merge_solution(
            dv[a], dv[b], gv, du[a], du[b], gu,
            g[a], be[a], g[b], be[b], rho, kernel=self.kernel,
            k_ii=self.k_self[a], k_jj=self.k_self[b],
        )
        return PairValues(rho, kc, sol.B, gu)

    def pair_grid(self, rows, cols=None) -> tuple:
        """``(ρ̃, K(i,j), ⟨u_i, u_j⟩)`` of every pair (rows × all neurons, or × `cols`),
        from whole Gram rows (matrix products for sketched caches): the pairs
        `pair_values` gives without ``B``."""
        rows = np.ascontiguousarray(rows, dtype=np.intp)
        # cols=None reaches gram_rows: every column without a copy of them.
        picked = None if cols is None else np.asarray(cols, dtype=np.intp)
        cols = np.arange(self.size) if cols is None else picked
        if self.kernel == "approx":
            # `pair_values`' compiled kernel over the grid's pairs, without B: the
            # same values bit for bit, and one kernel fewer to compile (a fresh
            # environment's first run compiles each).
            shape = (rows.size, cols.size)
            gw = np.ascontiguousarray(self._gram_block("w", rows, picked),
                                      dtype=np.float64).reshape(-1)
            none = np.zeros(0)
            rho, kc, _ = pair_kernels.pair_values_approx(
                np.repeat(rows, shape[1]), np.tile(np.asarray(cols, dtype=np.intp), shape[0]),
                gw, none, none, self.gamma, self.beta, self.wnorm, self.k_self, none, none,
                False)
            return rho.reshape(shape), kc.reshape(shape), self.gram_rows("u", rows, picked)
        a, b = rows[:, None], cols[None, :]
        rho = self._rho(a, b, self.gram_rows("w", rows, picked))
        g, be = self.gamma, self.beta
        kc = kernels.cross_kernel_exact(g[a], be[a], g[b], be[b], rho)
        return rho, kc, self.gram_rows("u", rows, picked)

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
        """Merge solution of pair (i, j): `costs.MergeSolution` for the engine/editor
        (from exact Gram entries, `merge_terms`)."""
        gv_ii, gv_jj, gv_ij, gw_ij, gu_ii, gu_jj, gu_ij = self.merge_terms(i, j)
        rho = self._rho(np.array([i]), np.array([j]), np.array([gw_ij]))[0]
        if self.kernel == "approx":  # one pair: the same formulas in Python floats
            return costs.merge_solution_one(
                gv_ii, gv_jj, gv_ij, gu_ii, gu_jj, gu_ij, self.gamma[i], self.beta[i],
                self.gamma[j], self.beta[j], rho, self.k_self[i], self.k_self[j])
        return costs.merge_solution(
            gv_ii, gv_jj, gv_ij, gu_ii, gu_jj, gu_ij,
            self.gamma[i], self.beta[i], self.gamma[j], self.beta[j], rho,
            kernel=self.kernel, k_ii=self.k_self[i], k_jj=self.k_self[j],
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
        if hasattr(self, "version"):
            self.version += 1
            self._terms = None
        self.gamma[j] = self.beta[j] = self.wnorm[j] = 0.0
        self.k_self[j] = self.capacity[j] = 0.0


@dataclasses.dataclass
class SketchCache(GroupCache):
    """A `GroupCache` for groups too wide for n × n tables (`use_sketch`).

    Gram entries off the diagonal are estimated from random projections
    ``S = X Ω`` (``Ω`` Gaussian with variance ``1/r``, ``r = SKETCH_DIM``; the
    estimate of a cosine has a standard deviation of about ``1/sqrt(r)``); the
    diagonals are exact. The tables are never formed: O(n·r) memory per group.
    The merge the engine executes uses exact entries (`merge_terms`): the cosines of
    the current weights, read through `source`, with the cache's norms.

    Attributes:
        sk_w, sk_u: ``W_eff Ω_w`` and ``U Ω_u``, (n, r) float32.
        dw, du: Exact ``‖w_eff,i‖²`` and ``‖u_i‖²``.
        bias: The folded biases ``b_i`` (``v = [w_eff; b]``).
        source: ``source(rows) -> (w_eff, b, u)`` rows of the current weights, in
            float64 (`extract_rows`); None: estimates only.
    """

    sk_w: Optional[np.ndarray] = None
    sk_u: Optional[np.ndarray] = None
    dw: Optional[np.ndarray] = None
    du: Optional[np.ndarray] = None
    bias: Optional[np.ndarray] = None
    source: Optional[object] = dataclasses.field(default=None, repr=False, compare=False)
    version: int = dataclasses.field(default=0, repr=False, compare=False)
    _terms: Optional[tuple] = dataclasses.field(default=None, repr=False, compare=False)
    # A merged parent's Gram rows computed in the background (`prefetch_parent_rows`).
    _prefetch: Optional[tuple] = dataclasses.field(default=None, init=False, repr=False,
                                                   compare=False)

    def copy(self) -> "SketchCache":
        new = dataclasses.replace(self, _shared=True)
        for f in ("gamma", "beta", "wnorm", "k_self", "capacity", "dw", "du", "bias"):
            setattr(new, f, getattr(self, f).copy())
        return new

    def _own_grams(self) -> None:
        if self._shared:
            self.sk_w, self.sk_u = self.sk_w.copy(), self.sk_u.copy()
            self._shared = False

    def gram_diag(self, which: str) -> np.ndarray:
        if which == "w":
            return self.dw.copy()
        if which == "u":
            return self.du.copy()
        return self.dw + self.bias * self.bias

    def _sk(self, which):
        return self.sk_u if which == "u" else self.sk_w

    def _products(self, sk, a, b):
        """Estimated ``⟨x_a, x_b⟩`` (float64, summed in float32 like the sketch):
        whole rows of ``S Sᵀ`` by matrix products when the pairs share their rows
        enough (`PRODUCT_ROW_PAIRS`), else pair by pair."""
        a, b = a.ravel(), b.ravel()
        first = sorted_unique(a)
        if first.size * PRODUCT_ROW_PAIRS <= a.size:  # whole rows: matrix products
            out = np.empty(a.size)
            pos = np.searchsorted(first, a)
            step = max(1, (1 << 22) // sk.shape[0])  # (step × n) float32 ≤ 16 MB
            for s0 in range(0, first.size, step):
                at = (pos >= s0) & (pos < s0 + step)
                out[at] = (sk[first[s0:s0 + step]] @ sk.T)[pos[at] - s0, b[at]]
            return out
        return np.einsum("ij,ij->i", sk[a], sk[b]).astype(np.float64)

    def _gram_pair(self, a, b):
        gw = self.entries("w", a, b)
        a_, b_ = np.broadcast_arrays(np.asarray(a, dtype=np.intp), np.asarray(b, dtype=np.intp))
        return gw, gw + self.bias[a_] * self.bias[b_], self.entries("u", a, b)

    def max_cosine(self, rows, ok, which: str = "u", absolute: bool = False) -> np.ndarray:
        rows = np.asarray(rows, dtype=np.intp)
        un = np.sqrt(np.maximum(self.du if which == "u" else self.dw, 0.0)).astype(np.float32)
        unit = self._sk(which) / np.where(un > 0, un, 1.0)[:, None]
        cos = np.clip(unit[rows] @ unit.T, -1.0, 1.0)
        if absolute:
            cos = np.abs(cos)
        cos[:, ~ok] = -1.0
        cos[np.arange(rows.size), rows] = -1.0
        return cos.max(axis=1).astype(np.float64)

    def entries(self, which: str, a, b) -> np.ndarray:
        a, b = np.broadcast_arrays(np.asarray(a, dtype=np.intp), np.asarray(b, dtype=np.intp))
        sk = self._sk(which)
        est = self._products(sk, a, b).reshape(a.shape)
        diag = self.gram_diag("u" if which == "u" else "w")
        bound = np.sqrt(np.maximum(diag[a] * diag[b], 0.0))  # Cauchy–Schwarz
        out = np.where(a == b, diag[a], np.clip(est, -bound, bound))
        if which == "v":
            out = out + self.bias[a] * self.bias[b]
        return out

    def prefetch_parent_rows(self, i: int, j: int, a1, a2, m1, m2) -> None:
        """Starts computing, on a background thread, the Gram rows against every
        neuron (``gram_rows("w"/"u", [i])``) that slot `i` will have once
        `replace_with_parent` ``(i, j, a1, a2, m1, m2, ...)`` ran: the engine edits the
        model meanwhile, and a wide group's rows are two products over the whole
        sketch. The same values: the parent's sketch rows are computed as
        `replace_with_parent` writes them, and the product's entry of slot `i`, the
        only row that changes, is replaced by the exact diagonal."""
        x_w = a1 * self.sk_w[i] + a2 * self.sk_w[j]
        x_u = m1 * self.sk_u[i] + m2 * self.sk_u[j]
        sk_w, sk_u = self.sk_w, self.sk_u
        future = background_worker().submit(lambda: (x_w[None] @ sk_w.T, x_u[None] @ sk_u.T))
        self._prefetch = ((i, j, self.version), future)

    def _prefetched(self, which, rows, cols):
        """The background product of `prefetch_parent_rows` for these rows, or None."""
        pre = self._prefetch
        if pre is None or cols is not None or rows.size != 1 or which not in ("w", "u") \
                or pre[0] != (int(rows[0]), self.version):
            return None
        return pre[1].result()[0 if which == "w" else 1]

    def _gram_block(self, which: str, rows, cols=None) -> np.ndarray:
        """`gram_rows` (estimates, already float64)."""
        return self.gram_rows(which, rows, cols)

    def gram_rows(self, which: str, rows, cols=None) -> np.ndarray:
        rows = np.asarray(rows, dtype=np.intp)
        sk = self._sk(which)
        diag = self.gram_diag("u" if which == "u" else "w")
        product = self._prefetched(which, rows, cols)
        if cols is None:  # every column: no copy of the sketch
            cols, right, at = slice(None), sk, None
        else:
            cols = np.asarray(cols, dtype=np.intp)
            right = sk[cols]
            at = np.full(self.size, -1)
            at[cols] = np.arange(cols.size)
        out = (sk[rows] @ right.T if product is None else product).astype(np.float64)
        bound = np.sqrt(np.maximum(diag[rows, None] * diag[None, cols], 0.0))
        out = np.clip(out, -bound, bound)
        if at is None:  # a row's own column: its exact norm
            out[np.arange(rows.size), rows] = diag[rows]
        else:
            hit = np.flatnonzero(at[rows] >= 0)
            out[hit, at[rows[hit]]] = diag[rows[hit]]
        if which == "v":
            out += self.bias[rows, None] * self.bias[None, cols]
        return out

    def merge_terms(self, i: int, j: int):
        """Exact entries of the pair, read through `source` (estimates without one).
        The last pair's are kept for `replace_with_parent`, which runs after the
        model's weights were edited."""
        if self._terms is not None and self._terms[0] == (i, j, self.version):
            return self._terms[1]
        if self.source is None:
            gw = float(self.entries("w", i, j))
            gu = float(self.entries("u", i, j))
        else:
            w, _, u = self.source(np.array([i, j]))
            gw, gu = (float(x[0]) for x in self._exact_products(
                np.array([i]), np.array([j]), w, u, np.array([0]), np.array([1])))
        terms = self._terms_of(i, j, gw, gu)
        self._terms = ((i, j, self.version), terms)
        return terms

    def _exact_products(self, i, j, w, u, p, q):
        """Exact ``⟨w_i, w_j⟩`` and ``⟨u_i, u_j⟩`` of the pairs ``(i, j)`` (arrays),
        whose rows of the current weights `w`, `u` are ``p``, ``q``."""
        # Cosines of the current weights, norms of the cache: like the dense tables
        # (the paper's decoupled cache), the cache does not follow the neighbouring
        # groups' edits, and the values stay consistent with it.
        def products(x, d):
            # Row-wise products of the pairs only: a Gram product of all rows (one
            # sgemm) does rows / 2 times the work: 2.4× slower for 16 pairs of 8192.
            # C order: float32 sums depend on the memory order (cached columns or not).
            x = np.ascontiguousarray(x)
            norm = np.sqrt(np.einsum("ij,ij->i", x, x).astype(np.float64))
            dot = np.einsum("ij,ij->i", x[p], x[q]).astype(np.float64)
            den = norm[p] * norm[q]
            cos = np.where(den > 0, dot / np.where(den > 0, den, 1.0), 0.0)
            return cos * np.sqrt(np.maximum(d[i] * d[j], 0.0))

        return products(w, self.dw), products(u, self.du)

    def _terms_of(self, i, j, gw, gu):
        dv = self.gram_diag("v")
        gv = gw + float(self.bias[i] * self.bias[j])
        return (float(dv[i]), float(dv[j]), gv, gw, float(self.du[i]), float(self.du[j]), gu)

    def exact_pair_values(self, i: int, j: int) -> PairValues:
        """`pair_values` of one pair from exact Gram entries (`merge_terms`)."""
        return self._pair_values_of(i, j, self.merge_terms(i, j))

    def exact_pairs(self, i, j) -> PairValues:
        """`exact_pair_values` of the pairs ``(i[p], j[p])`` (arrays of one entry per
        pair), reading each neuron's weights once and pricing the pairs in one
        vectorised pass (the same values to rounding)."""
        i, j = np.asarray(i, dtype=np.intp), np.asarray(j, dtype=np.intp)
        if self.source is None or i.size <= 1:
            pvs = [self.exact_pair_values(int(a), int(b)) for a, b in zip(i, j)]
            if not pvs:
                return PairValues(*(np.zeros(0),) * 4)
            return PairValues(*(np.concatenate([getattr(pv, f) for pv in pvs])
                                for f in PairValues._fields))
        rows = sorted_unique(np.concatenate([i, j]))
        # float32 rows and their pairs' products (a selection's re-pricing: ~30
        # rows of up to 8192 floats a step); the merge executed reads float64
        # (`merge_terms`).
        w, _, u = self.source(rows, dtype=np.float32)
        gw, gu = self._exact_products(i, j, w, u, np.searchsorted(rows, i),
                                      np.searchsorted(rows, j))
        dv = self.gram_diag("v")
        terms = (dv[i], dv[j], gw + self.bias[i] * self.bias[j], gw, self.du[i],
                 self.du[j], gu)
        return self._pair_values_of(i, j, terms)

    def _pair_values_of(self, i, j, terms) -> PairValues:
        """PairValues of pairs (scalars or arrays) from their `_terms_of`."""
        gv_ii, gv_jj, gv_ij, gw_ij, gu_ii, gu_jj, gu_ij = terms
        a, b = np.atleast_1d(i), np.atleast_1d(j)
        g, be = self.gamma, self.beta
        if self.kernel == "approx":  # compiled, as `pair_values`: pair p's first neuron
            # at p, its second at P + p of the per-neuron arrays (the diagonals exact).
            p = a.size

            def per_pair(x):
                return np.ascontiguousarray(np.broadcast_to(x, (p,)), np.float64)

            def both(x_i, x_j):
                return np.concatenate([per_pair(x_i), per_pair(x_j)])

            rho, kc, B = pair_kernels.pair_values_approx(
                np.arange(p), np.arange(p, 2 * p), per_pair(gw_ij), per_pair(gv_ij),
                per_pair(gu_ij), both(g[a], g[b]), both(be[a], be[b]),
                both(self.wnorm[a], self.wnorm[b]), both(self.k_self[a], self.k_self[b]),
                both(gv_ii, gv_jj), both(gu_ii, gu_jj), True)
            return PairValues(rho, kc, B, per_pair(gu_ij))
        rho = self._rho(a, b, np.atleast_1d(gw_ij))
        if self.kernel == "exact":
            kc = kernels.cross_kernel_exact(g[a], be[a], g[b], be[b], rho)
        else:
            kc = kernels.cross_kernel_approx(rho, self.k_self[a], self.k_self[b])
        sol = costs.merge_solution(gv_ii, gv_jj, gv_ij, gu_ii, gu_jj, gu_ij, g[i], be[i],
                                   g[j], be[j], rho if np.ndim(i) else rho[0],
                                   kernel=self.kernel, k_ii=self.k_self[i],
                                   k_jj=self.k_self[j])
        return PairValues(rho, kc, np.atleast_1d(sol.B), np.atleast_1d(gu_ij))

    def replace_with_parent(self, i: int, j: int, a1, a2, m1, m2, gamma_k, beta_k) -> None:
        _, _, _, gw_ij, _, _, gu_ij = self.merge_terms(i, j)
        pre, self._prefetch = self._prefetch, None
        self.version += 1
        self._terms = None
        if pre is not None and pre[0] == (i, j, self.version - 1):
            self._prefetch = ((i, self.version), pre[1])  # slot i's rows from now on
        self._own_grams()
        self.dw[i] = a1 * a1 * self.dw[i] + 2.0 * a1 * a2 * gw_ij + a2 * a2 * self.dw[j]
        self.du[i] = m1 * m1 * self.du[i] + 2.0 * m1 * m2 * gu_ij + m2 * m2 * self.du[j]
        self.bias[i] = a1 * self.bias[i] + a2 * self.bias[j]
        self.sk_w[i] = a1 * self.sk_w[i] + a2 * self.sk_w[j]
        self.sk_u[i] = m1 * self.sk_u[i] + m2 * self.sk_u[j]
        self.gamma[i], self.beta[i] = abs(gamma_k), beta_k
        self.gamma[j], self.beta[j] = 0.0, 0.0
        self.wnorm[i] = np.sqrt(max(self.dw[i], 0.0))
        self.wnorm[j] = 0.0
        self.k_self[[i, j]] = kernels.self_kernel(self.gamma[[i, j]], self.beta[[i, j]])
        unorm = np.sqrt(np.maximum(self.du[[i, j]], 0.0))
        self.capacity[[i, j]] = unorm * np.sqrt(self.k_self[[i, j]])


@dataclasses.dataclass
class PruneCache:
    """Capacities of a group that is pruned only (``"coupled"`` groups).

    Attributes:
        capacity: ‖f_c‖ from the readers and the propagated moments
            (`hope_keras.scoring.neurons.coupled_capacity`).
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


_BACKGROUND = None


def background_worker():
    """One worker thread for background products (`SketchCache.prefetch_parent_rows`):
    BLAS releases the GIL."""
    global _BACKGROUND
    if _BACKGROUND is None:
        _BACKGROUND = concurrent.futures.ThreadPoolExecutor(1, "hope_keras_products")
    return _BACKGROUND


def wait_background() -> None:
    """Returns once the background products submitted so far are done."""
    if _BACKGROUND is not None:
        _BACKGROUND.submit(lambda: None).result()


def sorted_unique(keys):
    """``np.unique`` of a 1-D integer array by sorting (NumPy's hash-based path is
    several times slower at these sizes)."""
    keys = np.sort(keys)
    if keys.size:
        keys = keys[np.concatenate(([True], keys[1:] != keys[:-1]))]
    return keys
