"""Re-estimation of BatchNormalization moving statistics.

A short training run (a few hundred steps on CPU, say) leaves the moving mean
and variance of every :class:`keras.layers.BatchNormalization` layer lagging
behind the weights: with the default momentum of 0.99 the moving averages
remember about 100 steps, most of them taken with older weights, and the
model's inference-mode accuracy suffers (a ResNet-50 after 300 steps: 56 %
with the stale statistics, 84 % once they were re-estimated). HOPE also reads
these statistics to decide which neurons to prune or merge, so they should be
the statistics of the model as it is.

:func:`reestimate_batchnorm_statistics` replaces them with the population
statistics of each layer's input over some calibration data, in a single
forward pass.
"""

from __future__ import annotations

import collections
import numbers
import os
import pathlib

import keras
import numpy as np
from keras import ops

from hope_keras.graph import adapter as kg
from hope_keras.scoring import moments as moments_lib
from hope_keras.scoring.analysis import Analysis
from hope_keras.stats import inputs as inputs_lib
from hope_keras.stats import synthetic
from hope_keras.graph import layers as layer_rules

__all__ = ["correct_statistics", "reestimate_batchnorm_statistics", "synthetic_cache_dir"]


def _batchnorm_layers(model):
    """The model's BatchNormalization layers (nested models included), checked for
    what we support."""
    fg = kg.flatten(model)
    bns = []
    for key, layer in fg.layers.items():
        if layer_rules.get(layer).normalization != "batch":
            continue
        if fg.calls[key] != 1:
            raise ValueError(
                f"BatchNormalization layer {key!r} is called {fg.calls[key]} times in "
                "the model; a shared BatchNormalization layer has no single input to "
                "take statistics of."
            )
        node = fg.node_of(key)
        ndim = len(fg.shapes[node.inputs[0]])
        if layer.axis not in (-1, ndim - 1):
            raise ValueError(
                f"BatchNormalization layer {key!r} normalises axis {layer.axis} of a "
                f"rank-{ndim} input; only the last axis (channels_last) is supported."
            )
        bns.append(layer)
    return bns


def _make_step(model, bns):
    """One forward pass through ``model`` returning per-BN batch moments.

    Every BatchNormalization layer met on the way normalises with the statistics
    of the current batch (as in training mode, but without touching its moving
    statistics and whatever its ``trainable`` flag) and records the moments of its
    input; nested models are run layer by layer the same way; every other layer
    runs in inference mode (so Dropout and friends do nothing).
    """
    bn_ids = {id(bn) for bn in bns}

    def step(x):
        recorded = {}

        def operation_fn(op):
            if id(op) in bn_ids:

                def call(inputs, *args, **kwargs):
                    x = ops.cast(inputs, keras.backend.result_type(inputs.dtype, "float32"))
                    y = ops.cast(inputs, "float64")
                    axes = list(range(len(y.shape) - 1))
                    count = ops.sum(ops.ones_like(y[..., :1]))
                    mean64 = ops.mean(y, axis=axes)
                    m2 = ops.sum(ops.square(y - mean64), axis=axes)
                    recorded[id(op)] = (count, mean64, m2)
                    mean, variance = ops.moments(x, axes=axes)
                    out = ops.batch_normalization(
                        x,
                        mean,
                        variance,
                        axis=-1,
                        offset=ops.cast(op.beta, x.dtype) if op.center else None,
                        scale=ops.cast(op.gamma, x.dtype) if op.scale else None,
                        epsilon=op.epsilon,
                    )
                    return ops.cast(out, op.compute_dtype)

                return call
            if isinstance(op, keras.Model):
                inner = kg.functional_of(op)

                def call(*args, **kwargs):
                    return kg.run_through_graph(inner, args[0], operation_fn)

                return call

            def call(*args, **kwargs):
                if kg.accepts_training(op):
                    kwargs["training"] = False
                return op(*args, **kwargs)

            return call

        kg.run_through_graph(kg.functional_of(model), x, operation_fn)
        return [recorded[id(bn)] for bn in bns]

    if keras.backend.backend() == "tensorflow":
        return kg.graph_function(step)
    return step


