"""Synthetic inputs (`hope_keras.synthesize_inputs`) and the stream readers' correction
they drive (`compress`'s data-free correction), checked against re-estimation of the
statistics on the same inputs, which the correction must reproduce when the reference
statistics are those inputs' own."""

import keras
import numpy as np
import pytest
from conftest import small_resnet

import hope_keras
from hope_keras.graph import adapter as kg
from hope_keras.graph.blocks import is_batch_norm
from hope_keras.stats import bn_stats, synthetic
from hope_keras.stats.synthetic import StreamReference, correct_stream_readers, stream_readers

L = keras.layers


def _bn_input_moments(model, x):
    """{BN name: (batch mean, batch std) of its input on x}, in inference mode."""
    bns = [layer for layer in model.layers if isinstance(layer, L.BatchNormalization)]
    sub = keras.Model(model.inputs, [bn.input for bn in bns])
    outs = sub([x])
    out = {}
    for bn, z in zip(bns, outs):
        z = np.asarray(z, np.float64).reshape(-1, z.shape[-1])
        out[bn.name] = (z.mean(axis=0), z.std(axis=0))
    return out


def _mismatch(model, x):
    """Summed relative error between the BN inputs' batch statistics on x and the
    moving statistics (the quantity `synthesize_inputs` minimises)."""
    total = 0.0
    for name, (m, s) in _bn_input_moments(model, x).items():
        bn = model.get_layer(name)
        mu = bn.moving_mean.numpy()
        sd = np.sqrt(bn.moving_variance.numpy() + bn.epsilon)
        total += np.linalg.norm(m - mu) / (np.linalg.norm(mu) + 1e-3)
        total += np.linalg.norm(s - sd) / (np.linalg.norm(sd) + 1e-3)
    return total


@pytest.mark.parametrize("xla", [False, True])
def test_synthetic_inputs_match_the_moving_statistics_better_than_their_start(
        xla, monkeypatch):
    """Statistics of real inputs (uniform on [0, 2], not the normal noise the
    synthesis starts from) are matched to within a small fraction of the start's
    mismatch, with the step as a plain graph (the default) and compiled by XLA."""
    monkeypatch.setattr(synthetic, "SYNTHESIS_XLA", xla)
    monkeypatch.setattr(synthetic, "XLA_MIN_VALUES", 0)  # this model is below it
    model = small_resnet(seed=1)
    data = np.random.default_rng(0).uniform(0, 2, (64, 10, 10, 3)).astype("float32")
    bn_stats.reestimate_batchnorm_statistics(model, data)
    before = [w.numpy().copy() for w in model.weights]
    start = hope_keras.synthesize_inputs(model, num=16, steps=0, verbose=False)
    x = hope_keras.synthesize_inputs(model, num=16, steps=60, verbose=False)
    assert x.shape == (16, 10, 10, 3) and x.dtype == np.float32
    assert _mismatch(model, data) < 0.05  # attainable: real inputs have them
    assert _mismatch(model, x) < 0.15 * _mismatch(model, start)
    for w, v in zip(model.weights, before):  # the model is not changed
        np.testing.assert_array_equal(w.numpy(), v)
    again = hope_keras.synthesize_inputs(model, num=16, steps=60, verbose=False)
    np.testing.assert_allclose(again, x, rtol=1e-5, atol=1e-5)  # seeded


def test_a_step_xla_cannot_compile_runs_as_a_plain_graph(monkeypatch):
    """Fractional max pooling has no XLA kernel: the first compiled step fails before
    it changes anything, and the steps run as a plain graph, giving the inputs the
    plain graph gives."""
    import tensorflow as tf

    inputs = keras.Input((8, 8, 3))
    x = L.BatchNormalization()(L.Conv2D(4, 3, padding="same")(inputs))
    x = L.Lambda(lambda t: tf.nn.fractional_max_pool(
        t, [1.0, 1.5, 1.5, 1.0], pseudo_random=True, seed=1)[0],
        output_shape=(5, 5, 4))(x)
    x = L.BatchNormalization()(L.Conv2D(4, 1)(L.ReLU()(x)))
    model = keras.Model(inputs, x)
    for bn in (model.layers[2], model.layers[-1]):
        bn.moving_mean.assign(np.linspace(-0.5, 0.5, 4).astype("float32"))
        bn.moving_variance.assign(np.linspace(0.5, 2.0, 4).astype("float32"))
    with pytest.raises(tf.errors.InvalidArgumentError):  # what the fallback catches
        tf.function(lambda: model(tf.zeros((2, 8, 8, 3))), jit_compile=True)()
    monkeypatch.setattr(synthetic, "SYNTHESIS_XLA", True)
    monkeypatch.setattr(synthetic, "XLA_MIN_VALUES", 0)
    flat = kg.flatten(model)
    assert synthetic.xla_pays(flat, [n for n in flat.nodes if is_batch_norm(n.op)])
    compiled = hope_keras.synthesize_inputs(model, num=4, steps=5, verbose=False)
    monkeypatch.setattr(synthetic, "SYNTHESIS_XLA", False)
    plain = hope_keras.synthesize_inputs(model, num=4, steps=5, verbose=False)
    start = hope_keras.synthesize_inputs(model, num=4, steps=0, verbose=False)
    np.testing.assert_array_equal(compiled, plain)
    assert not np.allclose(plain, start)


