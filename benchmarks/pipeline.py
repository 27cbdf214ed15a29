#!/usr/bin/env python
"""Pipeline benchmark: compress → slim → recover, at equal budgets.

For each model and each neuron density, three compressions of the same trained model:

* ``hope`` — `hope_keras.compress(model, density=d)` with the library's defaults
  (or ``--hope key=value`` options);
* ``bn_scale`` — `hope_keras.baselines.prune(model, d, method="bn_scale",
  scope="layer")` (network slimming's |γ|, the same fraction of every layer);
* ``l1`` — `hope_keras.baselines.prune(model, d, method="l1_input", scope="layer")`
  (Li et al.'s filter l1 norm, per layer);

each followed by the *same* `hope_keras.recover` (the original as teacher, the same
unlabeled training images, epochs, batch size and seed), on the slimmed model. It
records, per point: held-out accuracy after compression (no data) and after
recover, the slimmed model's parameter and FLOPs ratios (`hope_keras.profile`), and
wall times. ``--report`` plots accuracy against the FLOPs ratio.

Models: ``demo`` (bundled CNN), ``vgg8`` (``benchmarks/fixtures``) and ``resnet50``
(``.cache/resnet50_fmnist.keras``, 32×32 RGB), loaded as in ``benchmarks/quality.py``
on its held-out test images; the training images come from the full Fashion-MNIST
training set (the same preprocessing as the model's test input).

Usage (repository root)::

    nice -n 10 .venv/bin/python benchmarks/pipeline.py --model demo
    .venv/bin/python benchmarks/pipeline.py --model demo --budget flops --densities 0.8 0.6 0.5
    .venv/bin/python benchmarks/pipeline.py --model vgg8 --densities 0.9 0.7 0.5
    .venv/bin/python benchmarks/pipeline.py --report

With ``--budget flops`` the points are FLOPs ratios instead (equal budgets in what a
deployment pays): HOPE runs ``compress(flops=r)``, each baseline's per-layer density
is bisected to the largest whose slimmed model is at or below ``r``.

Results: ``benchmarks/results/pipeline_<model>[_flops].json``; plots
``docs/img/pipeline_<model>[_flops].png``.
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
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(REPO / "scripts"))
from _common import add_quick, quick_path  # noqa: E402

DENSITIES = (0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3)
METHODS = ("hope", "bn_scale", "l1")


def _rgb(a):
    """As quality.load does for the ResNet-50 fixture: pad to 32×32, 3 channels."""
    a = np.pad(a[..., 0], ((0, 0), (2, 2), (2, 2)))
    return np.repeat(a[..., None], 3, axis=-1)


def training_images(model_name: str, n: int, seed: int = 0) -> np.ndarray:
    from recover_demo import training_images as gray

    x = gray(n, seed)
    return _rgb(x) if model_name == "resnet50" else x


BASELINE = {"bn_scale": "bn_scale", "l1": "l1_input"}


def _baseline_flops(model, method: str, density: float) -> float:
    import hope_keras

    m = _copy(model)
    hope_keras.baselines.prune(m, density, method=BASELINE[method], scope="layer")
    return hope_keras.profile(hope_keras.slim(m), reference=model,
                              latency=False).ratio("flops")


def _copy(model):
    import keras

    m = keras.models.clone_model(model)
    m.set_weights(model.get_weights())
    return m


def compress(method: str, model, budget: float, hope_kw: dict, axis: str = "density"):
    """Compresses in place to ``budget`` on ``axis``: a neuron density, or a FLOPs
    ratio (the baselines' per-layer density is bisected to the largest one whose
    slimmed FLOPs ratio is at or below the budget). Returns the density used."""
    import hope_keras

    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}. Received: {method!r}")
    if method == "hope":
        hope_keras.compress(model, verbose=False, **{axis: budget}, **hope_kw)
        return None
    density = budget
    if axis == "flops":
        lo, hi = 0.0, 1.0  # flops(lo) <= budget < flops(hi)
        for _ in range(10):
            mid = 0.5 * (lo + hi)
            if _baseline_flops(model, method, mid) <= budget:
                lo = mid
            else:
                hi = mid
        density = max(lo, 1e-3)
    hope_keras.baselines.prune(model, density, method=BASELINE[method], scope="layer")
    return density


def point(model_name, method, density, x_train, x_test, y_test, args, hope_kw,
          recover_kw) -> dict:
    import keras

    import hope_keras
    from quality import load
    from recover_demo import accuracy

    teacher = load(model_name, "heldout")[0]
    model = load(model_name, "heldout")[0]
    keras.utils.set_random_seed(args.seed)
    t0 = time.perf_counter()
    used = compress(method, model, density, hope_kw, args.budget)
    rec = {"method": method, args.budget: density, "compress_s": time.perf_counter() - t0}
    if used is not None:
        rec["baseline_density"] = used
    small = hope_keras.slim(model)
    rec["acc_compressed"] = accuracy(small, x_test, y_test)
    p = hope_keras.profile(small, reference=teacher, latency=False)
    rec.update(params_ratio=p.ratio("params"), flops_ratio=p.ratio("flops"))
    t0 = time.perf_counter()
    history = hope_keras.recover(small, x_train, teacher=teacher, epochs=args.epochs,
                                 verbose=0, **recover_kw)
    rec["recover_s"] = time.perf_counter() - t0
    if hasattr(history, "revert"):  # revert_if_worse: the agreements, and whether put back
        rec["revert"] = history.revert
    rec["acc_recovered"] = accuracy(small, x_test, y_test)
    return rec


def run(args):
    import hope_keras
    from quality import load
    from recover_demo import accuracy, parse_options

    hope_kw, recover_kw = parse_options(args.hope), parse_options(args.recover)
    _, x_test, y_test, _ = load(args.model, "heldout")
    x_train = training_images(args.model, args.images)
    teacher = load(args.model, "heldout")[0]
    out = {"model": args.model, "budget": args.budget, "images": args.images,
           "epochs": args.epochs,
           "seed": args.seed, "hope": hope_kw, "recover": recover_kw,
           "heldout": len(y_test), "acc_original": accuracy(teacher, x_test, y_test),
           "hope_keras": hope_keras.__version__, "points": []}
    print(f"{args.model}: {out['acc_original']:.4f} on {len(y_test)} held-out images")
    print(f"{'method':>9} {args.budget:>7} {'FLOPs':>6} {'params':>6} {'compressed':>10} "
          f"{'recovered':>9} {'recover s':>9}")
    for density in args.densities:
        for method in args.methods:
            r = point(args.model, method, density, x_train, x_test, y_test, args,
                      hope_kw, recover_kw)
            out["points"].append(r)
            print(f"{method:>9} {density:>7.2f} {r['flops_ratio']:>6.3f} "
                  f"{r['params_ratio']:>6.3f} {r['acc_compressed']:>10.4f} "
                  f"{r['acc_recovered']:>9.4f} {r['recover_s']:>9.1f}", flush=True)
    suffix = "" if args.budget == "density" else "_flops"
    path = Path(args.out or RESULTS / f"pipeline_{args.model}{suffix}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    if args.keep and path.exists():  # the other methods' points of the previous run
        old = json.loads(path.read_text())
        same = {k: old.get(k) for k in ("images", "epochs", "seed", "recover")}
        same["budget"] = old.get("budget", "density")  # older files: density only
        if same != {k: out[k] for k in same}:
            raise SystemExit(f"--keep: {path} was run with other settings {same}")
        kept = [q for q in old["points"] if q["method"] not in args.methods]
        out["points"] = sorted(kept + out["points"], key=lambda q: (
            -q[args.budget], METHODS.index(q["method"]) if q["method"] in METHODS else 99))
        out["rerun"] = {**old.get("rerun", {}), **{m: hope_keras.__version__
                                                   for m in args.methods}}
    path.write_text(json.dumps(out, indent=1))
    print(f"Wrote {path}")


def report():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for path in sorted(RESULTS.glob("pipeline_*.json")):
        data = json.loads(path.read_text())
        fig, ax = plt.subplots(figsize=(6, 4))
        for method in METHODS:
            pts = sorted((p for p in data["points"] if p["method"] == method),
                         key=lambda p: p["flops_ratio"])
            if not pts:
                continue
            f = [p["flops_ratio"] for p in pts]
            line, = ax.plot(f, [p["acc_recovered"] for p in pts], "o-",
                            label=f"{method} + recover")
            ax.plot(f, [p["acc_compressed"] for p in pts], "x:", color=line.get_color(),
                    alpha=0.6, label=f"{method}, no data")
        ax.axhline(data["acc_original"], color="gray", lw=0.8, label="original")
        ax.set_xlabel("FLOPs ratio (slimmed / original)")
        ax.set_ylabel(f"held-out accuracy ({data['heldout']} images)")
        ax.set_title(f"{data['model']}: compress → slim → recover "
                     f"({data['images']} unlabeled images, {data['epochs']} epoch)")
        ax.legend(fontsize=7)
        fig.tight_layout()
        out = IMG / f"{path.stem}.png"
        fig.savefig(out, dpi=120)
        plt.close(fig)
        print(f"Wrote {out}")


def table():
    """Markdown tables of every pipeline_*.json (for docs/benchmarks.md)."""
    for path in sorted(RESULTS.glob("pipeline_*.json")):
        data = json.loads(path.read_text())
        axis = data.get("budget", "density")
        print(f"\n{path.name}: {data['model']}, original {100 * data['acc_original']:.2f}% "
              f"on {data['heldout']} held-out images, seed {data['seed']}\n")
        print(f"| method | {axis} | FLOPs | params | data-free | after recover |")
        print("| --- | ---: | ---: | ---: | ---: | ---: |")
        for p in data["points"]:
            budget = p.get(axis, p.get("density"))
            print(f"| {p['method']} | {budget:.2f} | {p['flops_ratio']:.3f} "
                  f"| {p['params_ratio']:.3f} | {100 * p['acc_compressed']:.2f}% "
                  f"| {100 * p['acc_recovered']:.2f}%"
                  f"{' (put back)' if p.get('revert', {}).get('reverted') else ''} |")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="demo", choices=("demo", "vgg8", "resnet50"))
    ap.add_argument("--densities", type=float, nargs="*", default=list(DENSITIES),
                    help="budgets: neuron densities, or FLOPs ratios with --budget flops")
    ap.add_argument("--budget", choices=("density", "flops"), default="density",
                    help="equal neuron densities, or equal FLOPs ratios (HOPE: "
                         "compress(flops=r); baselines: per-layer density bisected)")
    ap.add_argument("--methods", nargs="*", default=list(METHODS), choices=METHODS)
    ap.add_argument("--images", type=int, default=2048)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--hope", nargs="*", default=[], help="key=value for compress")
    ap.add_argument("--recover", nargs="*", default=[], help="key=value for recover")
    ap.add_argument("--out", help="JSON path (default benchmarks/results/pipeline_<model>.json)")
    ap.add_argument("--keep", action="store_true",
                    help="keep the other methods' points of the JSON (re-run --methods only)")
    ap.add_argument("--report", action="store_true", help="plot every pipeline_*.json")
    ap.add_argument("--table", action="store_true",
                    help="print every pipeline_*.json as a markdown table")
    add_quick(ap)  # the demo CNN at density 0.8, 128 unlabeled images, one epoch
    args = ap.parse_args(argv)
    if args.quick:
        args.model, args.densities, args.images, args.epochs = "demo", [0.8], 128, 1
        suffix = "" if args.budget == "density" else "_flops"
        args.out = str(quick_path(args.out or f"pipeline_{args.model}{suffix}.json"))
        args.report = args.table = False
    if args.report:
        report()
    elif args.table:
        table()
    else:
        run(args)


if __name__ == "__main__":
    main()
