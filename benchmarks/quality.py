#!/usr/bin/env python
"""Compression quality: HOPE against magnitude baselines and Neuron Merging.

For one trained model, no fine-tuning, data-free (except `calibrate` for BN-free
LeNet, which reads the 512 unlabeled calibration images), it measures the test
accuracy and the top-1 agreement with the uncompressed model at neuron densities
1.0, 0.9, …, 0.3 (LeNet also 0.2, the Neuron Merging paper's setting) for

* ``hope`` — all actions (prune, merge, evict), merge_scale="sum", refresh="local",
  rate="auto" (per neuron under a density budget): the engine defaults;
  ``hope_prune`` (prune only), ``hope_prune_merge``, ``hope_paper_scale``
  (merge_scale="paper"), ``hope_neighbors`` (refresh="neighbors"),
  ``hope_spec_rate`` (rate="params", the spec's J / P_init);
* ``l1_input``, ``l1_joint``, ``bn_scale`` (`hope_keras.baselines.prune`, global);
* ``neuron_merging`` (`hope_keras.baselines.neuron_merging`, global, t = 0).

HOPE runs once per variant down to the lowest density on the model; every density
is then a replay of that trajectory (`Trajectory.replay`) on the original weights.
The wall time reported per method is one call at the lowest density, analysis
included, on the 2 shared CPU cores of the development machine.

Usage (repository root)::

    nice -n 10 .venv/bin/python benchmarks/quality.py --model lenet300
    .venv/bin/python benchmarks/quality.py --report     # tables + PNGs from the JSONs

Models: ``demo`` (bundled fmnist_cnn), ``lenet300`` and ``vgg8``
(``benchmarks/fixtures``), ``resnet50`` (``.cache/resnet50_fmnist.keras``); all made
by ``scripts/make_benchmark_fixtures.py`` / ``scripts/make_fixtures.py``. Results:
``benchmarks/results/quality_<model>.json``; plots ``docs/img/quality_<model>.png``.
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
IMG = REPO / "docs" / "img"
DENSITIES = (1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3)

HOPE_VARIANTS = {
    # compress(rate="auto"): under a density budget the rate is J per neuron removed.
    "hope": dict(actions=("prune", "merge", "evict"), merge_scale="sum", refresh="local"),
    "hope_prune": dict(actions=("prune",), merge_scale="sum", refresh="local"),
    "hope_prune_merge": dict(actions=("prune", "merge"), merge_scale="sum",
                             refresh="local"),
    "hope_paper_scale": dict(actions=("prune", "merge", "evict"), merge_scale="paper",
                             refresh="local"),
    "hope_neighbors": dict(actions=("prune", "merge", "evict"), merge_scale="sum",
                           refresh="neighbors"),
    # The spec's rate DR = J / P_init (the engine default before rate="auto").
    "hope_spec_rate": dict(actions=("prune", "merge", "evict"), merge_scale="sum",
                           refresh="local", rate="params"),
}
BASELINES = ("l1_input", "l1_joint", "bn_scale", "neuron_merging")
# Proposed further changes (NOT the library's behaviour; see docs/quality.md), on top
# of the per-neuron rate: exp_n0 normalises J with the layer's *initial* width n0
# instead of its live width n; exp_residual uses the sum-consistent merge cost of
# spec section 5.
EXPERIMENTS = {
    "exp_n0": dict(width="initial", merge_cost="paper", rate="neurons"),
    "exp_residual": dict(width="live", merge_cost="residual", rate="neurons"),
}
# Neuron Merging paper (Kim et al. 2020), LeNet-300-100 on Fashion-MNIST,
# 80 % of the hidden neurons removed, no fine-tuning.
NM_PAPER_LENET = {"baseline": 89.80, "prune": 66.76, "neuron_merging": 80.02}


def heldout_test(n: int):
    """`n` Fashion-MNIST test images NOT in the demo subset (float32, labels)."""
    sys.path.insert(0, str(REPO / "scripts"))
    from make_fixtures import load_fashion_mnist

    with np.load(REPO / "src" / "hope_keras" / "data" / "fmnist_test_subset.npz") as f:
        used = set(f["test_indices"].tolist())
    data = load_fashion_mnist()
    idx = np.array([i for i in range(len(data["x_test"])) if i not in used])[:n]
    x = (data["x_test"][idx].astype(np.float32) / 255.0)[..., None]
    return x, data["y_test"][idx].astype(np.int64)


def load(model_name: str, split: str = "subset"):
    """(model, x_test, y_test, x_calib) for a benchmark model."""
    import keras

    from hope_keras.data import load_demo_data, load_demo_model

    data = load_demo_data()  # 2000 fixed test images (rng 0), 512 training images
    x, y, xc = data.x_test, data.y_test, data.x_calib
    if split == "heldout":
        x, y = heldout_test(2000)
    if model_name == "demo":
        return load_demo_model(), x, y, xc
    if model_name == "resnet50":
        path = REPO / ".cache" / "resnet50_fmnist.keras"

        def rgb(a):
            a = np.pad(a[..., 0], ((0, 0), (2, 2), (2, 2)))
            return np.repeat(a[..., None], 3, axis=-1)

        x, xc = rgb(x), rgb(xc)
    else:
        path = REPO / "benchmarks" / "fixtures" / f"{model_name}.keras"
    model = keras.models.load_model(path, compile=False)
    return model, x, y, xc


def experimental_encoder(width="live", merge_cost="paper", rate="params"):
    """An `Encoder` with the proposed cost changes (see EXPERIMENTS): all of them are
    engine options now."""
    import functools

    from hope_keras.engine import Encoder

    return functools.partial(Encoder, width=width, merge_cost=merge_cost, rate=rate)


def live_params(model, graph) -> int:
    """Parameters `hope_keras.slim` would keep (computed without rebuilding)."""
    import keras

    from hope_keras.slim import evicted_blocks, live_channels

    removed = set()
    for b in graph.blocks:
        if b.name in evicted_blocks(model, graph):
            removed |= set(b.branch_layers)
    out_n, in_frac = {}, {}
    for name, grp in graph.groups.items():
        if grp.producer in removed:
            continue
        k = int(live_channels(model, grp).sum())
        out_n[grp.producer] = out_n[grp.bn] = k
        for c in grp.consumers:
            in_frac[c.layer] = (k, grp.size)
    total = 0
    for layer in model.layers:
        if layer.name in removed:
            continue
        if hasattr(layer, "kernel") and layer.kernel is not None:
            shape = tuple(layer.kernel.shape)
            out = out_n.get(layer.name, shape[-1])
            rows = int(np.prod(shape[:-1]))
            if layer.name in in_frac:
                k, n = in_frac[layer.name]
                rows = rows // n * k
            bias = 1 if getattr(layer, "use_bias", False) else 0
            total += rows * out + bias * out
        elif isinstance(layer, keras.layers.BatchNormalization):
            n = out_n.get(layer.name, int(layer.moving_mean.shape[0]))
            total += len(layer.weights) * n
        else:
            total += int(layer.count_params())
    return total


class Evaluator:
    def __init__(self, model, x, y, graph, batch_size=500):
        import tensorflow as tf

        self.model, self.x, self.y, self.bs, self.graph = model, x, y, batch_size, graph
        self.fn = tf.function(lambda t: model(t, training=False), reduce_retracing=True)
        self.reference = self.predict()
        self.params0 = model.count_params()

    def predict(self):
        out = [np.asarray(self.fn(self.x[k:k + self.bs]))
               for k in range(0, len(self.x), self.bs)]
        return np.argmax(np.concatenate(out), axis=1)

    def __call__(self):
        p = self.predict()
        return (float(np.mean(p == self.y)), float(np.mean(p == self.reference)),
                live_params(self.model, self.graph) / self.params0)


def alive_per_group(traj, analysis, densities):
    """{density: {group: live neurons}} along a trajectory (evicted groups: 0)."""
    sizes = {g.name: g.size for g in analysis.groups}
    block_groups = {b.name: b.groups for b in analysis.blocks}
    out = {}
    for d in densities:
        if d >= 1.0:
            continue
        alive = dict(sizes)
        active = sum(sizes.values())
        for s in traj.steps[: traj.step_for_density(d)]:
            if s.kind == "evict":
                for g in block_groups[s.unit]:
                    alive[g] = 0
            else:  # a merge removes one neuron (two if the parent is dead)
                alive[s.unit] -= active - s.active_after
            active = s.active_after
        out[str(d)] = alive
    return out


def run(model_name: str, n_test: int, methods=None, densities=DENSITIES,
        extra_densities=(), probe_steps=0, split="subset"):

    import hope_keras
    from hope_keras import baselines
    from hope_keras.calibration import calibrate

    model, x, y, xc = load(model_name, split)
    x, y = x[:n_test], y[:n_test]
    info = {"model": model_name, "n_test": int(len(x)), "params": int(model.count_params()),
            "split": split}
    if model_name == "lenet300":
        t0 = time.perf_counter()
        model = calibrate(model, xc)
        info["calibrate_s"] = time.perf_counter() - t0
    analysis = hope_keras.analyze(model)
    info["neurons"] = analysis.num_neurons
    info["groups"] = len(analysis.groups)
    info["blocks"] = sum(b.evictable for b in analysis.blocks)
    original = [w.numpy().copy() for w in model.weights]

    def reset():
        for w, v in zip(model.weights, original):
            w.assign(v)

    # An eviction removes a whole block at once, so replaying a run to 0.3 can
    # overshoot a density; a run with that density as its budget skips such
    # evictions. On small models with blocks, run each density directly.
    direct = info["blocks"] > 0 and info["neurons"] < 2000
    info["hope_densities"] = "direct runs" if direct else "replays of one run"
    ev = Evaluator(model, x, y, analysis.graph)
    acc0 = ev()[0]
    info["accuracy"] = acc0
    all_d = sorted(set(densities) | set(extra_densities), reverse=True)
    d_min = min(all_d)
    results, times, notes = {}, {}, {}
    methods = methods or list(HOPE_VARIANTS) + list(BASELINES) + list(EXPERIMENTS)
    print(f"{model_name}: {info}", flush=True)
    for method in methods:
        results[method] = {}
        if method in EXPERIMENTS:
            reset()
            t0 = time.perf_counter()
            enc = experimental_encoder(**EXPERIMENTS[method])(
                model, actions=("prune", "merge", "evict"), verbose=False)
            enc.run(density=d_min, verbose=False)
            times[method] = time.perf_counter() - t0
            traj = enc.trajectory
            notes[method] = {k: int(np.sum(traj.field("kind") == k))
                             for k in ("prune", "merge", "evict")}
            notes[method]["alive"] = alive_per_group(traj, analysis, all_d)
            for d in all_d:
                reset()
                reached = 1.0
                if d < 1.0 and direct:
                    e = experimental_encoder(**EXPERIMENTS[method])(
                        model, actions=("prune", "merge", "evict"), verbose=False)
                    e.run(density=d, verbose=False)
                    e.editor.commit()
                    reached = e.active / e.num_neurons
                elif d < 1.0:
                    traj.replay(model, density=d, check=False)
                    reached = float(traj.densities()[traj.step_for_density(d) - 1])
                results[method][str(d)] = ev() + (reached,)
        elif method == "hope_neighbors" and probe_steps:
            # Too slow to run to the end on this model: time the first steps only.
            reset()
            t0 = time.perf_counter()
            res = hope_keras.compress(model, steps=probe_steps, verbose=False,
                                      **HOPE_VARIANTS[method])
            dt = time.perf_counter() - t0
            t_local = times.get("hope")
            total = analysis.num_neurons - np.floor(d_min * analysis.num_neurons)
            notes[method] = {"probe_steps": probe_steps, "probe_s": dt,
                             "projected_s": dt / probe_steps * total}
            del results[method]
            save(model_name, split, info, all_d, {}, {}, {method: notes[method]}, {})
            print(f"  {method:18s} {probe_steps} steps in {dt:.1f}s; projected "
                  f"{dt / probe_steps * total:.0f}s for the full run "
                  f"(hope local: {t_local})", flush=True)
            continue
        elif method in HOPE_VARIANTS:
            opts = HOPE_VARIANTS[method]
            if method == "hope_prune_merge" and info["blocks"] == 0 and "hope" in results:
                results[method] = dict(results["hope"])
                times[method] = times["hope"]
                notes[method] = "no evictable block: identical to hope"
                continue
            reset()
            t0 = time.perf_counter()
            res = hope_keras.compress(model, density=d_min, verbose=False, **opts)
            times[method] = time.perf_counter() - t0
            traj = res.trajectory
            kinds = {k: int(np.sum(traj.field("kind") == k))
                     for k in ("prune", "merge", "evict")}
            notes[method] = kinds
            notes[method]["alive"] = alive_per_group(traj, analysis, all_d)
            for d in all_d:
                reset()
                reached = 1.0
                if d < 1.0 and direct:
                    reached = hope_keras.compress(model, density=d, verbose=False,
                                                  **opts).density
                elif d < 1.0:
                    traj.replay(model, density=d, check=False)
                    reached = float(traj.densities()[traj.step_for_density(d) - 1])
                results[method][str(d)] = ev() + (reached,)
        else:
            alive = {}
            for d in all_d:
                reset()
                if d < 1.0:
                    if method == "neuron_merging":
                        r = baselines.neuron_merging(model, d, analysis=analysis)
                    else:
                        r = baselines.prune(model, d, method=method, analysis=analysis)
                    alive[str(d)] = {g.name: g.size for g in analysis.groups}
                    for g, _ in r.removed:
                        alive[str(d)][g] -= 1
                results[method][str(d)] = ev() + (r.density if d < 1.0 else 1.0,)
            reset()
            t0 = time.perf_counter()
            if method == "neuron_merging":
                r = baselines.neuron_merging(model, d_min)
                notes[method] = {"merged": len(r.merges), "removed": len(r.removed)}
            else:
                baselines.prune(model, d_min, method=method)
            times[method] = time.perf_counter() - t0
            notes.setdefault(method, {})["alive"] = alive
        row = " ".join(f"{d}:{results[method][str(d)][0]:.3f}" for d in all_d)
        brief = {k: v for k, v in notes.get(method, {}).items() if k != "alive"}
        print(f"  {method:18s} {times[method]:7.1f}s  {row}  {brief}", flush=True)
        save(model_name, split, info, all_d, {method: results[method]},
             {method: times[method]}, {method: notes.get(method, {})}, {})
    extra = {}
    if model_name == "lenet300" and split == "subset":
        extra = lenet_paper_setting(model, reset, ev, analysis)
    reset()
    return save(model_name, split, info, all_d, results, times, notes, extra)


def save(model_name, split, info, all_d, results, times, notes, extra):
    """Writes (merges into) benchmarks/results/quality_<model>[_<split>].json."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    suffix = "" if split == "subset" else f"_{split}"
    path = RESULTS / f"quality_{model_name}{suffix}.json"
    out = {"info": info, "densities": all_d, "results": {}, "seconds": {}, "notes": {},
           "paper_setting": extra}
    if path.exists():  # a partial run (--methods) updates the stored methods only
        old = json.loads(path.read_text())
        if old["info"].get("n_test") == info["n_test"] and old["densities"] == all_d:
            for key in ("results", "seconds", "notes"):
                out[key] = old[key]
            out["paper_setting"] = extra or old.get("paper_setting", {})
    for key, new in (("results", results), ("seconds", times), ("notes", notes)):
        out[key].update(new)
    order = list(HOPE_VARIANTS) + list(BASELINES) + list(EXPERIMENTS)
    for key in ("results", "seconds", "notes"):
        out[key] = {m: out[key][m] for m in order if m in out[key]}
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {path}")
    return out


