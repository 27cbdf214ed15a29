"""Measured latency ratio against FLOPs ratio of slimmed models, with and without
``round_to`` (`hope_keras.SearchOptions(round_to=...)`, docs/hope.md, "Widths that suit the
hardware").

Per model: one run to the lowest FLOPs point per ``round_to`` (statistics correction
off: it changes weights, not shapes, and latency depends on shapes only), replayed to
each point, slimmed, and timed against the original with `hope_keras.profile`
(`paired_timing`: the two alternate, and the ratio is the median of the per-round
ratios; ``"call"``: the compiled ``model(x)``, as `hope_keras.profile` times it;
``--tflite``: also the float32 TFLite interpreter at batch 1). Weights are random with BatchNorm statistics
re-estimated on random inputs and random γ/β, as a trained network's are non-trivial
(latency does not depend on their values). The load average of the machine is
recorded before and after each model (the machine may be shared).

Run: .venv/bin/python benchmarks/latency.py [--models demo xception mobilenetv2
     efficientnetb0 resnet50] [--points 0.8 0.6 0.4] [--batches 1 32]
     [--round-to 1 8] [--repeats 9] [--seconds 3] [--tflite] [--quick]
Writes benchmarks/results/latency_<model>.json per model; ``--report`` prints the
tables of docs/benchmarks.md from them. ``--fold-batchnorm``: each slimmed model also
with its BNs folded (`hope_keras.fold_batchnorm`), timed against the original and
against the original folded too (latency_<model>_fold.json).

``--latency-budget R [--budget-batch B]``: instead, per model one
``compress(latency=LatencyBudget(R, batch_size=B))`` run (`hope_keras.search.latency`:
FLOPs target lowered by measurement until the measured ratio is ≤ R; statistics
correction off), its rounds, and an independent re-measurement of the result with
`paired_timing` (``--repeats`` rounds at least, ``--seconds``); for comparison, also
three `hope_keras.profile` ratios of the two medians (30 runs each) and three
`hope_keras.latency_ratio` calls (30 rounds each). Writes
benchmarks/results/latency_budget_<model>_b<B>.json.
"""

import argparse
import json
import os
import time
from pathlib import Path

import keras
import numpy as np
from _common import add_quick, write_results

import hope_keras

L = keras.layers
RESULTS = Path(__file__).parent / "results"


def mini_xception(size=64, widths=(16, 32, 64, 128), classes=7):
    """The FER mini-Xception: two 3 × 3 convs, then per width a residual module of two
    SeparableConv2D + BN (+ ReLU) with a strided 1 × 1 Conv + BN projection."""
    inputs = keras.Input((size, size, 3))
    x = inputs
    for k in range(2):
        x = L.ReLU()(L.BatchNormalization()(L.Conv2D(8, 3, use_bias=False)(x)))
    for w in widths:
        shortcut = L.BatchNormalization()(L.Conv2D(w, 1, strides=2, padding="same",
                                                   use_bias=False)(x))
        y = L.ReLU()(L.BatchNormalization()(L.SeparableConv2D(w, 3, padding="same",
                                                              use_bias=False)(x)))
        y = L.BatchNormalization()(L.SeparableConv2D(w, 3, padding="same",
                                                     use_bias=False)(y))
        y = L.MaxPooling2D(3, strides=2, padding="same")(y)
        x = L.Add()([y, shortcut])
    x = L.Conv2D(classes, 3, padding="same")(x)
    outputs = L.Softmax()(L.GlobalAveragePooling2D()(x))
    return keras.Model(inputs, outputs, name="mini_xception")


