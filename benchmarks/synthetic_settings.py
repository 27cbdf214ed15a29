"""How the stream readers' correction was chosen: synthetic-input settings on ResNet-50.

`compress(correct_statistics="auto")` measures the BNs that read a residual stream on
synthetic inputs (`hope_keras.synthesize_inputs`). This script compresses the
ResNet-50 fixture (`.cache/resnet50_fmnist.keras`, from
scripts/make_benchmark_fixtures.py) to densities 0.55, 0.5 and 0.45 of every
compressible neuron (the benchmark's densities) with the cost that was the default
when these settings were chosen, `HopeCost(groups="no_streams")` (the 3840 stream
channels whole), and `correct_statistics="surrogate"`, then, for each setting, makes
the synthetic inputs from the uncompressed model and corrects the stream readers of
each compressed model with them (`mode="readers"`, what `compress` does), or
re-estimates every BN's statistics on them outright (`mode="reestimate"`). Accuracy on
the selection split (the first 1000 bundled test images) and the held-out split (1000
other test images); the library's setting was chosen on the selection split.

Run: .venv/bin/python benchmarks/synthetic_settings.py  (~15 min on 2 cores; ``--quick``:
the demo CNN, one density, one setting, seconds)
Writes benchmarks/results/synthetic_settings.json.

``--which-bns`` (uses data; a diagnostic): which BNs' stale statistics cost the
accuracy. The same compressed models (densities 0.6 and 0.5, "surrogate"), then the
moving statistics of one subset of BNs re-estimated on 256 calibration images, the
others kept (three passes, so that each subset sees its own corrected upstream):
every BN; the stream readers (``*_0_bn``, ``*_1_bn``); the BNs inside the branches
(``*_2_bn``, ``*_3_bn``); one stage. Writes
benchmarks/results/synthetic_which_bns.json.

``--which-bns --flops``: the same diagnostic for today's default under a FLOPs budget
(``compress(flops=r)`` with every default, the stream readers' correction included,
at FLOPs ratios 0.5 and 0.4), with every stage as a subset. Writes
benchmarks/results/synthetic_which_bns_flops.json.

``--inputs resnet50`` / ``--inputs resnet50_64`` / ``--inputs resnet50_128``: how many
synthetic inputs a resolution needs (16, 8, 4, 2 inputs, two seeds each; the 64×64 and
128×128 fixtures from ``scripts/make_benchmark_fixtures.py --only resnet50
--resnet-size 64`` / ``128``). Writes
benchmarks/results/synthetic_inputs_<model>.json. Values after the model replace
those varied (``--inputs resnet50 64 32 16``: 64, 32 and 16 inputs; written to
``synthetic_inputs_resnet50_64_32_16.json``); the same for ``--steps`` and ``--size``.
On a fixture of 128 × 128 or more the points are those of ``--coarse``
there (densities 0.7, 0.6, 0.5 and FLOPs 0.5), and ``--seeds N`` past the default
seeds runs seeds 0 … N − 1 (``--inputs resnet50_128 16 8 --seeds 6``).

``--prior resnet50`` / ``resnet50_64`` / ``resnet50_128``: how the inputs are
parameterised (`synthesize_inputs(prior=...)`): ``"spectrum"`` (1/f Fourier
amplitudes) or ``"pixels"`` (16 inputs, two seeds each; density 0.6 added to the
points). Writes benchmarks/results/synthetic_prior_<model>.json.

``--real-reference resnet50_128`` (uses data; a diagnostic): the same readers'
correction measured on 16 or 256 real calibration images instead of the synthetic
inputs, and the readers' statistics re-estimated outright on 256 of them, at
densities 0.6, 0.5 and FLOPs 0.5, 0.4. Writes
benchmarks/results/synthetic_real_reference_<model>.json. ``--relative`` runs instead
an experiment (`relative_correction`, not the library's rule) on the synthetic batch
and on 256 real images; writes ``..._<model>_relative.json``.

``--prior-cost``: what each prior costs at 224 × 224: ``synthesize_inputs`` on
``keras.applications.ResNet50(weights=None)`` (the cost does not depend on the
weights), 16 inputs, 20 steps, the two priors alternated twice; seconds per step
after the first call's tracing. Writes benchmarks/results/synthetic_prior_cost.json.

``--coarse resnet50_128`` / ``--coarse resnet50``: the first 80 of the 100 Adam steps at
half the size (`synthesize_inputs(coarse_steps=80)`, the default at 128 × 128 and
above) against none (``coarse_steps=0``), six seeds each (16 inputs);
points: densities 0.7, 0.6, 0.5 and FLOPs 0.5 at 128 × 128 (where that fixture holds
or falls), the usual ones with density 0.6 at 32 × 32. Writes
benchmarks/results/synthetic_coarse_<model>.json. ``--seeds N``: the first N seeds
(any study).

``--coarse-cost``: what the coarse steps save at 224 × 224: the whole
``synthesize_inputs`` (16 inputs, 100 steps, tracing included) on
``keras.applications.ResNet50(weights=None)``, the default (80 steps at 112 × 112)
and ``coarse_steps=0`` alternated twice. Writes
benchmarks/results/synthetic_coarse_cost.json.

``--xla-cost [MODEL@SIZE ...]``: what compiling the Adam step with XLA saves or costs:
the whole ``synthesize_inputs`` (the defaults, tracing and compiling included) with
the step compiled by XLA and as a plain graph, alternated, on ResNet-50 at 224 and 32,
MobileNetV2 at 32 (depthwise convolutions), and a small residual net at 32, 16 and 8
(its 3 × 3 convolutions dense or, ``grouped@32``, in two groups; `_xla_model`), with
each model's values of BN inputs per input and what `synthetic.xla_pays` says. Writes
benchmarks/results/synthetic_xla_cost.json (other models: named after them,
``synthetic_xla_cost_grouped@32.json``).

``--steps resnet50``: 100 or 200 Adam steps, three seeds each (16 inputs). Writes
benchmarks/results/synthetic_steps_resnet50.json. With values (``--steps
resnet50_128 100 200``) density 0.6 is added to the points and the JSON's name lists
them (``synthetic_steps_resnet50_128_100_200.json``).

``--size resnet50`` / ``--size resnet50_64``: the spatial size the inputs are made at
(`synthesize_inputs(size=...)`; the network runs at that size): the fixture's own, a
half and a quarter of it (16 inputs, two seeds each). Writes
benchmarks/results/synthetic_size_<model>.json.
"""

