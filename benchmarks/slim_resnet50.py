"""Issue 3 benchmark: slimmed ResNet50 at densities 0.9 … 0.3 — parameters, FLOPs and
measured inference latency (batch 8, 224×224, CPU) relative to the original.

One greedy run to density 0.3, replayed to each density.
Run: .venv/bin/python benchmarks/slim_resnet50.py
"""

import keras
import numpy as np
from _common import calibrated_resnet50, flops, latency

import hope_keras


def main():
    model = calibrated_resnet50()
    weights = model.get_weights()
    work = keras.models.clone_model(model)
    work.set_weights(weights)
    result = hope_keras.compress(work, density=0.3, verbose=False)
    x = np.random.default_rng(0).uniform(0, 255, (8, 224, 224, 3)).astype("float32")
    p0, f0, l0 = model.count_params(), flops(model), latency(model, x)
    print(f"original: {p0} params, {f0 / 1e9:.2f} GFLOPs/image, {l0 * 1e3:.0f} ms/batch of 8")
    print(f"{'density':>8} {'params':>8} {'FLOPs':>8} {'latency':>8}")
    for density in (0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3):
        m = keras.models.clone_model(model)
        m.set_weights(weights)
        result.trajectory.replay(m, density=density)
        small = hope_keras.slim(m)
        print(f"{density:>8.1f} {small.count_params() / p0:>8.3f} {flops(small) / f0:>8.3f} "
              f"{latency(small, x) / l0:>8.3f}")


if __name__ == "__main__":
    main()