def lenet_paper_setting(model, reset, ev, analysis):
    """80 % of the hidden neurons removed, per layer (the NM paper's protocol)."""
    from hope_keras import baselines

    out = {}
    runs = {
        "l2_prune_per_layer": lambda: baselines.neuron_merging(
            model, 0.2, criterion="l2", threshold=2.0, scope="layer", analysis=analysis),
        "neuron_merging_per_layer": lambda: baselines.neuron_merging(
            model, 0.2, criterion="l2", scope="layer", analysis=analysis),
        "l2_prune_global": lambda: baselines.neuron_merging(
            model, 0.2, criterion="l2", threshold=2.0, analysis=analysis),
        "neuron_merging_global": lambda: baselines.neuron_merging(
            model, 0.2, criterion="l2", analysis=analysis),
        # Sensitivity to the paper's similarity threshold t (not used elsewhere).
        "neuron_merging_per_layer_t0.3": lambda: baselines.neuron_merging(
            model, 0.2, criterion="l2", threshold=0.3, scope="layer", analysis=analysis),
        "neuron_merging_per_layer_t0.5": lambda: baselines.neuron_merging(
            model, 0.2, criterion="l2", threshold=0.5, scope="layer", analysis=analysis),
    }
    for name, fn in runs.items():
        reset()
        r = fn()
        per_layer = {}
        for g, _ in r.removed:
            per_layer[g] = per_layer.get(g, 0) + 1
        out[name] = {"acc_agree": ev(), "removed_per_layer": per_layer,
                     "merged": len(r.merges)}
        print(f"  paper setting {name}: {out[name]}", flush=True)
    return out


