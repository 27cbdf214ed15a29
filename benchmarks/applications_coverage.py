"""keras.applications families: coverage, compress + slim exactness, `.keras` round trip.

For each family (``weights=None``, small inputs, 10 classes; BN statistics
re-estimated on 4 random images so that they are not the initial 0/1; VGG16 through
`hope_keras.calibrate`, ConvNeXtTiny too since its LayerNorm has no moving
statistics; logits, `classifier_activation=None`), and the nested transfer-learning model
``Sequential([Input, ResNet50(include_top=False), GlobalAveragePooling2D, Dense])``:

* coverage: compressible channels / hidden output channels of every Conv/Dense
  (`Analysis.coverage()`), groups by kind, residual blocks (evictable), pinned layers;
* `compress(density=0.8)` then `slim`: largest |slim − in place| relative to the
  largest |output|, and whether the slimmed model's parameter count is the one
  `compress` reported;
* the slimmed model saved as `.keras` and reloaded with ``safe_mode=True``: largest
  |reloaded − slimmed|;
* wall time of analyze + compress + slim (shared 2-core machine: see the load).

Run: .venv/bin/python benchmarks/applications_coverage.py [NAME ...] [--quick]
(``--quick``: MobileNet alone.)
"""

import os
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import hope_keras  # noqa: E402
from _common import quick_requested  # noqa: E402

A = keras.applications
FAMILIES = ("ResNet50", "ResNet101", "ResNet152", "ResNet50V2", "DenseNet121",
            "InceptionV3", "Xception", "MobileNet", "MobileNetV2", "MobileNetV3Small",
            "EfficientNetB0", "ConvNeXtTiny", "VGG16", "nested", "EfficientNetV2B0",
            "NASNetMobile", "InceptionResNetV2")
CALIBRATED = ("VGG16", "ConvNeXtTiny")
SIZES = {"InceptionV3": 75, "Xception": 71, "InceptionResNetV2": 75}  # the smallest they take


def build(name):
    if name == "nested":
        backbone = A.ResNet50(weights=None, include_top=False, input_shape=(32, 32, 3))
        return keras.Sequential([keras.Input((32, 32, 3)), backbone,
                                 keras.layers.GlobalAveragePooling2D(),
                                 keras.layers.Dense(10)])
    size = SIZES.get(name, 32)
    # Logits, not softmax: a random deep network's softmax saturates to exact 0/1,
    # which would hide any slim-vs-in-place difference.
    kw = dict(weights=None, input_shape=(size, size, 3), classes=10,
              classifier_activation=None)
    if name.startswith(("MobileNetV3", "ConvNeXt", "EfficientNetV2")):
        kw["include_preprocessing"] = False
    return getattr(A, name)(**kw)


def main(names):
    rng = np.random.default_rng(0)
    rows = []
    for name in names:
        keras.utils.set_random_seed(0)
        m = build(name)
        shape = tuple(m.inputs[0].shape[1:])
        x = rng.uniform(0, 1, (4,) + shape).astype("float32")
        if name in CALIBRATED:
            m = hope_keras.calibrate(m, rng.uniform(0, 1, (16,) + shape).astype("float32"))
        else:
            hope_keras.reestimate_batchnorm_statistics(m, x, batch_size=4)
        t0 = time.perf_counter()
        a = hope_keras.analyze(m)
        kinds = {}
        for g in a.groups:
            kinds[g.kind] = kinds.get(g.kind, 0) + 1
        r = hope_keras.compress(m, density=0.8, verbose=False)
        y1 = m.predict(x, verbose=0)
        s = hope_keras.slim(m)
        seconds = time.perf_counter() - t0
        y2 = s.predict(x, verbose=0)
        rel = float(np.abs(y2 - y1).max() / (np.abs(y1).max() + 1e-12))
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "slim.keras")
            s.save(path)
            back = keras.models.load_model(path, safe_mode=True)
            reload = float(np.abs(back.predict(x, verbose=0) - y2).max())
        count_ok = abs(s.count_params() - r.params_ratio * m.count_params()) < 0.5
        row = dict(name=name, coverage=a.coverage(), kinds=kinds, blocks=len(a.blocks),
                   evictable=sum(b.evictable for b in a.blocks), pinned=len(a.pinned),
                   steps=len(r.trajectory), params=r.params_ratio, flops=r.flops_ratio,
                   rel=rel, reload=reload, count_ok=count_ok, seconds=seconds,
                   load=os.getloadavg()[0])
        rows.append(row)
        print(row, flush=True)
        del m, s
        keras.backend.clear_session()
    print("\n| model | input | coverage | groups (neurons / coupled) | blocks (evictable) "
          "| pinned | params / FLOPs at density 0.8 | slim vs in place (rel.) "
          "| count exact | reload | s (load) |")
    print("|---|---|---:|---|---|---:|---|---:|---|---:|---:|")
    for r in rows:
        size = SIZES.get(r["name"], 32)
        print(f"| {r['name']} | {size}×{size} | {100 * r['coverage']:.1f}% "
              f"| {r['kinds'].get('neurons', 0)} / {r['kinds'].get('coupled', 0)} "
              f"| {r['blocks']} ({r['evictable']}) | {r['pinned']} "
              f"| {r['params']:.3f} / {r['flops']:.3f} | {r['rel']:.1e} "
              f"| {'yes' if r['count_ok'] else 'NO'} "
              f"| {r['reload']:.0e} | {r['seconds']:.0f} ({r['load']:.0f}) |")


if __name__ == "__main__":
    if quick_requested():
        main(["MobileNet"])
    else:
        main(sys.argv[1:] or FAMILIES)
