"""The first default `compress` a user runs: its time, and the accuracy it keeps.

``--time`` (default): `keras.applications.ResNet50(weights=None)` with calibrated BN
statistics and random γ/β (`_common.calibrated_resnet50`) at 224 × 224 (``--size
32``: at 32 × 32), in one process: T, the median of 5 batch-8 forward passes
(``model(x, training=False)``) after a warm-up; then, each on a fresh model with the
same weights, the first data-free ``compress(density=0.5)`` (synthetic inputs made:
`HOPE_KERAS_CACHE` is off), a second one (the inputs are kept in memory), and
``compress(density=0.5, data=x)`` with 256 random images (``--values-per-channel V``:
the sample's rule, the file named ``..._valuesV``). Each in seconds and in T.

``--quality``: the ResNet-50 fixture (`.cache/resnet50_fmnist.keras`, 32 × 32,
scripts/make_benchmark_fixtures.py), held-out split (the 1000 test images after the
bundled 2000; ``--heldout N``: N of them, up to 8000) and selection split (the first
1000 bundled ones); ``--reestimated``: each ``data=`` model also with every BN
re-estimated on the data, at densities 0.9 …
0.5 and FLOPs 0.8 / 0.6 / 0.5: the data-free default, and ``data=`` with 1024
Fashion-MNIST training images (``--data-inputs N``: N of them, the results file named
``..._inputsN``; ``--values-per-channel V``: the sample's rule, default the library's
`DATA_VALUES_PER_CHANNEL`, the file named ``..._valuesV``; ``--data-correction
trusted|readers|parents-moved|stream-formula|stream-formula-stale|damped-readers|regression``:
which BNs ``data=`` measures and how, `use_data_correction`;
``--data-offset K``: the training images K … K + N − 1 instead, the file named
``..._offsetK``).
``--fixture PATH``: another saved model of the fixture's recipe instead (the results
file named after it). ``--compare-readers D …``: what the stream readers' correction
writes from the synthetic inputs and from the data, reader by reader, at densities D
(`compare_readers`; ``first_run_readers.json``).
``--quick``: density 0.9 only. ``--moments backend``: the corrections measure the BN
inputs' moments with the backend's float32 reductions instead of the compiled kernel
(results files ``..._backend_moments``). ``--synthesis xla``: the synthetic inputs'
Adam step compiled by XLA (`synthetic.SYNTHESIS_XLA`; results files
``..._xla_synthesis``). ``--original-pass in-turn``: ``data=`` measures
the original model before the first edit instead of on a thread beside the run
(`correction.MEASURE_ALONGSIDE`; results files ``..._in_turn``).
``--compare-original-pass``: both ways alternated in one process (``--repeats``), for
the second data-free run and the ``data=`` run
(``first_run_original_pass_<size>.json``). ``--compare-values V …``: the ``data=`` run
with each sample rule, alternated (``--repeats``; ``first_run_values_<size>.json``).

Run: .venv/bin/python benchmarks/first_run.py [--time] [--quality] [--quick]
Writes benchmarks/results/first_run_<time|quality>.json (not with --quick).
"""

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from _common import calibrated_resnet50, forward_time, write_results  # noqa: E402

import keras  # noqa: E402

import hope_keras  # noqa: E402

RESULTS = os.path.join(os.path.dirname(__file__), "results")
DENSITIES = (0.9, 0.8, 0.7, 0.6, 0.5)
FLOPS = (0.8, 0.6, 0.5)


def batch_time(model, size):
    """T: one batch-8 forward pass at `size` × `size` (`_common.forward_time`)."""
    x = np.random.default_rng(1).uniform(0, 255, (8, size, size, 3)).astype("float32")
    return forward_time(model, x)


