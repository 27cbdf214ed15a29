"""Truncated multivariate Taylor polynomials ("jets") through Dense stacks.

A jet of degree ``k`` in ``d`` variables is stored as a float64 array of shape
``(D, n)`` with ``D = C(d + k, d)``: row ``r`` holds, for each of ``n`` neurons,
the Taylor coefficient ``∂^α f(x0) / α!`` of the monomial ``h^α`` where
``α = multi_indices(d, k)[r]``. Monomials are ordered by total degree first, so
the degree-``k'`` jet of the same function is the first ``C(d + k', d)`` rows.

* A Dense layer acts linearly on the coefficients: ``J @ W`` (+ bias on row 0).
* An activation is composed as ``σ(p) = Σ_m a_m (p - p0)^m`` (Horner), with
  truncated products done through a precomputed table of index pairs.

Everything is vectorised over neurons; the only Python loops run over the
order ``k``.
"""

from __future__ import annotations

import functools
import math
from typing import List, Sequence, Tuple

import numpy as np

__all__ = [
    "num_features",
    "multi_indices",
    "product_table",
    "jet_multiply",
    "compose_activation",
    "input_jet",
    "hidden_jets",
    "estimate_memory",
]


def num_features(d_in: int, order: int) -> int:
    """``D_k = C(d_in + k, d_in)``, the number of derivatives of order ``≤ k``.

    Args:
        d_in: Input dimension.
        order: Matching order ``k``.

    Returns:
        The number of multi-indices ``α ∈ N^d_in`` with ``|α| ≤ k``.

    Example:

    ```python
    from hope_keras.derivative_matching import num_features
    assert num_features(2, 10) == 66
    ```
    """
    if d_in < 1 or order < 0:
        raise ValueError(
            f"num_features needs d_in >= 1 and order >= 0. Received: d_in={d_in}, order={order}"
        )
    return math.comb(int(d_in) + int(order), int(d_in))


@functools.lru_cache(maxsize=64)
def _multi_indices(d: int, k: int) -> np.ndarray:
    rows: List[Tuple[int, ...]] = []

    def rec(prefix, remaining, slots):
        if slots == 1:
            rows.append(prefix + (remaining,))
            return
        for first in range(remaining, -1, -1):
            rec(prefix + (first,), remaining - first, slots - 1)

    for deg in range(k + 1):
        rec((), deg, d)
    out = np.asarray(rows, dtype=np.int64).reshape(-1, d)
    out.setflags(write=False)
    return out


def multi_indices(d_in: int, order: int) -> np.ndarray:
    """All multi-indices of order ``≤ k``, graded (degree 0 first).

    Args:
        d_in: Number of variables.
        order: Maximal total degree ``k``.

    Returns:
        Read-only int array ``(D_k, d_in)``.

    Example:

    ```python
    from hope_keras.derivative_matching import multi_indices
    print(multi_indices(2, 2).tolist())
    # [[0, 0], [1, 0], [0, 1], [2, 0], [1, 1], [0, 2]]
    ```
    """
    return _multi_indices(int(d_in), int(order))


@functools.lru_cache(maxsize=32)
def _product_table(d: int, k: int):
    idx = _multi_indices(d, k)
    base = (k + 1) ** np.arange(d, dtype=np.int64)
    codes = idx @ base  # sums of multi-indices of total degree <= k add without carry
    sorter = np.argsort(codes)
    deg = idx.sum(axis=1)
    ia, ib, ic = [], [], []
    for i in range(len(idx)):
        m = math.comb(d + k - int(deg[i]), d)  # partners of degree <= k - |a|
        target = codes[i] + codes[:m]
        ia.append(np.full(m, i, dtype=np.int64))
        ib.append(np.arange(m, dtype=np.int64))
        ic.append(sorter[np.searchsorted(codes, target, sorter=sorter)])
    ia = np.concatenate(ia)
    ib = np.concatenate(ib)
    ic = np.concatenate(ic)
    order = np.argsort(ic, kind="stable")
    ia, ib, ic = ia[order], ib[order], ic[order]
    starts = np.searchsorted(ic, np.arange(len(idx)))
    for arr in (ia, ib, starts):
        arr.setflags(write=False)
    return ia, ib, starts


def product_table(d_in: int, order: int):
    """Index table for truncated products of degree-``k`` jets.

    Args:
        d_in: Number of variables.
        order: Degree ``k``.

    Returns:
        ``(ia, ib, starts)``: all pairs ``(α, β)`` with ``|α| + |β| ≤ k`` as row
        indices, sorted by the row of ``α + β``; ``starts[c]`` is the first pair
        landing on row ``c`` (for ``np.add.reduceat``). There are
        ``C(2 d_in + k, 2 d_in)`` pairs.

    Example:

    ```python
    from hope_keras.derivative_matching.jets import product_table
    ia, ib, starts = product_table(2, 10)
    assert len(ia) == 1001
    ```
    """
    return _product_table(int(d_in), int(order))


def _num_pairs(d_in: int, order: int) -> int:
    return math.comb(2 * int(d_in) + int(order), 2 * int(d_in))


