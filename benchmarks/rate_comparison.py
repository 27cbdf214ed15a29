"""The distortion rate under a density budget: the spec's J / P_init against
distortion per neuron, on the bundled demo CNN, on the 2000 test images and on the
512 training images (`x_calib`, a split the change was not chosen on).

Run: .venv/bin/python benchmarks/rate_comparison.py
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402

import hope_keras  # noqa: E402
from hope_keras.data import load_demo_data, load_demo_model  # noqa: E402

DENSITIES = (0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3)


def main():
    d = load_demo_data()
    splits = {"test (2000)": (d.x_test, d.y_test), "train x_calib (512)": (d.x_calib, d.y_calib)}
    runs = {rate: hope_keras.compress(load_demo_model(), density=min(DENSITIES), rate=rate,
                                      verbose=False).trajectory
            for rate in ("params", "neurons")}
    print("| split | rate | " + " | ".join(str(x) for x in DENSITIES) + " |")
    print("| --- | --- |" + " ---: |" * len(DENSITIES))
    for split, (x, y) in splits.items():
        for rate, trajectory in runs.items():
            accs = []
            for density in DENSITIES:
                m = trajectory.replay(load_demo_model(), density=density)
                accs.append(np.mean(np.argmax(m.predict(x, batch_size=500, verbose=0), 1) == y))
            print(f"| {split} | `{rate}` | " + " | ".join(f"{a:.3f}" for a in accs) + " |")


if __name__ == "__main__":
    main()