def check_finite_statistics(names, means, m2s, what: str, tail: str) -> None:
    """Raises ValueError naming the layers whose accumulated statistics (``means``,
    ``m2s``, one pair per name) are not finite: NaN/Inf in the data.

    Example:

    >>> import numpy as np
    >>> check_finite_statistics(["bn"], [np.zeros(2)], [np.ones(2)], "Stats of", "")
    >>> check_finite_statistics(["bn"], [np.array([np.nan])], [np.ones(1)], "Stats of",
    ...                         "Nothing was changed.")
    Traceback (most recent call last):
    ...
    ValueError: Stats of bn are not finite: the data holds NaN/Inf values (or the model overflows on it). Clean the data first. Nothing was changed.
    """
    broken = [n for n, a, b in zip(names, means, m2s)
              if not (np.all(np.isfinite(a)) and np.all(np.isfinite(b)))]
    if broken:
        raise ValueError(
            f"{what} {', '.join(broken[:5])}{', …' if len(broken) > 5 else ''} are not "
            "finite: the data holds NaN/Inf values (or the model overflows on it). Clean "
            f"the data first. {tail}")


def reestimate_batchnorm_statistics(
    model, data, batches=None, batch_size=256, verbose=0, only=None
):
    """Sets BatchNormalization moving statistics to population statistics.

    Every :class:`keras.layers.BatchNormalization` layer of ``model`` gets its
    ``moving_mean`` and ``moving_variance`` replaced by the mean and the
    *biased* (population, divide-by-N) variance of its input over ``data``,
    per channel. Biased is what Keras itself normalises with in training mode
    and averages into ``moving_variance``, which inference mode then uses as
    its estimate of the variance; with it, a model re-estimated on one batch
    gives in inference mode the same outputs as in training mode on that
    batch.

    It takes one forward pass. A functional sub-model outputs the input of
    every BatchNormalization layer; during the pass each BatchNormalization
    layer normalises with the statistics of the current batch (as in
    training, but its ``trainable`` flag and moving statistics are left
    alone), all other layers run in inference mode (Dropout is off). Each
    layer's input is therefore the one it sees once the layers before it
    have population statistics, up to batch-to-batch noise in those upstream
    statistics, which vanishes with the batch size: with a single batch the
    result is exact, and batches of a few hundred are plenty in practice.
    Per-batch counts, means and centred sums of squares are computed in
    float64 and merged exactly (Chan et al.'s pairwise update), so there is
    no float32 cancellation however much data is used.

    Args:
        model: A built Keras Functional or Sequential model (nested Functional
            or Sequential sub-models are entered, e.g. a backbone inside a
            ``Sequential([backbone, head])``). Its BatchNormalization layers must
            normalise the last axis (channels-last) and must each be called
            once; otherwise a ValueError naming the layer is raised before
            anything is changed.
        data: Calibration inputs: a numpy array (or tensor) of inputs, split
            into batches of ``batch_size`` (a model of several inputs: a list or
            dict of arrays); a tuple ``(x, y)`` / ``(x, y, sample_weight)`` of
            which only ``x`` is used; or a ``tf.data.Dataset`` or any iterable of
            batches, each ``x`` or such a tuple (`hope_keras.stats.inputs`).
            Inputs are cast to the model's input dtype, so uint8 images are fine
            if the model expects the raw pixel values.
        batches: Use at most this many batches (``None``: all of ``data``).
            Needed for an infinite (``repeat()``-ed) dataset.
        batch_size: Batch size used to split a numpy array; ignored for
            datasets and iterables.
        verbose: 0 is silent, 1 prints one line per layer at the end, 2 also
            prints progress per batch.
        only: Names of the BatchNormalization layers to re-estimate (None: all).
            The others keep their statistics and run in inference mode.

    Returns:
        dict: Maps each BatchNormalization layer's name to a
        ``(mean, variance)`` pair of float64 numpy arrays, the values that
        were assigned (cast to the variables' dtype).

    Raises:
        ValueError: If ``data`` yields no batch, or for an unsupported layer
            (see ``model``); for batches of another shape than the model's input,
            ``batch_size`` below 1, or one value per channel (nothing is written).

    Example:
        >>> import numpy as np, keras
        >>> from hope_keras.stats.bn_stats import reestimate_batchnorm_statistics
        >>> inputs = keras.Input((8, 8, 3))
        >>> x = keras.layers.Conv2D(4, 3, name="conv")(inputs)
        >>> x = keras.layers.BatchNormalization(name="bn")(x)
        >>> model = keras.Model(inputs, keras.layers.ReLU()(x))
        >>> calib = np.random.default_rng(0).normal(size=(64, 8, 8, 3))
        >>> stats = reestimate_batchnorm_statistics(model, calib, batch_size=16)
        >>> conv_out = model.get_layer("conv")(calib.astype("float32"))
        >>> bn = model.get_layer("bn")
        >>> np.allclose(bn.moving_mean.numpy(),
        ...             np.mean(conv_out, axis=(0, 1, 2)), atol=1e-5)
        True
    """
    if isinstance(batches, numbers.Number) and batches < 1:
        raise ValueError(f"batches must be positive or None, got {batches}.")
    if isinstance(batch_size, bool) or not isinstance(batch_size, numbers.Integral) \
            or batch_size < 1:
        raise ValueError(f"batch_size must be an integer ≥ 1. Received: "
                         f"batch_size={batch_size!r}")
    bns = _batchnorm_layers(model)
    if only is not None:
        only = set(only)
        missing = only - {bn.name for bn in bns}
        if missing:
            raise ValueError(f"only= names no BatchNormalization layer of model "
                             f"'{model.name}': {sorted(missing)}")
        bns = [bn for bn in bns if bn.name in only]
    if not bns:
        if verbose:
            print("reestimate_batchnorm_statistics: no BatchNormalization layers.")
        return {}

    step = _make_step(model, bns)

    n = [0.0] * len(bns)
    mean = [np.zeros(bn.moving_mean.shape[-1], np.float64) for bn in bns]
    m2 = [np.zeros(bn.moving_mean.shape[-1], np.float64) for bn in bns]
    seen = 0
    samples = 0
    for x in inputs_lib.batches(model, data, batch_size):
        if batches is not None and seen >= batches:
            break
        if seen == 0:
            inputs_lib.check_shapes(model, x, "The data's batches have shape")
        moments = step(x)
        for i, (count_b, mean_b, m2_b) in enumerate(moments):
            count_b = float(count_b)
            mean_b = np.asarray(mean_b, np.float64)
            m2_b = np.asarray(m2_b, np.float64)
            total = n[i] + count_b
            delta = mean_b - mean[i]
            mean[i] = mean[i] + delta * (count_b / total)
            m2[i] = m2[i] + m2_b + delta**2 * (n[i] * count_b / total)
            n[i] = total
        seen += 1
        samples += int(keras.tree.flatten(x)[0].shape[0])
        if verbose >= 2:
            print(f"  batch {seen}: {samples} samples")
    if seen == 0:
        raise ValueError("data yielded no batches.")
    few = [bn.name for bn, count in zip(bns, n) if count < 2]
    if few:
        raise ValueError(
            f"The BatchNormalization layer(s) {', '.join(few)} saw one value per channel "
            f"({samples} sample(s)): their variance would be 0. Give more samples "
            f"(hundreds are typical). Nothing was changed.")
    # Checked before any layer is written: a NaN in the data would reach every BN.
    check_finite_statistics([bn.name for bn in bns], mean, m2,
                            "The statistics measured for the BatchNormalization layer(s)",
                            "Nothing was changed.")

    result = {}
    for i, bn in enumerate(bns):
        variance = m2[i] / n[i]
        bn.moving_mean.assign(mean[i].astype(bn.moving_mean.dtype))
        bn.moving_variance.assign(variance.astype(bn.moving_variance.dtype))
        if getattr(bn, "renorm", False):
            std = np.sqrt(variance + bn.epsilon)
            bn.moving_stddev.assign(std.astype(bn.moving_stddev.dtype))
            bn.renorm_mean.assign(mean[i].astype(bn.renorm_mean.dtype))
            bn.renorm_stddev.assign(std.astype(bn.renorm_stddev.dtype))
        result[bn.name] = (mean[i], variance)
        if verbose:
            print(
                f"  {bn.name}: mean |mu| {np.mean(np.abs(mean[i])):.4g}, "
                f"mean var {np.mean(variance):.4g}"
            )
    if verbose:
        print(
            f"reestimate_batchnorm_statistics: {len(bns)} layers, "
            f"{seen} batches, {samples} samples."
        )
    return result


