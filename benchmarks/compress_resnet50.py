"""Issue 3 benchmark: whole HOPE compression of ResNet50 (224×224) to density 0.5.

Cache build included; target under 60 s (stretch under 15 s) on 2 CPU cores. Runs on
the GPU when TensorFlow sees one (plain device placement).
Run: .venv/bin/python benchmarks/compress_resnet50.py [--quick]
"""

import argparse
import collections
import time

import tensorflow as tf
from _common import QUICK_RESNET_SIZE, add_quick, calibrated_resnet50, compress, peak_rss_gb

import hope_keras


def main():
    ap = add_quick(argparse.ArgumentParser(description=__doc__.split("\n")[0]))
    args = ap.parse_args()
    print("devices:", [d.device_type for d in tf.config.list_logical_devices()])
    model = calibrated_resnet50(size=QUICK_RESNET_SIZE if args.quick else 224)
    density = 0.98 if args.quick else 0.5
    before = peak_rss_gb()
    t = time.perf_counter()
    analysis = hope_keras.analyze(model)
    t_cache = time.perf_counter() - t
    result = compress(model, density=density, analysis=analysis)
    total = time.perf_counter() - t
    steps = len(result.trajectory)
    kinds = collections.Counter(s.kind for s in result.trajectory.steps)
    print(f"density {result.density:.4f}, params ratio {result.params_ratio:.4f}, "
          f"{steps} steps {dict(kinds)}")
    print(f"wall time {total:.2f} s (analyze/cache {t_cache:.2f} s, greedy scan + edits "
          f"{total - t_cache:.2f} s, {1e3 * (total - t_cache) / steps:.2f} ms/step)")
    print(f"peak RSS {peak_rss_gb():.2f} GB (before: {before:.2f} GB)")


if __name__ == "__main__":
    main()
