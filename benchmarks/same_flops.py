"""The default against another method at the FLOPs ratio that method reached.

A FLOPs budget is met from below, and a method may stop further below it than the
default does: ``round_to=8`` removes channels in rounds of eight, so on a model with
layers of 32 and 64 channels its run to ``flops=0.8`` can stop at 0.775 where the
default stops at 0.798. Compared at the same *target*, the two then differ in size as
well as in method. This script compares them at the same *ratio*: for each point the
method reached on the quality benchmark's FLOPs axis (its stored results), the
default's trajectory replayed to that ratio (``Trajectory.step_for(flops=r + tol)``:
the last step at or below it, as ``compress(flops=r)`` stops; ``tol``, 0.001 by
default, so that a ratio both reached is not missed by rounding), evaluated on the
same selection and held-out images. The uncompressed accuracy is checked against the
stored one first (the same fixture and splits, or a clear error).

Run (repository root)::

    .venv/bin/python benchmarks/same_flops.py --model demo
    .venv/bin/python benchmarks/same_flops.py --model resnet50 \
        --file benchmarks/results/quality_resnet50_round8.json

``--method`` (default ``hope_round8``), ``--targets`` (default 0.8 0.6 0.4),
``--tolerance`` (default 0.001).
Writes ``benchmarks/results/same_flops_<model>_<method>.json`` and prints a markdown
table. ``--quick``: the demo CNN at one target, 200 + 200 images, written under the
quick folder.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))
import quality as Q  # noqa: E402
from _common import add_quick, quick_path  # noqa: E402


def compare(model, stored, method, targets, n=None, tolerance=1e-3):
    """Rows ``{target, method: {flops, acc}, default: {flops, acc}}``: the default's
    trajectory replayed to each FLOPs ratio `method` reached at `targets` (plus
    `tolerance`)."""
    info = stored["info"]
    points = [p for p in stored["results"][method]["flops"]
              if any(abs(p["target"] - t) < 1e-9 for t in targets)]
    if not points:
        raise SystemExit(f"{method!r} has no stored FLOPs point at {targets}")
    n_sel, n_heldout = n or (info["n"]["sel"], info["n"]["heldout"])
    bench = Q.Bench(model, n_sel, n_heldout, Q.DENSITIES)
    if n is None and any(abs(bench.info["accuracy"][s] - info["accuracy"][s]) > 1e-9
                         for s in Q.SPLITS):
        raise SystemExit(f"the {model} model scores {bench.info['accuracy']} uncompressed, "
                         f"the stored results {info['accuracy']}: another fixture or "
                         "other splits; run the quality benchmark again first")
    ratios = [p["flops"] + tolerance for p in points]
    bench.targets = lambda axis: ratios
    default, _ = bench.run_hope("hope", "flops")
    at = {round(p["target"], 12): p for p in default}
    rows = []
    for p in points:
        d = at.get(round(p["flops"] + tolerance, 12))
        if d is None:  # the default has no step at or below this ratio
            continue
        rows.append({"target": p["target"],
                     method: {"flops": p["flops"], "acc": p["acc"]},
                     "default": {"flops": d["flops"], "acc": d["acc"]}})
    return rows


def markdown(model, method, rows) -> str:
    out = [f"| {model}: FLOPs target | {method}: FLOPs reached | {method} | default at that "
           "ratio: FLOPs | default | difference |",
           "|---|---|---|---|---|---|"]
    for r in rows:
        m, d = r[method], r["default"]
        diff = {s: 100 * (m["acc"][s] - d["acc"][s]) for s in Q.SPLITS}
        out.append(f"| {r['target']:g} | {m['flops']:.3f} | "
                   f"{100 * m['acc']['sel']:.1f} / {100 * m['acc']['heldout']:.1f} | "
                   f"{d['flops']:.3f} | "
                   f"{100 * d['acc']['sel']:.1f} / {100 * d['acc']['heldout']:.1f} | "
                   f"{diff['sel']:+.1f} / {diff['heldout']:+.1f} |")
    return "\n".join(out)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=Q.MODELS)
    p.add_argument("--method", default="hope_round8")
    p.add_argument("--file", help="stored quality results (default: "
                   "benchmarks/results/quality_<model>.json)")
    p.add_argument("--targets", nargs="+", type=float, default=[0.8, 0.6, 0.4])
    p.add_argument("--tolerance", type=float, default=1e-3,
                   help="the default is replayed to the method's ratio plus this")
    add_quick(p)
    args = p.parse_args(argv)
    if args.quick:
        args.model, args.targets = "demo", [0.8]
    if args.model is None:
        p.error("--model is required (or --quick)")
    path = Path(args.file) if args.file else Q.RESULTS / f"quality_{args.model}.json"
    with open(path) as f:
        stored = json.load(f)
    rows = compare(args.model, stored, args.method, args.targets,
                   n=(200, 200) if args.quick else None, tolerance=args.tolerance)
    print(markdown(args.model, args.method, rows), flush=True)
    out = Q.RESULTS / f"same_flops_{args.model}_{args.method}.json"
    if args.quick:
        out = quick_path(out)
    with open(out, "w") as f:
        json.dump({"model": args.model, "method": args.method, "stored": str(path.name),
                   "tolerance": args.tolerance, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
