"""`make demo`: HOPE on the bundled Fashion-MNIST CNN, data-free, no fine-tuning.

Analyses the model, compresses it once to the lowest density with the greedy
encoder and the library's defaults, replays the trajectory to each density, slims
the result (checking it matches the in-place model) and prints test accuracy,
parameters, FLOPs and wall time. Variants (the paper's cost, baselines) are in
benchmarks/quality.py.
"""

import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402

import hope_keras  # noqa: E402
from hope_keras.data import load_demo_data, load_demo_model  # noqa: E402

DENSITIES = (0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3)


def accuracy(model, x, y):
    return float(np.mean(np.argmax(model.predict(x, batch_size=500, verbose=0), 1) == y))


def main():
    data = load_demo_data()
    x, y = data.x_test, data.y_test
    original = load_demo_model()
    hope_keras.analyze(original).summary()
    base_acc, base_params = accuracy(original, x, y), original.count_params()
    print()

    t0 = time.perf_counter()
    result = hope_keras.compress(load_demo_model(), density=min(DENSITIES), verbose=False)
    trajectory = result.trajectory
    kinds = {k: sum(s.kind == k for s in trajectory.steps) for k in ("prune", "merge", "evict")}
    print(f"Greedy run to density {min(DENSITIES)}: {len(trajectory)} steps {kinds}, "
          f"{time.perf_counter() - t0:.1f} s (analysis included)")

    print(f"\n{'density':>8} {'accuracy':>9} {'params':>8} {'params':>7} {'FLOPs':>7}")
    print(f"{'':>8} {'':>9} {'':>8} {'ratio':>7} {'ratio':>7}")
    print(f"{1.0:>8.2f} {base_acc:>9.4f} {base_params:>8d} {1.0:>7.3f} {1.0:>7.3f}")
    for density in DENSITIES:
        k = trajectory.step_for(density=density)
        model = trajectory.replay(load_demo_model(), step=k)
        small = hope_keras.slim(model)
        assert np.allclose(small.predict(x[:64], verbose=0),
                           model.predict(x[:64], verbose=0), atol=1e-4)
        flops = trajectory.steps[k - 1].flops_after
        print(f"{density:>8.2f} {accuracy(small, x, y):>9.4f} {small.count_params():>8d} "
              f"{small.count_params() / base_params:>7.3f} {flops:>7.3f}")
    print(f"\nTest accuracy on the bundled {len(y)}-image Fashion-MNIST test subset; "
          "no data was used to compress, no fine-tuning.")


if __name__ == "__main__":
    main()