def correct_statistics(model, analysis, exclude=(), trajectory=None) -> dict:
    """Data-free correction of BatchNormalization moving statistics after compression.

    Every BatchNormalization layer's moving mean and variance describe its input in
    the network as trained. Once channels upstream were pruned or merged, that input
    has moved: a pruned ReLU channel took its mean ``u_i·E[ReLU(z_i)]`` with it, and
    the variance changed. Without data, `hope_keras.scoring.moments.propagate` (each BN
    output ``N(β, γ²)``, channels independent) predicts the input's per-channel mean
    and variance before and after the edit; each BN's moving mean is shifted by the
    predicted change of the mean and its moving variance scaled by the predicted
    ratio of the variances, so that it keeps normalising its input to what the next
    layers were trained on. Channels whose input the edits made constant (pruned
    channels, an evicted branch's end) keep the statistics the edit wrote. Use it
    on the model compressed in place (before `slim`), with the analysis of the
    model *before* compression; it changes only moving statistics. With data,
    `reestimate_batchnorm_statistics` (or `hope_keras.recover`) measures them
    instead, and does better.

    A merged parent's channel must keep the statistics its merge wrote (they encode
    the parent exactly, docs/theory.md §6): pass the run's ``trajectory``. Without
    it the parent is moved by the change from the channel whose slot it took, which
    costs accuracy after merges (ResNet-50 fixture at density 0.9, selection split:
    81.1 % with ``compress``'s own correction, 33.5 % after this one without the
    trajectory, 81.1 % with it; `Encoder(correction=True)` passes it).

    Correcting every BN is not what `compress` does, by measurement (docs/benchmarks.md,
    "BN statistics correction"): after magnitude pruning (`hope_keras.baselines`) of
    the demo CNN and VGG-8 it adds 11–17 points on average, and 14–28 points at
    densities 0.8–0.7 to HOPE on a swish CNN (prunes only); the BNs that read a
    residual stream are where its independent channels fail (ResNet-50 fixture at
    density 0.5: 52.4 % with the trajectory against 75.4 % with `compress`'s
    correction, which measures them on synthetic inputs). ``compress``'s data-free
    correction (the default without ``data=``) applies it only where the prediction's
    independence assumptions survive the edits: not downstream of a merged group, an
    evicted block, or a sum (a residual ``Add``) whose input moved
    (`untrusted_tensors`). ``exclude`` names groups and blocks to leave out here.

    Args:
        model: The model compressed in place.
        analysis: `hope_keras.analyze(model)` computed before compressing it (its
            ``moments`` are the reference); `compress` keeps one
            (``CompressionResult.analysis``).
        exclude: Names of groups and residual blocks (of ``analysis``) whose edits
            the prediction should not be trusted for (merged groups, evicted
            blocks): BatchNormalization layers downstream of them are left as they
            are.
        trajectory: The compression's `hope_keras.Trajectory`
            (``CompressionResult.trajectory``): its merged parents keep their
            statistics. None: every live channel is moved.

    Returns:
        dict: Maps each corrected BatchNormalization layer's name to its new
        ``(moving_mean, moving_variance)`` (float64 numpy arrays).

    Raises:
        ValueError: if `analysis` was computed on another model, or `exclude`
            names no group or block of it.

    Example:

    >>> import keras, hope_keras
    >>> keras.utils.set_random_seed(0)
    >>> inputs = keras.Input((8,))
    >>> x = keras.layers.Dense(6)(inputs)
    >>> x = keras.layers.ReLU()(keras.layers.BatchNormalization(name="bn1")(x))
    >>> x = keras.layers.BatchNormalization(name="bn2")(keras.layers.Dense(4)(x))
    >>> model = keras.Model(inputs, keras.layers.Dense(2)(x))
    >>> enc = hope_keras.Encoder(model, actions=("prune",), correction=False, verbose=False)
    >>> enc.run(density=0.5)
    'budget'
    >>> new = hope_keras.correct_statistics(model, enc.analysis)
    >>> sorted(new)
    ['bn1', 'bn2']
    """

    if not isinstance(analysis, Analysis):
        raise TypeError(f"correct_statistics needs the hope_keras.Analysis of the model "
                        f"taken before compressing it (CompressionResult.analysis). "
                        f"Received: {analysis!r} of type {type(analysis).__name__}")
    flat = analysis.graph.flat
    mine = {id(layer) for layer in kg.flatten(model).layers.values()}
    if not all(id(layer) in mine for layer in flat.layers.values()):
        raise ValueError(
            f"correct_statistics: the analysis was computed on another model than "
            f"{model.name!r}; pass hope_keras.analyze(model) taken before compressing "
            f"this model (or CompressionResult.analysis).")
    skip = downstream_of(analysis.graph, exclude)
    keep = None
    if trajectory is not None:
        steps = getattr(trajectory, "steps", trajectory)
        unknown = sorted({s.unit for s in steps if s.kind == "merge"}
                         - set(analysis.graph.groups))
        if unknown:
            raise ValueError(f"correct_statistics: the trajectory merges groups the "
                             f"analysis does not have: {unknown}")
        keep = merged_parents(analysis.graph, steps)
    return apply_correction(flat, analysis.moments, moments_lib.propagate(flat), skip, keep)