def build(name, quick):
    """The model, its weights seeded, with non-trivial BatchNorm statistics."""
    keras.utils.set_random_seed(0)
    if name == "demo":
        from hope_keras.data import load_demo_model

        return load_demo_model()
    size = {"xception": 64, "mobilenetv2": 128, "efficientnetb0": 128,
            "resnet50": 224}[name]
    if quick:
        size = 32
    if name == "xception":
        model = mini_xception(size)
    else:
        builder = {"mobilenetv2": keras.applications.MobileNetV2,
                   "efficientnetb0": keras.applications.EfficientNetB0,
                   "resnet50": keras.applications.ResNet50}[name]
        model = builder(weights=None, input_shape=(size, size, 3))
    rng = np.random.default_rng(0)
    hope_keras.reestimate_batchnorm_statistics(
        model, rng.uniform(0, 255, (8, size, size, 3)).astype("float32"), batch_size=8)
    for layer in model.layers:
        if isinstance(layer, L.BatchNormalization):
            n = layer.gamma.shape[0]
            layer.gamma.assign(rng.uniform(0.3, 1.5, n).astype("float32"))
            layer.beta.assign(rng.normal(0, 0.5, n).astype("float32"))
    return model


def copy(model):
    clone = keras.models.clone_model(model)
    clone.set_weights(model.get_weights())
    return clone


def widths(model):
    """Output channels of the layers with kernels, in order."""
    return [int(layer.output.shape[-1]) for layer in model.layers
            if isinstance(layer, (L.Conv2D, L.Dense, L.SeparableConv2D))
            and not isinstance(layer, L.DepthwiseConv2D)]


def uniform(model, scale):
    """`model`'s architecture (fresh weights) with the output width of every Conv,
    Dense and SeparableConv layer except the output layers scaled by `scale` (rounded,
    at least 1): every residual stream's layers scale alike, so the sums still add."""
    config = model.get_config()
    entries = config["output_layers"]
    # One output is given as its [name, node, tensor]; several as a list of those.
    outputs = {entries[0]} if isinstance(entries[0], str) else {e[0] for e in entries}
    for layer in config["layers"]:
        layer.pop("build_config", None)  # the saved input shapes: rebuilt from the new ones
        shape = layer["config"].get("target_shape")
        if layer["class_name"] == "Reshape" and tuple(shape[:-1]) == (1, 1):
            # A squeeze-and-excitation reshape (1, 1, channels): its channels scale too.
            layer["config"]["target_shape"] = [1, 1, max(1, int(round(shape[-1] * scale)))]
        if layer["name"] in outputs or layer["class_name"] not in (
                "Conv2D", "Dense", "SeparableConv2D"):
            continue
        key = "units" if layer["class_name"] == "Dense" else "filters"
        layer["config"][key] = max(1, int(round(layer["config"][key] * scale)))
    return keras.Model.from_config(config)


def uniform_run(name, args):
    """`--uniform`: the uniformly narrowed models against the original (module doc)."""
    from hope_keras.deploy.profile import _runners

    model = build(name, args.quick)
    shape = tuple(model.inputs[0].shape[1:])
    rng = np.random.default_rng(0)
    load_before = os.getloadavg()
    original_folded = hope_keras.fold_batchnorm(model)
    rows = []
    for scale in args.uniform:
        small = uniform(model, scale)
        p = hope_keras.profile(small, reference=model, latency=False)
        small_folded = hope_keras.fold_batchnorm(small)
        for batch in args.batches:
            x = rng.normal(size=(batch,) + shape).astype("float32")
            run = {key: _runners(m, x, ("call",), None)[0]
                   for key, m in (("small", small), ("original", model),
                                  ("small_folded", small_folded),
                                  ("original_folded", original_folded))}
            as_is = paired_timing(run["small"], run["original"], ("call",), args.repeats,
                                  args.seconds)["call"]
            folded = paired_timing(run["small_folded"], run["original_folded"], ("call",),
                                   args.repeats, args.seconds)["call"]
            row = {"scale": scale, "batch": batch, "flops_ratio": p.ratio("flops"),
                   "params_ratio": p.ratio("params"), "call": as_is,
                   "call_both_folded": folded, "widths": widths(small),
                   "load": os.getloadavg()[0]}
            rows.append(row)
            print(f"{name:>14} widths × {scale} batch={batch:>2}: FLOPs "
                  f"{row['flops_ratio']:.3f}, latency {as_is['ratio']:.3f} (both folded "
                  f"{folded['ratio']:.3f}), load {row['load']:.1f}", flush=True)
    out = {"model": name, "input_shape": list(shape), "scales": args.uniform,
           "batches": args.batches, "min_rounds": args.repeats,
           "seconds_per_point": args.seconds, "load_before": load_before,
           "load_after": os.getloadavg(), "cpu_count": os.cpu_count(), "rows": rows}
    path = write_results(RESULTS / f"latency_uniform_{name}.json", out, args.quick)
    print(f"wrote {path}", flush=True)