def timing(size, quick, only=None):
    from hope_keras.stats import bn_stats

    shape = (size, size, 3)
    reference = calibrated_resnet50(images=4) if size == 224 else None
    if reference is None:
        reference = keras.applications.ResNet50(weights=None, input_shape=shape, classes=10)
        reference.set_weights(calibrated_resnet50(images=4, size=size, builder=lambda weights, **_: (
            keras.applications.ResNet50(weights=None, input_shape=shape, classes=10)
        )).get_weights())
    weights = reference.get_weights()
    T = batch_time(reference, size)
    out = {"size": size, "T_s": round(T, 3)}
    print(f"T (batch-8 forward, {size}x{size}): {T:.3f} s", flush=True)
    data = np.random.default_rng(2).uniform(0, 255, (256,) + shape).astype("float32")
    runs = [("first data-free", None), ("second data-free", None), ("data=256 inputs", data)]
    if quick or only == "data":
        runs = runs[2:]
    elif only == "data-free":
        runs = runs[:2]
    bn_stats._SYNTHETIC_INPUTS.clear()
    for label, x in runs:
        model = keras.models.clone_model(reference)
        model.set_weights(weights)
        t = time.perf_counter()
        result = hope_keras.compress(model, density=0.5, data=x, verbose=False)
        seconds = time.perf_counter() - t
        out[label] = {"s": round(seconds, 2), "T": round(seconds / T, 1),
                      "steps": len(result.trajectory), "corrected": len(result.corrected)}
        print(f"{label}: {seconds:.2f} s = {seconds / T:.1f} T "
              f"({len(result.trajectory)} steps, {len(result.corrected)} BNs corrected)",
              flush=True)
    return out


def compare_original_pass(size, repeats):
    """The second data-free run and the ``data=`` run of `timing`, each with the
    original model's pass beside the run and in turn (`correction.MEASURE_ALONGSIDE`),
    alternated `repeats` times in one process after a first data-free run (which
    makes the synthetic inputs); T measured before each round."""
    from hope_keras.stats import correction

    reference = calibrated_resnet50(images=4)
    weights = reference.get_weights()
    shape = (size, size, 3)
    data = np.random.default_rng(2).uniform(0, 255, (256,) + shape).astype("float32")
    model = keras.models.clone_model(reference)
    model.set_weights(weights)
    hope_keras.compress(model, density=0.5, verbose=False)  # the synthetic inputs
    rows = []
    for rep in range(repeats):
        T = batch_time(reference, size)
        for x in (None, data):
            for alongside in (True, False):
                correction.MEASURE_ALONGSIDE = alongside
                rows.append(dict(run="data-free, inputs kept" if x is None else "data=",
                                 original_pass="alongside" if alongside else "in turn",
                                 repeat=rep, **_timed(reference, weights, x, T)))
                print(json.dumps(rows[-1]), flush=True)
    correction.MEASURE_ALONGSIDE = True
    return {"size": size, "rows": rows}


def compare_values(size, values, repeats):
    """The ``data=`` run of `timing` with each sample rule of `values` (values per
    channel, `correction.DATA_VALUES_PER_CHANNEL`), alternated `repeats` times in one
    process; T measured before each round."""
    from hope_keras.stats import correction

    default = correction.DATA_VALUES_PER_CHANNEL
    reference = calibrated_resnet50(images=4, size=size)
    weights = reference.get_weights()
    data = np.random.default_rng(2).uniform(0, 255, (256, size, size, 3)).astype("float32")
    rows = []
    try:
        for rep in range(repeats):
            T = batch_time(reference, size)
            for v in values:
                correction.DATA_VALUES_PER_CHANNEL = v
                rows.append(dict(values_per_channel=v, repeat=rep,
                                 **_timed(reference, weights, data, T)))
                print(json.dumps(rows[-1]), flush=True)
    finally:
        correction.DATA_VALUES_PER_CHANNEL = default
    return {"size": size, "rows": rows}


def _timed(reference, weights, x, T):
    """`compress(density=0.5, data=x)` of a fresh copy of `reference` holding
    `weights`: its seconds, in T too, and the load."""
    model = keras.models.clone_model(reference)
    model.set_weights(weights)
    t = time.perf_counter()
    result = hope_keras.compress(model, density=0.5, data=x, verbose=False)
    seconds = time.perf_counter() - t
    return dict(s=round(seconds, 2), T_s=round(T, 3), T=round(seconds / T, 1),
                steps=len(result.trajectory), load=round(os.getloadavg()[0], 2))


