"""Below density 0.5 on ResNet-50: do the late evictions cost the accuracy?

The default (`compress(density=d)`, every default, the stream readers' correction
included) against the same run with its evictions stopped at density
`--evictions-until` (default 0.5): the encoder runs to it as usual, then continues with prunes and
merges only (`Encoder.next_action(max_removed=0)` skips every eviction), and the BN
statistics are corrected as `compress` does. Both start from the same steps, so the
difference is what the evictions after that density (and the prunes and merges they
replace) do. A diagnostic, not a setting of the library: accuracy on the selection
split (the first 1000 bundled test images) and the held-out split (1000 others).

``--densities d ...``: other densities than 0.5 … 0.3 (written to
eviction_diagnostic_<model>_stop<stop>_<first>-<last>.json). ``--fixture PATH``:
another saved build of the ResNet-50 fixture (the file named after it). ``--reestimate``: also
each compressed model with every BN re-estimated on the 512 calibration images (uses
data), which separates the selection from the statistics.

Run: .venv/bin/python benchmarks/eviction_diagnostic.py [--model resnet50]
[--evictions-until 0.5]
(~3 min for ResNet-50 on 2 cores). Writes
benchmarks/results/eviction_diagnostic_<model>_stop<stop>.json.
"""

import argparse
import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
import quality as Q  # noqa: E402
from _common import add_quick, quick_path  # noqa: E402

import hope_keras  # noqa: E402

DENSITIES = (0.5, 0.45, 0.4, 0.35, 0.3)
OUT = os.path.join(os.path.dirname(__file__), "results", "eviction_diagnostic_{}_stop{}.json")


def compressed(b, density, stop=None):
    """`compress(density=density)` on the bench's model, its evictions stopped at
    density `stop` (None: not stopped). Returns (accuracy, the evicted blocks in the
    order of the run, params ratio, FLOPs ratio)."""
    a = b.analysis
    b.reset()
    enc = hope_keras.Encoder(b.model, analysis=a, verbose=False)  # corrects as compress
    if stop is None or stop <= density:
        enc.run(density=density, verbose=False)
    else:
        enc.run(density=stop, verbose=False)
        target = math.floor(density * enc.num_neurons + 1e-9)
        while enc.active > target:
            action = enc.next_action(max_removed=0)  # prunes and merges only
            if action is None:
                break
            enc.execute(action)
        enc.run(steps=len(enc.trajectory), verbose=False)  # edits written back, corrected
    order = [s.unit for s in enc.trajectory.steps if s.kind == "evict"]
    return (b.ev()[0], order, round(enc.sizes.params_ratio, 3),
            round(enc.sizes.flops_ratio, 3))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="resnet50")
    p.add_argument("--evictions-until", dest="stop", type=float, default=0.5,
                   help="density below which the second run evicts no block")
    p.add_argument("--densities", nargs="+", type=float, default=None)
    p.add_argument("--reestimate", action="store_true",
                   help="also re-estimate every BN on the calibration images (uses data)")
    p.add_argument("--fixture", help="this saved model instead of the ResNet-50 fixture "
                   "(another build of its recipe; the results file named after it)")
    add_quick(p)  # the demo CNN, 200 + 200 images, density 0.45 with evictions stopped at 0.5
    args = p.parse_args()
    n = 1000
    if args.quick:
        args.model, args.stop, args.densities, args.reestimate, n = "demo", 0.5, [0.45], True, 200
    if args.fixture:
        from pathlib import Path

        Q.model_path = lambda name: Path(args.fixture)
    b = Q.Bench(args.model, n, n, (0.5,))
    rows = []
    for d in args.densities or DENSITIES:
        for label, stop in (("default", None), (f"evictions stop at {args.stop}", args.stop)):
            acc, ev, pr, fr = compressed(b, d, stop)
            rows.append(dict(density=d, variant=label, acc=acc, evictions=len(ev),
                             evicted=ev, params_ratio=pr, flops_ratio=fr))
            if args.reestimate:
                hope_keras.reestimate_batchnorm_statistics(b.model, b.xc)
                rows[-1]["bn_reestimated"] = b.ev()[0]
            print(json.dumps(rows[-1]), flush=True)
    out = OUT.format(args.model, args.stop)
    if args.densities:
        out = out.replace(".json", f"_{args.densities[0]}-{args.densities[-1]}.json")
    if args.fixture:
        out = out.replace(".json", f"_{os.path.splitext(os.path.basename(args.fixture))[0]}.json")
    if args.quick:
        out = str(quick_path(out))
    with open(out, "w") as f:
        json.dump({"model": args.model, "stop": args.stop, "rows": rows}, f, indent=1)
    re = " BN re-estimated (uses data) |" if args.reestimate else ""
    print("| density | variant | evictions | params | FLOPs | sel / held-out |" + re)
    print("|---|---|---|---|---|---|" + ("---|" if re else ""))
    for r in rows:
        cell = (f" {100 * r['bn_reestimated']['sel']:.1f} / "
                f"{100 * r['bn_reestimated']['heldout']:.1f} |" if re else "")
        print(f"| {r['density']} | {r['variant']} | {r['evictions']} | "
              f"{r['params_ratio']:.3f} | {r['flops_ratio']:.3f} | "
              f"{100 * r['acc']['sel']:.1f} / {100 * r['acc']['heldout']:.1f} |" + cell)
    last = rows[-2]  # the default at the lowest density
    print("the default's evictions, in order:", ", ".join(last["evicted"]))


if __name__ == "__main__":
    main()
