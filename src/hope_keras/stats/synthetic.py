"""Data-free synthetic inputs, and what they correct: the BN statistics of stream readers.

A residual stream is a sum (``x + branch(x)``) of everything before it. Once the
branches are merged, pruned or evicted, the stream's distribution moves, and every
BatchNormalization that reads it (a block's first BN, a projection shortcut's BN; in
a pre-activation network the block's own BN) normalises with statistics of a stream
that is gone. The Gaussian surrogate cannot predict that move: the stream's channels
are correlated sums, not independent ReLU outputs (docs/theory.md §6).

Without data, :func:`synthesize_inputs` makes a small batch of inputs whose
BatchNormalization batch statistics match the model's moving statistics (the
"distilled data" of ZeroQ, Cai et al. 2020: gradient descent on the inputs), and
:func:`correct_stream_readers` measures on that batch how each stream reader's input
moved between the original and the compressed model: its moving mean is shifted by
the measured change of the mean and its moving variance scaled by the measured ratio
of variances, one BN after the other so that each sees the corrected ones before it.
``compress`` without ``data=`` (the default) does this for the readers of
every stream its steps moved.
"""

from __future__ import annotations

import keras
import numpy as np

from hope_keras.graph import adapter as kg
from hope_keras.progress import WorkBar, resolve_verbose
from hope_keras.graph import layers as layer_rules
from hope_keras.graph.blocks import is_batch_norm
from hope_keras.stats import moment_kernels

__all__ = ["synthesize_inputs", "stream_readers", "StreamReference",
           "correct_stream_readers"]

#: Batch size, Adam steps and learning rate of `synthesize_inputs`, chosen on the
#: selection split of the ResNet-50 fixture (docs/quality.md, "The BNs that read a residual stream").
SYNTHETIC_INPUTS = 16
SYNTHETIC_STEPS = 100
LEARNING_RATE = 0.1
#: Seed of the data-free correction's initial noise (another seed gives other inputs:
#: how much the accuracy moves with it, docs/quality.md, "Compressing with data").
SYNTHETIC_SEED = 0
#: How image inputs are parameterised (``"spectrum"``: 1/f Fourier amplitudes; see
#: `synthesize_inputs`).
PRIOR = "spectrum"
PRIORS = ("spectrum", "pixels")
#: Image inputs whose sides are both at least this: by default the first
#: `COARSE_FRACTION` of the Adam steps run at half the size (see `synthesize_inputs`,
#: ``coarse_steps``), chosen on the selection split of the ResNet-50 fixtures
#: (docs/benchmarks.md, "Coarse steps first": better at 128 × 128; at 32 × 32 level
#: and slower; at 64 × 64 worse).
COARSE_MIN_SIDE = 128
COARSE_FRACTION = 0.8
#: The coarse steps run at the size divided by this (each side, rounded down).
COARSE_SCALE = 2
#: Image inputs whose sides are both at least `COARSE_MIN_SIDE`: the data-free
#: correction makes its inputs, and measures the stream readers on them, at the size
#: divided by this (see `reduced_size`). 1, the model's size: on the ResNet-50 fixture
#: trained at 64 × 64, inputs made and measured at 1/2 or 1/4 of the size lost 0.7–2.6
#: points at density 0.6 and FLOPs 0.8 and a third or more of the accuracy at FLOPs
#: 0.6 (docs/benchmarks.md, "Made at a reduced size").
MEASURE_SCALE = 1
#: ... with this many Adam steps there (None: `SYNTHETIC_STEPS`).
MEASURE_STEPS = None
#: Whether `synthesize_inputs` has XLA compile its Adam step (TensorFlow's
#: ``jit_compile``) where `xla_pays`. Off: on ResNet-50 the synthesis ran 1.4–2 times faster
#: on two CPU cores, but the inputs it made corrected the ResNet-50 fixture far
#: worse with one of three synthetic seeds and no better with the other two
#: (docs/benchmarks.md, "Stream readers' correction", "Compiled by XLA"). A model
#: with an operation XLA cannot compile runs the steps as a plain graph either way.
SYNTHESIS_XLA = False
#: `xla_pays`: the values of BN inputs per input below which compiling costs more
#: than 100 steps save.
XLA_MIN_VALUES = 100_000