#: ``--variants``: synthetic-input settings (constants of `hope_keras.stats.synthetic`)
#: whose first data-free run is timed, alternated, in one process.
VARIANTS = {
    "default": {},
    "half→full": dict(COARSE_FRACTION=1.0, COARSE_SCALE=2),
    "quarter→full": dict(COARSE_FRACTION=1.0, COARSE_SCALE=4),
    "half→full 50 steps": dict(COARSE_FRACTION=1.0, COARSE_SCALE=2, SYNTHETIC_STEPS=50),
    "quarter→full 50 steps": dict(COARSE_FRACTION=1.0, COARSE_SCALE=4, SYNTHETIC_STEPS=50),
    "half@half": dict(MEASURE_SCALE=2),
    "quarter@quarter": dict(MEASURE_SCALE=4),
    "half@half 50 steps": dict(MEASURE_SCALE=2, SYNTHETIC_STEPS=50),
    "quarter@quarter 50 steps": dict(MEASURE_SCALE=4, SYNTHETIC_STEPS=50),
    # Fewer steps, all at the full size (as at 32 × 32, where no step is coarse).
    "full 25 steps": dict(COARSE_FRACTION=0.0, SYNTHETIC_STEPS=25),
    "full 12 steps": dict(COARSE_FRACTION=0.0, SYNTHETIC_STEPS=12),
}


def variants(size, names, repeats):
    """The first data-free ``compress(density=0.5)`` under each synthetic-input
    setting of `names` (`VARIANTS`), alternated `repeats` times, with T measured
    before each run in the same process."""
    from hope_keras.stats import bn_stats, synthetic

    shape = (size, size, 3)
    reference = calibrated_resnet50(images=4)
    weights = reference.get_weights()
    defaults = {k: getattr(synthetic, k) for v in VARIANTS.values() for k in v}
    rows = []
    for rep in range(repeats):
        for name in names:
            T = batch_time(reference, size)  # before each run: the load drifts
            for k, v in {**defaults, **VARIANTS[name]}.items():
                setattr(synthetic, k, v)
            bn_stats._SYNTHETIC_INPUTS.clear()
            model = keras.models.clone_model(reference)
            model.set_weights(weights)
            load = os.getloadavg()[0]
            t = time.perf_counter()
            result = hope_keras.compress(model, density=0.5, verbose=False)
            seconds = time.perf_counter() - t
            rows.append(dict(variant=name, repeat=rep, s=round(seconds, 2),
                             T_s=round(T, 3), T=round(seconds / T, 1),
                             load=round(load, 2), load_after=round(os.getloadavg()[0], 2),
                             corrected=len(result.corrected)))
            print(json.dumps(rows[-1], ensure_ascii=False), flush=True)
    for k, v in defaults.items():
        setattr(synthetic, k, v)
    return {"size": size, "shape": list(shape), "rows": rows}


def quality(quick, data_inputs, only=None, heldout=1000, reestimated=False, data_offset=0):
    import quality as Q

    model, splits, _ = Q.load_splits("resnet50", 1000, heldout)
    ev = Q.Evaluator(model, splits)
    original = [w.numpy().copy() for w in model.weights]
    train = _training_images(data_inputs, data_offset)
    points = [("density", d) for d in DENSITIES] + [("flops", f) for f in FLOPS]
    if quick:
        points = points[:1]
    acc, _ = ev()
    out = {"uncompressed": acc}
    print(f"uncompressed: held-out {100 * acc['heldout']:.1f}, selection "
          f"{100 * acc['sel']:.1f}", flush=True)
    runs = [("data-free", None), (f"data={len(train)} training images", train)]
    if only:
        runs = [r for r in runs if (r[1] is None) == (only == "data-free")]
    for label, data in runs:
        for axis, value in points:
            for w, v in zip(model.weights, original):
                w.assign(v)
            t = time.perf_counter()
            hope_keras.compress(model, **{axis: value}, data=data, verbose=False)
            seconds = time.perf_counter() - t
            acc, _ = ev()
            out.setdefault(label, {})[f"{axis} {value}"] = {**acc, "s": round(seconds, 1)}
            print(f"{label} {axis} {value}: held-out {100 * acc['heldout']:.1f}, "
                  f"selection {100 * acc['sel']:.1f} ({seconds:.1f} s)", flush=True)
            if reestimated and data is not None:
                # The statistics the data itself gives: every BN re-estimated on it.
                hope_keras.reestimate_batchnorm_statistics(model, data)
                acc, _ = ev()
                out.setdefault(label + ", then every BN re-estimated on it", {})[
                    f"{axis} {value}"] = acc
                print(f"  then every BN re-estimated on the data: held-out "
                      f"{100 * acc['heldout']:.1f}, selection {100 * acc['sel']:.1f}",
                      flush=True)
    return out