# Synthetic inputs of the last few models (weights digest and settings → inputs): several
# runs from the same weights (a density sweep, a replay) make them once. ~10 MB each at 224².
_SYNTHETIC_INPUTS: "collections.OrderedDict[str, np.ndarray]" = collections.OrderedDict()
_SYNTHETIC_KEEP = 4
_OFF = ("", "0", "off", "false", "no")


def synthetic_cache_dir():
    """Where `compress` keeps synthetic inputs between sessions, or None (not kept).

    ``HOPE_KERAS_CACHE``: a directory, or ``off`` (also ``0``, ``false``, ``no``, empty);
    unset: ``$XDG_CACHE_HOME/hope_keras``, else ``~/.cache/hope_keras``. One ``.npy``
    file per model weights and synthesis settings (16 × 224 × 224 × 3 float32: 9.6 MB);
    a file that cannot be read back is ignored with a warning and made again.

    Example:

    >>> import os
    >>> from hope_keras.stats.bn_stats import synthetic_cache_dir
    >>> saved = os.environ.get("HOPE_KERAS_CACHE")
    >>> os.environ["HOPE_KERAS_CACHE"] = "/tmp/hk"
    >>> str(synthetic_cache_dir())
    '/tmp/hk'
    >>> os.environ["HOPE_KERAS_CACHE"] = "off"
    >>> synthetic_cache_dir() is None
    True
    >>> os.environ["HOPE_KERAS_CACHE"] = saved or "off"
    """
    value = os.environ.get("HOPE_KERAS_CACHE")
    if value is not None:
        return None if value.strip().lower() in _OFF else pathlib.Path(value).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "hope_keras"