def release_plan(flat) -> dict:
    """Node index → tensor keys read for the last time there (model outputs kept)."""
    last = {}
    for node in flat.nodes:
        for t in node.inputs:
            last[t] = node.index
    plan: dict = {}
    for t, k in last.items():
        if not flat.is_output(t):
            plan.setdefault(k, []).append(t)
    return plan


def run_graph(flat, x, hook=None, plan=None, values=None):
    """Runs the flattened graph on `x` op by op, every layer in inference mode.

    ``hook(node, args, kwargs)`` may return a node's outputs instead of the call
    (None: call it). Tensors are dropped after their last reader (`plan`).
    ``values`` (`snapshot`): the layers compute with these values of their
    variables instead of the variables (`keras.StatelessScope`, which is per
    thread), so a pass on another thread measures the model as it was while its
    variables are edited."""
    tensors = {}
    for (key, layer), value in zip(flat.inputs, keras.tree.flatten(x)):
        tensors[key] = keras.ops.cast(value, layer.dtype)
    for node in flat.nodes:
        args, kwargs = node.call_args(tensors)
        out = hook(node, args, kwargs) if hook is not None else None
        if out is None:
            if kg.accepts_training(node.op):
                kwargs["training"] = False
            if values is None or not node.op.weights:
                out = node.op(*args, **kwargs)
            else:
                with keras.StatelessScope([(v, values[id(v)]) for v in node.op.weights]):
                    out = node.op(*args, **kwargs)
        for key, t in zip(node.outputs, keras.tree.flatten(out)):
            tensors[key] = t
        for t in (plan or {}).get(node.index, ()):
            tensors.pop(t, None)
    return tensors


def snapshot(model, copies=None) -> dict:
    """``{id(variable): tensor}``: a copy of every weight's current value, for
    `run_graph`'s ``values`` (the editor writes into the variables' buffers), or of
    `copies` (copies already taken, in ``model.weights`` order)."""
    if copies is None:
        copies = [np.array(kg.weight_view(w)) for w in model.weights]
    return {id(w): keras.ops.convert_to_tensor(v) for w, v in zip(model.weights, copies)}


def _run_error(flat, shape):
    """The exception running the graph on two zero inputs of `shape` raises (a size
    the model does not run at), or None."""
    try:
        run_graph(flat, np.zeros((2,) + tuple(shape), np.float32), plan=release_plan(flat))
    except Exception as e:  # noqa: BLE001 - the caller names the size and the cause
        return e
    return None


def _reduced_axes(bn, rank: int) -> list:
    """The axes a BatchNormalization layer averages over: all but its ``axis``
    (the channels: the last one under ``channels_last``, 1 under ``channels_first``)."""
    kept = bn.axis if isinstance(bn.axis, (list, tuple)) else [bn.axis]
    kept = {a % rank for a in kept}
    return [a for a in range(rank) if a not in kept]


def batch_moments(x, bn):
    """Per-channel mean and variance of `x`, as the BN layer `bn` counts channels, as
    float64 numpy. A tensor in host memory is read in place, once, by a compiled
    kernel accumulating in float64 (`hope_keras.stats.moment_kernels`): one read
    where the backend's reductions make four (``compress(data=)`` of a ResNet-50 @224
    with each: docs/benchmarks.md, "The first compress").
    Elsewhere (an accelerator's memory, several channel axes) the backend
    reduces it in float32, two passes: about 1e-5 relative, far below the sampling
    noise of the statistics."""
    axes = tuple(_reduced_axes(bn, len(x.shape)))
    host = _host_view(x)
    if host is not None and len(axes) == len(x.shape) - 1:
        kept = next(a for a in range(len(x.shape)) if a not in axes)
        return moment_kernels.channel_moments(host, axis=kept)
    x = keras.ops.cast(x, "float32")
    mean = keras.ops.mean(x, axis=axes, keepdims=True)
    var = keras.ops.mean(keras.ops.square(x - mean), axis=axes)
    return (np.asarray(keras.ops.convert_to_numpy(keras.ops.squeeze(mean, axis=axes)),
                       np.float64),
            np.asarray(keras.ops.convert_to_numpy(var), np.float64))