def test_xla_pays_without_depthwise_convolutions_and_with_enough_values():
    """`xla_pays`: not with a depthwise or separable convolution (a grouped one with
    a group per channel included), nor below `XLA_MIN_VALUES` values of BN inputs per
    input; otherwise yes, grouped convolutions included."""
    def model_with(conv, size):
        inputs = keras.Input((size, size, 8))
        x = L.BatchNormalization()(conv(inputs))
        return keras.Model(inputs, L.BatchNormalization()(L.Conv2D(8, 1)(L.ReLU()(x))))

    def pays(model):
        flat = kg.flatten(model)
        return synthetic.xla_pays(flat, [n for n in flat.nodes if is_batch_norm(n.op)])

    side = int(np.ceil(np.sqrt(synthetic.XLA_MIN_VALUES / 16)))  # two BNs of 8 channels
    assert pays(model_with(L.Conv2D(8, 3, padding="same"), side))
    assert not pays(model_with(L.Conv2D(8, 3, padding="same"), side - 2))
    assert pays(model_with(L.Conv2D(8, 3, padding="same", groups=2), side))
    for conv in (L.DepthwiseConv2D(3, padding="same"), L.SeparableConv2D(8, 3, padding="same"),
                 L.Conv2D(8, 3, padding="same", groups=8)):
        assert not pays(model_with(conv, side))


@pytest.mark.parametrize("axes", [[0, 1, 2], [0, 2, 3], [0]])
def test_the_moments_gradient_matches_float64_central_differences(axes):
    """`differentiable_moments` in float32 on inputs whose mean is 300 standard
    deviations (a BN input of a trained network can sit far from zero): its values
    and its gradient of a loss of both moments against a float64 reference, the
    gradient by central differences of the numpy formulas (exact for a quadratic),
    checked at every element."""
    import tensorflow as tf

    from hope_keras.stats.synthetic import differentiable_moments

    rng = np.random.default_rng(0)
    shape = (3, 4, 5, 2) if len(axes) > 1 else (6, 3)
    x64 = 300.0 + rng.normal(size=shape)
    kept = [d for i, d in enumerate(shape) if i not in axes]
    wm, wv = rng.normal(size=kept), rng.normal(size=kept)

    def loss64(x):
        m = x.mean(axis=tuple(axes))
        v = ((x - np.expand_dims(m, axes)) ** 2).mean(axis=tuple(axes))
        return float(np.sum(wm * m) + np.sum(wv * v))

    h = 1e-3
    expected = np.zeros(shape)
    for i in np.ndindex(shape):
        e = np.zeros(shape)
        e[i] = h
        expected[i] = (loss64(x64 + e) - loss64(x64 - e)) / (2 * h)
    x = tf.Variable(x64.astype(np.float32))
    with tf.GradientTape() as tape:
        m, v = differentiable_moments(x, axes)
        loss = tf.reduce_sum(wm.astype(np.float32) * m) + tf.reduce_sum(wv.astype(np.float32) * v)
    grad = tape.gradient(loss, x).numpy()
    np.testing.assert_allclose(m.numpy(), x64.mean(axis=tuple(axes)), rtol=1e-6)
    np.testing.assert_allclose(v.numpy(), x64.var(axis=tuple(axes)), rtol=2e-3)
    np.testing.assert_allclose(grad, expected, rtol=0, atol=2e-3 * np.abs(expected).max())