def use_data_correction(name):
    """``--data-correction``: which BNs ``data=`` measures on the data (the library
    measures every stale one: ``"stale"``). ``"trusted"``: the surrogate's prediction
    where the data-free correction trusts it, every other stale BN measured on the
    data; ``"readers"``: as the data-free correction, with the stream readers measured
    on the data instead of synthetic inputs (the other untrusted BNs left as the run
    leaves them); ``"parents-moved"``: every stale BN, a merged parent's channel moved
    by the change from the channel whose slot it took, like every other channel (the
    library keeps the statistics its merge wrote); ``"stream-formula"`` and
    ``"stream-formula-stale"``: `_use_stream_formula_on_data`; ``"damped-readers"``:
    `_use_damped_readers`; ``"regression"``: `_use_regression_on_data`."""
    if name == "stale":
        return
    if name == "damped-readers":
        _use_damped_readers(DAMPED_READERS)
        return
    if name in ("stream-formula", "stream-formula-stale"):
        _use_stream_formula_on_data(name == "stream-formula-stale")
        return
    if name == "regression":
        _use_regression_on_data(REGRESSION_RHO_MIN)
        return
    if name == "parents-moved":
        from hope_keras.stats import bn_stats

        bn_stats.merged_parents = lambda graph, steps: {}
        return
    from hope_keras.stats import bn_stats, correction, synthetic

    def from_data(self, steps):
        flat = self.graph.flat
        out, untrusted, parents = _surrogate_where_trusted(self, steps)
        stale = bn_stats.downstream_of(self.graph, {s.unit for s in steps})
        readers = {n.index for n in synthetic.stream_readers(self.graph)}
        before = self._original_moments()  # the original's pass, waited for
        out.update(self._correct_on_data(
            {n.index for n in flat.nodes if n.index in before
             and n.inputs[0] in stale and n.inputs[0] in untrusted
             and (name == "trusted" or n.index in readers)}, parents))
        return out

    correction.StatisticsCorrection._from_data = from_data


def _surrogate_where_trusted(fixer, steps):
    """The data-free correction's first part, for the `StatisticsCorrection` `fixer`
    after `steps`: the surrogate's prediction written where it is trusted. Returns (what it
    wrote, the untrusted tensors, the merged parents)."""
    from hope_keras.scoring import moments as moments_lib
    from hope_keras.stats import bn_stats

    graph, flat = fixer.graph, fixer.graph.flat
    untrusted = bn_stats.untrusted_tensors(graph, steps, "auto")
    parents = bn_stats.merged_parents(graph, steps)
    out = bn_stats.apply_correction(flat, fixer.moments, moments_lib.propagate(flat),
                                    untrusted, parents)
    return out, untrusted, parents


#: ``--data-correction damped-readers``: the stream readers' variance ratio on the data
#: raised to this power (the synthetic inputs' log-ratio is about 0.9 of the data's on
#: the readers, `compare_readers`).
DAMPED_READERS = 0.9


