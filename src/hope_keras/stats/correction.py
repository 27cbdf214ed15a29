"""Correcting the BatchNormalization statistics a compression leaves stale.

Every edit changes what the layers after it see: a BatchNormalization downstream of
a pruned, merged or evicted unit normalises with moving statistics of a tensor that
is gone. `StatisticsCorrection` puts them right after a run, one of three ways:

* **with data** (``data=``, any unlabeled inputs): the stale BatchNormalizations are
  moved by the change their inputs show on a sample of the data between the
  original model and the edited one: one forward pass each; nothing synthetic is
  made. The original is measured on a thread while the run edits the model, from
  a copy of its weights taken before the first edit (`MEASURE_ALONGSIDE`).
* **data-free** (``"auto"``, the default): the Gaussian surrogate predicts the new
  statistics where its independence assumptions hold (`hope_keras.scoring.moments`), and
  the readers of a residual stream the run moved are measured on synthetic inputs
  made from the original weights (`hope_keras.stats.synthetic`). Those inputs are made
  only when the run moved such a stream, after the run, and kept for later runs
  from the same weights.
* ``"surrogate"`` (the prediction only, where trusted), True (the prediction for
  every BatchNormalization) or False (none).

A merged parent's channel is never moved by the change from the channel whose slot
it took: its statistics make its BatchNormalization compute the parent exactly and
are not its input's. With data and under the surrogate it keeps them
(`hope_keras.stats.bn_stats.merged_parents`); the stream readers' measurement on
synthetic inputs shifts them by the stream's own move (the edited layer applied to
both inputs).

The `hope_keras.Encoder` owns one and applies it at the end of each ``run``; a
second ``run`` first puts back the statistics the first one wrote, so the
correction always starts from the model's own statistics (docs/theory.md,
"Statistics correction").
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import math
import numbers

import keras
import numpy as np

from hope_keras.graph import adapter as kg
from hope_keras.stats import bn_stats
from hope_keras.stats import inputs as inputs_lib
from hope_keras.graph import layers as layer_rules
from hope_keras.progress import WorkBar, resolve_verbose
from hope_keras.stats import synthetic
from hope_keras.scoring import moments as moments_lib
from hope_keras.edit.editor import defer_keyboard_interrupt
from hope_keras.stats.synthetic import SYNTHETIC_INPUTS

__all__ = ["StatisticsCorrection"]

MODES = (False, True, "auto", "surrogate")

#: With ``data=``: inputs are drawn until every stale BatchNormalization sees at
#: least this many values per channel (its input's spatial positions times the
#: inputs), so a 7 × 7 map needs 21 inputs and a 1 × 1 one 1024 (docs/quality.md,
#: "Compressing with data": 512 and 2048 are within 0.1 point of it on a 32 × 32
#: fixture's selection mean; at 224 × 224, 16 inputs instead of 21 stray further from
#: a large sample's correction and save no time that shows beside the search).
DATA_VALUES_PER_CHANNEL = 1024
#: ... and never fewer than this many inputs, nor more than the data holds.
DATA_MIN_INPUTS = 16
#: The original model's pass runs on a thread beside the run (the run's steps are
#: single-threaded Python; the pass is mostly the backend's kernels), reading a copy
#: of the weights: with ``data=``, always; data-free, when the synthetic inputs of
#: these weights are kept. False: with ``data=`` before the first edit, data-free
#: after the run, in turn. The statistics written are the same (docs/hope.md,
#: "Compressing with data").
MEASURE_ALONGSIDE = True


def _check_mode(mode):
    if not any(mode is v or (isinstance(v, str) and mode == v) for v in MODES):
        raise ValueError(f"correction must be False, True, 'auto' or 'surrogate'. "
                         f"Received: correction={mode!r}")
    return mode


class StatisticsCorrection:
    """What the `hope_keras.Encoder` does to the BatchNormalization statistics after
    its run (see the module docstring).

    Args:
        mode: ``"auto"`` (default), ``"surrogate"``, True or False; ignored when
            ``data`` is given (the stale statistics are then re-estimated on it).
        data: Unlabeled inputs: an array, a ``tf.data.Dataset`` or an iterable of
            batches (``x`` or ``(x, y, ...)``: labels are ignored).
        verbose: ``"auto"``, True or False: announce and show the progress of the
            synthetic inputs and of the re-estimation.

    Example:

    >>> import keras, numpy as np, hope_keras
    >>> inputs = keras.Input((8,))
    >>> x = keras.layers.Dense(16)(inputs)
    >>> x = keras.layers.ReLU()(keras.layers.BatchNormalization(name="first")(x))
    >>> x = keras.layers.BatchNormalization(name="late")(keras.layers.Dense(8)(x))
    >>> model = keras.Model(inputs, keras.layers.Dense(2)(x))
    >>> data = np.random.default_rng(0).normal(size=(128, 8)).astype("float32")
    >>> result = hope_keras.compress(model, density=0.5, data=data, verbose=False)
    >>> result.corrected  # the BNs of the edited group and after it
    ['first', 'late']
    """

    def __init__(self, mode="auto", data=None, verbose="auto"):
        self.mode = _check_mode(mode)
        if data is not None and isinstance(data, (str, bytes, numbers.Number)):
            raise TypeError(f"data must be inputs (an array, a tf.data.Dataset or an "
                            f"iterable of batches). Received: {data!r}")
        self.data = data
        resolve_verbose(verbose)
        self.verbose = verbose
        self._original = None  # the weights before the first edit
        self._x = None  # the inputs drawn from `data`
        self._measuring = None  # the original's pass (`_measure_original`): a Future
        self._before = None  # ... its result: {BN node index: (mean, variance)}
        self._kept = None  # data-free: a Future of the readers' reference (or None)
        self._written = {}  # BN layer → (moving_mean, moving_variance) before the writes
        self.last = {}

    @property
    def name(self):
        """How the trajectory records it: ``"data"`` or the mode."""
        return "data" if self.data is not None else self.mode

    def start(self, model, graph, moments) -> None:
        """Before the first edit: what the correction needs of the original model.
        Puts back what an earlier `finish` wrote (a run that goes on corrects from
        the model's own statistics)."""
        self.model, self.graph, self.moments = model, graph, moments
        self.undo()
        if self.data is not None and self._x is None:
            self._measure_original(model, graph)
        if (self._original is None and self.data is None and self.mode == "auto"
                and _stream_readers(graph)):
            # Copies, not views: the edits write into the variables' buffers.
            self._original = [np.array(kg.weight_view(w)) for w in model.weights]
            if MEASURE_ALONGSIDE:  # the readers' reference, if their inputs are kept
                self._kept = _beside(_kept_reference, model, graph, self._original)

    def _measure_original(self, model, graph) -> None:
        """With data, before any edit: a sample drawn and checked, enough for the BN
        that sees the fewest values per input (whichever the run leaves stale), every
        BN's moving statistics, and a copy of the weights; every BN's input moments
        on the sample are then measured from that copy (one forward pass), on a
        thread beside the run (`MEASURE_ALONGSIDE`) or here."""
        flat = graph.flat
        nodes = [node for node in flat.nodes
                 if layer_rules.get(node.op).normalization == "batch" and node.inputs]
        if not nodes:
            return
        x = _sample(model, self.data, flat, [node.op.name for node in nodes])
        _check_data(model, x)
        if resolve_verbose(self.verbose):
            print(f"Measuring the inputs of {len(nodes)} BatchNormalization layers on "
                  f"{inputs_lib.count(x)} of the inputs given as data=, from the weights "
                  "before the "
                  f"first edit{' (beside the run)' if MEASURE_ALONGSIDE else ''}.")
        self._stats0 = {node.index: (np.asarray(node.op.moving_mean.numpy(), np.float64),
                                     np.asarray(node.op.moving_variance.numpy(), np.float64))
                        for node in nodes}
        self._x = x
        values = synthetic.snapshot(model)
        task = functools.partial(_input_moments, flat, x, nodes, values)
        if MEASURE_ALONGSIDE:
            self._measuring = _beside(task)
        else:
            self._measuring = concurrent.futures.Future()
            try:
                self._measuring.set_result(task())
            except Exception as e:  # noqa: BLE001 - `_original_moments` measures again
                self._measuring.set_exception(e)
        # The copy is kept only for a pass that failed (`_original_moments`).
        self._measuring.values = values
        self._measuring.add_done_callback(_drop_values_on_success)

    def _original_moments(self) -> dict:
        """The original model's BN input moments (`_measure_original`), waiting for
        its pass. Should that pass fail (a layer that cannot compute from copied
        values), the original weights are put back for a pass of their own."""
        future = self._measuring
        if future is not None:
            try:
                self._before = future.result()
            except Exception:  # noqa: BLE001 - measured again below; its error stands
                self._before = self._remeasure(future.values)
            self._measuring = None
        return self._before

    def _remeasure(self, values) -> dict:
        """`_input_moments` with the snapshot's values assigned to the model for the
        pass, the edited ones after it."""
        model, flat = self.model, self.graph.flat
        nodes = [node for node in flat.nodes if node.index in self._stats0]
        with _weights_put_back(model, [values[id(w)] for w in model.weights]):
            return _input_moments(flat, self._x, nodes)

    def undo(self) -> None:
        """Puts back the statistics the last `finish` wrote."""
        for bn, (mean, var) in self._written.items():
            bn.moving_mean.assign(mean)
            bn.moving_variance.assign(var)
        self._written = {}

    def finish(self, steps) -> dict:
        """Corrects the statistics after `steps` (all the steps since `start`'s
        model was original). Returns ``{BN name: (mean, variance)}`` written."""
        if self.data is None and not self.mode:
            self.last = {}
            return {}
        bns = {layer.name: layer for layer in self.graph.flat.layers.values()
               if layer_rules.get(layer).normalization == "batch"}
        saved = {name: (bn.moving_mean.numpy(), bn.moving_variance.numpy())
                 for name, bn in bns.items()}
        try:
            if self.data is not None:
                out = self._from_data(steps)
            else:
                out = self._data_free(steps)
                self._kept = None  # unused: the run moved no stream (a later one measures)
        except BaseException:
            for name, (mean, var) in saved.items():
                bns[name].moving_mean.assign(mean)
                bns[name].moving_variance.assign(var)
            raise
        self._written = {bns[name]: saved[name] for name in out if name in bns}
        self.last = out
        return out

    # ------------------------------------------------------------------ with data
    def _from_data(self, steps) -> dict:
        """Each stale BN's statistics moved by the change its input shows on the data
        between the original and the edited model: ``μ = μ₀ + (m₁ − m₀)``,
        ``σ² = σ₀² · v₁ / v₀`` (``μ₀, σ₀²``: its moving statistics before the run;
        ``m, v``: its input's mean and variance on the same inputs before and after),
        in topological order, so each BN sees those before it corrected (``m₀, v₀``
        and ``μ₀, σ₀²`` were taken by `start`, before the first edit). Measuring
        the change on the same inputs cancels their sampling noise, and the
        statistics keep the population the model was calibrated on. A merged
        parent's channel keeps what its merge wrote (`bn_stats.merged_parents`)."""
        stale = bn_stats.downstream_of(self.graph, {s.unit for s in steps})
        return self._correct_on_data(
            {node.index for node in self.graph.flat.nodes
             if layer_rules.get(node.op).normalization == "batch"
             and node.inputs and node.inputs[0] in stale},
            bn_stats.merged_parents(self.graph, steps))

    def _correct_on_data(self, todo, keep=None) -> dict:
        """`_from_data`'s correction of the BN nodes (indices) `todo`, one pass over
        the sample; returns ``{BN name: (mean, variance)}`` written. ``keep``:
        ``{BN name: channels}`` whose statistics stay as the run wrote them."""
        keep = keep or {}
        if not todo:
            return {}
        flat = self.graph.flat
        x = self._x
        before = self._original_moments()
        if resolve_verbose(self.verbose):
            print(f"Correcting {len(todo)} BatchNormalization layers on "
                  f"{inputs_lib.count(x)} of the "
                  "inputs given as data= (measured from the original weights, and now).")
        bar = WorkBar(len(todo), "layer", verbose=self.verbose)
        written = {}

        def correct(node, args, kwargs):
            if node.index not in todo:
                return None
            bn = node.op
            m0, v0 = before[node.index]
            m1, v1 = synthetic.batch_moments(args[0], bn)
            mean0, var0 = self._stats0[node.index]
            mean = np.asarray(bn.moving_mean.numpy(), np.float64)
            var = np.asarray(bn.moving_variance.numpy(), np.float64)
            finite = np.isfinite(m0) & np.isfinite(v0) & np.isfinite(m1) & np.isfinite(v1)
            scale = max(float(np.mean(v0[finite])) if finite.any() else 0.0, 1e-30)
            live = finite & (v0 > 1e-6 * scale) & (v1 > 1e-6 * scale)
            if bn.name in keep:
                live[keep[bn.name]] = False
            mean = np.where(live, mean0 + (m1 - m0), mean)
            var = np.where(live, var0 * v1 / np.where(live, v0, 1.0), var)
            bn.moving_mean.assign(mean.astype(bn.moving_mean.dtype))
            bn.moving_variance.assign(var.astype(bn.moving_variance.dtype))
            written[bn.name] = (mean, var)
            bar.update(len(written))
            return None  # the BN now runs with the corrected statistics

        try:
            synthetic.run_graph(flat, x, correct, synthetic.release_plan(flat))
        finally:
            bar.close()
        return written

    # ------------------------------------------------------------------ data-free
    def _data_free(self, steps) -> dict:
        untrusted = bn_stats.untrusted_tensors(self.graph, steps, self.mode)
        out = bn_stats.apply_correction(self.graph.flat, self.moments,
                                        moments_lib.propagate(self.graph.flat), untrusted,
                                        bn_stats.merged_parents(self.graph, steps))
        if self.mode != "auto" or self._original is None:
            return out
        readers = [n for n in _stream_readers(self.graph) if n.inputs[0] in untrusted]
        if readers:
            if resolve_verbose(self.verbose):
                print(f"Correcting {len(readers)} BatchNormalization layers that read a "
                      f"moved residual stream, measured on {SYNTHETIC_INPUTS} synthetic "
                      "inputs made from the original weights (kept for later runs; pass "
                      "data= to use real inputs instead).")
            reference = self._reference()
            if reference is not None:
                out.update(synthetic.correct_stream_readers(reference, untrusted))
        return out

    def _reference(self):
        """The stream readers' reference on synthetic inputs of the original model:
        measured beside the run from the copied weights when the inputs were kept
        (`_kept_reference`), else with the original weights put back for the
        measurement, then the edited ones."""
        kept, self._kept = self._kept, None
        if kept is not None:
            try:
                reference = kept.result()
            except Exception:  # noqa: BLE001 - measured below, the original weights put back
                reference = None
            if reference is not None:
                return reference
        model = self.model
        with _weights_put_back(model, self._original):
            x = bn_stats.synthetic_inputs(model, verbose=self.verbose)
            if x is None:
                return None
            return synthetic.StreamReference(model, self.graph, x)


def _beside(fn, *args) -> concurrent.futures.Future:
    """``fn(*args)`` on a thread of its own (which ends with it)."""
    pool = concurrent.futures.ThreadPoolExecutor(1, "hope_keras-correction")
    future = pool.submit(fn, *args)
    pool.shutdown(wait=False)
    return future


def _kept_reference(model, graph, original):
    """The stream readers' `synthetic.StreamReference` on the synthetic inputs kept
    for the weights `original` (copies, in ``model.weights`` order), computed from
    them while the model's variables may be edited; None when no inputs are kept
    (they are made after the run, only if it moved a stream)."""
    x = bn_stats.kept_synthetic_inputs(model, original)
    if x is None:
        return None
    return synthetic.StreamReference(model, graph, x, values=synthetic.snapshot(model, original))


def _drop_values_on_success(future) -> None:
    if future.exception() is None:
        future.values = None


def _input_moments(flat, x, nodes, values=None) -> dict:
    """``{node index: (mean, variance)}`` of the input of each BN node of `nodes` on
    `x`, one pass over the graph (computed from `values` when given:
    `synthetic.run_graph`)."""
    wanted = {node.index for node in nodes}
    out = {}

    def measure(node, args, kwargs):
        if node.index in wanted:
            out[node.index] = synthetic.batch_moments(args[0], node.op)
        return None

    synthetic.run_graph(flat, x, measure, synthetic.release_plan(flat), values=values)
    return out


@contextlib.contextmanager
def _weights_put_back(model, original):
    """The model holds `original` (values in ``model.weights`` order) inside, and its
    current (edited) weights again after, whatever happens inside."""
    edited = [np.array(kg.weight_view(w)) for w in model.weights]
    try:
        _assign(model, original)
        yield
    finally:
        with defer_keyboard_interrupt():
            _assign(model, edited)


def _assign(model, values) -> None:
    for w, v in zip(model.weights, values):
        w.assign(v)


def _stream_readers(graph):
    return synthetic.stream_readers(graph)


_SHAPE_ERROR = "data= holds inputs of shape"


def _check_data(model, x) -> None:
    """The sample drawn from data= (its batches' shapes checked by `_sample`): at
    least 2 inputs, finite; named before any edit."""
    n = inputs_lib.count(x)
    if n < 2:
        raise ValueError(f"data= holds {n} input(s): a BatchNormalization needs at "
                         "least 2 to measure a variance. Nothing was changed.")
    for part in keras.tree.flatten(x):
        if np.issubdtype(part.dtype, np.floating) and not np.all(np.isfinite(part)):
            raise ValueError("data= holds NaN or infinite values. Nothing was changed.")


def _positions(flat, names) -> int:
    """The fewest values per channel one input gives any of the BNs `names`."""
    fewest = math.inf
    for node in flat.nodes:
        if node.op.name in names and node.inputs:
            shape = flat.shapes[node.inputs[0]]
            spatial = [d for d in shape[1:-1]]
            known = int(np.prod([d for d in spatial if d is not None])) if spatial else 1
            fewest = min(fewest, max(known, 1))
    return 1 if fewest is math.inf else int(fewest)


def _sample(model, data, flat, names):
    """The first inputs of `data` (an array, or a list of arrays for a model of
    several inputs: `hope_keras.stats.inputs`), enough that every BN of `names` sees
    `DATA_VALUES_PER_CHANNEL` values per channel: arrays are cut, a dataset or
    iterable is read batch by batch until enough inputs came."""
    want = max(DATA_MIN_INPUTS, math.ceil(DATA_VALUES_PER_CHANNEL / _positions(flat, names)))
    parts, got = [], 0
    for x in inputs_lib.batches(model, data, batch_size=want):
        x = keras.tree.map_structure(np.asarray, x)
        inputs_lib.check_shapes(model, x, _SHAPE_ERROR)  # before joining batches
        parts.append(x)
        got += inputs_lib.count(x)
        if got >= want:
            break
    if not parts:
        raise ValueError("data= yielded no inputs. Nothing was changed.")
    return inputs_lib.take(inputs_lib.concatenate(parts), 0, want)
