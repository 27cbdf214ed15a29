"""Greedy step time against the number of layers (should be flat).

The same conv net (width 128, 3×3 convs, BN, ReLU) at several depths; times the
greedy steps only (cache built before timing).
Run: .venv/bin/python benchmarks/step_time_vs_depth.py [--quick]
"""

import argparse
import time

import keras
import numpy as np

import hope_keras
from _common import add_quick

L = keras.layers


def net(depth, width=128):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((16, 16, 3))
    x = inputs
    for _ in range(depth):
        x = L.ReLU()(L.BatchNormalization()(L.Conv2D(width, 3, padding="same")(x)))
    x = L.GlobalAveragePooling2D()(x)
    model = keras.Model(inputs, L.Dense(10)(x))
    rng = np.random.default_rng(0)
    for layer in model.layers:
        if isinstance(layer, L.BatchNormalization):
            layer.gamma.assign(rng.uniform(0.3, 1.5, width).astype("float32"))
            layer.beta.assign(rng.normal(0, 0.5, width).astype("float32"))
    return model


def main(steps=300):
    args = add_quick(argparse.ArgumentParser(description=__doc__.split("\n")[0])).parse_args()
    depths, width = (4, 8, 16, 32, 64), 128
    if args.quick:
        depths, width, steps = (4,), 16, 20
    print(f"{'layers':>7} {'cache s':>8} {'ms/step':>8}")
    for depth in depths:
        model = net(depth, width)
        t = time.perf_counter()
        enc = hope_keras.Encoder(model)
        t_cache = time.perf_counter() - t
        t = time.perf_counter()
        for _ in range(steps):
            enc.execute(enc.next_action())
        per_step = (time.perf_counter() - t) / steps
        print(f"{depth:>7} {t_cache:>8.2f} {1e3 * per_step:>8.2f}")


if __name__ == "__main__":
    main()