def _uniform_report():
    """docs/benchmarks.md's table of the ``--uniform`` runs: per model and batch,
    latency as is / both folded (FLOPs ratio) at each scale."""
    lines = []
    for label, data in _results("", prefix="latency_uniform_"):
        if not lines:
            lines = ["| model (input), batch | " + " | ".join(
                f"widths × {s}" for s in data["scales"]) + " |",
                "|---" * (len(data["scales"]) + 1) + "|"]
        for batch in sorted(data["batches"], reverse=True):
            cells = []
            for scale in data["scales"]:
                row = next(x for x in data["rows"] if x["scale"] == scale
                           and x["batch"] == batch)
                cells.append(f"{row['call']['ratio']:.2f} / "
                             f"{row['call_both_folded']['ratio']:.2f} "
                             f"({row['flops_ratio']:.2f})")
            lines.append(f"| {label}, {batch} | " + " | ".join(cells) + " |")
    return lines


def paired_timing(small, reference, methods, min_repeats, seconds):
    """Per method: the slimmed and the original model run alternately (the order
    swapping each round) until both `min_repeats` rounds and `seconds` are done (at
    most 200 rounds). The ratio is the median of the per-round ratios: a slow spell
    of a shared machine hits both runs of a round alike. Also the ratio of the
    fastest runs, and the medians in ms."""
    out = {}
    for m in methods:
        a, b = small[m], reference[m]
        for _ in range(2):
            a(), b()
        ta, tb = [], []
        start, k = time.perf_counter(), 0
        while k < min_repeats or (time.perf_counter() - start < seconds and k < 200):
            for fn, times in (((a, ta), (b, tb)) if k % 2 == 0 else ((b, tb), (a, ta))):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            k += 1
        ta, tb = np.array(ta), np.array(tb)
        out[m] = {"ratio": float(np.median(ta / tb)), "ratio_fastest": float(ta.min() / tb.min()),
                  "ms": 1e3 * float(np.median(ta)), "original_ms": 1e3 * float(np.median(tb)),
                  "rounds": k}
    return out


