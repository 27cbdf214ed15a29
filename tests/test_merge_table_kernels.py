"""The compiled per-step loops of the merge tables (hope_keras.search.merge_tables.kernels)
against the NumPy expressions they replaced (the oracle, kept here): same pairs in the
same order, same row minima, on tables with signed zeros, infinities, dead neurons and
cuts equal to entries."""

import os

import numpy as np
import pytest

from hope_keras import _jit as jit
from hope_keras.search.merge_tables import kernels
from hope_keras.search.merge_tables.bounds import nonzero2


def numpy_scan(lo, ok, rows, cut):
    """`DenseTable._select`'s scan as NumPy ran it: the live columns of the rows
    copied, compared with the cut, and the row minima taken after the pairs found
    are replaced by their exact values (here: `exact_values`)."""
    cols = np.flatnonzero(ok)
    sub = np.take(np.take(lo, rows, axis=0), cols, axis=1)
    pr, pc = nonzero2(sub <= cut[rows][:, None])
    return rows[pr], cols[pc], sub, pr, pc


def random_table(rng, n, dtype):
    lo = rng.normal(0.0, 1.0, (n, n)).astype(dtype)
    lo = np.minimum(lo, lo.T)
    pick = rng.random((n, n))
    lo[pick < 0.05] = np.inf
    lo[(pick > 0.05) & (pick < 0.08)] = 0.0
    lo[(pick > 0.08) & (pick < 0.10)] = -0.0
    np.fill_diagonal(lo, np.inf)
    return lo


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("n", [2, 3, 31, 32, 33, 64, 65, 200])
def test_dense_scan_matches_numpy(dtype, n):
    rng = np.random.default_rng(n)
    for trial in range(6):
        lo = random_table(rng, n, dtype)
        ok = rng.random(n) < 0.8
        ok[:2] = True
        rows = np.flatnonzero(ok & (rng.random(n) < 0.7))
        cut = rng.normal(-0.5, 1.0, n).astype(dtype)
        # cuts equal to entries, signed zeros and infinity
        cut[rng.random(n) < 0.2] = lo[0, 1]
        cut[rng.random(n) < 0.1] = -0.0
        cut[rng.random(n) < 0.1] = 0.0
        cut[rng.random(n) < 0.05] = np.inf
        r, l, rest = kernels.dense_scan(lo, ok, rows, cut)
        want_r, want_l, sub, pr, pc = numpy_scan(lo, ok, rows, cut)
        np.testing.assert_array_equal(r, want_r)
        np.testing.assert_array_equal(l, want_l)
        others = sub.copy()
        others[pr, pc] = np.inf
        want_rest = (others.min(axis=1) if others.shape[1] else np.full(rows.size, np.inf))
        np.testing.assert_array_equal(rest, want_rest.astype(np.float64))
        assert rest.dtype == np.float64

        # The row bounds after the pairs found are priced (their entries replaced),
        # and the pairs whose entry is still within the cut.
        priced = lo.copy()
        priced[r, l] = (np.abs(lo[r, l]) + rng.random(r.size)).astype(dtype)
        rowlo = rng.normal(size=n)
        want = rowlo.copy()
        sub2 = sub.copy()
        sub2[pr, pc] = priced[r, l]
        if rows.size:
            want[rows] = sub2.min(axis=1) if sub2.shape[1] else np.inf
        cut64 = cut.astype(np.float64) + rng.random(n)
        keep = kernels.tighten_rows(priced, rowlo, rows, rest, r, l, cut64)
        np.testing.assert_array_equal(rowlo, want)
        np.testing.assert_array_equal(keep, priced[r, l] <= cut64[r])


def test_dense_scan_grows_its_output_past_the_first_buffer():
    n = 300
    lo = np.zeros((n, n), dtype=np.float32)
    ok = np.ones(n, dtype=bool)
    rows = np.arange(n)
    r, l, rest = kernels.dense_scan(lo, ok, rows, np.zeros(n, dtype=np.float32))
    assert r.size == n * n
    np.testing.assert_array_equal(l, np.tile(np.arange(n), n))
    assert np.all(rest == np.inf)


def test_order_keys_sort_as_the_values():
    rng = np.random.default_rng(0)
    for dtype in (np.float32, np.float64):
        x = np.concatenate([rng.normal(size=200), [np.inf, -np.inf, 0.0, 1e-300, -1e-300,
                                                   np.finfo(dtype).tiny]]).astype(dtype)
        k = kernels.order_keys(x)
        order = np.argsort(k, kind="stable")
        assert np.all(np.diff(x[order]) >= 0)
        np.testing.assert_array_equal(kernels.from_keys(k, dtype), x.astype(np.float64))


def test_caching_needs_a_writable_place_and_changes_no_setting(monkeypatch, tmp_path):
    """numba caches where it can (its own order of places); with none writable the
    kernels compile uncached instead of failing; importing them leaves numba's
    settings, and the environment, as they were."""
    before = dict(os.environ)
    here = kernels.__file__
    assert jit.can_cache(here)  # this checkout's package directory is writable
    assert jit.jit_options(here) == dict(cache=True, nogil=True)
    assert dict(os.environ) == before
    (tmp_path / "file").write_text("a file, not a directory")
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path / "file"))
    assert not jit.can_cache(here)
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path / "mine"))
    assert jit.can_cache(here) and (tmp_path / "mine").is_dir()
    monkeypatch.delenv("NUMBA_CACHE_DIR")
    monkeypatch.setattr(jit, "_writable", lambda path: False)
    assert not jit.can_cache(here)
    assert jit.jit_options(here) == dict(cache=False, nogil=True)
