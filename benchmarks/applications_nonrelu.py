#!/usr/bin/env python
"""keras.applications networks beyond ReLU: analyze time, coverage and exactness.

1. ``analyze(EfficientNetB0 @ 224×224)`` wall time (target < 10 s on the 2 cores of
   the development machine), best of ``--repeats``.
2. Coverage and exactness of MobileNet, MobileNetV2, MobileNetV3Small, EfficientNetB0
   and ConvNeXtTiny (``weights=None``, ``--size`` input, 10 classes), prepared as in
   ``tests/test_applications.py`` (BN statistics from a pass over 4 uniform random
   images): groups by kind, share of hidden channels compressible
   (``Analysis.coverage()``), ``compress(density=0.8)`` + ``slim`` against the
   in-place model (max |difference| of the softmax outputs on those 4 images), the
   slim model's parameter count against the engine's ``params_ratio``, and the slim
   model saved as ``.keras`` and reloaded in safe mode (max |difference| to the slim
   model). ConvNeXtTiny (LayerNormalization, no BN before its GELUs) runs twice: as
   built, and through ``hope_keras.calibrate`` on the same 4 images (identity BNs with
   the measured pre-activation statistics before each GELU), row "ConvNeXtTiny
   (calibrate)".

Usage (repository root)::

    nice -n 10 .venv/bin/python benchmarks/applications_nonrelu.py [--size 32] [--repeats 3]
        [--quick]   # EfficientNetB0 timed at 32×32 once; the table's MobileNetV3Small row
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import numpy as np  # noqa: E402
from _common import add_quick, compress  # noqa: E402

FAMILIES = ("MobileNet", "MobileNetV2", "MobileNetV3Small", "EfficientNetB0", "ConvNeXtTiny")


def build(name, size):
    import keras

    kw = {"include_preprocessing": False} if name == "MobileNetV3Small" else {}
    return getattr(keras.applications, name)(weights=None, input_shape=(size, size, 3),
                                             classes=10, **kw)


def prepare(model, rng, n=4):
    import hope_keras

    x = rng.uniform(0, 1, (n,) + tuple(model.inputs[0].shape[1:])).astype("float32")
    hope_keras.reestimate_batchnorm_statistics(model, x, batch_size=n)
    return x


def time_efficientnet(repeats, size=224):
    import keras

    import hope_keras

    keras.utils.set_random_seed(0)
    kw = {} if size == 224 else {"input_shape": (size, size, 3)}
    model = keras.applications.EfficientNetB0(weights=None, **kw)  # 1000 classes
    prepare(model, np.random.default_rng(0), n=2)
    load_before = os.getloadavg()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        a = hope_keras.analyze(model)
        times.append(time.perf_counter() - t0)
    kinds = {k: sum(g.kind == k for g in a.groups) for k in ("neurons", "coupled")}
    print(f"EfficientNetB0 @{size}: {len(a.groups)} groups {kinds}, {a.num_neurons} channels, "
          f"coverage {100 * a.coverage():.1f}%; analyze best {min(times):.2f} s, "
          f"all {[round(t, 2) for t in times]} (load average 1/5/15 min before "
          f"{'/'.join(f'{v:.2f}' for v in load_before)}, after "
          f"{'/'.join(f'{v:.2f}' for v in os.getloadavg())}; {os.cpu_count()} CPUs)",
          flush=True)


def coverage_table(size, names=FAMILIES + ("ConvNeXtTiny (calibrate)",)):
    import keras

    import hope_keras

    rows = []
    for name in names:
        keras.utils.set_random_seed(0)
        model = build(name.split(" ")[0], size)
        x = prepare(model, np.random.default_rng(0))
        if name.endswith("(calibrate)"):
            model = hope_keras.calibrate(model, x)
        t0 = time.perf_counter()
        a = hope_keras.analyze(model)
        t_an = time.perf_counter() - t0
        kinds = {k: sum(g.kind == k for g in a.groups) for k in ("neurons", "coupled")}
        res = compress(model, density=0.8, analysis=a)
        small = hope_keras.slim(model)
        y, ys = model.predict(x, verbose=0), small.predict(x, verbose=0)
        diff = float(np.abs(y - ys).max())
        exact = small.count_params() == round(res.params_ratio * model.count_params())
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "small.keras")
            small.save(path)
            reloaded = keras.models.load_model(path, safe_mode=True)
            rt = float(np.abs(reloaded.predict(x, verbose=0) - ys).max())
        rows.append((name, len(a.groups), kinds["neurons"], kinds["coupled"],
                     a.num_neurons, a.graph.hidden_channels, a.coverage(), res.density,
                     res.params_ratio, diff, exact, rt, t_an))
        print(f"{name}: {rows[-1]}", flush=True)
    print(f"\n| model (@{size}×{size}) | groups (neurons / coupled) | compressible / hidden "
          "channels | coverage | density reached | params ratio | max abs(slim − in-place) "
          "| params exact | .keras round-trip max abs | analyze (s) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for (name, ng, nn, nc, n, h, cov, d, pr, diff, exact, rt, t) in rows:
        print(f"| {name} | {ng} ({nn} / {nc}) | {n} / {h} | {100 * cov:.1f}% | {d:.3f} | "
              f"{pr:.3f} | {diff:.1e} | {'yes' if exact else 'NO'} | {rt:.1e} | {t:.2f} |")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--skip-timing", action="store_true")
    add_quick(p)
    args = p.parse_args(argv)
    if args.quick:
        time_efficientnet(1, size=32)
        coverage_table(32, names=("MobileNetV3Small",))
        return
    if not args.skip_timing:
        time_efficientnet(args.repeats)
    coverage_table(args.size)


if __name__ == "__main__":
    main()