def _use_damped_readers(power):
    """``--data-correction damped-readers``: ``data=`` as the library does, with each
    stream reader's variance ratio ``v₁ / v₀`` raised to `power` (a diagnostic: whether
    the data's larger variance correction of the readers is what costs the points
    where the data-free correction is ahead)."""
    from hope_keras.stats import correction, synthetic

    from_data = correction.StatisticsCorrection._from_data

    def damped_from_data(self, steps):
        before = self._original_moments()
        readers = {n.op.name: before[n.index] for n in synthetic.stream_readers(self.graph)
                   if n.index in before}
        measure = synthetic.batch_moments

        def damped(x, bn):
            m1, v1 = measure(x, bn)
            if bn.name not in readers:
                return m1, v1
            v0 = readers[bn.name][1]
            ok = (v0 > 0) & (v1 > 0)
            return m1, np.where(ok, v0 * (v1 / np.where(ok, v0, 1.0)) ** power, v1)

        synthetic.batch_moments = damped
        try:
            return from_data(self, steps)
        finally:
            synthetic.batch_moments = measure

    correction.StatisticsCorrection._from_data = damped_from_data


def _keep_original_weights():
    """`StatisticsCorrection.start` with data also keeps a copy of the weights before
    the first edit (``_weights0``), for the variants that compute from them."""
    from hope_keras.graph import adapter as kg
    from hope_keras.stats import correction

    start = correction.StatisticsCorrection.start

    def start_keeping_weights(self, model, graph, moments):
        if self.data is not None and self._x is None:
            self._weights0 = [np.array(kg.weight_view(w)) for w in model.weights]
        start(self, model, graph, moments)

    correction.StatisticsCorrection.start = start_keeping_weights


def _use_stream_formula_on_data(stale):
    """``--data-correction stream-formula``: the data-free correction with its stream
    readers' reference (`synthetic.StreamReference`: the reader's edited source layer
    applied to the original and the new input) taken on the data instead of synthetic
    inputs; ``stream-formula-stale``: that, then every other stale BN measured on the
    data as the library does (two passes: the readers first)."""
    from hope_keras.stats import bn_stats, correction, synthetic

    def from_data(self, steps):
        flat = self.graph.flat
        out, untrusted, parents = _surrogate_where_trusted(self, steps)
        readers = [n for n in synthetic.stream_readers(self.graph)
                   if n.inputs[0] in untrusted]
        if readers:
            reference = synthetic.StreamReference(
                self.model, self.graph, self._x,
                values=synthetic.snapshot(self.model, self._weights0))
            out.update(synthetic.correct_stream_readers(reference, untrusted))
        if stale:
            before = self._original_moments()
            done = {n.index for n in readers}
            moved = bn_stats.downstream_of(self.graph, {s.unit for s in steps})
            out.update(self._correct_on_data(
                {n.index for n in flat.nodes if n.index in before and n.index not in done
                 and n.inputs[0] in moved}, parents))
        return out

    _keep_original_weights()
    correction.StatisticsCorrection._from_data = from_data


#: ``--data-correction regression``: the smallest correlation a channel's scale is
#: divided by (uncorrelated channels would be scaled to their mean).
REGRESSION_RHO_MIN = 0.1