def _settings_key() -> str:
    """A short hash of the synthesis settings: inputs made under other settings (or
    another seed) are other inputs, in memory and on disk."""
    import hashlib

    settings = repr((3, synthetic.SYNTHETIC_INPUTS, synthetic.SYNTHETIC_STEPS,
                     synthetic.LEARNING_RATE, synthetic.SYNTHETIC_SEED, synthetic.PRIOR,
                     synthetic.COARSE_MIN_SIDE, synthetic.COARSE_FRACTION, synthetic.COARSE_SCALE,
                     synthetic.MEASURE_SCALE, synthetic.MEASURE_STEPS)).encode()
    return hashlib.sha256(settings).hexdigest()[:12]


def _memory_key(digest) -> str:
    """The in-memory key of a weights digest under the current synthesis settings."""
    return f"{digest}-{_settings_key()}"


def _synthetic_file(digest):
    """The cache file of a weights digest under the current synthesis settings."""
    folder = synthetic_cache_dir()
    if folder is None:
        return None
    return folder / f"synthetic-{digest[:40]}-{_settings_key()}.npy"


def _load_synthetic(path, model, size=None):
    """The inputs cached at `path` (None when absent; a warning when unreadable)."""
    import warnings

    if path is None or not path.exists():
        return None
    try:
        x = np.load(path, allow_pickle=False)
        shape = tuple(kg.functional_of(model).inputs[0].shape[1:])
        if size is not None:
            shape = synthetic.resized_shape(shape, size, model)
        if (x.dtype != np.float32 or x.shape != (synthetic.SYNTHETIC_INPUTS,) + shape
                or not np.all(np.isfinite(x))):
            raise ValueError(f"{x.dtype} array of shape {x.shape}, expected float32 "
                             f"{(synthetic.SYNTHETIC_INPUTS,) + shape}, finite")
        return x
    except Exception as e:  # noqa: BLE001 - any unreadable file is made again
        warnings.warn(f"the data-free correction: ignoring the cached synthetic inputs "
                      f"{path} ({e}); making them again.", stacklevel=4)
        return None