def measure(name, args):
    from hope_keras.deploy.profile import _runners

    model = build(name, args.quick)
    rows = []
    load_before = os.getloadavg()
    shape = tuple(model.inputs[0].shape[1:])
    rng = np.random.default_rng(0)
    batches = {b: rng.normal(size=(b,) + shape).astype("float32") for b in args.batches}
    methods = {b: ("call", "tflite") if args.tflite and b == 1 else ("call",)
               for b in args.batches}
    reference = {b: _runners(model, batches[b], methods[b], None)[0] for b in args.batches}
    if args.fold_batchnorm:  # the original with its BNs folded too: like against like
        original_folded = hope_keras.fold_batchnorm(model)
        reference_folded = {b: _runners(original_folded, batches[b], ("call",), None)[0]
                            for b in args.batches}
    for r in args.round_to:
        t0 = time.perf_counter()
        enc = hope_keras.Encoder(copy(model), search={"round_to": r}, correction=False, verbose=False)
        # Groups of round_to channels or fewer stay whole: some points may be out of reach.
        reachable = [p for p in args.points if p > enc.min_reachable()[2] + 1e-9]
        for point in sorted(set(args.points) - set(reachable), reverse=True):
            rows.append({"round_to": r, "flops_budget": point, "out_of_reach": True,
                         "min_flops_ratio": enc.min_reachable()[2]})
            print(f"{name:>14} round_to={r} flops={point}: out of reach (at least "
                  f"{enc.min_reachable()[2]:.3f})", flush=True)
        if not reachable:
            continue
        result = enc.compress(flops=min(reachable))
        seconds = time.perf_counter() - t0
        for point in reachable:
            m = result.trajectory.replay(copy(model), flops=point)
            small = hope_keras.slim(m)
            p = hope_keras.profile(small, reference=model, latency=False)
            for batch in args.batches:
                runners = _runners(small, batches[batch], methods[batch], None)[0]
                timing = paired_timing(runners, reference[batch], methods[batch],
                                       args.repeats, args.seconds)
                if args.fold_batchnorm:
                    folded = _runners(hope_keras.fold_batchnorm(small), batches[batch],
                                      ("call",), None)[0]
                    timing["call_folded"] = paired_timing(
                        folded, reference[batch], ("call",), args.repeats,
                        args.seconds)["call"]
                    timing["call_both_folded"] = paired_timing(
                        folded, reference_folded[batch], ("call",), args.repeats,
                        args.seconds)["call"]
                row = {"round_to": r, "flops_budget": point, "batch": batch,
                       "flops_ratio": p.ratio("flops"), "params_ratio": p.ratio("params"),
                       "latency": timing, "load": os.getloadavg()[0],
                       "compress_seconds": seconds, "widths": widths(small)}
                rows.append(row)
                lat = " ".join(f"{k} {v['ratio']:.3f} (fastest {v['ratio_fastest']:.3f}, "
                               f"{v['rounds']} rounds)" for k, v in timing.items())
                print(f"{name:>14} round_to={r} flops={point} batch={batch:>2}: FLOPs "
                      f"{row['flops_ratio']:.3f}, params {row['params_ratio']:.3f}, "
                      f"latency {lat}; original {timing['call']['original_ms']:.2f} ms, "
                      f"load {row['load']:.1f}", flush=True)
    out = {"model": name, "input_shape": list(shape),
           "points": args.points, "batches": args.batches, "min_rounds": args.repeats,
           "seconds_per_point": args.seconds,
           "load_before": load_before, "load_after": os.getloadavg(),
           "cpu_count": os.cpu_count(), "rows": rows}
    path = RESULTS / f"latency_{name}{'_fold' if args.fold_batchnorm else ''}.json"
    path = write_results(path, out, args.quick)
    print(f"load average {load_before[0]:.2f} before, {out['load_after'][0]:.2f} after; "
          f"wrote {path}", flush=True)


def budget_run(name, args):
    """One latency-budget run on `name`, and its re-measurement (module doc)."""
    from hope_keras.deploy.profile import _runners

    model = build(name, args.quick)
    load_before, t0 = os.getloadavg(), time.perf_counter()
    budget = hope_keras.LatencyBudget(args.latency_budget, batch_size=args.budget_batch)
    enc = hope_keras.Encoder(copy(model), correction=False, verbose=True)
    result = enc.compress(latency=budget)
    seconds = time.perf_counter() - t0
    rounds = result.trajectory.meta["latency"]["rounds"]
    small = hope_keras.slim(enc.model)
    shape = tuple(model.inputs[0].shape[1:])
    x = np.random.default_rng(1).normal(size=(args.budget_batch,) + shape).astype("float32")
    check = paired_timing(_runners(small, x, ("call",), None)[0],
                          _runners(model, x, ("call",), None)[0], ("call",),
                          args.repeats, args.seconds)["call"]
    estimators = {"profile_ratio_of_medians": [], "latency_ratio": []}
    for _ in range(3):
        estimators["profile_ratio_of_medians"].append(hope_keras.profile(
            small, reference=model, x=x, methods=("call",), repeats=30).ratio("call"))
        estimators["latency_ratio"].append(hope_keras.latency_ratio(small, model, x=x))
    out = {"model": name, "input_shape": list(shape), "latency_budget": args.latency_budget,
           "batch": args.budget_batch, "stopped": result.stopped,
           "latency_ratio": result.latency_ratio, "flops_ratio": result.flops_ratio,
           "params_ratio": result.params_ratio, "steps": len(result.trajectory),
           "rounds": rounds, "seconds": seconds,
           "measure_seconds": sum(r["seconds"] for r in rounds), "remeasured": check, "estimators": estimators,
           "load_before": load_before, "load_after": os.getloadavg(),
           "cpu_count": os.cpu_count()}
    path = RESULTS / f"latency_budget_{name}_b{args.budget_batch}.json"
    path = write_results(path, out, args.quick)
    print(f"{name}: latency={args.latency_budget} (batch {args.budget_batch}): measured "
          f"{result.latency_ratio:.3f} after {len(rounds)} rounds ({result.stopped}), "
          f"FLOPs {result.flops_ratio:.3f}, params {result.params_ratio:.3f}; re-measured "
          f"{check['ratio']:.3f} ({check['rounds']} rounds, original "
          f"{check['original_ms']:.1f} ms); {seconds:.0f} s, of which measuring "
          f"{out['measure_seconds']:.0f} s; load {load_before[0]:.1f} → "
          f"{out['load_after'][0]:.1f}; estimators {estimators}; wrote {path}", flush=True)