def test_synthesize_inputs_rejects_what_it_cannot_do():
    a, b = keras.Input((3,)), keras.Input((3,))
    two = keras.Model([a, b], L.Dense(2)(L.Concatenate()([a, b])))
    with pytest.raises(ValueError, match="one input.*has 2"):
        hope_keras.synthesize_inputs(two, verbose=False)
    plain = keras.Model(a, L.Dense(2)(a))
    with pytest.raises(ValueError, match="no BatchNormalization"):
        hope_keras.synthesize_inputs(plain, verbose=False)
    with pytest.raises(ValueError, match="num must be.*Received: num=1"):
        hope_keras.synthesize_inputs(small_resnet(), num=1, verbose=False)


def _gap_resnet(side=24, seed=0, height=None):
    """Stem → one identity block → global average pooling → head: runs at any size."""
    keras.utils.set_random_seed(seed)
    height = side if height is None else height
    inputs = keras.Input((height, side, 3))
    x = L.ReLU()(L.BatchNormalization()(L.Conv2D(8, 3, padding="same")(inputs)))
    y = L.ReLU()(L.BatchNormalization()(L.Conv2D(6, 3, padding="same")(x)))
    y = L.BatchNormalization()(L.Conv2D(8, 1)(y))
    x = L.ReLU()(L.Add()([x, y]))
    outputs = L.Dense(3)(L.GlobalAveragePooling2D()(x))
    model = keras.Model(inputs, outputs)
    data = np.random.default_rng(seed).uniform(0, 2, (32, height, side, 3)).astype("float32")
    bn_stats.reestimate_batchnorm_statistics(model, data)
    return model


def _mismatch_at(model, x):
    """`_mismatch` on inputs of any size (the flattened graph run op by op)."""
    from hope_keras.graph import adapter as kg
    from hope_keras.stats import synthetic

    total = []

    def hook(node, args, kwargs):
        if isinstance(node.op, L.BatchNormalization):
            z = np.asarray(args[0], np.float64).reshape(-1, args[0].shape[-1])
            mu = node.op.moving_mean.numpy()
            sd = np.sqrt(node.op.moving_variance.numpy() + node.op.epsilon)
            total.append(np.linalg.norm(z.mean(0) - mu) / (np.linalg.norm(mu) + 1e-3)
                         + np.linalg.norm(z.std(0) - sd) / (np.linalg.norm(sd) + 1e-3))

    synthetic.run_graph(kg.flatten(model), x, hook)
    return sum(total)


def test_synthetic_inputs_at_a_smaller_size():
    """A network that runs at any size gets inputs made at a smaller one, matched to
    its statistics there; a network whose Flatten fixes the size is refused."""
    model = _gap_resnet(side=24)
    before = [w.numpy().copy() for w in model.weights]
    start = hope_keras.synthesize_inputs(model, num=16, steps=0, size=12, verbose=False)
    x = hope_keras.synthesize_inputs(model, num=16, steps=60, size=(12, 12), verbose=False)
    assert x.shape == (16, 12, 12, 3)
    assert _mismatch_at(model, x) < 0.3 * _mismatch_at(model, start)
    for w, v in zip(model.weights, before):
        np.testing.assert_array_equal(w.numpy(), v)
    wide = _gap_resnet(side=20, height=10)
    assert hope_keras.synthesize_inputs(wide, num=2, steps=1, size=(5, 10),
                                        verbose=False).shape == (2, 5, 10, 3)
    fixed = small_resnet()  # Flatten → Dense
    with pytest.raises(ValueError, match=r"does not run on inputs of shape \(5, 5, 3\)"):
        hope_keras.synthesize_inputs(fixed, size=5, verbose=False)
    with pytest.raises(ValueError, match="size must be.*Received: size=0"):
        hope_keras.synthesize_inputs(model, size=0, verbose=False)


def _images(coef, size):
    """The images `synthesize_inputs` makes from spectrum coefficients at `size`."""
    import tensorflow as tf

    from hope_keras.stats.synthetic import _spectrum_scale

    h, w = size
    amp = _spectrum_scale(h, w)
    img = tf.signal.irfft2d(tf.complex(coef[0] * amp, coef[1] * amp), fft_length=[h, w])
    return np.asarray(img) * np.sqrt(h * w)