def _save_synthetic(path, x) -> None:
    """Writes the inputs to `path` atomically; a cache that cannot be written is
    skipped with a warning."""
    import tempfile
    import warnings

    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            np.save(f, x, allow_pickle=False)
        os.replace(tmp, path)
    except OSError as e:
        warnings.warn(f"the data-free correction: could not keep the synthetic inputs "
                      f"in {path.parent} ({e}); set HOPE_KERAS_CACHE to a writable "
                      f"directory, or to 'off'.", stacklevel=4)


def synthetic_inputs(model, verbose="auto"):
    """`hope_keras.synthesize_inputs` of `model` with the module settings of
    `hope_keras.stats.synthetic` (inputs, steps, seed, ...), made once per weights and
    settings: kept in memory for the last few and on disk (`synthetic_cache_dir`).
    None, with a warning, when they cannot be made for this model."""
    digest = _weights_digest(model)
    key = _memory_key(digest)
    x = _SYNTHETIC_INPUTS.get(key)
    if x is not None:
        _SYNTHETIC_INPUTS.move_to_end(key)
        return x
    path = _synthetic_file(digest)
    size = synthetic.reduced_size(model)
    x = _load_synthetic(path, model, size)
    if x is None:
        try:
            steps = synthetic.SYNTHETIC_STEPS
            if size is not None and synthetic.MEASURE_STEPS is not None:
                steps = synthetic.MEASURE_STEPS
            x = synthetic.synthesize_inputs(model, num=synthetic.SYNTHETIC_INPUTS,
                                            steps=steps, size=size,
                                            seed=synthetic.SYNTHETIC_SEED, verbose=verbose)
        except ValueError as e:
            import warnings

            warnings.warn(f"the data-free correction: {e} The BatchNormalization "
                          "layers that read residual streams keep their statistics.",
                          stacklevel=3)
            return None
        _save_synthetic(path, x)
    _SYNTHETIC_INPUTS[key] = x
    while len(_SYNTHETIC_INPUTS) > _SYNTHETIC_KEEP:
        _SYNTHETIC_INPUTS.popitem(last=False)
    return x


def kept_synthetic_inputs(model, values=None):
    """The inputs `synthetic_inputs` returns for `model`'s weights (or for `values`,
    copies of them in ``model.weights`` order) when they are kept, in memory or on
    disk; None when they are not: nothing is made. Only reads the cache (safe on a
    thread beside a run)."""
    digest = _weights_digest(model, values)
    x = _SYNTHETIC_INPUTS.get(_memory_key(digest))
    if x is not None:
        return x
    return _load_synthetic(_synthetic_file(digest), model, synthetic.reduced_size(model))


def _weights_digest(model, values=None) -> str:
    """sha256 of the model's input shape and all of its weights (paths and values;
    `values`: copies of them in ``model.weights`` order)."""
    import hashlib

    h = hashlib.sha256(repr([tuple(t.shape) for t in kg.functional_of(model).inputs]).encode())
    if values is None:
        values = (keras.ops.convert_to_numpy(w) for w in model.weights)
    for w, v in zip(model.weights, values):
        h.update(w.path.encode())
        h.update(np.ascontiguousarray(v).tobytes())
    return h.hexdigest()


