#!/usr/bin/env python
"""HOPE and derivative matching side by side on the same trained GELU MLP.

Task (the one of ``derivative_matching_posttraining.py``): x uniform on the unit disk,
y = sin(2x₁)·cos(1.5x₂) + 0.5·x₁x₂ + N(0, 0.1²); 4096 training, 1024 validation
(selection) and 4096 test (held-out) points. A low-dimensional, smooth target is the
regime derivative matching is built for (its kept width is bounded by
D_k = C(2 + k, 2) whatever the teacher's width). Teacher: ``--layers`` hidden GELU
layers of width ``--width``, 1 output, Adam 1e-3, ``--epochs`` epochs, batch 128.

* Derivative matching: `hope_keras.derivative_matching.compress_mlp(order=k)` for
  k = 0, 1, … (backward, center 0, R = 1), every hidden layer with the same k.
* HOPE: `hope_keras.calibrate` on 512 unlabeled training inputs (inserts identity
  BatchNormalizations with the measured pre-activation statistics before each GELU,
  so the GELU groups are scored with GELU's Gaussian moments), then one
  `hope_keras.compress` run (prune only: merges need ReLU) down to a few neurons per
  layer, replayed to each point of a geometric grid of kept neuron counts. ``hope``:
  the defaults; ``hope_mc``: ``mean_compensation=True``; ``hope_sc``: the defaults
  followed by the data-free BN statistics compensation proposed in
  ``nonrelu_quality.py`` (not the library's behaviour).

For each method, the operating point is the smallest model whose **validation** MSE
is ≤ 1.05 × the teacher's (chosen on validation only); its test MSE, kept widths,
parameters (of the slimmed model) and sup error on the unit ball
(`derivative_matching.sup_error`, 20 000 uniform points, ‖teacher − student‖_∞) are
reported. Also, at derivative matching's operating point, HOPE at the same total
number of kept hidden neurons.

Usage (repository root)::

    nice -n 10 .venv/bin/python benchmarks/hope_vs_derivative_matching.py [--seeds 0,1,2]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import numpy as np  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
sys.path.insert(0, str(Path(__file__).resolve().parent))
from derivative_matching_posttraining import data, mse  # noqa: E402
from _common import add_quick, compress, quick_dir  # noqa: E402

METHODS = ("hope", "hope_mc", "hope_sc")
TOL = 1.05  # "equal error": within 5 % of the teacher's validation MSE


def hidden_widths(model):
    import keras

    dense = [l for l in model.layers if isinstance(l, keras.layers.Dense)]
    return [int(l.units) for l in dense[:-1]]


def train_teacher(seed, width, layers, epochs):
    import keras

    keras.utils.set_random_seed(seed)
    rng = np.random.default_rng(seed)
    xtr, ytr = data(4096, rng)
    xva, yva = data(1024, rng)
    xte, yte = data(4096, rng)
    teacher = keras.Sequential(
        [keras.Input((2,))]
        + [keras.layers.Dense(width, activation="gelu", name=f"fc{i + 1}")
           for i in range(layers)]
        + [keras.layers.Dense(1, name="out")])
    teacher.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
    teacher.fit(xtr, ytr, epochs=epochs, batch_size=128, verbose=0)
    return teacher, {"train": (xtr, ytr), "val": (xva, yva), "test": (xte, yte)}


def evaluate(teacher, student, splits, with_sup=False):
    from hope_keras import derivative_matching as dm

    out = {k: mse(student, *splits[k]) for k in ("val", "test")}
    if with_sup:
        out["sup"] = float(dm.sup_error(teacher, student, radius=1.0, samples=20000))
    return out


def run_dm(teacher, splits, kmax, ref_val):
    from hope_keras import derivative_matching as dm

    rows = []
    for k in range(kmax + 1):
        student, rep = dm.compress_mlp(teacher, order=k, radius=1.0)
        r = evaluate(teacher, student, splits, with_sup=True)
        r.update(k=k, widths=hidden_widths(student), params=int(student.count_params()))
        rows.append(r)
        print(f"    dm k={k:2d} widths={r['widths']} val {r['val']:.5f} test "
              f"{r['test']:.5f} sup {r['sup']:.3g}", flush=True)
        if r["val"] <= TOL * ref_val:
            break
    return rows


def run_hope(teacher, splits, name, grid_min):
    import hope_keras

    calibrated = hope_keras.calibrate(teacher, splits["train"][0][:512])
    analysis = hope_keras.analyze(calibrated)
    N = analysis.num_neurons
    sizes = {g.name: g.size for g in analysis.groups}
    original = [w.numpy().copy() for w in calibrated.weights]
    opts = {"mean_compensation": True} if name == "hope_mc" else {}
    sc = name == "hope_sc"
    t0 = time.perf_counter()
    res = compress(calibrated, density=grid_min * len(sizes) / N, analysis=analysis, **opts)
    seconds = time.perf_counter() - t0
    traj = res.trajectory
    # Kept neuron counts: geometric grid from N down to the run's end.
    kept_end = traj.steps[-1].active_after
    grid = sorted({int(round(v)) for v in np.geomspace(N, kept_end, 200)}, reverse=True)
    rows = []
    for kept in grid:
        for w, v in zip(calibrated.weights, original):
            w.assign(v)
        n = traj.step_for(density=(kept + 1e-6) / N)
        if n:
            traj.replay(calibrated, step=n, check=False)
            if sc:  # the data-free BN statistics correction, on top of the replay
                hope_keras.correct_statistics(calibrated, analysis)
        alive = dict(sizes)
        for s in traj.steps[:n]:
            alive[s.unit] -= 1
        r = evaluate(teacher, calibrated, splits)
        r.update(kept=int(sum(alive.values())), widths=[alive[g] for g in sizes], step=n)
        rows.append(r)
    for w, v in zip(calibrated.weights, original):
        w.assign(v)
    post = (lambda: hope_keras.correct_statistics(calibrated, analysis)) if sc else None
    return calibrated, traj, rows, seconds, post


def materialise(teacher, calibrated, traj, step, post=None):
    """Replay `step` steps on the calibrated model, slim it, measure sup error."""
    import hope_keras

    state = [w.numpy().copy() for w in calibrated.weights]
    traj.replay(calibrated, step=step, check=False)
    if post is not None and step:
        post()
    small = hope_keras.slim(calibrated)
    for w, v in zip(calibrated.weights, state):
        w.assign(v)
    from hope_keras import derivative_matching as dm

    return small, float(dm.sup_error(teacher, small, radius=1.0, samples=20000))


def run_seed(seed, args):
    t0 = time.perf_counter()
    teacher, splits = train_teacher(seed, args.width, args.layers, args.epochs)
    ref = {k: mse(teacher, *splits[k]) for k in ("train", "val", "test")}
    out = {"seed": seed, "teacher": ref, "teacher_params": int(teacher.count_params()),
           "train_s": round(time.perf_counter() - t0, 1)}
    print(f"seed {seed}: teacher {ref} ({out['train_s']} s)", flush=True)
    dm_rows = run_dm(teacher, splits, args.kmax, ref["val"])
    dm_pick = next((r for r in dm_rows if r["val"] <= TOL * ref["val"]), None)
    out["dm"] = {"rows": dm_rows, "pick": dm_pick}
    for name in METHODS:
        calibrated, traj, rows, secs, post = run_hope(teacher, splits, name, args.grid_min)
        ok = [r for r in rows if r["val"] <= TOL * ref["val"]]
        pick = min(ok, key=lambda r: r["kept"]) if ok else None
        entry = {"rows": rows, "pick": pick, "seconds": round(secs, 2)}
        if pick is not None:
            small, sup = materialise(teacher, calibrated, traj, pick["step"], post)
            pick.update(sup=sup, params=int(small.count_params()))
        if dm_pick is not None:  # HOPE at derivative matching's total kept width
            total = sum(dm_pick["widths"])
            same = min(rows, key=lambda r: (abs(r["kept"] - total), r["kept"]))
            small, sup = materialise(teacher, calibrated, traj, same["step"], post)
            entry["at_dm_width"] = dict(same, sup=sup, params=int(small.count_params()))
        out[name] = entry
        p = entry["pick"]
        print(f"    {name}: pick {None if p is None else (p['kept'], p['widths'], p['val'], p['test'], p['sup'])}; "
              f"at dm width {entry.get('at_dm_width', {}).get('test')}, "
              f"sup {entry.get('at_dm_width', {}).get('sup')} ({secs:.1f} s)", flush=True)
    return out


def report(results, args):
    print(f"\nTeacher: {args['layers']} × {args['width']} GELU; 'pick' = smallest model with "
          f"validation MSE ≤ {TOL} × teacher's; test = held-out MSE; sup = max "
          "|teacher − student| on 20 000 points of the unit ball.\n")
    print("| seed | method | kept widths | hidden neurons | params | val MSE | test MSE "
          "(teacher) | sup error |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        t = r["teacher"]
        for name in ("dm",) + METHODS:
            p = r[name]["pick"]
            label = {"dm": "derivative matching (k = {})", "hope": "HOPE",
                     "hope_mc": "HOPE, mean_compensation",
                     "hope_sc": "HOPE + statistics compensation (proposal)"}[name]
            if p is None:
                print(f"| {r['seed']} | {label.format('–')} | not reached | | | | | |")
                continue
            label = label.format(p.get("k"))
            print(f"| {r['seed']} | {label} | {p['widths']} | {sum(p['widths'])} | "
                  f"{p['params']} | {p['val']:.5f} | {p['test']:.5f} ({t['test']:.5f}) | "
                  f"{p['sup']:.3g} |")
    print("\nHOPE at derivative matching's kept hidden neurons (same total width):\n")
    print("| seed | dm widths | dm test MSE | dm sup | method | HOPE widths | HOPE test MSE "
          "| HOPE sup |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        d = r["dm"]["pick"]
        if d is None:
            continue
        for name in METHODS:
            h = r[name].get("at_dm_width")
            print(f"| {r['seed']} | {d['widths']} | {d['test']:.5f} | {d['sup']:.3g} | "
                  f"{name} | {h['widths']} | {h['test']:.4g} | {h['sup']:.3g} |")
    marks = (1.0, 0.75, 0.5, 0.25, 0.125)
    print("\nHOPE's held-out (test) MSE against the kept share of hidden neurons (nearest "
          "grid point):\n")
    print("| seed | method | " + " | ".join(f"{m:g}" for m in marks) + " |")
    print("|---" * (len(marks) + 2) + "|")
    for r in results:
        n0 = max(x["kept"] for x in r["hope"]["rows"])
        for name in METHODS:
            rows = r[name]["rows"]
            cells = [min(rows, key=lambda x: abs(x["kept"] - m * n0))["test"] for m in marks]
            print(f"| {r['seed']} | {name} | " + " | ".join(f"{c:.4f}" for c in cells) + " |")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--kmax", type=int, default=10)
    p.add_argument("--grid-min", type=int, default=2,
                   help="HOPE runs down to about this many neurons per layer")
    p.add_argument("--report", action="store_true", help="only print the tables")
    add_quick(p)  # one seed, a 4 × 16 teacher trained 2 epochs, k ≤ 2
    args = p.parse_args(argv)
    results_dir = RESULTS
    if args.quick:
        args.seeds, args.width, args.epochs, args.kmax, args.report = "0", 16, 2, 2, False
        results_dir = quick_dir()
    path = results_dir / "hope_vs_derivative_matching.json"
    if not args.report:
        results = [run_seed(int(s), args) for s in args.seeds.split(",")]
        results_dir.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"args": vars(args), "results": results}, indent=1)
                        + "\n")
        print(f"wrote {path}")
    saved = json.loads(path.read_text())
    report(saved["results"], saved["args"])


if __name__ == "__main__":
    main()