def jet_multiply(a: np.ndarray, b: np.ndarray, d_in: int, order: int, chunk: int = 0) -> np.ndarray:
    """Truncated product of two jets of shape ``(D_k, n)``.

    Args:
        a: First jet, ``(D_k, n)``.
        b: Second jet, same shape.
        d_in: Number of variables.
        order: Degree ``k``.
        chunk: Neurons per block (``0``: choose to keep temporaries ≲ 128 MiB).

    Returns:
        The coefficients of ``a · b`` truncated at degree ``k``, ``(D_k, n)``.

    Example:

    ```python
    import numpy as np
    from hope_keras.derivative_matching.jets import jet_multiply
    x = np.zeros((3, 1)); x[1] = 1.0          # the jet of h_1 in d=2, k=1
    y = jet_multiply(x, x, 2, 1)               # h_1^2 truncated at degree 1
    assert not y.any()
    ```
    """
    ia, ib, starts = product_table(d_in, order)
    n = a.shape[1]
    if chunk <= 0:
        chunk = max(1, min(n, (1 << 27) // (8 * max(len(ia), 1))))
    out = np.empty(a.shape, dtype=np.float64)
    for lo in range(0, n, chunk):
        hi = min(n, lo + chunk)
        prod = a[ia, lo:hi] * b[ib, lo:hi]
        out[:, lo:hi] = np.add.reduceat(prod, starts, axis=0)
    return out


def compose_activation(p: np.ndarray, coeffs: np.ndarray, d_in: int, order: int) -> np.ndarray:
    """Jet of ``σ(p)`` from the jet ``p`` and the Taylor table of ``σ`` at ``p[0]``.

    Args:
        p: Pre-activation jet ``(D_k, n)``.
        coeffs: ``(k + 1, n)``, ``coeffs[m] = σ^(m)(p[0]) / m!``.
        d_in: Number of variables.
        order: Degree ``k``.

    Returns:
        The jet of ``σ(p)``, ``(D_k, n)``.

    Example:

    ```python
    import numpy as np
    from hope_keras.derivative_matching.jets import compose_activation, input_jet
    from hope_keras.derivative_matching import taylor_coefficients
    x = input_jet(np.zeros(1), 4)                      # the identity, d=1
    y = compose_activation(x, taylor_coefficients("tanh", x[0], 4), 1, 4)
    # tanh(h) = h - h^3/3 + ...
    assert np.allclose(y[:, 0], [0, 1, 0, -1 / 3, 0])
    ```
    """
    q = np.array(p, dtype=np.float64, copy=True)
    q[0] = 0.0
    out = np.zeros_like(q)
    out[0] = coeffs[order]
    for m in range(order - 1, -1, -1):
        out = jet_multiply(out, q, d_in, order)
        out[0] += coeffs[m]
    return out


def input_jet(center: np.ndarray, order: int) -> np.ndarray:
    """Jet of the identity map ``x = x0 + h`` at ``x0 = center``.

    Args:
        center: Expansion point ``(d_in,)``.
        order: Degree ``k``.

    Returns:
        ``(D_k, d_in)`` float64: row 0 is the center, the degree-1 rows the
        identity, all higher rows zero.

    Example:

    ```python
    import numpy as np
    from hope_keras.derivative_matching.jets import input_jet
    assert input_jet(np.array([1.0, 2.0]), 2).shape == (6, 2)
    ```
    """
    center = np.asarray(center, dtype=np.float64).reshape(-1)
    d = center.shape[0]
    jet = np.zeros((num_features(d, order), d))
    jet[0] = center
    if order >= 1:
        jet[1 : d + 1] = np.eye(d)
    return jet


def hidden_jets(
    kernels: Sequence[np.ndarray],
    biases: Sequence[np.ndarray],
    activations: Sequence,
    center: np.ndarray,
    order: int,
    upto: int,
) -> List[np.ndarray]:
    """Jets of the post-activation outputs of layers ``0..upto``.

    Args:
        kernels: Keras-layout kernels ``(d_{ℓ-1}, d_ℓ)``.
        biases: Biases ``(d_ℓ,)``.
        activations: ``AnalyticActivation`` per layer (at least ``upto + 1``).
        center: Expansion point ``(d_in,)``.
        order: Degree ``k``.
        upto: Last layer to propagate through.

    Returns:
        List of ``upto + 1`` jets, entry ``ℓ`` of shape ``(D_k, d_ℓ)``.

    Example:

    ```python
    import numpy as np
    from hope_keras.derivative_matching.activations import get_analytic_activation
    from hope_keras.derivative_matching.jets import hidden_jets
    w = [np.ones((2, 3))]; b = [np.zeros(3)]
    jets = hidden_jets(w, b, [get_analytic_activation("tanh")], np.zeros(2), 3, 0)
    assert jets[0].shape == (10, 3)
    ```
    """
    center = np.asarray(center, dtype=np.float64).reshape(-1)
    d = center.shape[0]
    jet = input_jet(center, order)
    out = []
    for ell in range(upto + 1):
        pre = jet @ np.asarray(kernels[ell], dtype=np.float64)
        pre[0] += np.asarray(biases[ell], dtype=np.float64)
        coeffs = np.asarray(activations[ell].taylor(pre[0], order), dtype=np.float64)
        jet = compose_activation(pre, coeffs, d, order)
        out.append(jet)
    return out


def estimate_memory(d_in: int, order: int, max_width: int) -> int:
    """Bytes the feature computation needs (jets, product table, QR, temporaries).

    Args:
        d_in: Input dimension.
        order: Matching order ``k``.
        max_width: Widest hidden layer.

    Returns:
        An estimate in bytes.

    Example:

    ```python
    from hope_keras.derivative_matching.jets import estimate_memory
    print(estimate_memory(2, 10, 1024) / 2**20, "MiB")
    ```
    """
    dk = num_features(d_in, order)
    pairs = _num_pairs(d_in, order)
    chunk = max(1, min(max_width, (1 << 27) // (8 * pairs)))
    table = 4 * 8 * pairs
    temporaries = 8 * pairs * chunk
    arrays = 8 * dk * max_width * 8
    return int(table + temporaries + arrays)
