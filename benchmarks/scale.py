"""Scale: analyze and compress on wide layers and big models.

One model per process (peak RSS is per process):

* ``resnet50``: `keras.applications.ResNet50(weights=None)` at 224×224 prepared by
  `_common.calibrated_resnet50`; analyze, then compress to density 0.5.
* ``vgg16``: `keras.applications.VGG16(weights=None, input_shape=(64, 64, 3))`
  through `hope_keras.calibrate` on 8 random images; analyze, compress to 0.8.
* ``mlp``: 4 × Dense(8192) + BatchNormalization + ReLU (input 1024, head 10, random
  BN γ/β); analyze, compress to 0.5.

Targets (2 shared CPU cores): ResNet-50 analyze ≤ 1.5 s, compress ≤ 3 s;
VGG16 analyze ≤ 5 s, compress ≤ 60 s, ≤ 3 GB; MLP compress ≤ 60 s, ≤ 3 GB.

Run: .venv/bin/python benchmarks/scale.py resnet50 [--profile] [--breakdown] [--candidates K]
[--reference-time]
(``mlp --width W``: W-wide layers; ``--init numpy``: kernels drawn by NumPy, see
`mlp`; ``--output-error``: the compressed model's output error relative to the
original's output spread, on 512 standard normal inputs; ``--bn-stats``: BN
statistics measured on normal inputs, see `mlp`;
``--unoriented``: top-k tables whose rows hold partners of any capacity, the
earlier behaviour, for comparison; ``--refine-batch B``: sketched groups
re-price B pairs a round, whatever their width: `search.REFINE_BATCH`,
`search.REFINE_BATCH_WIDE`)
(``--candidates none``: the exhaustive scan; ``--steps N``: stop after N steps;
``--compare``: afterwards, rerun with the exhaustive scan on a fresh copy of the model
and report whether the trajectories are identical: kinds, units, indices, J and DR;
``--correct-statistics auto``: also time the BN-statistics correction `compress` runs
by default, before the run and after it; ``data``: the correction of
``compress(data=x)``, x 256 random images).
"""

import argparse
import collections
import contextlib
import functools
import os
import time

from _common import add_quick, calibrated_resnet50, forward_time, peak_rss_gb

import keras
import numpy as np

import hope_keras


def vgg16():
    keras.utils.set_random_seed(0)
    model = keras.applications.VGG16(weights=None, input_shape=(64, 64, 3))
    x = np.random.default_rng(0).uniform(0, 255, (8, 64, 64, 3)).astype("float32")
    return hope_keras.calibrate(model, x, batch_size=8)


def mlp(width=8192, depth=4, d_in=1024, seed=0, init="keras", bn_stats=False):
    """``init="numpy"``: kernels drawn by NumPy (Glorot-uniform, as Keras' default,
    float32, a slice at a time) into zero-initialised layers; Keras' own initializer
    leaves its temporaries resident (oneDNN's buffers: RSS before analyze 2.15 against
    1.85 GB), which the peak memory would count. Other values, the same distribution.
    ``bn_stats``: the BN moving statistics measured on 1024 standard normal inputs
    (a seed of their own) instead of Keras' 0 and 1, so that HOPE's data-free model
    describes the inputs `--output-error` measures on."""
    keras.utils.set_random_seed(seed)
    L = keras.layers
    inputs = keras.Input((d_in,))
    x = inputs
    kernel_init = "zeros" if init == "numpy" else "glorot_uniform"
    for k in range(depth):
        x = L.Dense(width, name=f"fc{k}", kernel_initializer=kernel_init)(x)
        x = L.ReLU()(L.BatchNormalization(name=f"fc{k}_bn")(x))
    model = keras.Model(inputs, L.Dense(10, name="head", kernel_initializer=kernel_init)(x))
    rng = np.random.default_rng(seed)
    if init == "numpy":
        for layer in model.layers:
            if isinstance(layer, L.Dense):
                fan_in, fan_out = layer.kernel.shape
                limit = np.float32(np.sqrt(6.0 / (fan_in + fan_out)))
                value = np.empty((fan_in, fan_out), np.float32)
                for s0 in range(0, fan_in, 1024):
                    part = value[s0:s0 + 1024]
                    part[...] = rng.random(part.shape, dtype=np.float32)
                    part *= 2 * limit
                    part -= limit
                layer.kernel.assign(value)
                del value
    for layer in model.layers:
        if isinstance(layer, L.BatchNormalization):
            layer.gamma.assign(rng.uniform(0.3, 1.5, width).astype("float32"))
            layer.beta.assign(rng.normal(0, 0.5, width).astype("float32"))
    if bn_stats:
        x = np.random.default_rng(2).normal(size=(1024, d_in)).astype("float32")
        for layer in model.layers:
            if isinstance(layer, L.BatchNormalization):
                a = keras.Model(inputs, layer.input).predict(x, batch_size=256, verbose=0)
                a = a.astype(np.float64)
                layer.moving_mean.assign(a.mean(axis=0).astype("float32"))
                layer.moving_variance.assign(a.var(axis=0).astype("float32"))
    return model


