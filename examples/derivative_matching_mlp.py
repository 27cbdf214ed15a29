"""Derivative matching: compress a wide GELU MLP to a width that does not depend on
its original width, data-free.

    .venv/bin/python examples/derivative_matching_mlp.py --width 1024 --order 8
"""

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402

from hope_keras import derivative_matching as dm  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--order", type=int, default=8)
    parser.add_argument("--radius", type=float, default=1.0)
    args = parser.parse_args()
    keras.utils.set_random_seed(0)
    teacher = keras.Sequential([keras.Input((2,))]
                               + [keras.layers.Dense(args.width, activation="gelu")
                                  for _ in range(3)]
                               + [keras.layers.Dense(2)])
    student, report = dm.compress_mlp(teacher, order=args.order, radius=args.radius)
    print(report)
    print(f"parameters: {teacher.count_params():,} -> {student.count_params():,}")
    for r in (0.5 * args.radius, args.radius, 2 * args.radius):
        print(f"sup error on the ball of radius {r}: "
              f"{dm.sup_error(teacher, student, radius=r, samples=20000):.3g}")


if __name__ == "__main__":
    main()