def _cells(data, point):
    """{round_to: {"flops": ratio, (method, batch): latency ratio, "load": max} or None
    (out of reach)} of one FLOPs budget."""
    cells = {}
    for row in data["rows"]:
        if row["flops_budget"] != point:
            continue
        r = row["round_to"]
        if row.get("out_of_reach"):
            cells[r] = None
            continue
        c = cells.setdefault(r, {})
        c["flops"] = row["flops_ratio"]
        c["load"] = max(c.get("load", 0), row["load"])
        for method, t in row["latency"].items():
            c[(method, row["batch"])] = t["ratio"]
    return cells


def _pair(cells, key):
    return " → ".join("—" if cells.get(r) is None or key not in cells[r]
                      else f"{cells[r][key]:.2f}" for r in (1, 8))


def _results(suffix, prefix="latency_"):
    """``(label, data)`` of each model's results file ``<prefix><model><suffix>.json``
    that exists, in the tables' order."""
    for name in ("demo", "xception", "mobilenetv2", "efficientnetb0", "resnet50"):
        path = RESULTS / f"{prefix}{name}{suffix}.json"
        if path.exists():
            data = json.loads(path.read_text())
            yield f"{name} ({data['input_shape'][0]})", data


def report():
    """Prints the docs/benchmarks.md table (Keras call at the largest batch, FLOPs ratio
    in brackets) and writes every measurement to benchmarks/results/latency.md, from
    benchmarks/results/latency_*.json; each cell is ``round_to`` 1 → 8."""
    short = ["| model (input) | FLOPs 0.8 | FLOPs 0.6 | FLOPs 0.4 |", "|---|---|---|---|"]
    full = ["| model (input) | budget | FLOPs | call, batch 32 (8) | call, batch 1 | "
            "TFLite, batch 1 | load |", "|---|---|---|---|---|---|---|"]
    for label, data in _results(""):
        batch = max(data["batches"])
        row = [label]
        for point in data["points"]:
            cells = _cells(data, point)
            row.append(f"{_pair(cells, ('call', batch))} ({_pair(cells, 'flops')})")
            loads = [c["load"] for c in cells.values() if c]
            full.append(f"| {label} | {point} | {_pair(cells, 'flops')} | "
                        f"{_pair(cells, ('call', batch))} | {_pair(cells, ('call', 1))} | "
                        f"{_pair(cells, ('tflite', 1))} | {min(loads):.0f}–{max(loads):.0f} |")
        short.append("| " + " | ".join(row) + " |")
    print("\n".join(short))
    folded = _fold_report()
    print("\n".join(folded["short"]))
    print("\n".join(_uniform_report()))
    (RESULTS / "latency.md").write_text(
        "Latency ratio (slimmed / original) against FLOPs ratio, round_to 1 → 8: "
        "`benchmarks/latency.py --report` from latency_*.json (docs/benchmarks.md, "
        "\"Latency\").\n\n" + "\n".join(full) + "\n\n"
        "With `--fold-batchnorm` (latency_*_fold.json), per round_to and batch: the slimmed "
        "model as is / folded / folded against the original folded too (FLOPs ratio).\n\n"
        + "\n".join(folded["full"]) + "\n\n"
        "With `--uniform` (latency_uniform_*.json), every width scaled alike: latency as is / "
        "with both models folded (FLOPs ratio).\n\n" + "\n".join(_uniform_report()) + "\n")