import json
import math
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
import quality as Q  # noqa: E402
from _common import compress, quick_path, quick_requested  # noqa: E402

import hope_keras  # noqa: E402
from hope_keras.stats import bn_stats
from hope_keras.scoring import costs
from hope_keras.stats import synthetic  # noqa: E402

DENSITIES = (0.55, 0.5, 0.45)
# (inputs, Adam steps, learning rate, seed, mode); steps 0: standard normal noise.
SETTINGS = [
    (16, 0, 0.1, 0, "readers"),
    (32, 50, 0.05, 0, "readers"),
    (32, 50, 0.05, 1, "readers"),
    (32, 50, 0.1, 0, "readers"),
    (32, 100, 0.05, 0, "readers"),
    (32, 100, 0.1, 0, "readers"),
    (32, 100, 0.1, 1, "readers"),
    (32, 100, 0.2, 0, "readers"),
    (32, 200, 0.05, 0, "readers"),
    (64, 50, 0.05, 0, "readers"),
    (16, 100, 0.1, 0, "readers"),
    (16, 100, 0.1, 1, "readers"),
    (16, 100, 0.1, 0, "reestimate"),
]
OUT = os.path.join(os.path.dirname(__file__), "results", "synthetic_settings.json")
# The points of a study on a fixture of 128 x 128 or more: where it holds or falls.
LARGE_POINTS = {"density 0.7": dict(density=0.7), "density 0.6": dict(density=0.6),
                "density 0.5": dict(density=0.5), "FLOPs 0.5": dict(flops=0.5)}