# `--breakdown`: the parts of a greedy run timed, as (label, module, class, method); a
# label's calls from inside the same label count once (a merge prunes its second
# neuron). The first four parts do not call one another; the last is inside the third.
BREAKDOWN = (
    ("selection (merge tables)", "hope_keras.search.candidates", "MergeTable", "select"),
    ("exact re-pricing (sketched groups)", "hope_keras.scoring.cache", "SketchCache",
     "exact_pairs"),
    ("a merged parent's pairs", "hope_keras.search.candidates", "MergeTable", "on_merge"),
    ("model edits", "hope_keras.edit.editor", "ModelEditor", "merge"),
    ("model edits", "hope_keras.edit.editor", "ModelEditor", "prune"),
    ("  of which waiting for sketch products", "hope_keras.scoring.cache", "SketchCache",
     "_prefetched"),
)


@contextlib.contextmanager
def breakdown_timers():
    """Wall time and calls of each `BREAKDOWN` part while inside (the methods wrapped,
    put back on exit): yields ``{label: [seconds, calls]}``."""
    import importlib

    spent, depth, saved = {}, {}, []
    for label, module, cls_name, name in BREAKDOWN:
        cls = getattr(importlib.import_module(module), cls_name)
        original = cls.__dict__[name]
        acc = spent.setdefault(label, [0.0, 0])
        depth[label] = 0

        def timed(*a, _f=original, _acc=acc, _label=label, **k):
            depth[_label] += 1
            t = time.perf_counter()
            try:
                return _f(*a, **k)
            finally:
                depth[_label] -= 1
                if not depth[_label]:
                    _acc[0] += time.perf_counter() - t
                    _acc[1] += 1

        saved.append((cls, name, original))
        setattr(cls, name, timed)
    try:
        yield spent
    finally:
        for cls, name, original in saved:
            setattr(cls, name, original)


def print_breakdown(spent, t_run, steps):
    """The `breakdown_timers` parts against the run's wall time."""
    n = max(steps, 1)
    print(f"  the run's {steps} steps, {1e3 * t_run / n:.2f} ms a step:")
    top = 0.0
    for label, (seconds, calls) in spent.items():
        if not label.startswith(" "):
            top += seconds
        print(f"    {label}: {seconds:.2f} s, {1e3 * seconds / n:.2f} ms a step "
              f"({calls} calls)")
    print(f"    everything else: {t_run - top:.2f} s, {1e3 * (t_run - top) / n:.2f} ms a step")


