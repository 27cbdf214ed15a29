"""Reproduce the deep experiment of "Width-Independent Compressibility" (fig. 2).

L = 5: four hidden layers of width 1024, d_in = d_out = 2, sigmoid and GELU,
default Keras initialisation (Glorot-uniform kernels, zero biases) with a fixed
seed, float32. All four hidden layers are compressed with a uniform order k,
backward ([3, 2, 1, 0]) and forward ([0, 1, 2, 3]); the sup error on uniform
samples of the balls R ∈ {0.5, 1, 2, 4} is printed for k = 0..10 together with
the kept widths, and plotted to docs/img/derivative_matching_deep.png.

Usage:
    .venv/bin/python benchmarks/derivative_matching_paper.py [--samples 20000]
        [--kmax 10] [--seed 0] [--keep rank|dk] [--init keras|torch]

``--keep dk`` keeps D_k neurons per layer as in the paper instead of the numerical
rank; ``--init torch`` uses PyTorch's default nn.Linear initialisation
(U(±1/sqrt(fan_in)) for kernels and biases) to probe the init dependence.
"""

import argparse
import json
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np

import keras
from _common import add_quick, quick_path
from hope_keras import derivative_matching as dm

RADII = (0.5, 1.0, 2.0, 4.0)


def teacher(act, seed, init="keras", width=1024, depth=4):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential(
        [keras.Input((2,))]
        + [keras.layers.Dense(width, activation=act) for _ in range(depth)]
        + [keras.layers.Dense(2)],
        name=f"teacher_{act}",
    )
    if init == "torch":
        rng = np.random.default_rng(seed)
        for layer in model.layers:
            k, b = layer.get_weights()
            lim = 1.0 / np.sqrt(k.shape[0])
            layer.set_weights([rng.uniform(-lim, lim, k.shape).astype("float32"),
                               rng.uniform(-lim, lim, b.shape).astype("float32")])
    return model


def predict(model, x, batch=8192):
    return np.concatenate(
        [np.asarray(model(x[i : i + batch].astype("float32"))) for i in range(0, len(x), batch)]
    ).astype(np.float64)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=20000)
    ap.add_argument("--kmax", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--keep", default="rank", choices=["rank", "dk"])
    ap.add_argument("--init", default="keras", choices=["keras", "torch"])
    ap.add_argument("--acts", default="sigmoid,gelu")
    ap.add_argument("--out", default="docs/img/derivative_matching_deep.png")
    ap.add_argument("--json", default="")
    add_quick(ap)  # a 4 × 32 sigmoid teacher, k ≤ 1, 500 points per radius
    args = ap.parse_args()
    width = 1024
    if args.quick:
        args.samples, args.kmax, args.acts, width = 500, 1, "sigmoid", 32
        args.out = str(quick_path(args.out))
        args.json = str(quick_path(args.json or "derivative_matching_deep.json"))

    points = {R: dm.sample_ball(args.samples, 2, R, seed=args.seed + 1) for R in RADII}
    results = {}
    t_all = time.perf_counter()
    for act in args.acts.split(","):
        model = teacher(act, args.seed, args.init, width=width)
        y_t = {R: predict(model, x) for R, x in points.items()}
        for direction in ("backward", "forward"):
            rows = []
            for k in range(args.kmax + 1):
                t0 = time.perf_counter()
                student, rep = dm.compress_mlp(model, order=k, direction=direction, keep=args.keep)
                secs = time.perf_counter() - t0
                errs = [float(np.max(np.abs(predict(student, points[R]) - y_t[R]))) for R in RADII]
                widths = [student.layers[i].units for i in range(4)]
                ranks = {l.index: l.rank for l in rep.layers}
                rows.append(dict(k=k, d_k=dm.num_features(2, k), widths=widths,
                                 ranks=[ranks[i] for i in range(4)], errors=errs,
                                 l1=[round(l.l1_inflation, 3) for l in sorted(rep.layers, key=lambda l: l.index)],
                                 seconds=secs))
                print(f"{act:8s} {direction:8s} k={k:2d} D_k={rows[-1]['d_k']:3d} widths={widths} "
                      + " ".join(f"R={R}:{e:.2e}" for R, e in zip(RADII, errs))
                      + f"  ({secs:.1f}s)", flush=True)
            results[(act, direction)] = rows

    print(f"\ntotal {time.perf_counter() - t_all:.0f}s\n")
    # Markdown tables
    for act in args.acts.split(","):
        print(f"#### {act} (init={args.init}, keep={args.keep})\n")
        print("| k | D_k | kept widths (layers 0-3) | " + " | ".join(
            f"R={R} bwd / fwd" for R in RADII) + " |")
        print("|---|---|---|" + "---|" * len(RADII))
        for rb, rf in zip(results[(act, "backward")], results[(act, "forward")]):
            cells = " | ".join(f"{eb:.1e} / {ef:.1e}" for eb, ef in zip(rb["errors"], rf["errors"]))
            print(f"| {rb['k']} | {rb['d_k']} | {rb['widths']} | {cells} |")
        print()
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({f"{a}/{d}": r for (a, d), r in results.items()}, fh, indent=1)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    acts = args.acts.split(",")
    fig, axes = plt.subplots(1, len(acts), figsize=(5.2 * len(acts), 4), squeeze=False)
    for ax, act in zip(axes[0], acts):
        for i, R in enumerate(RADII):
            for direction, style in (("backward", "-o"), ("forward", "--x")):
                rows = results[(act, direction)]
                ax.semilogy([r["k"] for r in rows], [max(r["errors"][i], 1e-12) for r in rows],
                            style, color=f"C{i}", ms=4,
                            label=f"R={R} {direction}" if direction == "backward" or i == 0 else None)
        ax.set_title(f"{act}: 4x{width} -> kept widths (init={args.init}, keep={args.keep})", fontsize=9)
        ax.set_xlabel("matching order k")
        ax.set_ylabel("sup error on ball (float32)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