@pytest.mark.parametrize("small", [(6, 8), (5, 7), (6, 7)])
def test_an_upsampled_spectrum_interpolates_the_small_images(small):
    """At twice the size, the even pixels of the upsampled spectrum's images are the
    small images' pixels (the inverse FFTs computed independently, at both sizes), for
    even and odd sides."""
    from hope_keras.stats.synthetic import _upsampled_spectrum

    h0, w0 = small
    coef = np.random.default_rng(0).normal(size=(2, 3, 2, h0, w0 // 2 + 1)).astype("float32")
    big = (2 * h0, 2 * w0)
    up = _upsampled_spectrum(coef, small, big)
    assert up.shape == (2, 3, 2, 2 * h0, w0 + 1)
    x0, x1 = _images(coef, small), _images(up, big)
    np.testing.assert_allclose(x1[..., ::2, ::2], x0, rtol=1e-4, atol=1e-4)
    assert np.abs(x1).max() < 3 * np.abs(x0).max()  # interpolation, no blow-up
    with pytest.raises(ValueError, match="smaller"):
        _upsampled_spectrum(coef, small, (h0 - 1, w0))


def test_synthetic_inputs_with_coarse_steps():
    """Steps at half size first, then at the full size: inputs of the model's size,
    matched better than the start and about as well as the same number of steps at
    the full size; the default makes none below COARSE_MIN_SIDE (the same inputs as
    coarse_steps=0); bad values and a model that cannot run at half size are refused."""
    from hope_keras.stats import synthetic

    model = _gap_resnet(side=16)
    start = hope_keras.synthesize_inputs(model, num=16, steps=0, verbose=False)
    full = hope_keras.synthesize_inputs(model, num=16, steps=60, verbose=False)
    mixed = hope_keras.synthesize_inputs(model, num=16, steps=60, coarse_steps=40,
                                         verbose=False)
    assert mixed.shape == (16, 16, 16, 3) and np.all(np.isfinite(mixed))
    assert _mismatch_at(model, mixed) < 0.3 * _mismatch_at(model, start)
    assert _mismatch_at(model, mixed) < 2.0 * _mismatch_at(model, full)
    assert not np.allclose(mixed, full)
    np.testing.assert_array_equal(  # below COARSE_MIN_SIDE the default is no coarse step
        hope_keras.synthesize_inputs(model, num=16, steps=60, coarse_steps=0, verbose=False),
        full)
    only = hope_keras.synthesize_inputs(model, num=4, steps=3, coarse_steps=3, verbose=False)
    assert only.shape == (4, 16, 16, 3)
    assert synthetic._coarse_steps(None, 100, (128, 160, 3), "spectrum") == 80
    assert synthetic._coarse_steps(None, 100, (127, 160, 3), "spectrum") == 0
    assert synthetic._coarse_steps(None, 100, (128, 160, 3), "pixels") == 0
    assert synthetic._coarse_steps(None, 100, (256,), "spectrum") == 0
    with pytest.raises(ValueError, match="coarse_steps must be.*Received: coarse_steps=61"):
        hope_keras.synthesize_inputs(model, steps=60, coarse_steps=61, verbose=False)
    with pytest.raises(ValueError, match="prior='pixels'"):
        hope_keras.synthesize_inputs(model, steps=2, coarse_steps=1, prior="pixels",
                                     verbose=False)
    fixed = small_resnet()  # Flatten → Dense: does not run at half size
    with pytest.raises(ValueError, match=r"1/2 of its size, coarse_steps=1"):
        hope_keras.synthesize_inputs(fixed, steps=2, coarse_steps=1, verbose=False)


def test_the_default_coarse_steps_skip_a_model_that_runs_at_its_size_only(monkeypatch):
    """With the default rule in force (COARSE_MIN_SIDE lowered for a small model), a
    model whose Flatten fixes its size gets every step at the full size; one that
    runs at any size gets the coarse steps (other inputs than without them)."""
    from hope_keras.stats import synthetic

    fixed = small_resnet()
    ref = hope_keras.synthesize_inputs(fixed, num=4, steps=5, coarse_steps=0, verbose=False)
    gap = _gap_resnet(side=16)
    gap_ref = hope_keras.synthesize_inputs(gap, num=4, steps=5, coarse_steps=0, verbose=False)
    monkeypatch.setattr(synthetic, "COARSE_MIN_SIDE", 8)
    np.testing.assert_array_equal(
        hope_keras.synthesize_inputs(fixed, num=4, steps=5, verbose=False), ref)
    assert not np.allclose(hope_keras.synthesize_inputs(gap, num=4, steps=5, verbose=False),
                           gap_ref)


def _spectrum_slope(x):
    """Slope of log mean amplitude against log spatial frequency (numpy's FFT of
    each image channel, frequencies binned between 2/side and the Nyquist one)."""
    h, w = x.shape[1:3]
    amp = np.abs(np.fft.rfft2(np.moveaxis(x, -1, 1).astype(np.float64))).mean(axis=(0, 1))
    f = np.sqrt(np.fft.fftfreq(h)[:, None] ** 2 + np.fft.rfftfreq(w)[None, :] ** 2)
    edges = np.geomspace(2.0 / max(h, w), 0.5, 7)
    mid, mean = [], []
    for lo, hi in zip(edges[:-1], edges[1:]):
        band = (f >= lo) & (f < hi)
        mid.append(np.sqrt(lo * hi))
        mean.append(amp[band].mean())
    return np.polyfit(np.log(mid), np.log(mean), 1)[0]


def test_spectrum_prior_makes_images_whose_amplitudes_fall_as_one_over_f():
    """The default prior parameterises images by Fourier coefficients scaled by 1/f:
    its starting noise has amplitudes falling as 1/f (slope -1 on a log-log plot) and
    pixels of about unit variance; free pixels are white (slope 0). After the
    optimisation both match the statistics better than they started."""
    model = _gap_resnet(side=32)
    spec = hope_keras.synthesize_inputs(model, num=8, steps=0, verbose=False)
    white = hope_keras.synthesize_inputs(model, num=8, steps=0, prior="pixels", verbose=False)
    assert spec.shape == white.shape == (8, 32, 32, 3) and spec.dtype == np.float32
    assert abs(_spectrum_slope(spec) + 1.0) < 0.15
    assert abs(_spectrum_slope(white)) < 0.1
    assert 0.5 < spec.var() < 2.0
    for prior in ("spectrum", "pixels"):
        start = hope_keras.synthesize_inputs(model, num=8, steps=0, prior=prior, verbose=False)
        x = hope_keras.synthesize_inputs(model, num=8, steps=60, prior=prior, verbose=False)
        assert _mismatch_at(model, x) < 0.3 * _mismatch_at(model, start), prior
    vector = _stream_net()  # not an image: the prior does not apply
    assert hope_keras.synthesize_inputs(vector, num=4, steps=2, verbose=False).shape == (4, 6)
    with pytest.raises(ValueError, match="prior must be.*Received: prior='fourier'"):
        hope_keras.synthesize_inputs(model, prior="fourier", verbose=False)


def test_spectrum_prior_channels_first():
    """Under ``channels_first`` the image is (channels, height, width): the 1/f
    spectrum lies along the last two axes, and a non-square image works."""
    previous = keras.config.image_data_format()
    keras.config.set_image_data_format("channels_first")
    try:
        keras.utils.set_random_seed(0)
        inputs = keras.Input((3, 16, 24))
        x = L.BatchNormalization(axis=1)(inputs)
        x = L.ReLU()(L.BatchNormalization()(L.Dense(5)(L.Flatten()(x))))
        model = keras.Model(inputs, L.Dense(2)(x))
        spec = hope_keras.synthesize_inputs(model, num=8, steps=0, verbose=False)
        moved = hope_keras.synthesize_inputs(model, num=8, steps=3, verbose=False)
    finally:
        keras.config.set_image_data_format(previous)
    assert spec.shape == moved.shape == (8, 3, 16, 24)
    assert abs(_spectrum_slope(np.moveaxis(spec, 1, -1)) + 1.0) < 0.2
    assert np.all(np.isfinite(moved)) and not np.allclose(moved, spec)


def _stream_net(seed=0):
    """Stem → one identity block (a → b, BN at its end) → Add → ReLU → reader Dense →
    BN "r_bn" (reads the stream) → ReLU → head."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((6,))
    x = L.ReLU()(L.BatchNormalization(name="s_bn")(L.Dense(5, name="s")(inputs)))
    y = L.ReLU()(L.BatchNormalization(name="a_bn")(L.Dense(4, name="a")(x)))
    y = L.BatchNormalization(name="b_bn")(L.Dense(5, name="b")(y))
    x = L.ReLU(name="out")(L.Add(name="add")([x, y]))
    x = L.ReLU()(L.BatchNormalization(name="r_bn")(L.Dense(4, name="r")(x)))
    return keras.Model(inputs, L.Dense(2, name="head")(x))


def _preact_net(seed=0):
    """A pre-activation block: the stream is a raw sum that the next BN ("p_bn")
    reads directly, with no layer in between."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((6,))
    x = L.Dense(5, name="s")(inputs)
    y = L.ReLU()(L.BatchNormalization(name="a_bn")(x))
    y = L.ReLU()(L.BatchNormalization(name="b_bn")(L.Dense(4, name="a")(y)))
    x = L.Add(name="add")([x, L.Dense(5, name="b")(y)])
    x = L.ReLU()(L.BatchNormalization(name="p_bn")(x))
    return keras.Model(inputs, L.Dense(2, name="head")(x))


def test_stream_readers_are_the_bns_reading_a_sum_without_a_bn_between():
    graph = hope_keras.walk(_stream_net())
    assert [n.key for n in stream_readers(graph)] == ["r_bn"]
    graph = hope_keras.walk(small_resnet())
    assert [n.key for n in stream_readers(graph)] == ["c2_bn"]
    graph = hope_keras.walk(_preact_net())
    assert [n.key for n in stream_readers(graph)] == ["p_bn"]


def test_a_reader_of_the_raw_sum_is_corrected_like_re_estimation():
    """Pre-activation: the reader reads the sum itself (its own input is what the
    reference stores); the branch's last layer halves, the stream moves."""
    model = _preact_net(seed=4)
    x = np.random.default_rng(1).normal(size=(256, 6)).astype("float32")
    bn_stats.reestimate_batchnorm_statistics(model, x)
    graph = hope_keras.walk(model)
    ref = StreamReference(model, graph, x)
    assert ref.source[graph.flat.node_of("p_bn").index] is None
    b = model.get_layer("b")
    b.kernel.assign(0.5 * b.kernel.numpy())
    assert set(correct_stream_readers(ref, set(graph.flat.shapes))) == {"p_bn"}
    p_bn = model.get_layer("p_bn")
    got = p_bn.moving_mean.numpy().copy(), p_bn.moving_variance.numpy().copy()
    bn_stats.reestimate_batchnorm_statistics(model, x)
    np.testing.assert_allclose(got[0], p_bn.moving_mean.numpy(), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(got[1], p_bn.moving_variance.numpy(), rtol=1e-4, atol=1e-6)


def test_the_correction_equals_re_estimation_when_the_reference_is_exact():
    """With moving statistics that are the exact statistics of the batch x, the
    correction measured on x must give the reader exactly what re-estimating on x
    gives, also when the reader's own filter was edited before the stream moved (a
    merge writes its slot's statistics for the old stream)."""
    model = _stream_net(seed=3)
    x = np.random.default_rng(0).normal(size=(256, 6)).astype("float32")
    bn_stats.reestimate_batchnorm_statistics(model, x)
    graph = hope_keras.walk(model)
    ref = StreamReference(model, graph, x)
    r = model.get_layer("r")
    k = r.kernel.numpy()
    k[:, 0] = 0.7 * k[:, 0] + 0.5 * k[:, 1]  # slot 0 of the reader gets a new filter
    r.kernel.assign(k)
    bn_stats.reestimate_batchnorm_statistics(model, x)  # exact for the old stream
    b_bn = model.get_layer("b_bn")  # the stream moves: the branch end loses half
    b_bn.gamma.assign(0.5 * b_bn.gamma.numpy())
    b_bn.beta.assign(b_bn.beta.numpy() - 0.3)
    r_bn = model.get_layer("r_bn")
    stale = r_bn.moving_mean.numpy().copy(), r_bn.moving_variance.numpy().copy()
    written = correct_stream_readers(ref, set(graph.flat.shapes))
    assert set(written) == {"r_bn"}
    got = r_bn.moving_mean.numpy().copy(), r_bn.moving_variance.numpy().copy()
    bn_stats.reestimate_batchnorm_statistics(model, x)
    want = r_bn.moving_mean.numpy(), r_bn.moving_variance.numpy()
    assert not np.allclose(stale[0], want[0], atol=1e-3)  # the stream did move
    np.testing.assert_allclose(got[0], want[0], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(got[1], want[1], rtol=1e-4, atol=1e-6)


def test_auto_corrects_the_readers_of_a_moved_stream_when_replayed_too():
    """A prune inside the block moves the stream: replaying the trajectory with
    the "auto" correction (as `compress` records it) gives the stream reader c2_bn
    new statistics, which "surrogate" leaves; two replays give the same model."""
    from hope_keras.search.encoder import Action

    enc = hope_keras.Encoder(small_resnet(seed=3), actions=("prune",))
    enc.execute(Action("prune", "b1a", 1, -1, 0.0, 0.0, 1.0, 1))
    meta = dict(enc.trajectory.meta)

    def replay(mode):
        t = hope_keras.Trajectory({**meta, "options": {**meta["options"],
                                                        "correct_statistics": mode}},
                                  enc.trajectory.steps)
        return t.replay(small_resnet(seed=3), step=1)

    plain, auto, surrogate, again = (replay(m) for m in (False, "auto", "surrogate", "auto"))
    c2 = [m.get_layer("c2_bn").moving_mean.numpy() for m in (plain, auto, surrogate)]
    np.testing.assert_array_equal(c2[2], c2[0])
    assert not np.allclose(c2[1], c2[0])
    x = np.random.default_rng(1).normal(size=(4, 10, 10, 3)).astype("float32")
    np.testing.assert_allclose(again(x), auto(x), rtol=1e-4, atol=1e-5)


def test_compress_auto_on_a_residual_net_runs_end_to_end():
    model = small_resnet(seed=5)
    result = hope_keras.compress(model, density=0.6, verbose=False)
    assert result.trajectory.meta["options"]["correct_statistics"] == "auto"
    small = hope_keras.slim(model)
    x = np.random.default_rng(2).normal(size=(4, 10, 10, 3)).astype("float32")
    np.testing.assert_allclose(small(x), model(x), rtol=1e-4, atol=1e-5)


def test_inputs_that_cannot_be_made_leave_the_readers_with_a_warning(monkeypatch):
    """If the synthesis fails (here: it diverges), compress warns, keeps the stream
    readers' statistics and still corrects the rest as the surrogate does."""
    from hope_keras.stats import synthetic

    def diverged(model, **kwargs):
        raise ValueError("synthesize_inputs: the optimisation diverged (test).")

    monkeypatch.setattr(synthetic, "synthesize_inputs", diverged)
    bn_stats._SYNTHETIC_INPUTS.clear()
    model, plain = small_resnet(seed=7), small_resnet(seed=7)
    with pytest.warns(UserWarning, match="diverged.*keep their statistics"):
        hope_keras.compress(model, density=0.6, verbose=False)
    hope_keras.Encoder(plain, correction="surrogate", verbose=False).compress(density=0.6)
    for a, b in zip(model.get_weights(), plain.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_synthetic_inputs_are_kept_on_disk_between_sessions(monkeypatch, tmp_path):
    """With HOPE_KERAS_CACHE set, `compress` writes the synthetic inputs once and a
    later session (the in-memory cache emptied) reads them instead of making them:
    the same compressed model. A file that cannot be read back is made again, with a
    warning; "off" writes nothing."""
    from hope_keras.stats import synthetic

    monkeypatch.setenv("HOPE_KERAS_CACHE", str(tmp_path))
    bn_stats._SYNTHETIC_INPUTS.clear()
    first = small_resnet(seed=8)
    hope_keras.compress(first, density=0.6, verbose=False)
    files = list(tmp_path.glob("synthetic-*.npy"))
    assert len(files) == 1 and not list(tmp_path.glob("*.tmp"))

    made = []
    real = synthetic.synthesize_inputs

    def counting(model, **kwargs):
        made.append(model.name)
        return real(model, **kwargs)

    monkeypatch.setattr(synthetic, "synthesize_inputs", counting)
    bn_stats._SYNTHETIC_INPUTS.clear()  # a new session
    again = small_resnet(seed=8)
    hope_keras.compress(again, density=0.6, verbose=False)
    assert made == []
    for a, b in zip(first.get_weights(), again.get_weights()):
        np.testing.assert_array_equal(a, b)

    files[0].write_bytes(b"not an array")
    bn_stats._SYNTHETIC_INPUTS.clear()
    third = small_resnet(seed=8)
    with pytest.warns(UserWarning, match="ignoring the cached synthetic inputs"):
        hope_keras.compress(third, density=0.6, verbose=False)
    assert len(made) == 1
    for a, b in zip(first.get_weights(), third.get_weights()):
        np.testing.assert_array_equal(a, b)
    assert np.load(files[0]).shape[0] == synthetic.SYNTHETIC_INPUTS  # written again

    cwd = tmp_path / "cwd"  # "off" is not a directory name
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    monkeypatch.setenv("HOPE_KERAS_CACHE", "off")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    bn_stats._SYNTHETIC_INPUTS.clear()
    hope_keras.compress(small_resnet(seed=9), density=0.6, verbose=False)
    assert not any(cwd.iterdir()) and not (tmp_path / "xdg").exists()
    assert len(list(tmp_path.glob("synthetic-*.npy"))) == 1


def test_the_synthetic_seed_makes_other_inputs_kept_apart(monkeypatch, tmp_path):
    """`SYNTHETIC_SEED` reaches the synthesis and the caches' keys: in one session,
    another seed makes its own inputs (other values) in a file of its own, and reads
    neither the default seed's file nor its inputs kept in memory."""
    from hope_keras.stats import synthetic

    monkeypatch.setenv("HOPE_KERAS_CACHE", str(tmp_path))
    seeds = []
    real = synthetic.synthesize_inputs

    def recording(model, **kwargs):
        seeds.append(kwargs["seed"])
        return real(model, **kwargs)

    monkeypatch.setattr(synthetic, "synthesize_inputs", recording)
    made = {}
    bn_stats._SYNTHETIC_INPUTS.clear()
    for seed in (0, 1):
        monkeypatch.setattr(synthetic, "SYNTHETIC_SEED", seed)
        hope_keras.compress(small_resnet(seed=10), density=0.6, verbose=False)
        new = set(tmp_path.glob("synthetic-*.npy")) - set(made.values())
        assert len(new) == 1
        made[seed] = new.pop()
    assert seeds == [0, 1]
    assert not np.array_equal(np.load(made[0]), np.load(made[1]))


def _gap_resnet_with_reader(side, seed=0):
    """Stem → two identity blocks (the second block's first BN reads the stream) →
    global average pooling → head, at `side` × `side`: runs at any size."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((side, side, 3))
    x = L.ReLU()(L.BatchNormalization()(L.Conv2D(8, 3, strides=2, padding="same")(inputs)))
    for _ in range(2):
        y = L.ReLU()(L.BatchNormalization()(L.Conv2D(6, 3, padding="same")(x)))
        y = L.BatchNormalization()(L.Conv2D(8, 1)(y))
        x = L.ReLU()(L.Add()([x, y]))
    model = keras.Model(inputs, L.Dense(3)(L.GlobalAveragePooling2D()(x)))
    data = np.random.default_rng(seed).uniform(0, 2, (16, side, side, 3)).astype("float32")
    bn_stats.reestimate_batchnorm_statistics(model, data)
    return model


def test_large_images_are_made_and_measured_at_the_reduced_size(monkeypatch):
    """For an image model whose sides are both at least COARSE_MIN_SIDE and that runs
    at 1/MEASURE_SCALE of its size, the data-free correction makes its synthetic
    inputs there (MEASURE_STEPS Adam steps) and measures the stream readers on them:
    `compress` hands inputs of the reduced shape to the readers' reference. Below
    the threshold, or for a model that runs at its own size only, the inputs are
    the model's size."""
    from hope_keras.stats import synthetic

    if synthetic.MEASURE_SCALE == 1:  # the option off by default: turn it on
        monkeypatch.setattr(synthetic, "MEASURE_SCALE", 4)
        monkeypatch.setattr(synthetic, "MEASURE_STEPS", 10)
    scale, steps = synthetic.MEASURE_SCALE, synthetic.MEASURE_STEPS
    side = synthetic.COARSE_MIN_SIDE
    made, references = [], []
    real_make, real_reference = synthetic.synthesize_inputs, synthetic.StreamReference

    def recording_make(model, **kwargs):
        made.append(kwargs)
        return real_make(model, **kwargs)

    def recording_reference(model, graph, x):
        references.append(x.shape)
        return real_reference(model, graph, x)

    monkeypatch.setattr(synthetic, "synthesize_inputs", recording_make)
    monkeypatch.setattr(synthetic, "StreamReference", recording_reference)
    bn_stats._SYNTHETIC_INPUTS.clear()
    large = _gap_resnet_with_reader(side, seed=3)
    assert synthetic.reduced_size(large) == (side // scale, side // scale)
    hope_keras.compress(large, density=0.6, verbose=False)
    assert references == [(synthetic.SYNTHETIC_INPUTS, side // scale, side // scale, 3)]
    assert made[-1]["size"] == (side // scale, side // scale)
    assert made[-1]["steps"] == (steps if steps is not None else synthetic.SYNTHETIC_STEPS)
    # One pixel short of the threshold: the model's own size, the usual steps.
    assert synthetic.reduced_size(_gap_resnet(side=side - 1, height=side)) is None
    small = _gap_resnet(side=16, seed=3)
    bn_stats._SYNTHETIC_INPUTS.clear()
    assert bn_stats.synthetic_inputs(small, verbose=False).shape == (
        synthetic.SYNTHETIC_INPUTS, 16, 16, 3)
    assert made[-1]["size"] is None and made[-1]["steps"] == synthetic.SYNTHETIC_STEPS
    # A Flatten fixes the size: the model's own, even above the threshold.
    inputs = keras.Input((side, side, 3))
    h = L.BatchNormalization()(L.Conv2D(2, 3, strides=8)(inputs))
    fixed = keras.Model(inputs, L.Dense(2)(L.Flatten()(h)))
    assert synthetic.reduced_size(fixed) is None
