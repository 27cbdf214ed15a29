#!/usr/bin/env python
"""Compression quality on a network without ReLU: HOPE against the baselines.

The model is ``benchmarks/fixtures/swish_cnn.keras`` (``scripts/make_benchmark_fixtures.py
--only swish``: vgg8's layout at half width, Conv → BN → swish everywhere, BN statistics
re-estimated). Every group is then ``"coupled"`` (prune only, scored through
`hope_keras.scoring.moments` with swish's Gaussian moments). Data-free, no fine-tuning; test
accuracy and top-1 agreement with the uncompressed model are measured along

* neuron density (active / initial compressible channels) 0.9 … 0.5, and
* the FLOPs ratio of the slimmed model 0.9 … 0.5 (2 × multiply-adds of the layers
  with a kernel, per example, counted by the engine's own counter
  ``hope_keras.search.sizes.SizeCounter`` for HOPE and baselines alike; checked once
  against ``hope_keras.deploy.profile.model_flops`` of the slimmed model),

on two disjoint splits of the Fashion-MNIST test set (the model was trained on the
60 000 training images):

* ``sel`` — the 2000 test images bundled with the package
  (`hope_keras.data.load_demo_data`; their indices are the .npz ``test_indices``);
* ``heldout`` — the 8000 other test images, which chose nothing. The
  target (default ≥ best baseline − 1 point at densities 0.9 … 0.6) is checked on it.

Methods:

* ``hope`` — ``hope_keras.compress`` with its defaults (``cost="hope"``);
  ``hope_mc`` — the same with ``mean_compensation=True``. (``cost="paper"`` prices
  only ReLU ``"neurons"`` groups, so it has nothing to compress here.) One run to the lowest target, replayed to each point
  (``Trajectory.replay``; the model has no residual block, so a replay equals a direct
  run).
* ``{l1_input,l1_joint,bn_scale}_{global,layer}[_mc]`` — `hope_keras.baselines.prune`
  (``scope``, ``mean_compensation``). On the FLOPs axis a baseline's density is
  searched (bisection over its removal order) for the first point at or below the ratio.

Usage (repository root, ~4 min on 2 shared cores)::

    nice -n 10 .venv/bin/python benchmarks/nonrelu_quality.py
    .venv/bin/python benchmarks/nonrelu_quality.py --report     # markdown tables
    nice -n 10 .venv/bin/python benchmarks/nonrelu_quality.py --diagnose  # see `diagnose`

Result: ``benchmarks/results/nonrelu_quality_<model>.json``.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))  # also when imported by path
from _common import add_quick, compress, encoder, quick_dir  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
TARGETS = (0.9, 0.8, 0.7, 0.6, 0.5)
AXES = ("density", "flops")
SPLITS = ("sel", "heldout")
# "hope" is `compress`'s default (its correct_statistics default included).
HOPE = {"hope": {}, "hope_mc": {"mean_compensation": True},
        "hope_auto": {"correct_statistics": "auto"},
        "hope_nocorr": {"correct_statistics": False}}
BASELINES = tuple(f"{m}_{s}{mc}" for m in ("l1_input", "l1_joint", "bn_scale")
                  for s in ("global", "layer") for mc in ("", "_mc"))
# After the edit, data-free BN statistics correction of every BN
# (`hope_keras.correct_statistics`) on top of the method (`compress`'s default
# corrects only where it trusts the prediction).
EXPERIMENTS = ("hope_sc",) + tuple(f"{m}_{s}_sc" for m in ("l1_input", "l1_joint", "bn_scale")
                                   for s in ("global", "layer"))
TARGET_POINTS = (0.9, 0.8, 0.7, 0.6)  # the target: default ≥ best baseline − 1 point here


# --------------------------------------------------------------------------- data
def heldout_test(n: int):
    """The first `n` Fashion-MNIST test images NOT in the bundled 2000 (float32, labels).

    (The same selection as benchmarks/quality.py's helper of that name.)"""
    sys.path.insert(0, str(REPO / "scripts"))
    from make_fixtures import load_fashion_mnist

    with np.load(REPO / "src" / "hope_keras" / "data" / "fmnist_test_subset.npz") as f:
        used = set(f["test_indices"].tolist())
    data = load_fashion_mnist()
    idx = np.array([i for i in range(len(data["x_test"])) if i not in used])[:n]
    x = (data["x_test"][idx].astype(np.float32) / 255.0)[..., None]
    return x, data["y_test"][idx].astype(np.int64)


def load(model_name: str, n_sel: int, n_heldout: int):
    import keras

    from hope_keras.data import load_demo_data

    data = load_demo_data()
    splits = {"sel": (data.x_test[:n_sel], data.y_test[:n_sel]),
              "heldout": heldout_test(n_heldout)}
    path = REPO / "benchmarks" / "fixtures" / f"{model_name}.keras"
    return keras.models.load_model(path, compile=False), splits


class Evaluator:
    """Accuracy and top-1 agreement with the uncompressed model on every split."""

    def __init__(self, model, splits, batch_size=500):
        import tensorflow as tf

        self.x = np.concatenate([splits[k][0] for k in SPLITS])
        self.y = {k: splits[k][1] for k in SPLITS}
        ends = np.cumsum([len(splits[k][0]) for k in SPLITS])
        self.slices = {k: slice(e - len(splits[k][0]), e) for k, e in zip(SPLITS, ends)}
        self.bs = batch_size
        self.fn = tf.function(lambda t: model(t, training=False), reduce_retracing=True)
        self.reference = self.predict()

    def predict(self):
        out = [np.asarray(self.fn(self.x[k:k + self.bs]))
               for k in range(0, len(self.x), self.bs)]
        return np.argmax(np.concatenate(out), axis=1)

    def __call__(self):
        p = self.predict()
        acc = {k: float(np.mean(p[s] == self.y[k])) for k, s in self.slices.items()}
        agree = {k: float(np.mean(p[s] == self.reference[s])) for k, s in self.slices.items()}
        return acc, agree


class Sizes:
    """Live parameter and FLOPs ratios of the slimmed model for given live widths."""

    def __init__(self, model, analysis):
        from hope_keras.search.sizes import SizeCounter

        self.counter = SizeCounter(model, analysis)  # pristine: never edited
        self.sizes = {g.name: g.size for g in analysis.groups}

    def __call__(self, alive):
        c = self.counter.copy()
        for g, n in alive.items():
            if n != self.sizes[g]:
                c.remove(g, self.sizes[g] - n)
        c.update(list(c.params_now))
        return c.params_ratio, c.flops_ratio


class Bench:
    def __init__(self, model_name, n_sel, n_heldout):
        import hope_keras

        model, splits = load(model_name, n_sel, n_heldout)
        t0 = time.perf_counter()
        self.analysis = a = hope_keras.analyze(model)
        info = {"model": model_name, "params": int(model.count_params()),
                "n": {k: int(len(v[0])) for k, v in splits.items()},
                "analyze_s": round(time.perf_counter() - t0, 2),
                "neurons": a.num_neurons,
                "groups": {g.name: [g.size, g.kind] for g in a.groups},
                "blocks": sum(b.evictable for b in a.blocks)}
        if info["blocks"]:
            raise SystemExit(f"{model_name}: has evictable blocks; this script replays one "
                             "HOPE run per axis, which needs a model without them")
        self.model, self.info = model, info
        self.original = [w.numpy().copy() for w in model.weights]
        self.ev = Evaluator(model, splits)
        self.sizes = Sizes(model, a)
        info["accuracy"], _ = self.ev()
        info["flops"] = int(self.sizes.counter.flops0)

    def reset(self):
        for w, v in zip(self.model.weights, self.original):
            w.assign(v)

    def point(self, target, density, alive, sc=False):
        if sc:
            import hope_keras

            hope_keras.correct_statistics(self.model, self.analysis)
        params, flops = self.sizes(alive)
        acc, agree = self.ev()
        return {"target": target, "density": density, "params": params, "flops": flops,
                "acc": acc, "agree": agree, "alive": alive}

    def run_hope(self, name, axis):

        sc = name.endswith("_sc")
        name = name[:-3] if sc else name
        N = self.analysis.num_neurons
        self.reset()
        t0 = time.perf_counter()
        opts = dict(HOPE[name])
        # The statistics correction after the run: `hope` is the
        # default; other variants (and `hope_sc`, corrected in `point`) go without
        # unless they set it.
        correct = opts.pop("correct_statistics",
                           "auto" if name == "hope" and not sc else False)  # compress's
        enc = encoder(self.model, analysis=self.analysis, correct_statistics=correct, **opts)
        stopped = enc.run(**{axis: min(TARGETS)}, verbose=False)
        note = {"seconds": round(time.perf_counter() - t0, 2), "stopped": stopped}
        traj = enc.trajectory
        traj.meta["options"]["correct_statistics"] = correct  # as compress records it
        points = []
        for t in TARGETS:
            self.reset()
            try:
                n = traj.step_for(**{axis: t})
            except ValueError:  # never reached
                continue
            traj.replay(self.model, step=n, check=False)
            alive = dict(self.sizes.sizes)
            for s in traj.steps[:n]:
                alive[s.unit] -= 1  # prune only: one channel per step
            p = self.point(t, traj.steps[n - 1].active_after / N if n else 1.0, alive, sc)
            if n:  # the engine's count, recomputed independently by `point`
                assert abs(p["flops"] - traj.steps[n - 1].flops_after) < 1e-9
            points.append(p)
        return points, note

    def _alive(self, removed):
        alive = dict(self.sizes.sizes)
        for g, _ in removed:
            alive[g] -= 1
        return alive

    def _density_for_flops(self, scores, scope, ratio):
        """The highest density whose removal set reaches FLOPs ≤ `ratio` (or None)."""
        from hope_keras.search import baselines

        N = self.analysis.num_neurons
        if scope == "global":
            order = baselines.removal_order(scores)

            def size(k):
                return self.sizes(self._alive(order[:k]))[1]

            if size(len(order)) > ratio + 1e-12:
                return None
            lo, hi = 0, len(order)
            while hi - lo > 1:
                mid = (lo + hi) // 2
                lo, hi = (lo, mid) if size(mid) <= ratio + 1e-12 else (mid, hi)
            return (N - hi) / N

        def size_d(i):
            return self.sizes(self._alive(baselines.layer_removals(scores, i / 1000)))[1]

        lo, hi = 1, 1000
        if size_d(lo) > ratio + 1e-12:
            return None
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if size_d(mid) <= ratio + 1e-12 else (lo, mid)
        return lo / 1000

    def run_baseline(self, name, axis):
        from hope_keras.search import baselines

        parts = name.split("_")
        sc = parts[-1] == "sc"
        parts = parts[:-1] if sc else parts
        mc = parts[-1] == "mc"
        parts = parts[:-1] if mc else parts
        method, scope = "_".join(parts[:-1]), parts[-1]
        scores = baselines.scores(self.analysis, method)
        points, note = [], {}
        for t in TARGETS:
            d = t if axis == "density" else self._density_for_flops(scores, scope, t)
            if d is None:
                continue
            self.reset()
            t0 = time.perf_counter()
            r = baselines.prune(self.model, d, method=method, scope=scope,
                                analysis=self.analysis, mean_compensation=mc)
            note.setdefault("seconds", round(time.perf_counter() - t0, 2))
            points.append(self.point(t, r.density, self._alive(r.removed), sc))
        return points, note

    def check_slim(self):
        """The counter against `profile.model_flops` of a slimmed model, and slim's
        outputs against the in-place compressed model."""
        import hope_keras
        from hope_keras.deploy.profile import model_flops

        self.reset()
        res = compress(self.model, density=0.6, analysis=self.analysis)
        small = hope_keras.slim(self.model)
        x = self.ev.x[:500]
        diff = float(np.max(np.abs(np.asarray(small(x)) - np.asarray(self.model(x)))))
        self.reset()
        out = {"counter_flops_ratio": res.flops_ratio,
               "slim_flops_ratio": model_flops(small) / model_flops(self.model),
               "counter_params_ratio": res.params_ratio,
               "slim_params_ratio": small.count_params() / self.model.count_params(),
               "slim_vs_inplace_max_abs": diff}
        print(f"  slim check: {out}", flush=True)
        return out


def run(model_name, n_sel, n_heldout, methods):
    bench = Bench(model_name, n_sel, n_heldout)
    print(f"{model_name}: {json.dumps(bench.info)}", flush=True)
    out = {"info": bench.info, "targets": list(TARGETS), "check": bench.check_slim(),
           "results": {}, "notes": {}}
    for axis in AXES:
        out["results"][axis], out["notes"][axis] = {}, {}
        for name in methods:
            fn = bench.run_hope if name.startswith("hope") else bench.run_baseline
            points, note = fn(name, axis)
            out["results"][axis][name], out["notes"][axis][name] = points, note
            row = " ".join(f"{p['target']:g}:{100 * p['acc']['sel']:.1f}/"
                           f"{100 * p['acc']['heldout']:.1f}" for p in points)
            print(f"  {axis:7s} {name:20s} {row}  {note}", flush=True)
    bench.reset()
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"nonrelu_quality_{model_name}.json"
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {path}")
    return out


# ------------------------------------------------------------------- diagnosis
def diagnose(model_name, n_sel, n_heldout, targets=(0.8, 0.7, 0.6)):
    """Allocation against within-layer ranking, and what the BN statistics cost.

    For each target density: the per-group kept counts of HOPE's run ("hope"
    allocation) or the same fraction of every group ("layer"), filled by ranking each
    group's channels by HOPE's capacity ‖u‖·sqrt(E[ψ²]), by sqrt(E[ψ²]) alone (no
    output weights), by ‖u‖ alone, or by |γ| (BN scale); each evaluated as is, with
    the data-free statistics compensation (``sc``), and with BN statistics
    re-estimated on the 512 bundled *training* images (``bn``, data: an upper bound
    for any statistics correction). Accuracy on both splits; ``--report`` prints one
    (``--split``, default held-out). It chooses nothing.
    """
    import hope_keras
    from hope_keras.data import load_demo_data
    from hope_keras.edit.editor import ModelEditor

    bench = Bench(model_name, n_sel, n_heldout)
    a = bench.analysis
    xc = load_demo_data().x_calib
    scores = {"capacity": {g: a.caches[g].capacity for g in a.caches},
              "rms_psi": {g: np.sqrt(a.caches[g].k_self) for g in a.caches},
              "u_norm": {g: a.caches[g].u_norm for g in a.caches},
              "bn_scale": {g: np.abs(st.gamma) for g, st in a.states.items()}}
    sizes = bench.sizes.sizes
    out = {}
    for d in targets:
        bench.reset()
        res = compress(bench.model, density=d, analysis=a)
        alive = dict(sizes)
        for step in res.trajectory.steps:
            alive[step.unit] -= 1
        allocs = {"hope": alive,
                  "layer": {g: max(1, int(round(d * n))) for g, n in sizes.items()}}
        for an, alloc in allocs.items():
            for sn, sc in scores.items():
                cell = {}
                for mode in ("none", "sc", "bn"):
                    bench.reset()
                    editor = ModelEditor(bench.model, a.graph)
                    for g, keep in alloc.items():
                        for i in np.argsort(sc[g], kind="stable")[: sizes[g] - keep]:
                            with editor.step():
                                editor.prune(g, int(i))
                    editor.commit()
                    if mode == "sc":
                        hope_keras.correct_statistics(bench.model, a)
                    elif mode == "bn":
                        hope_keras.reestimate_batchnorm_statistics(bench.model, xc,
                                                                   batch_size=256)
                    cell[mode] = bench.ev()[0]  # {split: accuracy}
                out[f"{d}|{an}|{sn}"] = {"alive": alloc, **cell}
                print(f"  {d} {an:5s} {sn:9s} " + " ".join(
                    f"{k}:{100 * v['sel']:.1f}/{100 * v['heldout']:.1f}"
                    for k, v in cell.items()), flush=True)
    bench.reset()
    path = RESULTS / f"nonrelu_diagnosis_{model_name}.json"
    path.write_text(json.dumps({"targets": list(targets), "cells": out}, indent=1) + "\n")
    print(f"wrote {path}")


def report_diagnosis(model_name, split="heldout"):
    r = json.loads((RESULTS / f"nonrelu_diagnosis_{model_name}.json").read_text())
    print(f"{split} split, accuracy %")
    lines = ["| density | allocation | ranking | as is | + statistics compensation | "
             "+ BN re-estimated on 512 training images |", "|---|---|---|---|---|---|"]
    for key, c in r["cells"].items():
        d, an, sn = key.split("|")
        lines.append(f"| {d} | {an} | {sn} | {100 * c['none'][split]:.1f} | "
                     f"{100 * c['sc'][split]:.1f} | {100 * c['bn'][split]:.1f} |")
    text = "\n".join(lines)
    print(text)
    return text


# ------------------------------------------------------------------------ report
def report(model_name):
    r = json.loads((RESULTS / f"nonrelu_quality_{model_name}.json").read_text())
    info, lines = r["info"], []
    acc0 = info["accuracy"]
    lines.append(f"{info['neurons']} compressible channels in {len(info['groups'])} groups "
                 f"(kinds: {sorted({k for _, k in info['groups'].values()})}); "
                 f"{info['params']} parameters, {info['flops']} FLOPs per image; "
                 f"uncompressed accuracy {100 * acc0['sel']:.2f} % (sel, "
                 f"{info['n']['sel']} images) / {100 * acc0['heldout']:.2f} % (held-out, "
                 f"{info['n']['heldout']} images).")
    for axis in AXES:
        res = r["results"][axis]
        ts = r["targets"]
        for split in SPLITS:
            lines.append(f"\n**{axis} axis, {split} split** (accuracy %; "
                         + ("density reached" if axis == "flops" else "FLOPs ratio")
                         + " in brackets)\n")
            lines.append("| method | " + " | ".join(f"{t:g}" for t in ts) + " |")
            lines.append("|---" * (len(ts) + 1) + "|")
            for m, pts in res.items():
                by_t = {p["target"]: p for p in pts}
                cells = []
                for t in ts:
                    p = by_t.get(t)
                    if p is None:
                        cells.append("–")
                        continue
                    extra = p["density"] if axis == "flops" else p["flops"]
                    cells.append(f"{100 * p['acc'][split]:.1f} ({extra:.2f})")
                name = f"**{m}**" if m == "hope" else m
                lines.append(f"| {name} | " + " | ".join(cells) + " |")
        # The target on the held-out split; then every BN corrected, like for like.
        for hope_name, pool, what in (
                ("hope", BASELINES, "HOPE default minus the best baseline"),
                ("hope_sc", [m for m in EXPERIMENTS if m != "hope_sc"],
                 "every BN corrected: HOPE + `correct_statistics` minus the best baseline "
                 "+ `correct_statistics`")):
            if hope_name not in res:
                continue
            lines.append(f"\n**Check, {axis} axis, held-out split**: {what} (best per "
                         "point on the held-out split itself, the strictest reading; then "
                         "the baseline best on the selection split, evaluated on held-out)\n")
            lines.append(f"| target | {hope_name} | best baseline (held-out) | difference | "
                         "best on sel → its held-out | difference | best global | "
                         "difference | best per layer | difference |")
            lines.append("|---|---|---|---|---|---|---|---|---|---|")
            for t in ts:
                hp = {p["target"]: p for p in res[hope_name]}.get(t)
                bl = {m: {p["target"]: p for p in res[m]}.get(t) for m in pool if m in res}
                bl = {m: p for m, p in bl.items() if p is not None}
                if hp is None or not bl:
                    continue
                best_h = max(bl, key=lambda m: bl[m]["acc"]["heldout"])
                best_s = max(bl, key=lambda m: bl[m]["acc"]["sel"])
                h = 100 * hp["acc"]["heldout"]
                bh = 100 * bl[best_h]["acc"]["heldout"]
                bs = 100 * bl[best_s]["acc"]["heldout"]
                mark = " (target ≥ −1)" if t in TARGET_POINTS and hope_name == "hope" else ""
                scoped = []
                for scope in ("global", "layer"):
                    sub = {m: p for m, p in bl.items() if f"_{scope}" in m}
                    b = max(sub, key=lambda m: sub[m]["acc"]["heldout"])
                    v = 100 * sub[b]["acc"]["heldout"]
                    scoped.append(f"{v:.1f} {b} | {h - v:+.1f}")
                lines.append(f"| {t:g} | {h:.1f} | {bh:.1f} {best_h} | {h - bh:+.1f}{mark} | "
                             f"{best_s} → {bs:.1f} | {h - bs:+.1f} | " + " | ".join(scoped)
                             + " |")
    text = "\n".join(lines)
    print(text)
    return text


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="swish_cnn")
    p.add_argument("--n-sel", type=int, default=2000)
    p.add_argument("--n-heldout", type=int, default=8000)
    p.add_argument("--methods", nargs="*",
                   default=list(HOPE) + list(BASELINES) + list(EXPERIMENTS))
    p.add_argument("--report", action="store_true", help="only print the tables")
    p.add_argument("--diagnose", action="store_true",
                   help="allocation × within-layer ranking × statistics")
    p.add_argument("--split", choices=SPLITS, default="heldout",
                   help="the split --diagnose --report prints")
    add_quick(p)  # 200 + 200 images, target 0.8, six methods, results in quick_dir()
    args = p.parse_args(argv)
    if args.quick:
        global RESULTS, TARGETS
        RESULTS, TARGETS, args.report = quick_dir(), (0.8,), False
        args.n_sel, args.n_heldout = 200, 200
        args.methods = ["hope", "hope_sc", "bn_scale_global", "bn_scale_layer",
                        "bn_scale_global_sc", "bn_scale_layer_sc"]  # both checks
    if args.diagnose:
        if not args.report:
            diagnose(args.model, args.n_sel, args.n_heldout)
        report_diagnosis(args.model, args.split)
        return 0
    if not args.report:
        run(args.model, args.n_sel, args.n_heldout, args.methods)
    report(args.model)
    return 0


if __name__ == "__main__":
    sys.exit(main())