def differentiable_moments(x, axes):
    """``tf.nn.moments(x, axes)`` (mean and biased variance) with its gradient in
    one expression: ``∂m/∂x = 1/n`` and ``∂v/∂x = 2 (x − m)/n`` (the path through
    the mean vanishes, as the deviations sum to zero), so the incoming gradients
    ``g_m, g_v`` give ``x · b + (g_m/n − b · m)`` with ``b = 2 g_v/n``: two
    elementwise passes over `x` where the backend's chain rule makes five or six.
    `synthesize_inputs` takes these moments of every BatchNormalization input at
    each step, where the chain rule's passes cost a quarter of a ResNet-50 step at
    224 × 224 (docs/benchmarks.md, "The first compress").

    Args:
        x: A float TensorFlow tensor.
        axes: The axes reduced (a list of ints).

    Returns:
        tuple: ``(mean, variance)``, `x`'s shape without `axes`.

    Example:

    >>> import numpy as np, tensorflow as tf
    >>> from hope_keras.stats.synthetic import differentiable_moments
    >>> x = tf.constant(np.arange(12.0).reshape(2, 3, 2))
    >>> m, v = differentiable_moments(x, [0, 1])
    >>> m.numpy(), v.numpy()
    (array([5., 6.]), array([11.66666667, 11.66666667]))
    """
    import tensorflow as tf

    axes = sorted(a % len(x.shape) for a in axes)

    @tf.custom_gradient
    def moments(x):
        mean, var = tf.nn.moments(x, axes=axes, keepdims=True)
        n = tf.cast(tf.size(x) // tf.size(mean), x.dtype)

        def grad(g_mean, g_var):
            b = tf.reshape(g_var, tf.shape(var)) * (2.0 / n)
            # (x − m) first: x · b − m · b cancels in float32 where |m| ≫ σ.
            return (x - mean) * b + tf.reshape(g_mean, tf.shape(mean)) / n

        return (tf.squeeze(mean, axes), tf.squeeze(var, axes)), grad

    return moments(x)


def _host_view(x):
    """`x` as a NumPy array without a copy where it lives in host memory (a NumPy
    array, or a CPU tensor of the backend), else None."""
    if isinstance(x, np.ndarray):
        return x
    device = str(getattr(x, "device", "") or "")
    if "CPU" not in device.upper():
        return None
    try:
        # np.asarray shares a CPU tensor's buffer (TensorFlow's .numpy() copies it).
        return np.asarray(x)
    except Exception:  # noqa: BLE001 - a symbolic or exotic tensor: the backend reduces it
        return None


def _single_input(flat, what):
    if len(flat.inputs) != 1:
        raise ValueError(f"{what} supports models with one input; model "
                         f"'{flat.model.name}' has {len(flat.inputs)}.")
    key, layer = flat.inputs[0]
    shape = tuple(layer.batch_shape[1:])
    if any(s is None for s in shape):
        raise ValueError(f"{what} needs a fully defined input shape; model "
                         f"'{flat.model.name}' takes {layer.batch_shape}.")
    return shape, layer.dtype


def resized_shape(shape, size, model) -> tuple:
    """`shape` (an image input's, without the batch) with its spatial size `size`."""
    received = size
    if isinstance(size, int) and not isinstance(size, bool):
        size = (size, size)
    ok = (isinstance(size, (tuple, list)) and len(size) == 2
          and all(isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in size))
    if not ok:
        raise ValueError(f"size must be a positive int or a pair (height, width) of "
                         f"them. Received: size={received!r}")
    if len(shape) != 3:
        raise ValueError(f"size applies to image inputs (height, width, channels); model "
                         f"'{model.name}' takes inputs of shape {shape}.")
    if keras.config.image_data_format() == "channels_first":
        return (shape[0],) + tuple(size)
    return tuple(size) + (shape[2],)


def _spectrum_scale(height, width) -> np.ndarray:
    """Amplitude of each 2-D frequency under the 1/f prior, ``(height, width // 2 + 1)``,
    scaled so that white unit coefficients give pixels of about unit variance."""
    f = np.sqrt(np.fft.fftfreq(height)[:, None] ** 2 + np.fft.rfftfreq(width)[None, :] ** 2)
    scale = 1.0 / np.maximum(f, 1.0 / max(height, width))
    return (scale / np.sqrt(np.mean(scale ** 2))).astype(np.float32)


def _upsampled_spectrum(coef, small, big) -> np.ndarray:
    """Coefficients ``(..., h, w // 2 + 1)`` of the 1/f parameterisation at the larger
    size `big` = ``(h, w)`` that give the images the coefficients `coef` give at
    `small` = ``(h0, w0)``, interpolated: the spectrum zero-padded (a Nyquist column of
    an even ``w0``, counted once by the inverse real FFT, is halved: at the larger size
    it is counted twice). At twice the size the big images' even pixels are the small
    images' pixels."""
    (h0, w0), (h, w) = small, big
    if h < h0 or w < w0:
        raise ValueError(f"_upsampled_spectrum: {big} is smaller than {small}")
    coef = np.asarray(coef, np.float32)
    out = np.zeros(coef.shape[:-2] + (h, w // 2 + 1), np.float32)
    pos, cols = (h0 + 1) // 2, w0 // 2 + 1  # rows of frequency 0 … pos − 1, then negative
    src_rows = np.arange(h0)
    dst_rows = np.where(src_rows < pos, src_rows, src_rows - h0 + h)
    a_small, a_big = _spectrum_scale(h0, w0), _spectrum_scale(h, w)
    ratio = (a_small / a_big[dst_rows, :cols]) * np.float32(np.sqrt(h * w / (h0 * w0)))
    if w0 % 2 == 0 and w > w0:
        ratio[:, -1] *= 0.5
    out[..., dst_rows, :cols] = coef * ratio
    return out


def _coarse_steps(coarse_steps, steps, shape, prior) -> int:
    """How many of `steps` run at half size (`synthesize_inputs`' ``coarse_steps``;
    None: the default rule). Raises ValueError for a value that does not apply."""
    image = prior == "spectrum" and len(shape) == 3
    if coarse_steps is None:
        if not image:
            return 0
        first = keras.config.image_data_format() == "channels_first"
        h, w = shape[1:] if first else shape[:2]
        return int(round(COARSE_FRACTION * steps)) if min(h, w) >= COARSE_MIN_SIDE else 0
    if (isinstance(coarse_steps, bool) or not isinstance(coarse_steps, int)
            or not 0 <= coarse_steps <= steps):
        raise ValueError(f"coarse_steps must be None or an integer from 0 to steps "
                         f"({steps}). Received: coarse_steps={coarse_steps!r}")
    if coarse_steps and not image:
        raise ValueError(f"coarse_steps applies to image inputs (height, width, channels) "
                         f"with prior='spectrum'; received inputs of shape {shape} and "
                         f"prior={prior!r}. Pass coarse_steps=0 or None.")
    return coarse_steps


def reduced_size(model):
    """The spatial size ``(height, width)`` the data-free correction makes its
    synthetic inputs and measures the stream readers at: the model's size divided by
    `MEASURE_SCALE` for an image input whose sides are both at least
    `COARSE_MIN_SIDE`, when the model runs there (convolutional up to a global
    pooling); None (the model's own size) otherwise."""
    if MEASURE_SCALE == 1:
        return None
    flat = kg.flatten(model)
    if len(flat.inputs) != 1:
        return None
    shape = tuple(flat.inputs[0][1].batch_shape[1:])
    if len(shape) != 3 or any(s is None for s in shape):
        return None
    first = keras.config.image_data_format() == "channels_first"
    h, w = shape[1:] if first else shape[:2]
    if min(h, w) < COARSE_MIN_SIDE:
        return None
    size = (max(h // MEASURE_SCALE, 1), max(w // MEASURE_SCALE, 1))
    if _run_error(flat, resized_shape(shape, size, model)) is not None:
        return None
    return size


def synthesize_inputs(model, num: int = SYNTHETIC_INPUTS, steps: int = SYNTHETIC_STEPS,
                      learning_rate: float = LEARNING_RATE, seed: int = 0,
                      verbose="auto", size=None, prior: str = PRIOR,
                      coarse_steps=None, coarse_scale=None) -> np.ndarray:
    """Data-free inputs whose BatchNormalization statistics match the model's.

    Starting from random noise, Adam adjusts a batch of ``num`` inputs so that every
    BatchNormalization layer's input has, over the batch, the mean and standard
    deviation its moving statistics record (the summed relative errors
    ``‖m − μ‖ / ‖μ‖ + ‖s − σ‖ / ‖σ‖`` over the layers; ZeroQ's distilled data). Images
    are parameterised by their Fourier spectrum, amplitudes falling as 1/f like
    natural images' (``prior``). The model runs in inference mode and is not
    changed. It costs ``steps`` forward and backward passes of the batch (compiled
    by XLA with `SYNTHESIS_XLA`, off by default).

    Args:
        model: A Keras model with one input of fully defined shape and at least
            one BatchNormalization layer (nested models are run through).
        num: Number of inputs.
        steps: Adam steps.
        learning_rate: Adam's learning rate.
        seed: Seed of the initial noise.
        verbose: ``"auto"``, True or False: a progress bar.
        size: For an image input, the spatial size ``(height, width)`` (or one int)
            of the inputs to make, when it is not the model's own (a convolutional
            network runs at any size; its BN statistics are then matched at that
            size). Cheaper, but the stream readers' correction measured on such
            inputs is worse: on a ResNet-50 trained at 64 × 64, inputs made at
            32 × 32 cost 16–38 points of accuracy at five compressions
            (`benchmarks/synthetic_settings.py --size resnet50_64`), so `compress`
            makes them at the model's size. None: the model's size.
        prior: How an image input (height, width, channels) is parameterised:
            ``"spectrum"`` (default): Adam moves the coefficients of each channel's
            2-D Fourier modes, scaled by ``1 / f`` (f the spatial frequency, in
            cycles per pixel, at least ``1 / side``), so the noise it starts from
            and the steps it takes have a natural image's spectrum instead of
            the pixel-level noise free pixels keep, which a network trained on
            images never saw. ``"pixels"``: free pixels (standard normal at the
            start). Other inputs (vectors, sequences) are free values either way.
            On the ResNet-50 fixtures the spectrum made the stream readers'
            correction better (docs/benchmarks.md, "Stream readers' correction").
        coarse_steps: For an image input under the ``"spectrum"`` prior, how many of
            the ``steps`` run at half the spatial size: their inputs, interpolated
            (the spectrum zero-padded), start the remaining steps at the full size.
            A step at half size has a quarter of the pixels (at 224 × 224 the whole
            synthesis took about half the time, docs/benchmarks.md). None
            (default): `COARSE_FRACTION` of the steps when both sides are at least
            `COARSE_MIN_SIDE` and the model runs at half size, else 0. On the
            ResNet-50 fixtures this made the stream readers' correction better at
            128 × 128, at 32 × 32 no better and slower, at 64 × 64 worse
            (docs/benchmarks.md, "Coarse steps first").
        coarse_scale: The coarse steps run at the size divided by this, an integer
            ≥ 2 (each side rounded down). None (default): `COARSE_SCALE`.

    Returns:
        np.ndarray: ``(num,) + input shape`` (with `size`, the input shape at that
        size), float32.

    Raises:
        ValueError: for a model with several inputs, an undefined input shape, no
            BatchNormalization layer, ``num`` below 2 or negative ``steps``, a `size`
            the model does not run at, an unknown ``prior``, a ``coarse_steps``
            outside 0 … ``steps``, or above 0 for inputs it does not apply to or a
            model that does not run at the coarse size, a ``coarse_scale`` below 2,
            or when the optimisation diverges.

    Example:

    >>> import keras, hope_keras
    >>> inputs = keras.Input((6,))
    >>> x = keras.layers.BatchNormalization()(keras.layers.Dense(4)(inputs))
    >>> model = keras.Model(inputs, keras.layers.Dense(2)(keras.layers.ReLU()(x)))
    >>> hope_keras.synthesize_inputs(model, num=8, steps=5, verbose=False).shape
    (8, 6)
    """
    import tensorflow as tf

    if isinstance(num, bool) or not isinstance(num, int) or num < 2:
        raise ValueError(f"num must be an integer ≥ 2 (a batch has statistics). "
                         f"Received: num={num!r}")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ValueError(f"steps must be an integer ≥ 0. Received: steps={steps!r}")
    if prior not in PRIORS:
        raise ValueError(f"prior must be one of {PRIORS}. Received: prior={prior!r}")
    if coarse_scale is None:
        coarse_scale = COARSE_SCALE
    if (isinstance(coarse_scale, bool) or not isinstance(coarse_scale, int)
            or coarse_scale < 2):
        raise ValueError(f"coarse_scale must be an integer ≥ 2. Received: "
                         f"coarse_scale={coarse_scale!r}")
    flat = kg.flatten(model)
    shape, _ = _single_input(flat, "synthesize_inputs")
    if size is not None:
        shape = resized_shape(shape, size, model)
        error = _run_error(flat, shape)
        if error is not None:
            raise ValueError(f"synthesize_inputs: model '{model.name}' does not run on "
                             f"inputs of shape {shape} (size={size!r}): {error}") from error
    bns = [node for node in flat.nodes if is_batch_norm(node.op) and node.inputs]
    if not bns:
        raise ValueError(f"synthesize_inputs: model '{model.name}' has no "
                         "BatchNormalization layer whose statistics inputs could match.")
    index = {node.index: k for k, node in enumerate(bns)}
    target_mean = [tf.constant(np.asarray(n.op.moving_mean.numpy(), np.float32)) for n in bns]
    target_std = [tf.constant(np.sqrt(np.asarray(n.op.moving_variance.numpy(), np.float32)
                                      + n.op.epsilon)) for n in bns]
    norm_mean = [tf.norm(m) + 1e-3 for m in target_mean]
    norm_std = [tf.norm(s) + 1e-3 for s in target_std]
    plan = release_plan(flat)
    coarse = _coarse_steps(coarse_steps, steps, shape, prior)
    first = keras.config.image_data_format() == "channels_first"
    if prior == "spectrum" and len(shape) == 3:
        c, h, w = shape if first else (shape[2], shape[0], shape[1])
        sizes = [((h, w), steps)]
        if coarse:
            half = (max(h // coarse_scale, 1), max(w // coarse_scale, 1))
            half_shape = (c,) + half if first else half + (c,)
            error = _run_error(flat, half_shape)
            if error is None:
                sizes = [(half, coarse), ((h, w), steps - coarse)]
            elif coarse_steps is not None:
                raise ValueError(f"synthesize_inputs: model '{model.name}' does not run "
                                 f"on inputs of shape {half_shape} (1/{coarse_scale} of its size, "
                                 f"coarse_steps={coarse_steps!r}): {error}") from error
            else:
                coarse = 0  # the default: only where the model runs at half size

        def variable(coef, size):
            # Fourier coefficients of each image channel, amplitudes falling as 1/f.
            ph, pw = size
            amp = tf.constant(_spectrum_scale(ph, pw))
            x = tf.Variable(coef, name="synthetic_spectrum")

            def inputs():
                img = tf.signal.irfft2d(tf.complex(x[0] * amp, x[1] * amp), fft_length=[ph, pw])
                img = img * float(np.sqrt(ph * pw))
                return img if first else tf.transpose(img, (0, 2, 3, 1))
            return x, inputs
        (h0, w0), _ = sizes[0]
        start = tf.random.stateless_normal((2, num, c, h0, w0 // 2 + 1), (seed, 0)) / np.sqrt(2.0)
    else:
        sizes = [(None, steps)]

        def variable(coef, size):
            x = tf.Variable(coef, name="synthetic")
            return x, lambda: x
        start = tf.random.stateless_normal((num,) + shape, (seed, 0))

    def loss_fn(inputs):
        terms = []

        def hook(node, args, kwargs):
            k = index.get(node.index)
            if k is not None:
                inp = tf.cast(args[0], tf.float32)
                m, v = differentiable_moments(inp, _reduced_axes(node.op, len(inp.shape)))
                terms.append(tf.norm(m - target_mean[k]) / norm_mean[k]
                             + tf.norm(tf.sqrt(v + 1e-5) - target_std[k]) / norm_std[k])
            return None

        run_graph(flat, inputs(), hook, plan)
        return tf.add_n(terms)

    if resolve_verbose(verbose):
        at_half = (f", the first {coarse} at 1/{coarse_scale} of the size" if coarse
                   else "")
        print(f"synthesize_inputs: {num} inputs matched to the BatchNormalization "
              f"statistics of '{model.name}' ({steps} Adam steps{at_half})")
    bar = WorkBar(steps, "step", verbose=verbose)
    xla = [SYNTHESIS_XLA and xla_pays(flat, bns)]

    def optimise(x, inputs, n_steps, done):
        optimizer = keras.optimizers.Adam(learning_rate)
        optimizer.build([x])  # its slots made here, or the step would be traced twice

        def step():
            with tf.GradientTape() as tape:
                loss = loss_fn(inputs)
            optimizer.apply_gradients([(tape.gradient(loss, x), x)])
            return loss

        compiled = kg.graph_function(step, jit_compile=xla[0])
        for k in range(n_steps):
            try:
                loss = compiled()
            except tf.errors.InvalidArgumentError:
                # XLA could not compile the step (it fails before anything runs):
                # the plain graph, for this size and the next.
                if k or not xla[0]:
                    raise
                xla[0] = False
                compiled = kg.graph_function(step)
                loss = compiled()
            bar.update(done + k + 1, loss=float(loss))

    done, previous = 0, None
    try:
        for size, n_steps in sizes:
            # At half size first (``coarse_steps``): those inputs, interpolated, are
            # where the steps at the full size start, with a fresh Adam.
            coef = start if previous is None else _upsampled_spectrum(x.numpy(), previous, size)
            x, inputs = variable(coef, size)
            optimise(x, inputs, n_steps, done)
            done, previous = done + n_steps, size
    finally:
        bar.close()
    out = keras.ops.convert_to_numpy(inputs()).astype(np.float32)
    if not np.all(np.isfinite(out)):
        raise ValueError(f"synthesize_inputs: the optimisation diverged on model "
                         f"'{model.name}' (non-finite inputs after {steps} steps at "
                         f"learning_rate={learning_rate}); try a smaller learning_rate.")
    return out


def xla_pays(flat, bns) -> bool:
    """Whether XLA is expected to make `synthesize_inputs`' steps faster on `flat`
    (with `SYNTHESIS_XLA`): no depthwise convolution (XLA's ran several times slower
    on two CPU cores: MobileNetV2), a grouped one with a group per channel included,
    and the inputs of the BNs `bns` at least `XLA_MIN_VALUES` values per input
    (docs/benchmarks.md, "Compiled by XLA")."""
    for node in flat.nodes:
        groups = getattr(node.op, "groups", 1) or 1
        # Depthwise and separable convolutions have a depth multiplier.
        if hasattr(node.op, "depth_multiplier") or (
                groups > 1 and groups == getattr(node.op, "filters", None)):
            return False
    values = sum(int(np.prod([d or 1 for d in flat.shapes[node.inputs[0]][1:]]))
                 for node in bns)
    return values >= XLA_MIN_VALUES


def stream_readers(graph) -> list:
    """The BatchNormalization nodes of ``graph.flat`` that read a residual stream.

    A reader's input is computed from the output of a sum or product of tensors
    (``Add``, ``Multiply``…) without another BatchNormalization on the way: a
    block's first BN and a projection shortcut's BN in a post-activation ResNet, a
    pre-activation block's own BN, the BN after a squeeze-and-excitation product.

    Args:
        graph: `hope_keras.graph.walker.walk(model)` (or ``analysis.graph``).

    Returns:
        list: The readers' `FlatNode` s, in topological order.
    """
    flat = graph.flat
    reach, out = set(), []
    for node in flat.nodes:
        if is_batch_norm(node.op):
            if node.inputs and node.inputs[0] in reach:
                out.append(node)
            continue
        if (layer_rules.role_of(node.op, node) == "merge"
                or any(t in reach for t in node.inputs)):
            reach |= set(node.outputs)
    return out


class StreamReference:
    """What `correct_stream_readers` compares the compressed model with.

    Taken on the original model before compression: for each stream reader, the
    input of the single-input layer that feeds it (its convolution, usually; the BN's
    own input when it reads the sum directly), on the synthetic batch ``x``. After
    compression that layer, with its edited weights, is applied to both the stored
    input and the new one, so the reader's own edits (a merged slot's filter) count on
    both sides and only the stream's move is measured.

    Args:
        model: The model before compression.
        graph: ``hope_keras.analyze(model).graph`` (or `hope_keras.graph.walker.walk`).
        x: Synthetic inputs (`synthesize_inputs`).
        values: The original weights' values, when the model's variables are
            edited meanwhile (`snapshot`, `run_graph`).

    Example:

    >>> import keras, hope_keras
    >>> from hope_keras.stats.synthetic import StreamReference
    >>> inputs = keras.Input((6,))
    >>> h = keras.layers.Dense(6)(inputs)
    >>> h = keras.layers.ReLU()(keras.layers.BatchNormalization()(h))
    >>> s = keras.layers.Add()([inputs, h])
    >>> y = keras.layers.BatchNormalization(name="reader")(keras.layers.Dense(3)(s))
    >>> model = keras.Model(inputs, y)
    >>> x = hope_keras.synthesize_inputs(model, num=8, steps=2, verbose=False)
    >>> ref = StreamReference(model, hope_keras.analyze(model).graph, x)
    >>> [node.key for node in ref.readers]
    ['reader']
    """

    def __init__(self, model, graph, x, values=None):
        self.graph, self.x = graph, x
        flat = graph.flat
        self.readers = stream_readers(graph)
        self.source = {}  # reader index → the node whose input was stored (None: BN's)
        wanted = {}  # node index → reader index, for the node whose input is stored
        for node in self.readers:
            src = flat.producer_node(node.inputs[0])
            ok = (src is not None and len(src.inputs) == 1 and not is_batch_norm(src.op)
                  and flat.calls.get(src.key) == 1 and len(src.outputs) == 1)
            self.source[node.index] = src.index if ok else None
            wanted[src.index if ok else node.index] = node.index
        self.stored = {}

        def hook(node, args, kwargs):
            r = wanted.get(node.index)
            if r is not None:
                self.stored[r] = args[0]
            return None

        if self.readers:
            run_graph(flat, x, hook, release_plan(flat), values=values)


def correct_stream_readers(reference: StreamReference, tensors) -> dict:
    """Corrects the moving statistics of the stream readers whose input moved.

    One pass of the compressed model over the reference's synthetic batch, in
    topological order: at each reader whose input tensor is in ``tensors``, the
    layer feeding it runs on the stored original input and on the current one; the
    BN's moving mean is shifted by the change of the batch mean and its moving
    variance scaled by the ratio of batch variances, channel by channel, and the BN
    then normalises with the new statistics, so later readers see the corrected
    ones. Channels the edits made constant (variance ≈ 0 before or after) keep the
    statistics the edits wrote, and so do channels whose measurement is not finite.

    Args:
        reference: The `StreamReference` taken before compression.
        tensors: Tensor keys (of the reference's graph) whose readers to correct,
            e.g. `hope_keras.stats.bn_stats.untrusted_tensors` of the steps.

    Returns:
        dict: ``{BN name: (moving_mean, moving_variance)}`` written (float64).
    """
    flat = reference.graph.flat
    todo = {node.index: node for node in reference.readers if node.inputs[0] in tensors}
    if not todo:
        return {}
    feeds = {}
    for r in todo:
        src = reference.source[r]
        if src is not None:
            feeds[src] = r
    before = {}
    written = {}

    def hook(node, args, kwargs):
        r = feeds.get(node.index)
        if r is not None:
            kw = dict(kwargs)
            if kg.accepts_training(node.op):
                kw["training"] = False
            before[r] = batch_moments(node.op(reference.stored[r], *args[1:], **kw), todo[r].op)
            return None
        if node.index not in todo:
            return None
        bn = node.op
        m0, v0 = before[node.index] if node.index in before else batch_moments(
            reference.stored[node.index], bn)
        m1, v1 = batch_moments(args[0], bn)
        finite = np.isfinite(m0) & np.isfinite(v0) & np.isfinite(m1) & np.isfinite(v1)
        scale = [float(np.mean(v[finite])) if finite.any() else 0.0 for v in (v0, v1)]
        tiny = 1e-6 * max(*scale, 1e-30)
        live = finite & (v0 > tiny) & (v1 > tiny)
        mean = np.asarray(bn.moving_mean.numpy(), np.float64)
        var = np.asarray(bn.moving_variance.numpy(), np.float64)
        mean = np.where(live, mean + (m1 - m0), mean)
        var = np.where(live, var * v1 / np.where(live, v0, 1.0), var)
        bn.moving_mean.assign(mean.astype(bn.moving_mean.dtype))
        bn.moving_variance.assign(var.astype(bn.moving_variance.dtype))
        written[bn.name] = (mean, var)
        return None  # the BN now runs with the corrected statistics

    run_graph(flat, reference.x, hook, release_plan(flat))
    return written
