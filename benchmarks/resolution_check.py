"""The default on the ResNet-50 fixtures trained at other resolutions (a check, not a setting).

`compress(density=d)` with every default (the stream readers' correction included)
on a ResNet-50 fixture (`--model resnet50 | resnet50_64 | resnet50_128`, from
scripts/make_benchmark_fixtures.py), then, as a diagnostic that uses data, the same
compressed model with every BN's statistics re-estimated on the 512 calibration images:
does the selection hold, or the statistics? Accuracy on the selection split (the first
1000 bundled test images) and the held-out split (1000 others).

``--baselines``: instead, the baselines the quality benchmark runs on ResNet-50
(`quality.RESNET_METHODS`: BN-scale global and per layer, L1-joint per layer, Neuron
Merging per layer) at the same densities, data-free and then with every BN
re-estimated the same way: does any selection hold where the default falls?

Run: .venv/bin/python benchmarks/resolution_check.py --model resnet50_128  (~10 min)
Writes benchmarks/results/resolution_check_<model>.json (``--baselines``:
resolution_check_<model>_baselines.json).
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
import quality as Q  # noqa: E402
from _common import add_quick, compress, quick_path  # noqa: E402

import hope_keras  # noqa: E402

DENSITIES = (0.9, 0.8, 0.7, 0.6, 0.5, 0.4)
OUT = os.path.join(os.path.dirname(__file__), "results", "resolution_check_{}.json")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="resnet50_128")
    p.add_argument("--baselines", action="store_true",
                   help="run the ResNet-50 baselines instead of the default")
    add_quick(p)  # the demo CNN, 200 + 200 images, one density
    args = p.parse_args()
    global OUT, DENSITIES
    n = 1000
    if args.quick:
        args.model, n, DENSITIES = "demo", 200, (0.8,)
        OUT = str(quick_path(OUT))
    if args.baselines:
        return baselines(args.model, n)
    b = Q.Bench(args.model, n, n, (0.5,))
    rows = [dict(density=1.0, default=b.ev()[0])]
    for d in DENSITIES:
        b.reset()
        r = compress(b.model, density=d, analysis=b.analysis)
        row = dict(density=d, default=b.ev()[0], params_ratio=round(r.params_ratio, 3),
                   flops_ratio=round(r.flops_ratio, 3),
                   evictions=sum(1 for s in r.trajectory.steps if s.kind == "evict"))
        hope_keras.reestimate_batchnorm_statistics(b.model, b.xc)
        row["bn_reestimated"] = b.ev()[0]
        rows.append(row)
        print(json.dumps(row), flush=True)
    with open(OUT.format(args.model), "w") as f:
        json.dump({"model": args.model, "rows": rows}, f, indent=1)
    print(f"uncompressed: {100 * rows[0]['default']['sel']:.1f} / "
          f"{100 * rows[0]['default']['heldout']:.1f}")
    print("| density | params | FLOPs | evictions | default sel / held-out | "
          "BN re-estimated (uses data) |")
    print("|---|---|---|---|---|---|")
    for r in rows[1:]:
        print(f"| {r['density']} | {r['params_ratio']:.3f} | {r['flops_ratio']:.3f} | "
              f"{r['evictions']} | {100 * r['default']['sel']:.1f} / "
              f"{100 * r['default']['heldout']:.1f} | "
              f"{100 * r['bn_reestimated']['sel']:.1f} / "
              f"{100 * r['bn_reestimated']['heldout']:.1f} |")


def baselines(model_name, n=1000):
    """The quality benchmark's ResNet-50 baselines at `DENSITIES`, data-free and with
    every BN re-estimated on the calibration images (uses data)."""
    names = [m for m in Q.RESNET_METHODS if not m.startswith("hope")]
    b = Q.Bench(model_name, n, n, DENSITIES)
    out = {}
    for name in names:
        for re in (False, True):
            b.reestimate = re
            points, _ = b.run_baseline(name, "density")
            key = name + ("_re" if re else "")
            out[key] = [dict(density=p["target"], acc=p["acc"], params=p["params"],
                             flops=p["flops"]) for p in points]
            print(key, json.dumps([(p["density"], p["acc"]) for p in out[key]]), flush=True)
    b.reestimate = False
    b.reset()
    with open(OUT.format(model_name + "_baselines"), "w") as f:
        json.dump({"model": model_name, "methods": out}, f, indent=1)
    print("| density | " + " | ".join(out) + " |")
    print("|---|" + "---|" * len(out))
    for k, d in enumerate(DENSITIES):
        cells = [f"{100 * out[m][k]['acc']['sel']:.1f} / {100 * out[m][k]['acc']['heldout']:.1f}"
                 for m in out]
        print(f"| {d} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