def untrusted_tensors(graph, steps, mode, trust_merges: bool = False) -> set:
    """Tensor keys whose predicted moments the correction ``mode`` (`hope_keras.stats.correction`) does
    not trust after `steps` (a trajectory's): none for True; for ``"auto"`` and
    ``"surrogate"``
    everything downstream of a merged group or an evicted block, and of a sum or
    product of tensors (``Add``, ``Multiply``, …) one of whose inputs the edits
    moved. The propagation treats a merged parent's children, and a sum's inputs
    (a residual branch and its shortcut), as independent; after prunes elsewhere
    its predictions are what the correction was measured on. ``trust_merges``: what
    only a merge reaches is trusted too (an experiment of the quality benchmark:
    ahead on two small models, up to 18.9 points behind on a real VGG16, docs/quality.md,
    "The surrogate behind merges")."""
    if mode is True:
        return set()
    moved = downstream_of(graph, {s.unit for s in steps})
    sums = {node.key for node in graph.flat.nodes
            if layer_rules.role_of(node.op, node) == "merge"
            and any(t in moved for t in node.inputs)}
    folded = {s.unit for s in steps
              if s.kind == "evict" or (s.kind == "merge" and not trust_merges)}
    return downstream_of(graph, folded, nodes=sums)


def downstream_of(graph, names, nodes=()) -> set:
    """Tensor keys of `graph.flat` that the edits of groups or residual blocks `names`
    reach: the groups' own tensors, the blocks' ``Add`` outputs, the outputs of the
    graph nodes (keys) `nodes`, and everything computed from them."""
    groups = graph.groups
    blocks = {b.name: b for b in graph.blocks}
    bad, sources = set(), set(nodes)
    for name in names:
        if name in groups:
            bad |= set(groups[name].tensors)
        elif name in blocks:
            sources.add(blocks[name].add)
        else:
            raise ValueError(f"exclude names no group or residual block of the analysis. "
                             f"Received: {name!r}")
    for node in graph.flat.nodes:  # a topological order
        if node.key in sources or any(t in bad for t in node.inputs):
            bad |= set(node.outputs)
    return bad


def merged_parents(graph, steps) -> dict:
    """``{BN name: channel indices}`` of the merged parents of `steps`, in their own
    group's BatchNormalization. A parent's statistics are not its input's: the merge
    writes them so that the BN computes ``a1·y_i + a2·y_j`` exactly (docs/theory.md
    §4), and the original channel ``i`` they replace is no reference for it."""
    out = {}
    for s in steps:
        if s.kind == "merge":
            bn = graph.groups[s.unit].bn
            if bn is not None:
                out.setdefault(bn, set()).add(int(s.i))
    return {bn: np.array(sorted(c), dtype=np.intp) for bn, c in out.items()}


def apply_correction(flat, before, after, skip=frozenset(), keep=None) -> dict:
    """Shifts each BatchNormalization's moving mean by the predicted change of its
    input's mean and scales its moving variance by the predicted ratio of variances
    (`before`, `after`: `hope_keras.scoring.moments.propagate` results), except where the
    input tensor is in `skip`. Channels whose input the edits made constant (predicted
    variance 0: a pruned channel, an evicted branch's end) keep the statistics the
    edit wrote: for a BN without γ and β the edit zeroes the moving mean to make the
    channel output zero, and re-normalising it would bring the channel back; so do
    the channels `keep` lists (``{BN name: channel indices}``, `merged_parents`).
    Returns ``{name: (mean, variance)}`` of those changed."""
    out = {}
    for node in flat.nodes:
        bn = node.op
        if layer_rules.get(bn).normalization != "batch" or not node.inputs:
            continue
        t = node.inputs[0]
        if t in skip or t not in before or t not in after:
            continue
        (m0, v0), (m1, v1) = before[t], after[t]
        if np.shape(m0) != tuple(bn.moving_mean.shape):
            continue
        live = np.asarray(v1) > 0
        if keep and bn.name in keep:  # merged parents: their merge's statistics
            live = live.copy()
            live[keep[bn.name]] = False
        ratio = np.where(live & (v0 > 0), v1 / np.where(v0 > 0, v0, 1.0), 1.0)
        mean = np.asarray(bn.moving_mean.numpy(), dtype=np.float64)
        mean = np.where(live, mean + (m1 - m0), mean)
        var = np.asarray(bn.moving_variance.numpy(), dtype=np.float64) * ratio
        bn.moving_mean.assign(mean.astype(bn.moving_mean.dtype))
        bn.moving_variance.assign(var.astype(bn.moving_variance.dtype))
        out[bn.name] = (mean, var)
    return out