def per_layer(model_name: str, n_test: int, densities=DENSITIES):
    """Diagnostic: the same fraction removed from every layer, ranked by HOPE's
    capacity ‖f_i‖ or by a baseline score. Separates the within-layer ranking from
    the allocation across layers."""
    import hope_keras
    from hope_keras import baselines
    from hope_keras.calibration import calibrate
    from hope_keras.edit import ModelEditor

    model, x, y, xc = load(model_name)
    x, y = x[:n_test], y[:n_test]
    if model_name == "lenet300":
        model = calibrate(model, xc)
    analysis = hope_keras.analyze(model)
    original = [w.numpy().copy() for w in model.weights]
    ev = Evaluator(model, x, y, analysis.graph)
    scorers = {"capacity": {g: analysis.caches[g].capacity for g in analysis.caches}}
    for m in baselines.METHODS:
        scorers[m] = baselines.scores(analysis, m)
    out = {}
    for name, sc in scorers.items():
        out[name] = {}
        for d in densities:
            for w, v in zip(model.weights, original):
                w.assign(v)
            editor = ModelEditor(model, analysis.graph)
            for g, i in baselines.layer_removals(sc, d):
                editor.prune(g, i)
            editor.commit()
            out[name][str(d)] = ev()
        print(f"  per-layer {name:10s} " + " ".join(
            f"{d}:{out[name][str(d)][0]:.3f}" for d in densities), flush=True)
    for w, v in zip(model.weights, original):
        w.assign(v)
    path = RESULTS / f"quality_{model_name}_perlayer.json"
    path.write_text(json.dumps({"densities": list(densities), "results": out}, indent=1))
    return out


