"""Synthetic inputs made at a reduced size: what the stream readers' correction keeps.

The data-free default (`compress` without ``data=``) makes 16 synthetic inputs
(`hope_keras.synthesize_inputs`) and measures on them how the inputs of the BNs that
read a moved residual stream changed (docs/theory.md §6). At 224 × 224 making them is
most of the first `compress`. This script compares, on a ResNet-50 fixture (MODEL:
``resnet50_128`` by default, ``.cache/resnet50_fmnist128.keras``; docs/benchmarks.md
reports ``resnet50_64``; scripts/make_benchmark_fixtures.py ``--only resnet50
--resnet-size 128 | 64``), ways of making them that cost less (each setting's keywords
passed to `synthesize_inputs` whatever the fixture's size):

* ``default``: the library's setting when run (today: 80 of the 100 Adam steps at
  half the size, the last 20 at the full size);
* ``half→full`` / ``quarter→full``: all the steps at a half / a quarter of the size
  (``coarse_steps=steps``, ``coarse_scale=2 | 4``), the spectrum then zero-padded to
  the full size, where the readers are measured;
* ``half@half`` / ``quarter@quarter``: all the steps at a half / a quarter of the size,
  and the readers measured at that size too (``size=``; the network is convolutional
  up to its global pooling, and only the relative change between the original and the
  edited model is used);
* ``… N steps``: the same with N Adam steps instead of 100 (``full N steps``: the
  default's sizes with N steps; ``full N steps lr L``: and learning rate L;
  ``cosine N``: N steps, the learning rate decayed from 0.1 to 0 along them).

Each point is compressed once with ``correct_statistics="surrogate"``; then, for each
setting and seed, the inputs are made from the uncompressed model and the stream
readers of each compressed model corrected with them (what ``compress`` does by
default: `synthetic_settings.corrected`). Accuracy % on the selection split (the first
1000 bundled test images; the setting is chosen on it) and the held-out split (1000
others); "s": time to make the inputs and the readers' reference (2 shared cores).

Run: nice -n 5 .venv/bin/python benchmarks/synthetic_reduced.py [MODEL] [--settings A,B]
[--seeds N] [--first-seed K] [--points "density 0.9,FLOPs 0.6"] (``--quick``: the demo
CNN, 200 + 200 images, one point, the default and 5 steps, one seed). Writes benchmarks/results/synthetic_reduced_<model>.json (rows appended per run of the
same settings file; ``--out NAME`` to choose another).
"""

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
import quality as Q  # noqa: E402
from _common import add_quick, compress, quick_path  # noqa: E402
from synthetic_settings import corrected  # noqa: E402

RESULTS = os.path.join(os.path.dirname(__file__), "results")
POINTS = {"density 0.9": dict(density=0.9), "density 0.8": dict(density=0.8),
          "density 0.7": dict(density=0.7), "density 0.6": dict(density=0.6),
          "density 0.5": dict(density=0.5), "FLOPs 0.8": dict(flops=0.8),
          "FLOPs 0.6": dict(flops=0.6), "FLOPs 0.5": dict(flops=0.5)}