def which_bns(flops=False):
    import keras

    points = (0.5, 0.4) if flops else (0.6, 0.5)
    b = Q.Bench("resnet50", 1000, 1000, points)
    a = b.analysis
    n, nc = a.num_neurons, 7616
    bns = [layer for layer in b.model.layers
           if isinstance(layer, keras.layers.BatchNormalization)]
    subsets = {
        "none": None,
        "every BN": lambda name: True,
        "stream readers (*_0_bn, *_1_bn)": lambda name: name.endswith(("_0_bn", "_1_bn")),
        "inside the branches (*_2_bn, *_3_bn)": lambda name: name.endswith(("_2_bn", "_3_bn")),
        "stage conv4": lambda name: name.startswith("conv4"),
        "stage conv5": lambda name: name.startswith("conv5"),
    }
    if flops:
        subsets.update({"stem (conv1_bn)": lambda name: name.startswith("conv1"),
                        "stage conv2": lambda name: name.startswith("conv2"),
                        "stage conv3": lambda name: name.startswith("conv3")})
    out = {}
    for d in points:
        b.reset()
        if flops:
            compress(b.model, flops=d, analysis=a, verbose=False)
        else:
            compress(b.model, density=(math.floor(d * n + 1e-9) - (n - nc)) / nc,
                                analysis=a, verbose=False, correct_statistics="surrogate",
                                cost=costs.HopeCost(groups="no_streams"))
        weights = [w.numpy().copy() for w in b.model.weights]
        for label, keep in subsets.items():
            for v, w in zip(b.model.weights, weights):
                v.assign(w)
            for _ in range(0 if keep is None else 3):
                old = {x.name: (x.moving_mean.numpy(), x.moving_variance.numpy()) for x in bns}
                hope_keras.reestimate_batchnorm_statistics(b.model, b.xc[:256])
                for x in bns:
                    if not keep(x.name):
                        x.moving_mean.assign(old[x.name][0])
                        x.moving_variance.assign(old[x.name][1])
            out.setdefault(label, {})[str(d)] = b.ev()[0]
            print(d, label, out[label][str(d)], flush=True)
    name = "synthetic_which_bns_flops" if flops else "synthetic_which_bns"
    with open(OUT.replace("synthetic_settings", name), "w") as f:
        json.dump(out, f, indent=1)
    axis = "FLOPs" if flops else "density"
    print("| BNs re-estimated | " + " | ".join(
        f"{axis} {d} sel / held-out" for d in points) + " |")
    print("|---|---|---|")
    for label, acc in out.items():
        print(f"| {label} | " + " | ".join(
            f"{100 * acc[str(d)]['sel']:.1f} / {100 * acc[str(d)]['heldout']:.1f}"
            for d in points) + " |")


def corrected(b, compressed, mode="readers", x=None, **synthesis):
    """(seconds, {key: accuracy}): synthetic inputs made from the uncompressed model
    (`synthesize_inputs(**synthesis)`; seconds with the readers' reference), or the
    inputs `x` when given, then each compressed model of `compressed` (key → (weights,
    trajectory steps)) corrected with them: its stream readers (``"readers"``, what
    `compress` does) or every BN's statistics re-estimated on them (``"reestimate"``)."""
    a = b.analysis
    b.reset()
    t = time.perf_counter()
    if x is None:
        x = synthetic.synthesize_inputs(b.model, verbose=False, **synthesis)
    ref = synthetic.StreamReference(b.model, a.graph, x)
    seconds = time.perf_counter() - t
    acc = {}
    for key, (weights, trajectory) in compressed.items():
        for v, w in zip(b.model.weights, weights):
            v.assign(w)
        if mode == "readers":
            synthetic.correct_stream_readers(
                ref, bn_stats.untrusted_tensors(a.graph, trajectory, "auto"))
        else:
            hope_keras.reestimate_batchnorm_statistics(b.model, x)
        acc[key] = b.ev()[0]
    return seconds, acc


