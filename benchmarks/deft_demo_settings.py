#!/usr/bin/env python
"""Source accuracy right after ``plan.apply`` on the bundled demo model (Fashion-MNIST
CNN), for both DEFT thresholds × the three shock reductions at one percentile.

No fine-tuning: this is the cheap check docs/deft.md recommends before choosing
``threshold``. Run from the repository root::

    .venv/bin/python benchmarks/deft_demo_settings.py [--percentile 10] [--n 1000] [--quick]
"""

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

from _common import add_quick  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--percentile", type=float, default=10.0)
    ap.add_argument("--n", type=int, default=1000, help="test images evaluated")
    add_quick(ap)  # 100 test images, the global threshold × one shock reduction
    args = ap.parse_args(argv)
    thresholds, compensations = ("global", "layer"), ("none", "mean", "mean_var")
    if args.quick:
        args.n, thresholds, compensations = 100, ("global",), ("mean_var",)

    import keras

    from hope_keras import deft
    from hope_keras.data import load_demo_data, load_demo_model

    source = load_demo_model()
    data = load_demo_data()
    x, y = data.x_test[:args.n], data.y_test[:args.n]
    print(f"source accuracy {deft.accuracy(source, x, y):.3f} on {len(x)} test images")
    print("| threshold | compensate | elastic | head inputs cut | after apply |")
    print("|---|---|---|---|---|")
    for threshold in thresholds:
        plan = deft.plan(source, percentile=args.percentile, threshold=threshold)
        cut = int((plan.head_input_drift > 0).sum())
        for compensate in compensations:
            model = keras.models.clone_model(source)
            model.set_weights(source.get_weights())
            plan.apply(model, compensate=compensate)
            acc = deft.SourceRetention(model, plan=plan,
                                       compensate=compensate).evaluate(model, x, y)
            print(f"| {threshold} | {compensate} | {100 * plan.elastic_fraction():.1f}% | "
                  f"{cut}/{len(plan.head_input_drift)} | {100 * acc:.1f} |")


if __name__ == "__main__":
    main()