def _fold_report():
    """The tables of the ``--fold-batchnorm`` runs: docs/benchmarks.md's (round_to 1,
    the largest batch) and every row for latency.md."""
    short = ["| model (input), batch | FLOPs 0.8 | FLOPs 0.6 | FLOPs 0.4 |", "|---|---|---|---|"]
    full = ["| model (input) | round_to | batch | FLOPs 0.8 | FLOPs 0.6 | FLOPs 0.4 |",
            "|---|---|---|---|---|---|"]
    for label, data in _results("_fold"):
        for r in sorted({row["round_to"] for row in data["rows"]}):
            for batch in sorted(data["batches"], reverse=True):
                cells = []
                for point in data["points"]:
                    row = next((x for x in data["rows"] if x["round_to"] == r and
                                x["flops_budget"] == point and x.get("batch") == batch), None)
                    if row is None:
                        cells.append("—")
                        continue
                    t = row["latency"]
                    cells.append(f"{t['call']['ratio']:.2f} / {t['call_folded']['ratio']:.2f}"
                                 f" / {t['call_both_folded']['ratio']:.2f} "
                                 f"({row['flops_ratio']:.2f})")
                full.append(f"| {label} | {r} | {batch} | " + " | ".join(cells) + " |")
                if r == 1:
                    short.append(f"| {label}, {batch} | " + " | ".join(cells) + " |")
    return {"short": short, "full": full}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["demo", "xception", "mobilenetv2",
                                                    "efficientnetb0", "resnet50"],
                    choices=("demo", "xception", "mobilenetv2", "efficientnetb0",
                             "resnet50"))
    ap.add_argument("--points", type=float, nargs="+", default=[0.8, 0.6, 0.4],
                    help="FLOPs ratios (compress(flops=...)) to slim to")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--round-to", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--repeats", type=int, default=9,
                    help="timed rounds at least (slimmed and original alternately)")
    ap.add_argument("--seconds", type=float, default=3.0,
                    help="timed rounds go on until this many seconds per point")
    ap.add_argument("--tflite", action="store_true", help="also time TFLite at batch 1")
    ap.add_argument("--fold-batchnorm", action="store_true",
                    help="also time fold_batchnorm(slim) against the original and against "
                         "the original folded (results latency_<model>_fold.json)")
    ap.add_argument("--latency-budget", type=float, metavar="R",
                    help="instead: one compress(latency=R) run per model, re-measured")
    ap.add_argument("--budget-batch", type=int, default=1, metavar="B",
                    help="with --latency-budget: the batch size timed (default 1)")
    ap.add_argument("--uniform", type=float, nargs="+", metavar="S",
                    help="instead: every width scaled by S, timed against the original")
    ap.add_argument("--report", action="store_true",
                    help="print the docs/benchmarks.md table from the results, run nothing")
    add_quick(ap)
    args = ap.parse_args()
    if args.report:
        report()
        return
    if args.quick:
        args.models, args.points, args.batches, args.repeats, args.seconds = (
            ["demo", "xception"], [0.6], [1], 2, 0.0)
    if args.quick and args.uniform:
        args.uniform = args.uniform[:1]
    for name in args.models:
        run = (budget_run if args.latency_budget else uniform_run if args.uniform
               else measure)
        run(name, args)
    if args.quick and not (args.uniform or args.latency_budget):
        args.uniform = [0.5]  # the --uniform path too, on the first model
        uniform_run(args.models[0], args)


if __name__ == "__main__":
    main()