MODELS = {
    "resnet50": (calibrated_resnet50, 0.5),
    "vgg16": (vgg16, 0.8),
    "mlp": (mlp, 0.5),
}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("model", choices=sorted(MODELS), nargs="?",
                   help="required, except with --quick (the MLP, 4 × 128)")
    p.add_argument("--density", type=float, default=None)
    p.add_argument("--candidates", default="auto",
                   help="Encoder merge_candidates: an int, 'none' (exhaustive) or 'auto'")
    p.add_argument("--search", default="auto", choices=("auto", "certified", "top_k"),
                   help="Encoder merge_search (default: the library's, auto)")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--width", type=int, default=None, help="mlp: layer width (8192)")
    p.add_argument("--gram-backend", choices=("auto", "numpy", "tensorflow"), default=None,
                   help="where the caches' products run (hope_keras.scoring.cache."
                        "GRAM_BACKEND; auto: TensorFlow with a GPU, else NumPy)")
    p.add_argument("--sketch-seed", type=int, default=None,
                   help="seed of the sketched groups' random projections "
                        "(hope_keras.scoring.cache.SKETCH_SEED, 0)")
    p.add_argument("--init", default="keras", choices=("keras", "numpy"),
                   help="mlp: kernels from Keras' initializer or drawn by NumPy (see mlp)")
    p.add_argument("--bn-stats", action="store_true",
                   help="mlp: BN statistics measured on normal inputs (see mlp)")
    p.add_argument("--output-error", action="store_true",
                   help="report the output error of the compressed model")
    p.add_argument("--unoriented", action="store_true",
                   help="top_k rows hold partners of any capacity (candidates.ORIENTED off)")
    p.add_argument("--refine-batch", type=int, default=None,
                   help="sketched groups: pairs re-priced exactly per round "
                        "in every group (search.REFINE_BATCH, 8; REFINE_BATCH_WIDE, 16)")
    p.add_argument("--analyze-twice", action="store_true",
                   help="also time a second analyze in the same process (TensorFlow warm)")
    p.add_argument("--profile", action="store_true", help="cProfile analyze and compress")
    p.add_argument("--breakdown", action="store_true",
                   help="time the run's parts (BREAKDOWN: selection, exact re-pricing, a "
                        "merged parent's pairs, model edits) against its wall time")
    p.add_argument("--reference-time", action="store_true",
                   help="also report analyze + compress in T, one batch-8 forward pass of "
                        "the model measured first in the same process (after the timed "
                        "run: the first call's compile is not warmed by it)")
    p.add_argument("--correct-statistics", default=None,
                   help="also time compress's BN-statistics correction with this mode "
                        "(auto: synthetic inputs for the stream readers, made after the "
                        "run; surrogate; data: on 256 random images, as compress(data=x))")
    p.add_argument("--compare", action="store_true",
                   help="rerun with the exhaustive scan and compare the trajectories")
    add_quick(p)
    args = p.parse_args()
    if args.quick:
        args.model = args.model or "mlp"
        if args.model != "mlp":
            p.error("--quick runs the mlp (4 × 128)")
        args.width, args.output_error, args.breakdown = args.width or 128, True, True
    elif args.model is None:
        p.error("the model is required (one of %s)" % ", ".join(sorted(MODELS)))
    build, density = MODELS[args.model]
    density = args.density or density
    cand = {"none": None, "auto": "auto"}.get(args.candidates, None)
    if args.candidates not in ("none", "auto"):
        cand = int(args.candidates)
    load = os.getloadavg()
    if args.refine_batch is not None:
        from hope_keras.search import merge_search as search_lib

        search_lib.REFINE_BATCH = search_lib.REFINE_BATCH_WIDE = args.refine_batch
    if args.unoriented:
        from hope_keras.search import candidates

        candidates.ORIENTED = False
    if args.sketch_seed is not None or args.gram_backend is not None:
        from hope_keras.scoring import cache as cache_lib

        if args.sketch_seed is not None:
            cache_lib.SKETCH_SEED = args.sketch_seed
        if args.gram_backend is not None:
            cache_lib.GRAM_BACKEND = args.gram_backend
    if args.width is not None or args.init != "keras" or args.bn_stats:
        if args.model != "mlp":
            p.error("--width, --init and --bn-stats apply to the mlp")
        build = functools.partial(mlp, width=args.width or 8192, init=args.init,
                                  bn_stats=args.bn_stats)
    keras.utils.set_random_seed(0)
    model = build()
    before = peak_rss_gb()
    if args.output_error:
        x_err = np.random.default_rng(1).normal(size=(512,) + model.input_shape[1:])
        y_ref = model.predict(x_err.astype("float32"), batch_size=64, verbose=0)
    print(f"{args.model}: {model.count_params()} parameters; load average "
          f"{load[0]:.1f} (1 min) at start; peak RSS before analyze {before:.2f} GB")
    prof = None
    if args.profile:
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    t, c = time.perf_counter(), time.process_time()
    analysis = hope_keras.analyze(model)
    t_an, c_an = time.perf_counter() - t, time.process_time() - c
    print(f"analyze: {t_an:.2f} s wall, {c_an:.2f} s CPU; {len(analysis.groups)} groups, "
          f"{analysis.num_neurons} neurons; peak RSS {peak_rss_gb():.2f} GB")
    if args.analyze_twice:
        t = time.perf_counter()
        hope_keras.analyze(model)
        print(f"analyze again: {time.perf_counter() - t:.2f} s wall")
    search = {} if cand == "auto" else {"merge_candidates": cand}
    search["merge_search"] = args.search
    t, c = time.perf_counter(), time.process_time()
    # The run's own correction is off: the one `compress` runs is timed apart below.
    enc = hope_keras.Encoder(model, analysis=analysis, search=search, correction=False,
                             verbose=False)
    t_init = time.perf_counter() - t
    correction, mode = None, args.correct_statistics
    if mode is not None:
        from hope_keras.stats.correction import StatisticsCorrection

        mode = {"true": True, "false": False}.get(mode.lower(), mode)
        data = None
        if mode == "data":  # 256 random images, as benchmarks/first_run.py
            data = np.random.default_rng(2).uniform(
                0, 255, (256,) + model.input_shape[1:]).astype("float32")
            mode = "auto"
        correction = StatisticsCorrection(mode, data=data, verbose=False)
        t_prep = time.perf_counter()
        correction.start(model, analysis.graph, analysis.moments)  # before any edit
        t_prep = time.perf_counter() - t_prep
    timers = breakdown_timers() if args.breakdown else contextlib.nullcontext()
    with timers as spent:
        t = time.perf_counter()
        stopped = enc.run(density=density, steps=args.steps, verbose=False)
        t_run = time.perf_counter() - t
    if mode is not None:
        t_fin = time.perf_counter()
        written = correction.finish(enc.trajectory.steps)
        t_fin = time.perf_counter() - t_fin
        print(f"correction {args.correct_statistics!r}: before the run {t_prep:.2f} s, "
              f"after it {t_fin:.2f} s (data-free: synthetic inputs made after the run "
              f"when a stream moved); {len(written)} BNs written; peak RSS "
              f"{peak_rss_gb():.2f} GB")
    c_comp = time.process_time() - c
    load = os.getloadavg()
    if prof is not None:
        import pstats

        prof.disable()
        pstats.Stats(prof).sort_stats("cumulative").print_stats(45)
        pstats.Stats(prof).sort_stats("tottime").print_stats(30)
        if os.environ.get("HOPE_PROFILE_DUMP"):
            prof.dump_stats(os.environ["HOPE_PROFILE_DUMP"])
    traj = enc.trajectory
    kinds = dict(collections.Counter(s.kind for s in traj.steps))
    n = max(len(traj), 1)
    print(f"compress to density {density} ({stopped}): {len(traj)} steps {kinds}; "
          f"density {enc.active / enc.num_neurons:.4f}, params ratio "
          f"{enc.sizes.params_ratio:.4f}")
    print(f"  encoder init {t_init:.2f} s + run {t_run:.2f} s ({1e3 * t_run / n:.2f} ms/step)"
          f"; analyze + compress {t_an + t_init + t_run:.2f} s wall, "
          f"{c_an + c_comp:.2f} s CPU (compress alone {c_comp:.2f} s CPU)")
    if args.breakdown:
        print_breakdown(spent, t_run, len(traj))
    if args.reference_time:
        x8 = np.random.default_rng(1).uniform(0, 255, (8,) + model.input_shape[1:])
        T = forward_time(model, x8.astype("float32"))
        total = t_an + t_init + t_run
        print(f"  T (batch-8 forward pass, same process, after the run) {T:.3f} s: "
              f"analyze + compress = {total / T:.1f} T")
    print(f"largest J of a step: {max((s.J for s in traj.steps), default=0.0):.3g}; "
          f"sum of J {sum(s.J for s in traj.steps):.6g}")
    coefs = [abs(c) for s in traj.steps if s.kind == "merge" for c in s.coef]
    if coefs:
        print(f"largest |parent coefficient| of a merge (a1, a2, m1, m2, γ, β): "
              f"{max(coefs):.4g}")
    if args.output_error:
        y = model.predict(x_err.astype("float32"), batch_size=64, verbose=0)
        err = np.linalg.norm(y - y_ref) / np.linalg.norm(y_ref - y_ref.mean(axis=0))
        print(f"output error ‖y − y₀‖ / ‖y₀ − mean‖ on 512 normal inputs: {err:.4f}")
    print(f"peak RSS {peak_rss_gb():.2f} GB; load average {load[0]:.1f} (1 min) at end")
    if args.compare:
        keras.utils.set_random_seed(0)
        ref_model = build()
        t = time.perf_counter()
        ref = hope_keras.Encoder(ref_model, analysis=hope_keras.analyze(ref_model),
                                 merge_candidates=None)
        ref.run(density=density, steps=args.steps, verbose=False)
        t_ref = time.perf_counter() - t

        def steps(tr):
            return [(s.kind, s.unit, s.i, s.j, s.J, s.DR) for s in tr.steps]

        a, b = steps(traj), steps(ref.trajectory)
        diff = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if diff is None and len(a) == len(b):
            print(f"exhaustive scan ({t_ref:.2f} s wall): identical trajectory, {len(b)} steps")
        else:
            k = diff if diff is not None else min(len(a), len(b))
            print(f"exhaustive scan ({t_ref:.2f} s wall): trajectories differ at step {k} "
                  f"of {len(a)} / {len(b)}: {a[k] if k < len(a) else None} vs "
                  f"{b[k] if k < len(b) else None}")


if __name__ == "__main__":
    main()
