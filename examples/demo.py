"""`make demo`: HOPE on the bundled Fashion-MNIST CNN, data-free, no fine-tuning.

Analyses the model, compresses it once to the lowest density with the greedy
encoder, then replays the trajectory to each density, slims the result and
prints test accuracy, parameters and wall time.
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

    work = load_demo_model()
    t0 = time.perf_counter()
    result = hope_keras.compress(work, density=min(DENSITIES), verbose=True)
    seconds = time.perf_counter() - t0
    kinds = {k: sum(s.kind == k for s in result.trajectory.steps)
             for k in ("prune", "merge", "evict")}
    print(f"\nGreedy run to density {min(DENSITIES)}: {len(result.trajectory)} steps "
          f"({kinds}) in {seconds:.1f} s, cache build included.\n")

    print(f"{'density':>8} {'accuracy':>9} {'slim acc.':>10} {'params':>9} "
          f"{'ratio':>7}")
    print(f"{1.0:>8.2f} {base_acc:>9.4f} {base_acc:>10.4f} {base_params:>9d} {1.0:>7.3f}")
    for density in DENSITIES:
        model = result.trajectory.replay(load_demo_model(), density=density)
        small = hope_keras.slim(model)
        acc, slim_acc = accuracy(model, x, y), accuracy(small, x, y)
        print(f"{density:>8.2f} {acc:>9.4f} {slim_acc:>10.4f} {small.count_params():>9d} "
              f"{small.count_params() / base_params:>7.3f}")
    print(f"\nTest accuracy on the bundled {len(y)}-image Fashion-MNIST test subset; "
          "no data was used to compress, no fine-tuning.")


if __name__ == "__main__":
    main()
