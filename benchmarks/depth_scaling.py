"""analyze + compress time against model size: ResNet50, ResNet101, ResNet152 at 224×224.

The target: the time grows about linearly in model size (ResNet152 ≤ 3.5 ×
ResNet50). Each model is `weights=None` with non-trivial BN statistics (one
calibration pass on random images, random γ/β, as `_common.calibrated_resnet50`), then
timed: `analyze`, and `compress(density=0.5)` (which re-analyzes; its time includes
that). Best of ``--repeats`` runs of each, since the machine may be shared; the load
average is printed beside the times.

Run: .venv/bin/python benchmarks/depth_scaling.py [--repeats 2] [--density 0.5] [--quick]
"""

import argparse
import os
import time

import keras
from _common import QUICK_RESNET_SIZE, add_quick, calibrated_resnet50, peak_rss_gb

import hope_keras


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--density", type=float, default=0.5)
    add_quick(ap)
    args = ap.parse_args()
    names, size = ("ResNet50", "ResNet101", "ResNet152"), 224
    if args.quick:
        names, size, args.repeats, args.density = ("ResNet50",), QUICK_RESNET_SIZE, 1, 0.98
    rows = []
    for name in names:
        model = calibrated_resnet50(builder=getattr(keras.applications, name), size=size)
        weights = model.get_weights()
        t_an, t_co = [], []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            analysis = hope_keras.analyze(model)
            t_an.append(time.perf_counter() - t0)
            model.set_weights(weights)
            t0 = time.perf_counter()
            result = hope_keras.compress(model, density=args.density, verbose=False)
            t_co.append(time.perf_counter() - t0)
            model.set_weights(weights)
        neurons = sum(g.size for g in analysis.graph.groups.values())
        rows.append((name, model.count_params(), neurons, len(result.trajectory),
                     min(t_an), min(t_co)))
        print(f"{name}: params {model.count_params()}, neurons {neurons}, "
              f"steps {len(result.trajectory)}, analyze {min(t_an):.2f} s, "
              f"compress {min(t_co):.2f} s, load {os.getloadavg()[0]:.1f}", flush=True)
        del model
        keras.backend.clear_session()
    base = rows[0]
    print("\n| model | params | neurons | steps | analyze s | compress s "
          "| analyze+compress / ResNet50 | params / ResNet50 |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        total = (r[4] + r[5]) / (base[4] + base[5])
        print(f"| {r[0]} | {r[1]} | {r[2]} | {r[3]} | {r[4]:.2f} | {r[5]:.2f} "
              f"| {total:.2f} | {r[1] / base[1]:.2f} |")
    print(f"\npeak RSS {peak_rss_gb():.1f} GB; load average {os.getloadavg()}")


if __name__ == "__main__":
    main()
