"""The merge search on sketched groups: certified against top-k, on trained models.

Sketch caches (`hope_keras.scoring.cache.SketchCache`) are built for groups of
`cache.SKETCH_WIDTH` (6144) neurons or more, wider than any trained model the
quality benchmark has. This script lowers the threshold so that every group of a
trained benchmark model is sketched, then compresses it with
``merge_search="certified"`` and ``"top_k"`` to each
density and reports accuracy on the selection split (data-free runs; LeNet-300-100
through `calibrate`, as in `quality.py`; no stream readers' correction, so that the
searches are compared alone).

Run: .venv/bin/python benchmarks/sketch_search.py [--model lenet300] [--width 64]
[--searches certified top_k] [--candidates auto 16 32] [--unoriented]
[--refine-batch 8]
"""

import argparse
import time

import keras
import numpy as np

import hope_keras
from hope_keras.scoring import cache

from _common import add_quick, compress
from quality import load_splits


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="lenet300", choices=("lenet300", "vgg8", "demo"))
    p.add_argument("--width", type=int, default=64,
                   help="groups of this many neurons or more are sketched")
    p.add_argument("--searches", nargs="*", default=["certified", "top_k"])
    p.add_argument("--candidates", nargs="*", type=lambda v: v if v == "auto" else int(v),
                   default=["auto"],
                   help="merge_candidates for each search: 'auto' (the library's "
                        "default; sketched groups get 16 partners per row) or partners "
                        "per row")
    p.add_argument("--densities", nargs="*", type=float,
                   default=[0.8, 0.6, 0.5, 0.4, 0.3, 0.2])
    p.add_argument("--refine-batch", type=int, default=None,
                   help="pairs re-priced from exact entries per round, every group "
                        "(search.REFINE_BATCH and REFINE_BATCH_WIDE)")
    p.add_argument("--unoriented", action="store_true",
                   help="top-k rows hold partners of any capacity (candidates.ORIENTED off)")
    add_quick(p)  # LeNet-300-100 sketched, one search, one density, 500 images
    args = p.parse_args()
    n_sel = 2000
    if args.quick:
        args.searches, args.densities, n_sel = ["top_k"], [0.8], 500
    if args.refine_batch is not None:
        from hope_keras.search import merge_search as search_lib

        search_lib.REFINE_BATCH = search_lib.REFINE_BATCH_WIDE = args.refine_batch
    if args.unoriented:
        from hope_keras.search import candidates

        candidates.ORIENTED = False
    model0, splits, xc = load_splits(args.model, n_sel, 0)
    if args.model == "lenet300":
        model0 = hope_keras.calibrate(model0, xc)
    x, y = splits["sel"]
    weights = model0.get_weights()
    cache.SKETCH_WIDTH = args.width
    analysis = hope_keras.analyze(model0)
    sketched = [n for n, c in analysis.caches.items() if isinstance(c, cache.SketchCache)]
    print(f"{args.model}: sketched groups {sketched} (SKETCH_WIDTH={args.width}); "
          f"accuracy % on the {len(y)} selection images")
    print("| search | " + " | ".join(f"{d:g}" for d in args.densities) + " | seconds |")
    print("|---" * (len(args.densities) + 2) + "|")
    for search, k in ((s, k) for s in args.searches for k in args.candidates):
        row, t = [], time.perf_counter()
        for d in args.densities:
            model0.set_weights(weights)
            compress(model0, density=d, analysis=analysis, merge_search=search,
                     merge_candidates=k, correct_statistics=False)
            pred = np.argmax(model0.predict(x, batch_size=500, verbose=0), axis=1)
            row.append(100.0 * float(np.mean(pred == y)))
        label = "merge_candidates='auto'" if k == "auto" else f"{k} partners"
        print(f"| {search}, {label} | " + " | ".join(f"{a:.1f}" for a in row)
              + f" | {time.perf_counter() - t:.1f} |", flush=True)
    model0.set_weights(weights)
    keras.backend.clear_session()


if __name__ == "__main__":
    main()
