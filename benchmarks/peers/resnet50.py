"""hope_keras beside a peer, Torch-Pruning, on ResNet-50 at one FLOPs ratio, in one run.

Torch side (`_torch_pruning_side.py`, in the interpreter given by ``--torch-python``,
default ``.cache/peers-venv/bin/python``: torch, torchvision and torch-pruning
installed there, not in the library's environment): L1 filter pruning of
torchvision's ResNet-50 (``weights=None``) with Torch-Pruning's ImageNet recipe
(`MagnitudeImportance(p=1)`, `MagnitudePruner`, 100 iterative steps of 1 % of every
layer's channels, uniform across layers, repeated until the FLOPs ratio is reached).

Keras side, in this process: `keras.applications.ResNet50(weights=None)` with
calibrated BN statistics and random γ/β (`_common.calibrated_resnet50`, as
benchmarks/first_run.py), and on fresh copies with the same weights: `analyze`; the
engine alone (``Encoder(..., correction=False).compress(flops=r)``: the greedy run,
no statistics correction); the default data-free ``compress(flops=r)`` (its
statistics correction makes synthetic inputs; `HOPE_KERAS_CACHE` is off and the
in-memory ones are cleared first); ``compress(flops=r, data=x)`` with 256 random
images; `slim` of the data-free result.

Both sides count FLOPs alike (2 × the multiply-accumulates of the Conv/Dense layers,
one example) and time the pruned model's latency against their own original (batch
8, interleaved runs as `hope_keras.profile` times them: its ``"call"``, the model
compiled with ``tf.function``; torch eager under ``inference_mode``), the ratio of
the medians (and of the minima, less sensitive to other jobs on the machine). T is one batch-8 forward
pass of each side's original, in its own process; times are also given in T.

Run: .venv/bin/python benchmarks/peers/resnet50.py [--flops 0.5] [--size 224]
     [--repeats 20] [--threads N] [--latency-only] [--torch-python PATH] [--quick]
Writes benchmarks/results/peers_resnet50[_latency][_threadsN].json (not with --quick). ``--quick``: 32 × 32,
FLOPs ratio 0.95, one timed repeat, 4 synthetic inputs of 5 steps (the default: 16
of 100); the Torch side only where ``--torch-python``
exists (the benchmark tier's CI has no torch: there it checks the Keras side alone).
"""

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
from _common import (QUICK_RESNET_SIZE, add_quick, calibrated_resnet50,  # noqa: E402
                     forward_time, quick_path, write_results)

import keras  # noqa: E402

import hope_keras  # noqa: E402

REPO = os.path.dirname(os.path.dirname(HERE))
RESULTS = os.path.join(REPO, "benchmarks", "results", "peers_resnet50.json")
TORCH_PYTHON = os.path.join(REPO, ".cache", "peers-venv", "bin", "python")
RANDOM_IMAGES = 256


def load():
    """The 1, 5 and 15 minute load averages (other jobs share the 2 cores)."""
    return [round(v, 2) for v in os.getloadavg()]


def interleaved_latency(models, x, repeats, warmup=1):
    """Seconds of every timed batch of each model, as `hope_keras.profile` times its
    ``"call"`` method (``model(x, training=False)`` compiled with ``tf.function``;
    runs interleaved, the order alternating each round), every run kept."""
    import tensorflow as tf

    xt = tf.convert_to_tensor(x)
    fns = [tf.function(lambda t, m=m: m(t, training=False)) for m in models]
    runs = [lambda fn=fn: np.asarray(fn(xt)) for fn in fns]
    for _ in range(warmup):
        for run in runs:
            run()
    times = [[] for _ in models]
    for r in range(repeats):
        order = list(range(len(models)))
        for i in (order if r % 2 == 0 else order[::-1]):
            t = time.perf_counter()
            runs[i]()
            times[i].append(time.perf_counter() - t)
    return times


def timed(fn):
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


