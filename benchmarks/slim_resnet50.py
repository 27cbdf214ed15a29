"""Slimmed ResNet50 at densities 0.9 … 0.3 (or FLOPs ratios 0.9 … 0.4 with
``--flops``) — parameters, FLOPs and measured inference latency (batch 8, 224×224,
CPU) relative to the original.

One greedy run to the lowest budget, replayed to each point. Counts and timings come from
`hope_keras.profile` (FLOPs: 2 × multiply-accumulates of the Dense/Conv layers;
latency: median of interleaved runs of the original and the slimmed model, compiled
direct call, and with ``--tflite`` also the TFLite interpreter).
Run: .venv/bin/python benchmarks/slim_resnet50.py [--flops] [--tflite] [--repeats 5]
     [--groups all] [--points 0.5] [--quick]
"""

import argparse

import keras
import numpy as np
from _common import QUICK_RESNET_SIZE, add_quick, calibrated_resnet50

import hope_keras


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tflite", action="store_true", help="also time TFLite float32")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--flops", action="store_true",
                    help="budget in FLOPs ratios (compress(flops=...)) instead of density")
    ap.add_argument("--groups", default="all", choices=("no_streams", "all"),
                    help="the default cost's scope: 'all' (the default) prices "
                         "residual-stream channels too, 'no_streams' leaves them whole")
    ap.add_argument("--points", type=float, nargs="*",
                    help="budgets to profile (default: 0.9 … 0.4 or 0.3)")
    add_quick(ap)
    args = ap.parse_args()
    size = 224
    if args.quick:  # one point, one timed repeat
        size, args.points, args.repeats = QUICK_RESNET_SIZE, [0.98], 1
    methods = ("call", "tflite") if args.tflite else ("call",)
    model = calibrated_resnet50(size=size)
    weights = model.get_weights()
    work = keras.models.clone_model(model)
    work.set_weights(weights)
    what, points = (("flops", (0.9, 0.8, 0.7, 0.6, 0.5, 0.4)) if args.flops
                     else ("density", (0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3)))
    if args.points:
        points = tuple(args.points)
    cost = hope_keras.costs.HopeCost(groups=args.groups)
    result = hope_keras.compress(work, verbose=False, cost=cost, **{what: min(points)})
    x = np.random.default_rng(0).uniform(0, 255, (8, size, size, 3)).astype("float32")
    print(f"{what:>8} {'params':>8} {'FLOPs':>8} " +
          " ".join(f"{'latency ' + m:>14}" for m in methods))
    for density in points:
        m = keras.models.clone_model(model)
        m.set_weights(weights)
        result.trajectory.replay(m, **{what: density})
        p = hope_keras.profile(hope_keras.slim(m), reference=model, x=x, methods=methods,
                               repeats=args.repeats, warmup=1)
        if density == points[0]:
            ref = p.reference
            print(f"original: {ref.params} params, {ref.flops / 1e9:.2f} GFLOPs/image, "
                  + ", ".join(f"{m_} {1e3 * t:.0f} ms/batch of 8"
                              for m_, t in ref.latency.items()))
        print(f"{density:>8.1f} {p.ratio('params'):>8.3f} {p.ratio('flops'):>8.3f} " +
              " ".join(f"{p.ratio(m_):>14.3f}" for m_ in methods))


if __name__ == "__main__":
    main()