def _use_regression_on_data(rho_min):
    """``--data-correction regression``: every stale BN (merged parents kept)
    set so that its normalized output on the edited model is the least-squares fit of
    the original's on the same inputs, ``σ = σ_moments / ρ`` (ρ: the per-channel
    correlation of the original's and the edited model's BN input, at least `rho_min`;
    the library matches the moments, ρ = 1), the mean likewise: whether fitting the
    original's activations instead of their variance closes the gap at mild densities."""
    from hope_keras.stats import bn_stats, correction, synthetic

    def from_data(self, steps):
        flat = self.graph.flat
        stale = bn_stats.downstream_of(self.graph, {s.unit for s in steps})
        keep = bn_stats.merged_parents(self.graph, steps)
        todo = {n.index for n in flat.nodes if n.index in self._stats0
                and n.inputs and n.inputs[0] in stale}
        if not todo:
            return {}
        y0s = {}

        def store(node, args, kwargs):
            if node.index in todo:
                y0s[node.index] = np.asarray(args[0], np.float32).reshape(
                    -1, args[0].shape[-1])
            return None

        synthetic.run_graph(flat, self._x, store, synthetic.release_plan(flat),
                            values=synthetic.snapshot(self.model, self._weights0))
        written = {}

        def fit(node, args, kwargs):
            if node.index not in todo:
                return None
            bn = node.op
            y0 = y0s.pop(node.index).astype(np.float64)
            y1 = np.asarray(args[0], np.float64).reshape(-1, args[0].shape[-1])
            m0, m1 = y0.mean(0), y1.mean(0)
            v0, v1 = y0.var(0), y1.var(0)
            c = np.einsum("mc,mc->c", y0 - m0, y1 - m1) / len(y0)
            mean0, var0 = self._stats0[node.index]
            eps = float(bn.epsilon)
            sd0 = np.sqrt(var0 + eps)
            scale = max(float(np.mean(v0)), 1e-30)
            live = (v0 > 1e-6 * scale) & (v1 > 1e-6 * scale)
            if bn.name in keep:
                live[keep[bn.name]] = False
            rho = np.clip(c / np.sqrt(np.where(live, v0 * v1, 1.0)), rho_min, 1.0)
            s = rho * np.sqrt(np.where(live, v0 / np.where(live, v1, 1.0), 1.0)) / sd0
            mean = np.asarray(bn.moving_mean.numpy(), np.float64)
            var = np.asarray(bn.moving_variance.numpy(), np.float64)
            mean = np.where(live, m1 - (m0 - mean0) / (s * sd0), mean)
            var = np.where(live, np.maximum(1.0 / s ** 2 - eps, 0.0), var)
            bn.moving_mean.assign(mean.astype(bn.moving_mean.dtype))
            bn.moving_variance.assign(var.astype(bn.moving_variance.dtype))
            written[bn.name] = (mean, var)
            return None

        synthetic.run_graph(flat, self._x, fit, synthetic.release_plan(flat))
        return written

    _keep_original_weights()
    correction.StatisticsCorrection._from_data = from_data


def compare_readers(densities, data_inputs):
    """``--compare-readers D …``: on the ResNet-50 fixture, what the stream readers'
    correction writes at each density from the synthetic inputs (the data-free
    default) and from `data_inputs` training images (the same formula:
    ``--data-correction stream-formula``), reader by reader: the moving mean's shift
    in units of the standard deviation before it, ``|Δμ| / σ`` (mean over channels),
    and the variance's log-ratio ``ln(σ²_new / σ²)`` (signed and absolute means), with
    the correlation of the two shifts over the channels."""
    import quality as Q
    from hope_keras.stats import synthetic

    model, _, _ = Q.load_splits("resnet50", 1, 1)
    original = [w.numpy().copy() for w in model.weights]
    train = _training_images(data_inputs)
    record, measure = {}, synthetic.correct_stream_readers

    def recording(reference, tensors):
        before = {n.op.name: (np.asarray(n.op.moving_mean.numpy(), np.float64),
                              np.asarray(n.op.moving_variance.numpy(), np.float64))
                  for n in reference.readers}
        out = measure(reference, tensors)
        record.update({name: (before[name], written) for name, written in out.items()})
        return out

    synthetic.correct_stream_readers = recording
    runs = {}
    for source in ("synthetic", "data"):
        if source == "data":
            _use_stream_formula_on_data(stale=False)
        for density in densities:
            for w, v in zip(model.weights, original):
                w.assign(v)
            record.clear()
            hope_keras.compress(model, density=density, verbose=False,
                                data=train if source == "data" else None)
            runs[(source, density)] = dict(record)
    synthetic.correct_stream_readers = measure
    out = {"data_inputs": data_inputs, "densities": {}}
    for density in densities:
        rows = {}
        for name in runs[("synthetic", density)]:
            if name not in runs[("data", density)]:
                continue
            row = {}
            shifts = []
            for source in ("synthetic", "data"):
                (m0, v0), (m1, v1) = runs[(source, density)][name]
                shift = (m1 - m0) / np.sqrt(v0 + 1e-3)
                log_ratio = np.log((v1 + 1e-3) / (v0 + 1e-3))
                shifts.append(shift)
                row[source] = {"abs_shift": round(float(np.mean(np.abs(shift))), 4),
                               "log_var": round(float(np.mean(log_ratio)), 4),
                               "abs_log_var": round(float(np.mean(np.abs(log_ratio))), 4)}
            row["shift_correlation"] = round(float(np.corrcoef(*shifts)[0, 1]), 3)
            rows[name] = row
            print(f"density {density} {name}: {json.dumps(row)}", flush=True)
        out["densities"][str(density)] = rows
    return out