# ------------------------------------------------------------------------ report
LABELS = {
    "hope": "HOPE (defaults: all actions, rate per neuron)",
    "hope_prune": "HOPE prune-only",
    "hope_prune_merge": "HOPE prune+merge",
    "hope_paper_scale": "HOPE merge_scale=paper",
    "hope_neighbors": "HOPE refresh=neighbors",
    "hope_spec_rate": "HOPE spec rate J/P_init",
    "l1_input": "L1 input",
    "l1_joint": "L1 joint",
    "bn_scale": "BN scale",
    "neuron_merging": "Neuron Merging",
    "exp_n0": "proposal: + initial width n0",
    "exp_residual": "proposal: + residual merge cost",
}


def report(models):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    IMG.mkdir(parents=True, exist_ok=True)
    lines = []
    for name in list(models) + [f"{m}_heldout" for m in models]:
        path = RESULTS / f"quality_{name}.json"
        if not path.exists():
            continue
        r = json.loads(path.read_text())
        info, ds = r["info"], r["densities"]
        lines.append(f"\n### Quality: {name}\n")
        where = ("2000 held-out test images (outside the demo subset)"
                 if name.endswith("_heldout") else f"{info['n_test']} test images")
        lines.append(f"{info['neurons']} compressible neurons in {info['groups']} groups, "
                     f"{info['blocks']} evictable blocks; uncompressed test accuracy "
                     f"{100 * info['accuracy']:.2f} % on {where}.\n")
        head = "| method | " + " | ".join(f"{d:g}" for d in ds) + " | time (s) |"
        lines += [head, "|---" * (len(ds) + 2) + "|"]
        for m, per in r["results"].items():
            cells = []
            for d in ds:
                acc, agr = per[str(d)][:2]
                mark = ""
                if len(per[str(d)]) > 3 and per[str(d)][3] < d - 0.01:
                    mark = f" @{per[str(d)][3]:.2f}"
                cells.append(f"{100 * acc:.1f} ({100 * agr:.0f}){mark}")
            lines.append(f"| {LABELS.get(m, m)} | " + " | ".join(cells)
                         + f" | {r['seconds'][m]:.1f} |")
        lines.append("\nCells: test accuracy % (top-1 agreement with the uncompressed "
                     "model %); `@d`: the density actually reached when an eviction "
                     "overshot the nominal one. Time: one call to the lowest density, "
                     "analysis included.")
        if r.get("paper_setting"):
            lines.append("\nNeuron Merging paper's setting (80 % of hidden neurons removed):\n")
            lines.append("| method | accuracy % | agreement % | removed per layer |")
            lines.append("|---|---|---|---|")
            for k, v in r["paper_setting"].items():
                acc, agr = v["acc_agree"][:2]
                lines.append(f"| {k} | {100 * acc:.2f} | {100 * agr:.1f} | "
                             f"{v['removed_per_layer']} |")
            for m in ("hope", "hope_spec_rate", "bn_scale", "exp_n0", "exp_residual"):
                v = r["results"].get(m, {}).get("0.2")
                if v:
                    lines.append(f"| {LABELS[m]} (global, density 0.2) | "
                                 f"{100 * v[0]:.2f} | {100 * v[1]:.1f} | |")
            lines.append(f"| NM paper: baseline / prune / merge | "
                         f"{NM_PAPER_LENET['baseline']} / {NM_PAPER_LENET['prune']} / "
                         f"{NM_PAPER_LENET['neuron_merging']} | | |")
        if name.endswith("_heldout"):
            lines.append("\n(held-out test images: no plot)\n")
            continue
        fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.8))
        colors = plt.get_cmap("tab20").colors
        for k, (m, per) in enumerate(r["results"].items()):
            acc = [100 * per[str(d)][0] for d in ds]
            style = "-" if m.startswith("hope") else (":" if m.startswith("exp") else "--")
            lw = 2.5 if m == "hope" else 1.3
            color = "black" if m == "hope" else colors[(2 * k) % 20 + (k >= 10)]
            line, = ax.plot(ds, acc, style, marker="o", ms=3, lw=lw, color=color,
                            label=LABELS.get(m, m))
            if len(per[str(ds[0])]) > 2:
                pr = [per[str(d)][2] for d in ds]
                ax2.plot(pr, acc, style, marker="o", ms=3, lw=lw, color=line.get_color())
        for a_ in (ax, ax2):
            a_.axhline(100 * info["accuracy"], color="gray", lw=0.8, ls=":")
            a_.invert_xaxis()
            a_.grid(alpha=0.3)
            a_.set_ylabel("test accuracy (%)")
        ax.set_xlabel("neuron density (active / initial compressible neurons)")
        ax2.set_xlabel("live parameters / original parameters")
        ax.set_title(f"{name}: accuracy vs neuron density (no fine-tuning)", fontsize=10)
        ax2.set_title("same points vs parameter ratio", fontsize=10)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(IMG / f"quality_{name}.png", dpi=110)
        plt.close(fig)
        lines.append(f"\n![{name}](img/quality_{name}.png)\n")
    text = "\n".join(lines)
    print(text)
    return text


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=("demo", "lenet300", "vgg8", "resnet50"))
    p.add_argument("--n-test", type=int, default=2000)
    p.add_argument("--methods", nargs="*")
    p.add_argument("--densities", type=float, nargs="*", default=list(DENSITIES))
    p.add_argument("--report", action="store_true")
    p.add_argument("--per-layer", action="store_true",
                   help="diagnostic: uniform per-layer pruning by capacity / baseline score")
    p.add_argument("--split", choices=("subset", "heldout"), default="subset",
                   help="heldout: 2000 test images outside the demo subset "
                        "(to check the proposals on data they were not chosen on)")
    p.add_argument("--neighbors-probe-steps", type=int, default=0,
                   help="time only this many refresh='neighbors' steps (ResNet-50)")
    args = p.parse_args(argv)
    if args.model and args.per_layer:
        per_layer(args.model, args.n_test)
    elif args.model:
        extra = (0.2,) if args.model == "lenet300" else ()
        run(args.model, args.n_test, methods=args.methods, extra_densities=extra,
            densities=tuple(args.densities),
            probe_steps=args.neighbors_probe_steps, split=args.split)
    if args.report:
        report(["demo", "lenet300", "vgg8", "resnet50"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