def settings(side):
    """Setting name → `synthesize_inputs` keyword arguments, for a model of `side`."""
    import keras

    out = {"default": {}}
    for steps in (100, 50, 25, 12, 5):
        tail = "" if steps == 100 else f" {steps} steps"
        if tail:
            out["full" + tail] = dict(steps=steps)
        out["half→full" + tail] = dict(steps=steps, coarse_steps=steps, coarse_scale=2)
        out["quarter→full" + tail] = dict(steps=steps, coarse_steps=steps, coarse_scale=4)
        out["half@half" + tail] = dict(steps=steps, size=side // 2, coarse_steps=0)
        out["quarter@quarter" + tail] = dict(steps=steps, size=side // 4, coarse_steps=0)
        for lr in (0.2, 0.3, 0.5):  # fewer steps, larger ones
            out[f"full{tail or ' 100 steps'} lr {lr}"] = dict(steps=steps, learning_rate=lr)
        # The learning rate decayed from the default's 0.1 to 0 over the steps.
        out[f"cosine {steps}"] = dict(
            steps=steps, learning_rate=keras.optimizers.schedules.CosineDecay(0.1, steps))
    return out


def _recorded(kwargs):
    """A setting's keywords as the results file records them (a schedule by its
    class and config)."""
    return {k: v if isinstance(v, (bool, int, float, str, type(None)))
            else {type(v).__name__: v.get_config()} for k, v in kwargs.items()}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("model", nargs="?", default="resnet50_128")
    p.add_argument("--settings", default="default,half→full,quarter→full,half@half")
    p.add_argument("--seeds", type=int, default=2)
    p.add_argument("--first-seed", type=int, default=0, help="seeds FIRST … FIRST + N − 1")
    p.add_argument("--points", default=",".join(POINTS))
    p.add_argument("--out", default=None)
    args = add_quick(p).parse_args()
    if args.quick:
        args.model, args.seeds, args.points = "demo", 1, "density 0.5"
        args.settings = "default,full 5 steps"  # the demo's Flatten fixes its size
    b = Q.Bench(args.model, *((200, 200) if args.quick else (1000, 1000)), (0.5,))
    a = b.analysis
    side = int(b.model.inputs[0].shape[1])
    table = settings(side)
    chosen = [s.strip() for s in args.settings.split(",")]
    unknown = [s for s in chosen if s not in table]
    if unknown:
        raise SystemExit(f"unknown settings {unknown}; known: {list(table)}")
    points = {k: POINTS[k] for k in (s.strip() for s in args.points.split(","))}
    out_path = os.path.join(RESULTS, f"synthetic_reduced_{args.out or args.model}.json")
    if args.quick:
        out_path = str(quick_path(out_path))
    record = {"model": args.model, "points": list(points), "rows": []}
    if os.path.exists(out_path):
        with open(out_path) as f:
            record = json.load(f)
        record["points"] = list(dict.fromkeys(record["points"] + list(points)))
    compressed = {}
    for label, kw in points.items():
        b.reset()
        t = time.perf_counter()
        r = compress(b.model, analysis=a, verbose=False, correct_statistics="surrogate", **kw)
        compressed[label] = ([w.numpy().copy() for w in b.model.weights], r.trajectory.steps)
        print(f"{label}: compressed in {time.perf_counter() - t:.1f} s", flush=True)
    for name in chosen:
        for seed in range(args.first_seed, args.first_seed + args.seeds):
            seconds, acc = corrected(b, compressed, seed=seed, **table[name])
            row = dict(setting=name, kwargs=_recorded(table[name]),
                       seed=seed, seconds=round(seconds, 1),
                       load=round(os.getloadavg()[0], 2), acc=acc)
            record["rows"].append(row)
            print(json.dumps(row), flush=True)
            with open(out_path, "w") as f:
                json.dump(record, f, indent=1)
    print_table(record)


def print_table(record):
    """Means over seeds, selection / held-out, per setting and point."""
    pts = record["points"]
    names = list(dict.fromkeys(r["setting"] for r in record["rows"]))
    print("| setting | seeds | s (mean) | " + " | ".join(f"{p} sel / held-out" for p in pts)
          + " |")
    print("|---" * (len(pts) + 3) + "|")
    for name in names:
        rs = [r for r in record["rows"] if r["setting"] == name]
        cells = []
        for p in pts:
            have = [r["acc"][p] for r in rs if p in r["acc"]]
            cells.append(f"{100 * np.mean([h['sel'] for h in have]):.1f} / "
                         f"{100 * np.mean([h['heldout'] for h in have]):.1f}" if have else "–")
        print(f"| {name} | {len(rs)} | {np.mean([r['seconds'] for r in rs]):.1f} | "
              + " | ".join(cells) + " |")


if __name__ == "__main__":
    if "--table" in sys.argv:
        with open(sys.argv[sys.argv.index("--table") + 1]) as f:
            print_table(json.load(f))
    else:
        main()
