"""Issue 2 benchmark: `hope_keras.analyze` on ResNet50(weights=None) at 224×224.

Target: under 20 s and under 3 GB on 2 CPU cores.
Run: .venv/bin/python benchmarks/analyze_resnet50.py [--quick]
"""

import argparse
import time

from _common import QUICK_RESNET_SIZE, add_quick, calibrated_resnet50, peak_rss_gb

import hope_keras


def main():
    ap = add_quick(argparse.ArgumentParser(description=__doc__.split("\n")[0]))
    args = ap.parse_args()
    model = calibrated_resnet50(size=QUICK_RESNET_SIZE if args.quick else 224)
    before = peak_rss_gb()
    times = []
    for _ in range(1 if args.quick else 3):
        t = time.perf_counter()
        analysis = hope_keras.analyze(model)
        times.append(time.perf_counter() - t)
    print(f"groups={len(analysis.groups)} neurons={analysis.num_neurons} "
          f"blocks={len(analysis.blocks)}")
    print(f"analyze wall time: best {min(times):.2f} s, all {[round(x, 2) for x in times]}")
    print(f"peak RSS of the process: {peak_rss_gb():.2f} GB "
          f"(before analyze: {before:.2f} GB, model + TensorFlow)")


if __name__ == "__main__":
    main()
