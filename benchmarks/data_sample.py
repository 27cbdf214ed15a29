"""How many inputs `compress(data=x)` needs at 224 × 224: the correction's sampling error.

`compress(model, data=x)` draws enough of ``x`` that every stale BatchNormalization
sees `hope_keras.stats.correction.DATA_VALUES_PER_CHANNEL` values per channel (and at
least `DATA_MIN_INPUTS` inputs), measures each one's input on them before and after
the run, and moves its statistics by the change (docs/theory.md §6). The two passes
over those inputs are most of ``compress(data=x)``'s time beyond the search. The
32 × 32 ResNet-50 fixture (docs/quality.md) sees one value per channel and input at
its last stage, so it cannot say what an input of 7 × 7 correlated positions is worth;
this script measures it at 224 × 224 on natural photographs:

1. ResNet-50 @224 (`_common.calibrated_resnet50`: random weights, BN statistics
   calibrated, γ/β random), one greedy run to density 0.5 without correction;
2. the reference: the data correction on all ``--pool`` random 224 × 224 crops of
   six scikit-image sample photographs (those `real_checkpoints.py` selects on);
3. per n of ``--inputs``, ``--draws`` random draws of n crops of that pool, each
   corrected on its draw; and, unless ``--no-synthetic``, the data-free correction
   (16 synthetic inputs made from the weights, about 90 s);
4. each corrected model against the reference on ``--eval`` crops of six other
   photographs (`PHOTOS_HELD`): the distance of the pooled features (``avg_pool``)
   from the reference's, relative to the uncorrected model's distance (1: no better
   than no correction; 0: the reference), and the top-1 agreement of the class outputs.

Run: .venv/bin/python benchmarks/data_sample.py  (about 6 minutes; installs
scikit-image's wheel into .cache/real_checkpoints/data like real_checkpoints.py)
Writes benchmarks/results/data_sample_224<--tag>.json.
"""

import argparse
import os
import sys
import time

# real_checkpoints.py turns oneDNN off for its fer model's training; these passes keep
# TensorFlow's default kernels, as compress(data=x) runs them.
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")
sys.path.insert(0, os.path.dirname(__file__))
import real_checkpoints as rc  # noqa: E402
from _common import (QUICK_RESNET_SIZE, add_quick, calibrated_resnet50,  # noqa: E402
                     write_results)

import keras  # noqa: E402
import numpy as np  # noqa: E402

import hope_keras  # noqa: E402
from hope_keras.stats import correction as correction_lib  # noqa: E402

RESULTS = os.path.join(os.path.dirname(__file__), "results")
# Held-out photographs: `real_checkpoints.PHOTOS_HELD` with the two narrower than 224
# (page, coins) replaced.
PHOTOS_HELD = ("camera.png", "motorcycle_right.png", "gravel.png", "grass.png",
               "ihc.png", "moon.png")


def main():
    p = add_quick(argparse.ArgumentParser(description=__doc__.split("\n")[0]))
    p.add_argument("--pool", type=int, default=256)
    p.add_argument("--inputs", type=int, nargs="+", default=[11, 16, 21, 32, 64])
    p.add_argument("--draws", type=int, default=6)
    p.add_argument("--eval", type=int, default=32)
    p.add_argument("--density", type=float, default=0.5)
    p.add_argument("--no-synthetic", dest="synthetic", action="store_false")
    p.add_argument("--tag", default="", help="appended to the results file's name")
    args = p.parse_args()
    size = 224
    if args.quick:
        if not rc.installed("data"):
            print("--quick: scikit-image's sample photographs are not installed "
                  "(the full run installs them); skipped.")
            return
        size, args.pool, args.inputs, args.draws, args.eval = QUICK_RESNET_SIZE, 8, [4], 1, 4
        args.synthetic = False
    else:
        rc.install("data")
    pool = rc.photo_crops(rc.PHOTOS_SEL, args.pool, size, seed=0)
    held = rc.photo_crops(PHOTOS_HELD, args.eval, size, seed=1)

    keras.utils.set_random_seed(0)
    model = calibrated_resnet50(size=size)
    outputs = keras.Model(model.inputs, [model.get_layer("avg_pool").output, model.output])
    original = [w.numpy().copy() for w in model.weights]
    analysis = hope_keras.analyze(model, verbose=False)
    enc = hope_keras.Encoder(model, analysis=analysis, correction=False, verbose=False)
    enc.run(density=args.density, verbose=False)
    steps = enc.trajectory.steps
    edited = [w.numpy().copy() for w in model.weights]
    # Every input given is used: the draw's size is the variable here.
    correction_lib.DATA_VALUES_PER_CHANNEL, correction_lib.DATA_MIN_INPUTS = 10 ** 9, 1

    def evaluate():
        feats, probs = outputs.predict(held, batch_size=8, verbose=0)
        return feats.astype(np.float64), probs.argmax(axis=-1)

    def corrected(data):
        """The edited model with its statistics corrected (data=None: data-free)."""
        for w, v in zip(model.weights, original):
            w.assign(v)
        corr = correction_lib.StatisticsCorrection("auto", data=data, verbose=False)
        corr.start(model, analysis.graph, analysis.moments)  # from the original weights
        for w, v in zip(model.weights, edited):
            w.assign(v)
        t = time.perf_counter()
        corr.finish(steps)
        seconds = time.perf_counter() - t
        out = evaluate()
        for w, v in zip(model.weights, edited):
            w.assign(v)
        return out, seconds

    uncorrected = evaluate()
    (ref_f, ref_c), _ = corrected(pool)
    base = float(np.mean(np.linalg.norm(uncorrected[0] - ref_f, axis=1)))

    def against_reference(f, c):
        rel = float(np.mean(np.linalg.norm(f - ref_f, axis=1))) / base
        return {"relative_error": round(rel, 4), "top1_agreement": float(np.mean(c == ref_c))}

    out = {"size": size, "density": args.density, "steps": len(steps), "pool": args.pool,
           "eval": args.eval, "uncorrected": against_reference(*uncorrected), "inputs": {}}
    rng = np.random.default_rng(2)
    for n in args.inputs:
        rows = []
        for _ in range(args.draws):
            (f, c), seconds = corrected(pool[rng.choice(args.pool, n, replace=False)])
            rows.append({**against_reference(f, c), "s": round(seconds, 2)})
        err = [r["relative_error"] for r in rows]
        agree = [r["top1_agreement"] for r in rows]
        out["inputs"][str(n)] = {"draws": rows, "relative_error_mean": float(np.mean(err)),
                                 "relative_error_max": float(np.max(err)),
                                 "top1_agreement_mean": float(np.mean(agree))}
        print(f"{n} inputs: relative error {np.mean(err):.3f} (max {np.max(err):.3f}), "
              f"top-1 agreement with the reference {np.mean(agree):.3f}", flush=True)
    if args.synthetic:
        (f, c), seconds = corrected(None)
        out["data-free"] = {**against_reference(f, c), "s": round(seconds, 1)}
        print(f"data-free: {out['data-free']}", flush=True)
    print(f"uncorrected: {out['uncorrected']}")
    path = os.path.join(RESULTS, f"data_sample_{size}{args.tag}.json")
    print(f"wrote {write_results(path, out, args.quick)}")


if __name__ == "__main__":
    main()
