"""Maximum-volume column selection (pivoted QR + maxvol refinement).

Given the ``D × N`` feature matrix ``Z`` of a layer, choose ``n = rank(Z)``
columns ``K`` whose ``n``-volume is (locally) maximal and the coefficients
``C = Z_K⁺ Z`` (``n × N``, ``C[:, K] = I``). With a maximal-volume choice every
entry of ``C`` is at most ``1 + tol`` in magnitude (Goreinov–Tyrtyshnikov), which
bounds the l1 inflation of the reweighted next layer by ``n (1 + tol) ≤ D_k``.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import scipy.linalg

__all__ = ["ColumnSelection", "maxvol_columns"]


@dataclasses.dataclass
class ColumnSelection:
    """Result of :func:`maxvol_columns`.

    Attributes:
        columns: Selected column indices, sorted ascending, length ``rank``.
        coefficients: ``C`` of shape ``(rank, N)`` with ``Z ≈ Z[:, columns] @ C``.
        rank: Numerical rank used.
        max_coefficient: ``max |C|`` (≤ ``1 + tol`` after refinement).
        swaps: Maxvol swaps performed after the pivoted-QR start.
        residual: ``‖Z − Z_K C‖_F / ‖Z‖_F`` (0 up to rounding when the rank is exact).
        singular_values: Diagonal of the pivoted-QR ``R`` factor (absolute values).
    """

    columns: np.ndarray
    coefficients: np.ndarray
    rank: int
    max_coefficient: float
    swaps: int
    residual: float
    singular_values: np.ndarray


def maxvol_columns(
    z: np.ndarray,
    *,
    rank: int | None = None,
    rtol: float = 1e-12,
    tol: float = 0.01,
    max_swaps: int | None = None,
) -> ColumnSelection:
    """Select ``rank(Z)`` columns of maximal volume and the coefficients ``C = Z_K⁺ Z``.

    Column-pivoted QR gives the numerical rank ``n`` (``|R_ii| > rtol·|R_00|``)
    and a starting set; maxvol swaps then increase the volume until every entry
    of ``C`` is at most ``1 + tol`` in magnitude.

    Args:
        z: Feature matrix ``(D, N)``.
        rank: Force this rank instead of the numerical one (capped at ``min(D, N)``).
        rtol: Relative threshold on the pivoted-QR diagonal for the numerical rank.
        tol: Maxvol stops when ``max |C| ≤ 1 + tol``.
        max_swaps: Cap on swaps (default ``10 · n + 100``).

    Returns:
        A :class:`ColumnSelection`.

    Example:

    ```python
    import numpy as np
    from hope_keras.derivative_matching import maxvol_columns
    z = np.random.default_rng(0).normal(size=(5, 40))
    sel = maxvol_columns(z)
    assert sel.rank == 5 and np.allclose(z[:, sel.columns] @ sel.coefficients, z)
    assert sel.max_coefficient <= 1.01 + 1e-9
    ```
    """
    z = np.asarray(z, dtype=np.float64)
    if z.ndim != 2:
        raise ValueError(f"maxvol_columns expects a 2-D matrix. Received shape {z.shape}.")
    d, n_cols = z.shape
    if not np.all(np.isfinite(z)):
        raise ValueError(
            "The feature matrix contains NaN or inf (overflow in high-order derivatives?). "
            "Lower the order or check the weights."
        )
    if n_cols == 0 or d == 0:
        return ColumnSelection(np.zeros(0, int), np.zeros((0, n_cols)), 0, 0.0, 0, 0.0, np.zeros(0))
    r, piv = scipy.linalg.qr(z, mode="r", pivoting=True)
    r = r[: min(d, n_cols)]
    diag = np.abs(np.diag(r))
    if rank is None:
        if diag.size == 0 or diag[0] == 0.0:
            n = 0
        else:
            n = int(np.sum(diag > rtol * diag[0]))
    else:
        # A forced rank cannot exceed the number of non-zero pivots.
        n = int(min(rank, diag.size, np.sum(diag > np.finfo(float).tiny)))
    if n == 0:
        return ColumnSelection(
            np.zeros(0, int), np.zeros((0, n_cols)), 0, 0.0, 0, 0.0 if not z.any() else 1.0, diag
        )
    # Coordinates of every column in the basis of the first n Q-columns.
    y = np.empty((n, n_cols))
    y[:, piv] = r[:n, :]
    a = y.T  # (N, n): choose n rows of maximal volume
    idx = np.array(piv[:n], dtype=np.int64)
    b = np.linalg.solve(a[idx].T, a.T).T  # a @ inv(a[idx])
    swaps = 0
    limit = 10 * n + 100 if max_swaps is None else int(max_swaps)
    while swaps < limit:
        flat = int(np.argmax(np.abs(b)))
        i, j = divmod(flat, n)
        if abs(b[i, j]) <= 1.0 + tol:
            break
        e_j = np.zeros(n)
        e_j[j] = 1.0
        b -= np.outer(b[:, j], b[i, :] - e_j) / b[i, j]
        idx[j] = i
        swaps += 1
    order = np.argsort(idx)
    idx = idx[order]
    c = np.linalg.solve(a[idx].T, y)  # C = Y_K^{-1} Y  (= Z_K^+ Z at exact rank)
    c[:, idx] = np.eye(n)
    resid = z - z[:, idx] @ c
    norm = np.linalg.norm(z)
    residual = float(np.linalg.norm(resid) / norm) if norm > 0 else 0.0
    return ColumnSelection(
        columns=idx,
        coefficients=c,
        rank=n,
        max_coefficient=float(np.max(np.abs(c))),
        swaps=swaps,
        residual=residual,
        singular_values=diag,
    )
