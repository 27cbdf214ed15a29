"""`make demo`: HOPE on the bundled Fashion-MNIST CNN, data-free, no fine-tuning.

Analyses the model, compresses it once to the lowest density with the greedy
encoder (with the spec's distortion rate and with the per-neuron rate), replays
each trajectory to each density, slims the result (checking it matches the
in-place model) and prints test accuracy, parameters and wall time.
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

    # The spec's distortion rate (default) and the per-neuron rate: neither wins on
    # every model (docs/hope.md, "Known limits").
    runs = {}
    for rate in ("params", "neurons"):
        t0 = time.perf_counter()
        result = hope_keras.compress(load_demo_model(), density=min(DENSITIES),
                                     rate=rate, verbose=False)
        kinds = {k: sum(s.kind == k for s in result.trajectory.steps)
                 for k in ("prune", "merge", "evict")}
        print(f"rate={rate!r}: greedy run to density {min(DENSITIES)}, "
              f"{len(result.trajectory)} steps {kinds}, {time.perf_counter() - t0:.1f} s")
        runs[rate] = result.trajectory

    print(f"\n{'':>8} {'rate=params (default)':>30} {'rate=neurons':>30}")
    print(f"{'density':>8} " + f"{'accuracy':>10} {'params':>9} {'ratio':>9} " * 2)
    row = f"{base_acc:>10.4f} {base_params:>9d} {1.0:>9.3f} "
    print(f"{1.0:>8.2f} " + row * 2)
    for density in DENSITIES:
        cells = []
        for rate, trajectory in runs.items():
            model = trajectory.replay(load_demo_model(), density=density)
            small = hope_keras.slim(model)
            assert np.allclose(small.predict(x[:64], verbose=0),
                               model.predict(x[:64], verbose=0), atol=1e-4)
            cells.append(f"{accuracy(small, x, y):>10.4f} {small.count_params():>9d} "
                         f"{small.count_params() / base_params:>9.3f} ")
        print(f"{density:>8.2f} " + "".join(cells))
    print(f"\nTest accuracy on the bundled {len(y)}-image Fashion-MNIST test subset; "
          "no data was used to compress, no fine-tuning.")


if __name__ == "__main__":
    main()