def study(model_name, vary="inputs", override=None):
    """One setting of the synthetic inputs varied on the default's compressed models
    ("surrogate" during the run, then the stream readers corrected):

    * ``"inputs"``: how many a resolution needs, 16, 8, 4 and 2 inputs (100 steps,
      lr 0.1, seeds 0 and 1) on `model_name` (resnet50: 32×32, its last stage 1×1
      per image; resnet50_64: 64×64, 2×2);
    * ``"steps"``: 100 or 200 Adam steps (16 inputs, seeds 0, 1 and 2), density 0.3
      added to the points (and density 0.6 when the values are given);
    * ``"size"``: the inputs' side, the fixture's own, a half and a quarter of it
      (16 inputs, seeds 0 and 1);
    * ``"prior"``: the image parameterisation, 1/f Fourier amplitudes or free pixels
      (16 inputs, 100 steps, seeds 0 and 1), density 0.6 added to the points.

    `override` replaces the values varied (the JSON's name then lists them).
    """
    b = Q.Bench(model_name, 1000, 1000, (0.5,))
    a = b.analysis
    custom = bool(override)
    points = {"density 0.5": dict(density=0.5), "density 0.45": dict(density=0.45),
              "density 0.4": dict(density=0.4), "FLOPs 0.5": dict(flops=0.5),
              "FLOPs 0.4": dict(flops=0.4)}
    if vary == "steps":
        if custom:  # the point where the 128 x 128 fixture falls
            points = {"density 0.6": dict(density=0.6), **points}
        points["density 0.3"] = dict(density=0.3)
        values, seeds = (100, 200), (0, 1, 2)
    elif vary == "size":
        side = int(b.model.inputs[0].shape[1])
        values, seeds = (side, side // 2, side // 4), (0, 1)
    elif vary == "prior":
        points = {"density 0.6": dict(density=0.6), **points}
        values, seeds = ("spectrum", "pixels"), (0, 1)
    elif vary == "coarse":
        points = {"density 0.6": dict(density=0.6), **points}
        if int(b.model.inputs[0].shape[1]) >= 128:
            points = dict(LARGE_POINTS)
        values, seeds = (0, 80), (0, 1, 2, 3, 4, 5)
    else:
        values, seeds = (16, 8, 4, 2), (0, 1)
        if int(b.model.inputs[0].shape[1]) >= 128:  # the --coarse points
            points = dict(LARGE_POINTS)
    if custom:
        values = tuple(override)
    if "--seeds" in sys.argv:  # the first N seeds (0 … N − 1 when N exceeds the list)
        n = int(sys.argv[sys.argv.index("--seeds") + 1])
        seeds = seeds[:n] if n <= len(seeds) else tuple(range(n))
    key = {"steps": "steps", "size": "size", "prior": "prior",
           "coarse": "coarse_steps"}.get(vary, "num")
    compressed = {}
    for label, kw in points.items():
        b.reset()
        r = compress(b.model, analysis=a, verbose=False,
                                correct_statistics="surrogate", **kw)
        compressed[label] = ([w.numpy().copy() for w in b.model.weights], r.trajectory.steps)
        print(f"{label}: surrogate only {b.ev()[0]}", flush=True)
    rows = []
    for value in values:
        for seed in seeds:
            seconds, acc = corrected(b, compressed, seed=seed, **{key: value})
            row = {key: value, "seed": seed, "seconds": round(seconds, 1), "acc": acc}
            rows.append(row)
            print(json.dumps(row), flush=True)
    name = f"synthetic_{vary}_{model_name}"
    if custom:
        name += "_" + "_".join(map(str, values))
    with open(OUT.replace("synthetic_settings", name), "w") as f:
        json.dump({"points": list(points), "rows": rows}, f, indent=1)
    print(f"| {vary} | s (mean) | " + " | ".join(f"{p} sel / held-out" for p in points)
          + " | mean sel |")
    print("|---" * (len(points) + 3) + "|")
    for value in values:
        rs = [r for r in rows if r[key] == value]
        cells = [f"{100 * np.mean([r['acc'][p]['sel'] for r in rs]):.1f} / "
                 f"{100 * np.mean([r['acc'][p]['heldout'] for r in rs]):.1f}" for p in points]
        mean = 100 * np.mean([r["acc"][p]["sel"] for r in rs for p in points])
        print(f"| {value} | {np.mean([r['seconds'] for r in rs]):.1f} | " + " | ".join(cells)
              + f" | {mean:.1f} |")


def prior_cost(steps=20, repeats=2):
    """Seconds per Adam step of `synthesize_inputs` at 224 x 224, per prior."""
    import keras
    model = keras.applications.ResNet50(weights=None)
    hope_keras.synthesize_inputs(model, num=16, steps=1, verbose=False)  # warm-up
    rows = []
    for rep in range(repeats):
        for prior in synthetic.PRIORS:
            t = time.perf_counter()
            hope_keras.synthesize_inputs(model, num=16, steps=1, verbose=False, prior=prior)
            first = time.perf_counter() - t
            t = time.perf_counter()
            hope_keras.synthesize_inputs(model, num=16, steps=steps + 1, verbose=False,
                                         prior=prior)
            per_step = (time.perf_counter() - t - first) / steps
            rows.append(dict(prior=prior, repeat=rep, s_per_step=round(per_step, 3)))
            print(json.dumps(rows[-1]), flush=True)
    with open(os.path.join(os.path.dirname(OUT), "synthetic_prior_cost.json"), "w") as f:
        json.dump({"steps": steps, "num": 16, "size": 224, "rows": rows}, f, indent=1)


def coarse_cost(repeats=2):
    """Seconds of the whole `synthesize_inputs` (100 steps, 16 inputs, tracing
    included) at 224 x 224, with the default's 80 steps at half size and without."""
    import keras
    model = keras.applications.ResNet50(weights=None)
    hope_keras.synthesize_inputs(model, num=16, steps=1, verbose=False)  # warm-up
    rows = []
    for rep in range(repeats):
        for coarse in (None, 0):
            t = time.perf_counter()
            hope_keras.synthesize_inputs(model, verbose=False, coarse_steps=coarse)
            rows.append(dict(coarse_steps=coarse, repeat=rep,
                             seconds=round(time.perf_counter() - t, 2),
                             load=round(os.getloadavg()[0], 2)))
            print(json.dumps(rows[-1]), flush=True)
    with open(os.path.join(os.path.dirname(OUT), "synthetic_coarse_cost.json"), "w") as f:
        json.dump({"steps": synthetic.SYNTHETIC_STEPS, "num": 16, "size": 224,
                   "rows": rows}, f, indent=1)


def _xla_model(spec):
    """A model for `xla_cost`: ``resnet50@S``, ``mobilenetv2@S`` (keras.applications,
    weights=None) or ``blocks@S`` / ``grouped@S`` (a conv stem and four bottleneck
    blocks of 8-16-8 channels, the 3 x 3 convolution dense or in 2 groups), at S x S."""
    import keras
    name, size = spec.split("@")
    size = int(size)
    if name == "resnet50":
        return keras.applications.ResNet50(weights=None, input_shape=(size, size, 3))
    if name == "mobilenetv2":
        return keras.applications.MobileNetV2(weights=None, input_shape=(size, size, 3))
    L = keras.layers
    inputs = keras.Input((size, size, 3))
    x = L.ReLU()(L.BatchNormalization()(L.Conv2D(8, 3, padding="same")(inputs)))
    for _ in range(4):
        y = L.ReLU()(L.BatchNormalization()(L.Conv2D(16, 1)(x)))
        y = L.Conv2D(16, 3, padding="same", groups=2 if name == "grouped" else 1)(y)
        y = L.BatchNormalization()(L.Conv2D(8, 1)(L.ReLU()(L.BatchNormalization()(y))))
        x = L.ReLU()(L.Add()([x, y]))
    return keras.Model(inputs, L.Dense(10)(L.GlobalAveragePooling2D()(x)))


XLA_MODELS = ("resnet50@224", "resnet50@32", "mobilenetv2@32", "grouped@32", "blocks@32",
              "blocks@16", "blocks@8")


def xla_cost(specs=XLA_MODELS, repeats=1):
    """Seconds of the whole `synthesize_inputs` (the defaults, tracing and compiling
    included) with its step compiled by XLA and as a plain graph, alternated, on each
    model; the values of BN inputs per input and what `synthetic.xla_pays` says."""
    from hope_keras.graph import adapter as kg
    from hope_keras.graph.blocks import is_batch_norm

    pays = synthetic.xla_pays
    rows = []
    for spec in specs:
        model = _xla_model(spec)
        flat = kg.flatten(model)
        bns = [n for n in flat.nodes if is_batch_norm(n.op) and n.inputs]
        values = sum(int(np.prod(flat.shapes[n.inputs[0]][1:])) for n in bns)
        rule = pays(flat, bns)
        hope_keras.synthesize_inputs(model, num=16, steps=1, verbose=False)  # warm-up
        for rep in range(repeats):
            for xla in (True, False):
                synthetic.SYNTHESIS_XLA = True
                synthetic.xla_pays = lambda flat, bns, xla=xla: xla
                t = time.perf_counter()
                hope_keras.synthesize_inputs(model, verbose=False)
                rows.append(dict(model=spec, bn_values=values, xla_pays=rule, xla=xla,
                                 repeat=rep, seconds=round(time.perf_counter() - t, 2),
                                 load=round(os.getloadavg()[0], 2)))
                print(json.dumps(rows[-1]), flush=True)
        synthetic.xla_pays = pays
    synthetic.SYNTHESIS_XLA = False
    name = "" if tuple(specs) == XLA_MODELS else "_" + "_".join(specs)
    with open(os.path.join(os.path.dirname(OUT), f"synthetic_xla_cost{name}.json"), "w") as f:
        json.dump({"steps": synthetic.SYNTHETIC_STEPS, "num": synthetic.SYNTHETIC_INPUTS,
                   "rows": rows}, f, indent=1)


def relative_correction(b, compressed, x, tensors_of):
    """{key: accuracy}: an experiment, not the library's correction. Each stream
    reader whose input moved gets ``μ ← μ₀ + (m_new − m₀)``, ``σ² ← σ₀² · v_new / v₀``
    with ``μ₀, σ₀²`` its moving statistics *before* the run and ``m₀, v₀`` its input's
    batch moments on the uncompressed model: the reader's own edits (a merged
    channel) are measured on the batch too, instead of kept as the edits wrote them."""
    from hope_keras.graph import adapter as kg

    a = b.analysis
    b.reset()
    flat = kg.flatten(b.model)
    readers = {node.index for node in synthetic.stream_readers(a.graph)}
    before = {}

    def record(node, args, kwargs):
        if node.index in readers:
            bn = node.op
            before[node.index] = (synthetic.batch_moments(args[0], bn),
                                  np.asarray(bn.moving_mean.numpy(), np.float64),
                                  np.asarray(bn.moving_variance.numpy(), np.float64))
        return None

    synthetic.run_graph(flat, x, record, synthetic.release_plan(flat))
    acc = {}
    for key, (weights, trajectory) in compressed.items():
        for v, w in zip(b.model.weights, weights):
            v.assign(w)
        moved = tensors_of(trajectory)

        def correct(node, args, kwargs):
            if node.index not in before or node.inputs[0] not in moved:
                return None
            bn = node.op
            (m0, v0), mu0, var0 = before[node.index]
            m1, v1 = synthetic.batch_moments(args[0], bn)
            tiny = 1e-6 * max(float(np.mean(v0)), float(np.mean(v1)), 1e-30)
            live = np.isfinite(m1) & np.isfinite(v1) & (v0 > tiny) & (v1 > tiny)
            mean = np.asarray(bn.moving_mean.numpy(), np.float64)
            var = np.asarray(bn.moving_variance.numpy(), np.float64)
            mean = np.where(live, mu0 + (m1 - m0), mean)
            var = np.where(live, var0 * v1 / np.where(live, v0, 1.0), var)
            bn.moving_mean.assign(mean.astype(bn.moving_mean.dtype))
            bn.moving_variance.assign(var.astype(bn.moving_variance.dtype))
            return None

        synthetic.run_graph(flat, x, correct, synthetic.release_plan(flat))
        acc[key] = b.ev()[0]
    return acc


def real_reference(model_name):
    """Uses data (a diagnostic): the stream readers' correction `compress` makes
    (shift of the mean, ratio of the variances, measured through each reader's
    feeding layer) measured on real calibration images instead of synthetic ones,
    16 and 256 of them, against the synthetic inputs (seed 0), every BN re-estimated
    on the 512 calibration images, and only the stream readers re-estimated outright
    on 256 of them (the other BNs as the run left them). Tells whether the
    measurement or the batch it is made on falls short."""
    import keras

    b = Q.Bench(model_name, 1000, 1000, (0.5,))
    a = b.analysis
    points = {"density 0.6": dict(density=0.6), "density 0.5": dict(density=0.5),
              "FLOPs 0.5": dict(flops=0.5), "FLOPs 0.4": dict(flops=0.4)}
    compressed, reest = {}, {}
    for label, kw in points.items():
        b.reset()
        r = compress(b.model, analysis=a, verbose=False,
                                correct_statistics="surrogate", **kw)
        compressed[label] = ([w.numpy().copy() for w in b.model.weights], r.trajectory.steps)
        hope_keras.reestimate_batchnorm_statistics(b.model, b.xc)
        reest[label] = b.ev()[0]
    rows = [dict(batch="every BN re-estimated on 512 real (uses data)", acc=reest)]
    if "--relative" not in sys.argv:
        readers = {node.op.name for node in synthetic.stream_readers(a.graph)}
        bns = [node.op for node in a.graph.flat.nodes
               if isinstance(node.op, keras.layers.BatchNormalization)]
        acc = {}
        for label, (weights, _) in compressed.items():
            for v, w in zip(b.model.weights, weights):
                v.assign(w)
            for _ in range(3):  # each reader sees its re-estimated upstream readers
                old = {bn.name: (bn.moving_mean.numpy(), bn.moving_variance.numpy())
                       for bn in bns if bn.name not in readers}
                hope_keras.reestimate_batchnorm_statistics(b.model, b.xc[:256])
                for bn in bns:
                    if bn.name in old:
                        bn.moving_mean.assign(old[bn.name][0])
                        bn.moving_variance.assign(old[bn.name][1])
            acc[label] = b.ev()[0]
        rows.append(dict(batch="stream readers re-estimated outright on 256 real (uses data)",
                         acc=acc))
        print(json.dumps(rows[-1]), flush=True)
        for label, x in (("synthetic, 16 (the default)", None), ("real, 16", b.xc[:16]),
                         ("real, 256", b.xc[:256])):
            _, acc = corrected(b, compressed, x=x, seed=0)
            rows.append(dict(batch=label, acc=acc))
            print(json.dumps(rows[-1]), flush=True)
    if "--relative" in sys.argv:
        x = synthetic.synthesize_inputs(b.model, verbose=False, seed=0)
        tensors_of = lambda steps: bn_stats.untrusted_tensors(a.graph, steps, "auto")  # noqa: E731
        for label, xs in (("synthetic, 16, relative to the original (experiment)", x),
                          ("real, 256, relative to the original (experiment)", b.xc[:256])):
            rows.append(dict(batch=label, acc=relative_correction(b, compressed, xs,
                                                                  tensors_of)))
            print(json.dumps(rows[-1]), flush=True)
        name = f"synthetic_real_reference_{model_name}_relative"
    else:
        name = f"synthetic_real_reference_{model_name}"
    with open(OUT.replace("synthetic_settings", name),
              "w") as f:
        json.dump({"points": list(points), "rows": rows}, f, indent=1)
    print("| readers measured on | " + " | ".join(f"{p} sel / held-out" for p in points)
          + " |")
    print("|---" * (len(points) + 1) + "|")
    for r in rows:
        print(f"| {r['batch']} | " + " | ".join(
            f"{100 * r['acc'][p]['sel']:.1f} / {100 * r['acc'][p]['heldout']:.1f}"
            for p in points) + " |")


def main():
    if "--prior-cost" in sys.argv:
        return prior_cost()
    if "--coarse-cost" in sys.argv:
        return coarse_cost()
    if "--xla-cost" in sys.argv:
        specs = [v for v in sys.argv[sys.argv.index("--xla-cost") + 1:]
                 if not v.startswith("--")]
        return xla_cost(tuple(specs) or XLA_MODELS)
    if "--real-reference" in sys.argv:
        return real_reference(sys.argv[sys.argv.index("--real-reference") + 1])
    if "--which-bns" in sys.argv:
        return which_bns(flops="--flops" in sys.argv)
    for vary in ("inputs", "steps", "size", "prior", "coarse"):
        if f"--{vary}" in sys.argv:
            at = sys.argv.index(f"--{vary}")
            values = []
            for v in sys.argv[at + 2:]:
                if v.startswith("--"):
                    break
                values.append(v)
            return study(sys.argv[at + 1], vary,
                         values if vary == "prior" else [int(v) for v in values])
    out, densities, settings = OUT, DENSITIES, SETTINGS
    if quick_requested():  # the demo CNN, 200 + 200 images, one density, one setting
        out, densities, settings = quick_path(OUT), (0.5,), [(16, 5, 0.1, 0, "readers")]
        b = Q.Bench("demo", 200, 200, densities)
        n = nc = b.analysis.num_neurons  # the density asked of compress, as it is
    else:
        b = Q.Bench("resnet50", 1000, 1000, densities)
        # 3840 stream channels are not priced by the default
        n, nc = b.analysis.num_neurons, 7616
    a = b.analysis
    compressed = {}
    for d in densities:
        b.reset()
        r = compress(b.model, density=(math.floor(d * n + 1e-9) - (n - nc)) / nc,
                                analysis=a, verbose=False, correct_statistics="surrogate",
                                cost=costs.HopeCost(groups="no_streams"))
        compressed[str(d)] = ([w.numpy().copy() for w in b.model.weights],
                              r.trajectory.steps)
        print(f"density {d}: surrogate only {b.ev()[0]}", flush=True)
    rows = []
    for num, steps, lr, seed, mode in settings:
        seconds, acc = corrected(b, compressed, mode, num=num, steps=steps,
                                 learning_rate=lr, seed=seed)
        row = dict(num=num, steps=steps, learning_rate=lr, seed=seed, mode=mode,
                   seconds=round(seconds, 1), acc=acc)
        rows.append(row)
        print(json.dumps(row), flush=True)
    with open(out, "w") as f:
        json.dump({"densities": densities, "rows": rows}, f, indent=1)
    print("| inputs | steps | lr | seed | mode | s | " + " | ".join(
        f"{d} sel / held-out" for d in densities) + " |")
    print("|---" * (6 + len(densities)) + "|")
    for r in rows:
        cells = " | ".join(f"{100 * r['acc'][str(d)]['sel']:.1f} / "
                           f"{100 * r['acc'][str(d)]['heldout']:.1f}" for d in densities)
        print(f"| {r['num']} | {r['steps']} | {r['learning_rate']} | {r['seed']} | "
              f"{r['mode']} | {r['seconds']} | {cells} |")


if __name__ == "__main__":
    main()
