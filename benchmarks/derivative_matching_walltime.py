"""Wall time of the whole derivative-matching pipeline against k and against width.

The pipeline is one ``compress_mlp`` call: jets (features) of every hidden layer,
pivoted QR + maxvol, reweighting, rebuilding the Keras model. Teacher: four
sigmoid hidden layers, d_in = d_out = 2, default Keras init, float32. Each point
is the median of ``--repeats`` runs. Writes docs/img/derivative_matching_walltime.png.

Usage:
    .venv/bin/python benchmarks/derivative_matching_walltime.py [--repeats 2]
        [--widths 128,256,512,1024,2048,4096] [--kmax 10]
"""

import argparse
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np

import keras
from _common import add_quick, quick_path
from hope_keras import derivative_matching as dm


def teacher(width, act="sigmoid", seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((2,))]
                            + [keras.layers.Dense(width, activation=act) for _ in range(4)]
                            + [keras.layers.Dense(2)])


def timed(model, k, repeats):
    times, rep = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        _, rep = dm.compress_mlp(model, order=k)
        times.append(time.perf_counter() - t0)
    return float(np.median(times)), rep


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--widths", default="128,256,512,1024,2048,4096")
    ap.add_argument("--kmax", type=int, default=10)
    ap.add_argument("--act", default="sigmoid")
    ap.add_argument("--out", default="docs/img/derivative_matching_walltime.png")
    add_quick(ap)  # a 4 × 32 teacher for k ≤ 1, widths 16 and 32, one repeat
    args = ap.parse_args()
    base = 1024
    if args.quick:
        args.repeats, args.widths, args.kmax, base = 1, "16,32", 1, 32
        args.out = str(quick_path(args.out))

    model = teacher(base, args.act)
    dm.compress_mlp(model, order=2)  # warm-up (imports, product tables)
    by_k = []
    print(f"| k | D_k | seconds (width {base}) | kept widths |")
    print("|---|---|---|---|")
    for k in range(args.kmax + 1):
        secs, rep = timed(model, k, args.repeats)
        by_k.append(secs)
        print(f"| {k} | {dm.num_features(2, k)} | {secs:.2f} | "
              f"{sorted(rep.widths.values())} |", flush=True)
    by_w = []
    widths = [int(w) for w in args.widths.split(",")]
    print(f"\n| width | seconds (k={args.kmax}) | teacher params |")
    print("|---|---|---|")
    for w in widths:
        m = teacher(w, args.act)
        secs, rep = timed(m, args.kmax, args.repeats)
        by_w.append(secs)
        print(f"| {w} | {secs:.2f} | {rep.params_before} |", flush=True)
        del m

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.6))
    a.plot(range(args.kmax + 1), by_k, "-o")
    a.set_xlabel("matching order k")
    a.set_ylabel("seconds")
    a.set_title(f"4 x {base}, d_in = 2", fontsize=9)
    b.loglog(widths, by_w, "-o")
    b.set_xticks(widths)
    b.set_xticklabels([str(w) for w in widths])
    b.minorticks_off()
    b.set_xlabel("hidden width")
    b.set_ylabel("seconds")
    b.set_title(f"k = {args.kmax}, 4 hidden layers", fontsize=9)
    for ax in (a, b):
        ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