def keras_side(size, flops, repeats, data_images, latency_only=False):
    from hope_keras.stats import bn_stats

    keras.utils.set_random_seed(0)  # the same initial weights every run
    reference = calibrated_resnet50(size=size)
    weights = reference.get_weights()

    def fresh():
        model = keras.models.clone_model(reference)
        model.set_weights(weights)
        return model

    rng = np.random.default_rng(1)
    x = rng.uniform(0, 255, (8, size, size, 3)).astype("float32")
    T = forward_time(reference, x)
    out = {"keras": keras.__version__, "size": size, "T_s": T, "load_start": load()}
    print(f"keras T (batch-8 forward, {size}x{size}): {T:.3f} s", flush=True)

    def record(label, seconds, **extra):
        out[label] = {"s": seconds, "T": seconds / T, **extra}
        more = ", ".join(f"{k} {v}" for k, v in extra.items())
        print(f"{label}: {seconds:.2f} s = {seconds / T:.1f} T{'; ' + more if more else ''}",
              flush=True)

    model = fresh()
    analysis, seconds = timed(lambda: hope_keras.analyze(model, verbose=False))
    record("analyze", seconds)
    encoder, init_s = timed(lambda: hope_keras.Encoder(
        model, analysis=analysis, correction=False, verbose=False))
    result, run_s = timed(lambda: encoder.compress(flops=flops))
    record("engine alone (Encoder init + run, no correction)", init_s + run_s,
           init_s=round(init_s, 2), run_s=round(run_s, 2), steps=len(result.trajectory),
           flops_ratio=round(result.flops_ratio, 4))

    if not latency_only:  # else the engine's model is slimmed: the same architecture
        bn_stats._SYNTHETIC_INPUTS.clear()  # the first data-free compress makes them
        model = fresh()
        result, seconds = timed(lambda: hope_keras.compress(model, flops=flops,
                                                            verbose=False))
        record("compress data-free (default)", seconds, steps=len(result.trajectory),
               corrected=len(result.corrected), flops_ratio=round(result.flops_ratio, 4))
        data = rng.uniform(0, 255, (data_images, size, size, 3)).astype("float32")
        other = fresh()
        result_data, seconds = timed(
            lambda: hope_keras.compress(other, flops=flops, data=data, verbose=False))
        record(f"compress data={data_images} random images", seconds,
               steps=len(result_data.trajectory), corrected=len(result_data.corrected))
        del other

    small, seconds = timed(lambda: hope_keras.slim(model))
    record("slim", seconds)
    p = hope_keras.profile(small, reference=reference, latency=False)
    pruned, original = interleaved_latency([small, reference], x, repeats)
    median = float(np.median(pruned)), float(np.median(original))
    out.update(params0=int(p.reference.params), flops0=int(p.reference.flops),
               params_ratio=p.ratio("params"), flops_ratio=p.ratio("flops"),
               latency_s={"original": median[1], "pruned": median[0]},
               latency_ratio=median[0] / median[1], repeats=repeats,
               latency_ratio_of_minima=min(pruned) / min(original),
               latency_runs_s={"original": original, "pruned": pruned}, load_end=load())
    print(f"keras slim: params {p.ratio('params'):.3f}, FLOPs {p.ratio('flops'):.3f}, "
          f"latency {1e3 * median[0]:.0f} / {1e3 * median[1]:.0f} ms = "
          f"{out['latency_ratio']:.3f} (of the minima {out['latency_ratio_of_minima']:.3f})",
          flush=True)
    return out


def torch_side(python, size, flops, repeats, path, threads=None):
    cmd = [python, os.path.join(HERE, "_torch_pruning_side.py"), "--size", str(size),
           "--flops", str(flops), "--repeats", str(repeats), "--out", str(path)]
    if threads:
        cmd += ["--threads", str(threads)]
    start = load()
    subprocess.run(cmd, check=True)
    with open(path) as f:
        out = json.load(f)
    out.update(load_start=start, load_end=load())
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--flops", type=float, default=0.5)
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--torch-python", default=TORCH_PYTHON,
                   help="the interpreter with torch, torchvision, torch-pruning")
    p.add_argument("--threads", type=int,
                   help="CPU threads of both frameworks and of NumPy's BLAS (default: "
                        "each one's own); on a machine shared with other jobs one thread "
                        "each times steadier")
    p.add_argument("--latency-only", action="store_true",
                   help="Keras side: no compress runs, the engine's model is slimmed "
                        "and timed (the default compress takes the same steps)")
    add_quick(p)
    args = p.parse_args()
    if args.threads:
        import tensorflow as tf

        tf.config.threading.set_intra_op_parallelism_threads(args.threads)
        tf.config.threading.set_inter_op_parallelism_threads(args.threads)
        import threadpoolctl  # NumPy's BLAS too (the engine's products)

        threadpoolctl.threadpool_limits(args.threads)
    data_images = RANDOM_IMAGES
    if args.quick:
        from hope_keras.stats import synthetic

        args.size, args.flops, args.repeats, data_images = QUICK_RESNET_SIZE, 0.95, 1, 16
        synthetic.SYNTHETIC_INPUTS, synthetic.SYNTHETIC_STEPS = 4, 5  # seconds, not minutes
    out = {"flops_target": args.flops, "cpus": os.cpu_count(), "threads": args.threads}
    results = RESULTS
    if args.threads or args.latency_only:
        results = RESULTS.replace(".json", f"{'_latency' if args.latency_only else ''}"
                                  f"{'_threads%d' % args.threads if args.threads else ''}.json")
    path = quick_path("peers_torch.json") if args.quick else results + ".torch.tmp"
    if os.path.exists(args.torch_python):
        out["torch_pruning"] = torch_side(args.torch_python, args.size, args.flops,
                                          args.repeats, path, args.threads)
        if not args.quick:
            os.remove(path)
    elif args.quick:
        print(f"Torch side skipped: no interpreter at {args.torch_python} (the Keras "
              "side alone is checked)", flush=True)
    else:
        sys.exit(f"No torch interpreter at {args.torch_python}: create it (docs/"
                 "benchmarks.md, 'Beside a peer') or pass --torch-python.")
    out["hope_keras"] = keras_side(args.size, args.flops, args.repeats, data_images,
                                   args.latency_only)
    print(f"wrote {write_results(results, out, args.quick)}")


if __name__ == "__main__":
    main()