def _training_images(n, offset=0):
    """`n` Fashion-MNIST training images from the `offset`-th, as the fixture sees them
    (in [0, 1], zero-padded to 32 × 32, repeated on 3 channels, as `quality.load_splits`)."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))
    from make_fixtures import load_fashion_mnist

    x = load_fashion_mnist()["x_train"][offset:offset + n].astype("float32") / 255.0
    x = np.pad(x, ((0, 0), (2, 2), (2, 2)))
    return np.repeat(x[..., None], 3, axis=-1)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--time", action="store_true")
    p.add_argument("--quality", action="store_true")
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--data-inputs", type=int, default=1024)
    p.add_argument("--data-offset", type=int, default=0,
                   help="--quality: the data= images start at this training image")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--heldout", type=int, default=1000,
                   help="--quality: held-out test images (after the bundled 2000; at "
                        "most 8000): more of them, less noise in a difference")
    p.add_argument("--reestimated", action="store_true",
                   help="--quality: after each data= run, also every BN re-estimated on "
                        "the data (`reestimate_batchnorm_statistics`), evaluated again")
    p.add_argument("--values-per-channel", type=int,
                   help="the data= sample's rule "
                        "(`stats.correction.DATA_VALUES_PER_CHANNEL`, default the library's)")
    p.add_argument("--data-correction", choices=("stale", "trusted", "readers",
                                                    "parents-moved", "stream-formula",
                                                    "stream-formula-stale",
                                                    "damped-readers", "regression"),
                   default="stale", help="--quality: which BNs data= measures on the "
                   "data (see use_data_correction; the library: stale)")
    p.add_argument("--regression-rho-min", type=float,
                   help="--data-correction regression: REGRESSION_RHO_MIN (0.1)")
    p.add_argument("--only", choices=("data-free", "data"),
                   help="--quality: only the data-free runs or only those with data=")
    p.add_argument("--synthetic-inputs", type=int,
                   help="synthetic inputs of the data-free correction (default: the "
                        "library's)")
    p.add_argument("--synthetic-seed", type=int,
                   help="seed of the data-free correction's synthetic inputs "
                        "(`stats.synthetic.SYNTHETIC_SEED`, default the library's)")
    p.add_argument("--variants", help="comma-separated names of VARIANTS: time the first "
                   "data-free run under each, alternated (--repeats rounds)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--moments", choices=("compiled", "backend"), default="compiled",
                   help="how the corrections measure the BN inputs' moments: the library's "
                        "compiled kernel, or the backend's float32 reductions (its path "
                        "for tensors in an accelerator's memory)")
    p.add_argument("--synthesis", choices=("plain", "xla"), default="plain",
                   help="the synthetic inputs' Adam step as a plain graph (the library's "
                        "default) or compiled by XLA where `synthetic.xla_pays`")
    p.add_argument("--original-pass", choices=("alongside", "in-turn"), default="alongside",
                   help="data=: the original model's pass on a thread beside the run (the "
                        "library's), or before the first edit")
    p.add_argument("--compare-values", type=int, nargs="+", metavar="V",
                   help="the data= run with each sample rule V (values per channel), "
                        "alternated --repeats times in one process")
    p.add_argument("--compare-original-pass", action="store_true",
                   help="time the second data-free run and the data= run with the "
                        "original's pass beside the run and in turn, alternated (--repeats)")
    p.add_argument("--compare-readers", type=float, nargs="+", metavar="D",
                   help="the stream readers' correction from synthetic inputs and from "
                        "the data (--data-inputs) at each density D, reader by reader")
    p.add_argument("--fixture", help="--quality / --compare-readers: this saved model "
                   "instead of the ResNet-50 fixture (the results file named after it)")
    args = p.parse_args()
    fixture = ""
    if args.fixture:
        import quality as Q
        from pathlib import Path

        Q.model_path = lambda name: Path(args.fixture)
        fixture = "_" + Path(args.fixture).stem
    if args.compare_readers:
        out = compare_readers(args.compare_readers, args.data_inputs)
        write_results(os.path.join(RESULTS, f"first_run_readers{fixture}.json"), out)
        return
    if args.compare_original_pass:
        out = compare_original_pass(args.size, args.repeats)
        write_results(os.path.join(RESULTS, f"first_run_original_pass_{args.size}.json"), out)
        return
    if args.compare_values:
        out = compare_values(args.size, args.compare_values, args.repeats)
        write_results(os.path.join(RESULTS, f"first_run_values_{args.size}.json"), out)
        return
    if args.variants:
        names = [n.strip() for n in args.variants.split(",")]
        out = variants(args.size, names, args.repeats)
        write_results(os.path.join(RESULTS, f"first_run_variants_{args.size}.json"), out,
                      ensure_ascii=False)
        return
    suffix = ""
    if args.synthetic_inputs:
        from hope_keras.stats import synthetic

        synthetic.SYNTHETIC_INPUTS = args.synthetic_inputs
        suffix = f"_synthetic{args.synthetic_inputs}"
    if args.synthetic_seed is not None:
        from hope_keras.stats import synthetic

        synthetic.SYNTHETIC_SEED = args.synthetic_seed
        suffix += f"_seed{args.synthetic_seed}"
    if args.moments == "backend":
        from hope_keras.stats import synthetic

        synthetic._host_view = lambda x: None
        suffix += "_backend_moments"
    if args.synthesis == "xla":
        from hope_keras.stats import synthetic

        synthetic.SYNTHESIS_XLA = True
        suffix += "_xla_synthesis"
    if args.original_pass == "in-turn":
        from hope_keras.stats import correction

        correction.MEASURE_ALONGSIDE = False
        suffix += "_in_turn"
    values = ""
    if args.values_per_channel:
        from hope_keras.stats import correction

        correction.DATA_VALUES_PER_CHANNEL = args.values_per_channel
        values = f"_values{args.values_per_channel}"
    if not args.quality:
        args.time = True
    if args.time:
        out = timing(32 if args.quick else args.size, args.quick, args.only)
        if not args.quick:
            write_results(os.path.join(RESULTS, f"first_run_time_{args.size}{suffix}{values}"
                                       f"{'_' + args.only if args.only else ''}.json"), out)
    if args.quality:
        if args.regression_rho_min is not None:
            global REGRESSION_RHO_MIN
            REGRESSION_RHO_MIN = args.regression_rho_min
        use_data_correction(args.data_correction)
        out = quality(args.quick, 256 if args.quick else args.data_inputs, args.only,
                      args.heldout, args.reestimated, args.data_offset)
        if not args.quick:
            if args.heldout != 1000:
                suffix += f"_heldout{args.heldout}"
            if args.data_inputs != 1024:
                suffix += f"_inputs{args.data_inputs}"
            if args.data_offset:
                suffix += f"_offset{args.data_offset}"
            suffix += values
            if args.data_correction != "stale":
                suffix += f"_{args.data_correction}"
            if args.regression_rho_min is not None:
                suffix += f"{args.regression_rho_min:g}"
            if args.reestimated:
                suffix += "_reestimated"
            suffix += fixture
            name = f"first_run_quality{suffix}{'_' + args.only if args.only else ''}.json"
            write_results(os.path.join(RESULTS, name), out)


if __name__ == "__main__":
    main()
