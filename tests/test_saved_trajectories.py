"""Saved trajectories re-run: a change meant to move code (not to change behaviour)
must leave every run's actions and final weights exactly equal, and its float fields
equal to within `FLOAT_RTOL` relative (bit for bit on the machine that wrote the file;
on another CPU the vector width changes the order of some sums, and the last bits
move: up to 2e-14 relative on an AVX2-only machine against the AVX-512 one that wrote
it, with the same actions and weights).

tests/data/saved_trajectories.npz holds, per run below, every step field (kind,
unit, i, j, J, DR, P_init, capacities, live counts and ratios, parent coefficients)
and a SHA-256 digest of each final weight's bytes, written by this file's `_write`.
Rewrite it (``python tests/test_saved_trajectories.py [run names]``) only for a
change that is meant to change trajectories, and say which runs it changes.
"""

import hashlib
import importlib
import os
import sys

import numpy as np
import pytest

from conftest import mlp, small_resnet

DATA = os.path.join(os.path.dirname(__file__), "data", "saved_trajectories.npz")
INT_FIELDS = ("i", "j", "active_after")
FLOAT_FIELDS = ("J", "DR", "P_init", "c_before", "c_after", "params_after", "flops_after")
FLOAT_RTOL = 1e-12
#: Module attributes a run sets: every group sketched (`hope_keras.scoring.cache.SketchCache`,
#: pairs re-priced from exact entries), or dense tables stored compact (float32).
SKETCHED = (("hope_keras.scoring.cache", "SKETCH_WIDTH", 16),)
COMPACT = (("hope_keras.search.merge_tables.dense", "DENSE_FLOAT64_MAX", 0),)


def _demo():
    from hope_keras.data import load_demo_model

    return load_demo_model()


def _mlp():
    return mlp((24, 20), seed=1)


#: name: (model factory, budget, cost, search options, patches). The demo's runs
#: cover the dense certified tables, prunes, merges, evictions and both budgets; the
#: MLPs the k-partner rows (certified and top-k), sketched groups and compact tables.
RUNS = {
    "small_resnet_hope": (small_resnet, dict(density=0.5), "hope", None, ()),
    "small_resnet_paper": (small_resnet, dict(density=0.5), "paper", None, ()),
    "mlp_hope": (mlp, dict(density=0.5), "hope", None, ()),
    "mlp_topk": (_mlp, dict(density=0.4), "hope", {"merge_search": "top_k"}, ()),
    "mlp_certified_rows": (_mlp, dict(density=0.4), "paper", {"merge_candidates": 3}, ()),
    "demo_density_hope": (_demo, dict(density=0.5), "hope", None, ()),
    "demo_density_paper": (_demo, dict(density=0.5), "paper", None, ()),
    "demo_flops_hope": (_demo, dict(flops=0.5), "hope", None, ()),
    "demo_flops_paper": (_demo, dict(flops=0.5), "paper", None, ()),
    "demo_topk": (_demo, dict(density=0.5), "hope", {"merge_search": "top_k"}, ()),
    "mlp_sketched": (_mlp, dict(density=0.4), "hope", None, SKETCHED),
    "mlp_sketched_topk": (_mlp, dict(density=0.4), "hope", {"merge_search": "top_k"},
                          SKETCHED),
    "mlp_sketched_rows": (_mlp, dict(density=0.4), "paper", {"merge_candidates": 3},
                          SKETCHED),
    "mlp_compact_dense": (_mlp, dict(density=0.4), "paper", None, COMPACT),
}


def _digest(w) -> str:
    w = np.ascontiguousarray(w)
    return hashlib.sha256(f"{w.dtype}{w.shape}".encode() + w.tobytes()).hexdigest()


def _run(name, setattr_) -> dict:
    from hope_keras.search.encoder import Encoder

    make, budget, cost, search, patches = RUNS[name]
    for module, attr, value in patches:
        setattr_(importlib.import_module(module), attr, value)
    model = make()
    enc = Encoder(model, cost=cost, search=search, correction=False, verbose=False)
    steps = enc.compress(**budget).trajectory.steps
    out = {"kind": np.array([s.kind for s in steps]),
           "unit": np.array([s.unit for s in steps]),
           "coef": np.array([s.coef for s in steps], np.float64).reshape(len(steps), 6),
           "weights": np.array([_digest(w) for w in model.get_weights()])}
    out.update({f: np.array([getattr(s, f) for s in steps], np.int64) for f in INT_FIELDS})
    out.update({f: np.array([getattr(s, f) for s in steps], np.float64)
                for f in FLOAT_FIELDS})
    return out


@pytest.mark.parametrize("name", list(RUNS))
def test_saved_trajectories_rerun(name, monkeypatch):
    saved = np.load(DATA)
    got = _run(name, monkeypatch.setattr)
    assert got["kind"].size > 0
    for field, value in got.items():
        want = saved[f"{name}/{field}"]
        assert value.shape == want.shape, (name, field)
        if value.dtype.kind == "f":
            np.testing.assert_allclose(value, want, rtol=FLOAT_RTOL, atol=0,
                                       err_msg=f"{name}/{field}")
            assert np.array_equal(np.isnan(value), np.isnan(want)), (name, field)
        else:  # actions, counts and the final weights' digests: exactly
            assert value.tobytes() == want.astype(value.dtype).tobytes(), (name, field)


def _write(path=DATA, names=None):
    """Writes the runs `names` (default: all) into `path`, keeping its other runs."""
    arrays = dict(np.load(path)) if names and os.path.exists(path) else {}
    for name in names or RUNS:
        undo = []

        def setattr_(module, attr, value):
            undo.append((module, attr, getattr(module, attr)))
            setattr(module, attr, value)

        try:
            arrays.update({f"{name}/{k}": v for k, v in _run(name, setattr_).items()})
        finally:
            for module, attr, value in reversed(undo):
                setattr(module, attr, value)
        print(name, arrays[f"{name}/kind"].size, "steps", flush=True)
    np.savez_compressed(path, **arrays)


if __name__ == "__main__":
    _write(names=sys.argv[1:] or None)
