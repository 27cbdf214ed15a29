"""The certified merge search against ``top_k`` on a trained network with 4096-wide
groups: held-out accuracy, sum of J and wall time.

The quality benchmark's models have groups of at most 2048 neurons (ResNet-50's last
residual stream); VGG16's classifier, where the certified search is slowest, has
4096. This trains a BN-ReLU MLP of that width on Fashion-MNIST (784 → 4096 → 4096 →
10: Flatten, two Dense + BatchNormalization + ReLU, a Dense head; Adam 1e-3, batch
128, one epoch on the first 30 000 training images, seed 0; cached in
``.cache/mlp4096_fmnist.keras``), then, for each search, one data-free `Encoder` run
with every other default to the lowest density, replayed to each density (the run's
statistics correction applied, as `compress` does). Accuracy on the selection split
(the 2000 bundled test images) and the held-out split (3000 other test images, as
benchmarks/quality.py).

Run: .venv/bin/python benchmarks/merge_search_wide.py [--width 4096]
     [--densities 0.9 0.8 0.7 0.6 0.5 0.4 0.3] [--report] [--quick]
Writes benchmarks/results/merge_search_wide_<width>.json (not with --quick: width 64,
2000 training images, densities 0.8 and 0.6).
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from _common import add_quick, quick_path  # noqa: E402

import keras  # noqa: E402

import hope_keras  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SEARCHES = ("certified", "top_k")


def train(width, n_train, path):
    """The MLP (trained once, then loaded from `path`)."""
    if path.exists():
        return keras.models.load_model(path, compile=False)
    sys.path.insert(0, str(REPO / "scripts"))
    from make_fixtures import load_fashion_mnist

    keras.utils.set_random_seed(0)
    data = load_fashion_mnist()
    x = (data["x_train"][:n_train].astype("float32") / 255.0)[..., None]
    y = data["y_train"][:n_train].astype("int64")
    L = keras.layers
    inputs = keras.Input((28, 28, 1))
    h = L.Flatten()(inputs)
    for k in range(2):
        h = L.ReLU()(L.BatchNormalization(name=f"bn{k}")(L.Dense(width, name=f"fc{k}")(h)))
    model = keras.Model(inputs, L.Dense(10, name="head")(h))
    model.compile(keras.optimizers.Adam(1e-3),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    t = time.perf_counter()
    model.fit(x, y, batch_size=128, epochs=1, verbose=0)
    print(f"trained {width}-wide MLP on {n_train} images in {time.perf_counter() - t:.0f} s",
          flush=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    model.save(path)
    return model


def accuracy(model, splits):
    return {k: float(np.mean(np.argmax(model.predict(x, batch_size=500, verbose=0), 1) == y))
            for k, (x, y) in splits.items()}


def report(path):
    """One row, `top_k` − certified in points of accuracy over every density, as
    ``benchmarks/quality.py --compare`` prints it for the quality benchmark's models."""
    out = json.loads(Path(path).read_text())
    pairs = list(zip(out["certified"]["points"], out["top_k"]["points"]))
    diff = {k: np.array([100 * (b[k] - a[k]) for a, b in pairs]) for k in ("heldout", "sel")}
    same = int(np.sum((np.abs(diff["sel"]) < 1e-9) & (np.abs(diff["heldout"]) < 1e-9)))
    print(f"| MLP 2 × {out['width']} ({out['width']}) | {same} of {len(pairs)} | " + " | ".join(
        f"{d.mean():+.2f} / {d.min():+.1f} / {d.max():+.1f}"
        for d in (diff["heldout"], diff["sel"])) + " |")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--width", type=int, default=4096)
    p.add_argument("--train-images", type=int, default=30000)
    p.add_argument("--densities", type=float, nargs="*",
                   default=[0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3])
    p.add_argument("--report", action="store_true",
                   help="print the summary row of the recorded results and stop")
    add_quick(p)
    args = p.parse_args()
    if args.report:
        return report(REPO / "benchmarks" / "results" / f"merge_search_wide_{args.width}.json")
    sys.path.insert(0, os.path.dirname(__file__))
    from quality import heldout_test

    from hope_keras.data import load_demo_data

    if args.quick:
        args.width, args.train_images, args.densities = 64, 2000, [0.8, 0.6]
        cache = quick_path(f"mlp{args.width}_fmnist.keras")
        out_path = quick_path(f"merge_search_wide_{args.width}.json")
    else:
        cache = REPO / ".cache" / f"mlp{args.width}_fmnist.keras"
        out_path = REPO / "benchmarks" / "results" / f"merge_search_wide_{args.width}.json"
    model = train(args.width, args.train_images, cache)
    demo = load_demo_data()
    splits = {"sel": (demo.x_test, demo.y_test), "heldout": heldout_test(3000)}
    original = model.get_weights()
    out = {"width": args.width, "train_images": args.train_images,
           "uncompressed": accuracy(model, splits), "load_start": os.getloadavg()[0]}
    print(f"uncompressed: {out['uncompressed']}", flush=True)
    analysis = hope_keras.analyze(model, verbose=False)
    for search in SEARCHES:
        model.set_weights(original)
        t = time.perf_counter()
        enc = hope_keras.Encoder(model, analysis=analysis, verbose=False,
                                 search={"merge_search": search})
        enc.run(density=min(args.densities), verbose=False)
        seconds = time.perf_counter() - t
        traj = enc.trajectory
        kinds = {k: int(sum(s.kind == k for s in traj.steps)) for k in ("prune", "merge")}
        row = {"seconds": seconds, "steps": kinds, "load": os.getloadavg()[0], "points": []}
        for d in args.densities:
            model.set_weights(original)
            n = traj.step_for(density=d)
            traj.replay(model, step=n, check=False)
            row["points"].append({"density": d, "sum_J": float(sum(s.J for s in traj.steps[:n])),
                                  **accuracy(model, splits)})
        out[search] = row
        print(f"{search}: {seconds:.1f} s (load {row['load']:.1f}), {kinds}; " + " ".join(
            f"{q['density']:g}: {100 * q['sel']:.1f}/{100 * q['heldout']:.1f} "
            f"(J {q['sum_J']:.5g})" for q in row["points"]), flush=True)
    with open(out_path, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {out_path}")
    report(out_path)


if __name__ == "__main__":
    main()
