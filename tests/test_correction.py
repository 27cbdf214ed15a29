"""The statistics correction the encoder runs after its steps (`hope_keras.stats.correction`):
with ``data=`` (re-estimation of the stale BatchNormalizations, nothing synthetic),
data-free (synthetic inputs only when a residual stream moved, made from the original
weights after the run, equal to making them before), undone and redone by a run that
goes on, announced under ``verbose=True`` and silent under ``verbose=False``."""

import threading

import keras
import numpy as np
import pytest
import tensorflow as tf

import hope_keras
from hope_keras.stats import bn_stats
from hope_keras.stats import correction
from hope_keras.scoring import moments
from hope_keras.stats import synthetic

from conftest import L, copy_model, mlp, randomize_bn, small_resnet


def _images(n, seed=0):
    return np.random.default_rng(seed).normal(size=(n, 10, 10, 3)).astype("float32")


def _bn_stats(model):
    return {layer.name: (layer.moving_mean.numpy(), layer.moving_variance.numpy())
            for layer in model.layers if isinstance(layer, keras.layers.BatchNormalization)}


@pytest.fixture
def synthesis_calls(monkeypatch):
    calls = []
    real = synthetic.synthesize_inputs

    def counting(model, *args, **kwargs):
        calls.append(model.name)
        return real(model, *args, **kwargs)

    monkeypatch.setattr(synthetic, "synthesize_inputs", counting)
    bn_stats._SYNTHETIC_INPUTS.clear()  # nothing from an earlier test's weights
    return calls


def _bn_inputs(model, x):
    """Each BatchNormalization's input on `x` through Keras' own forward pass
    (a Functional model of the BN inputs, inference mode): {name: (mean, var)}."""
    bns = [layer for layer in model.layers if isinstance(layer, keras.layers.BatchNormalization)]
    probe = keras.Model(model.inputs, [layer.input for layer in bns])
    outs = probe(x, training=False)
    return {bn.name: (np.mean(np.asarray(o, np.float64), axis=tuple(range(o.ndim - 1))),
                      np.var(np.asarray(o, np.float64), axis=tuple(range(o.ndim - 1))))
            for bn, o in zip(bns, outs)}


def test_data_moves_each_stale_batchnorm_by_the_change_of_its_input(synthesis_calls):
    """``compress(data=x)``: on x, each stale BN's moving mean keeps its offset from
    its input's mean (``μ − m`` after = ``μ₀ − m₀`` before) and its moving variance
    its ratio to the input's variance, measured by Keras' forward pass of the
    original and of the corrected model; a merged parent's channel keeps the
    statistics its merge wrote (they make the BN compute ``a1·y_i + a2·y_j``; the
    original channel ``i`` is no reference for it); the BNs upstream of every edit
    keep their statistics; nothing synthetic is made; the steps are those of a run
    without correction."""
    x = _images(96)
    model, ref = small_resnet(seed=3), small_resnet(seed=3)
    before, inputs0 = _bn_stats(model), _bn_inputs(model, x)
    result = hope_keras.compress(model, density=0.6, data=x, verbose=False)
    assert synthesis_calls == []
    assert result.trajectory.meta["options"]["correct_statistics"] == "data"
    enc = hope_keras.Encoder(ref, correction=False, verbose=False)
    enc.run(density=0.6)
    assert [s.unit for s in enc.trajectory.steps] == [s.unit for s in result.trajectory.steps]
    stale = bn_stats.downstream_of(enc.graph, {s.unit for s in enc.trajectory.steps})
    names = sorted(n.op.name for n in enc.graph.flat.nodes
                   if isinstance(n.op, keras.layers.BatchNormalization) and n.inputs[0] in stale)
    assert names and result.corrected == names
    after, inputs1 = _bn_stats(model), _bn_inputs(model, x)
    uncorrected = _bn_stats(ref)
    parents = {}
    for s in enc.trajectory.steps:
        if s.kind == "merge":
            parents.setdefault(enc.graph.groups[s.unit].bn, set()).add(s.i)
    assert parents and set(parents) <= set(names)
    for name in before:
        if name not in names:
            np.testing.assert_array_equal(after[name][0], before[name][0])
            continue
        (mu0, var0), (mu1, var1) = before[name], after[name]
        (m0, v0), (m1, v1) = inputs0[name], inputs1[name]
        live = (v0 > 1e-6 * v0.mean()) & (v1 > 1e-6 * v0.mean())
        kept = np.zeros(live.shape, bool)
        kept[sorted(parents.get(name, ()))] = True
        np.testing.assert_array_equal(mu1[kept], uncorrected[name][0][kept])
        np.testing.assert_array_equal(var1[kept], uncorrected[name][1][kept])
        live &= ~kept
        assert live.any()
        np.testing.assert_allclose((mu1 - m1)[live], (mu0 - m0)[live], atol=2e-4)
        np.testing.assert_allclose((var1 / v1)[live], (var0 / v0)[live], rtol=2e-3)
        # Dead channels keep what the edits wrote.
        np.testing.assert_array_equal(mu1[~live], uncorrected[name][0][~live])


def test_the_originals_pass_beside_the_run_writes_what_it_writes_in_turn(monkeypatch):
    """`MEASURE_ALONGSIDE`: the original model measured on a thread while the run
    edits it (from a copy of the weights) writes the same statistics, bit for bit,
    as measured before the first edit in turn."""
    x = _images(96)
    written = []
    for alongside in (True, False):
        monkeypatch.setattr(correction, "MEASURE_ALONGSIDE", alongside)
        model = small_resnet(seed=3)
        result = hope_keras.compress(model, density=0.5, data=x, verbose=False)
        written.append((result.corrected, model.get_weights()))
    assert written[0][0] == written[1][0] and written[0][0]
    for a, b in zip(written[0][1], written[1][1]):
        np.testing.assert_array_equal(a, b)


def _separable_net(seed=3):
    """Depthwise, separable and pointwise convolutions with BNs, a residual sum."""
    keras.utils.set_random_seed(seed)
    L = keras.layers
    inputs = keras.Input((10, 10, 3), name="image")
    x = L.ReLU()(L.BatchNormalization(name="stem_bn")(L.Conv2D(8, 3, padding="same")(inputs)))
    y = L.ReLU()(L.BatchNormalization(name="dw_bn")(L.DepthwiseConv2D(3, padding="same")(x)))
    y = L.BatchNormalization(name="pw_bn")(L.Conv2D(8, 1)(y))
    x = L.Add()([x, y])
    x = L.ReLU()(L.BatchNormalization(name="sep_bn")(L.SeparableConv2D(12, 3)(x)))
    x = L.GlobalAveragePooling2D()(x)
    return randomize_bn(keras.Model(inputs, L.Dense(4)(x), name="separable"), seed)


@pytest.mark.parametrize("build", [small_resnet, _separable_net])
def test_the_originals_pass_reads_the_weights_as_they_were_at_the_start(monkeypatch, build):
    """Weights changed while the original's pass waits to start (as a run's edits
    change them beside it) do not reach it: its moments are those of Keras' forward
    pass of an unedited copy (dense, convolution, depthwise, separable and BN layers)."""
    x = _images(96)
    model, original = build(seed=3), build(seed=3)
    go = threading.Event()
    real = correction._input_moments

    def waiting(*args, **kwargs):
        assert go.wait(60)
        return real(*args, **kwargs)

    monkeypatch.setattr(correction, "_input_moments", waiting)
    enc = hope_keras.Encoder(model, data=x, verbose=False)
    enc.correction.start(model, enc.graph, enc.analysis.moments)
    for w in model.weights:  # every weight moved while the pass waits
        w.assign(w * 0.5 + 0.25)
    go.set()
    measured = enc.correction._original_moments()
    expected = _bn_inputs(original, x[:len(enc.correction._x)])
    names = {n.index: n.op.name for n in enc.graph.flat.nodes}
    assert len(measured) == len(expected)
    for index, (m, v) in measured.items():
        np.testing.assert_allclose(m, expected[names[index]][0], rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(v, expected[names[index]][1], rtol=1e-4, atol=1e-6)


def test_a_pass_that_cannot_read_the_copy_measures_the_original_weights_put_back(monkeypatch):
    """Should the pass from the copied values fail, the original weights are put back
    for a pass of their own and the edited ones after it: the same model as when
    it does not fail."""
    x = _images(96)
    expected = small_resnet(seed=3)
    hope_keras.compress(expected, density=0.5, data=x, verbose=False)
    real = synthetic.run_graph
    failed = []

    def no_copies(flat, x, hook=None, plan=None, values=None):
        if values is not None:
            failed.append(True)
            raise RuntimeError("a layer that reads its variables elsewhere")
        return real(flat, x, hook, plan)

    monkeypatch.setattr(synthetic, "run_graph", no_copies)
    model = small_resnet(seed=3)
    hope_keras.compress(model, density=0.5, data=x, verbose=False)
    assert failed
    for a, b in zip(model.get_weights(), expected.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_kept_synthetic_inputs_are_measured_beside_the_run(monkeypatch, synthesis_calls):
    """Data-free, from weights whose synthetic inputs are kept: the stream readers'
    reference is taken beside the run from copied weights (the original weights are
    never put back), and the model is the same, bit for bit, as when it is taken
    after the run with the original weights put back (`MEASURE_ALONGSIDE` off)."""
    hope_keras.compress(small_resnet(seed=3), density=0.5, verbose=False)  # makes them
    assert len(synthesis_calls) == 1
    assigned, kept = [], []
    real_assign, real_kept = correction._assign, correction._kept_reference
    monkeypatch.setattr(correction, "_assign", lambda *a: assigned.append(1) or real_assign(*a))
    monkeypatch.setattr(correction, "_kept_reference",
                        lambda *a: kept.append(real_kept(*a)) or kept[-1])
    models = []
    for alongside in (True, False):
        monkeypatch.setattr(correction, "MEASURE_ALONGSIDE", alongside)
        model = small_resnet(seed=3)
        result = hope_keras.compress(model, density=0.5, verbose=False)
        assert result.corrected
        models.append(model)
        if alongside:
            assert len(kept) == 1 and kept[0] is not None and assigned == []
    assert len(synthesis_calls) == 1 and len(kept) == 1 and assigned  # in turn: put back
    for a, b in zip(models[0].get_weights(), models[1].get_weights()):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("kind", ["tuple", "dataset", "generator"])
def test_data_may_be_labelled_a_dataset_or_a_generator(kind):
    x = _images(96)
    expected = small_resnet(seed=3)
    hope_keras.compress(expected, density=0.6, data=x, verbose=False)
    if kind == "tuple":
        data = (x, np.zeros(len(x)))
    elif kind == "dataset":
        data = tf.data.Dataset.from_tensor_slices((x, np.zeros(len(x)))).batch(32)
    else:
        data = (x[k:k + 16] for k in range(0, len(x), 16))
    model = small_resnet(seed=3)
    hope_keras.compress(model, density=0.6, data=data, verbose=False)
    for a, b in zip(model.get_weights(), expected.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def _two_input_model():
    """An image branch and a vector branch (Conv/Dense → BN → ReLU each), joined, a
    Dense → BN → ReLU reader, and a head."""
    keras.utils.set_random_seed(5)
    image, meta = keras.Input((10, 10, 3), name="image"), keras.Input((5,), name="meta")
    h = L.GlobalAveragePooling2D()(L.ReLU()(L.BatchNormalization()(L.Conv2D(8, 3)(image))))
    m = L.ReLU()(L.BatchNormalization()(L.Dense(6)(meta)))
    z = L.ReLU()(L.BatchNormalization()(L.Dense(8)(L.Concatenate()([h, m]))))
    return randomize_bn(keras.Model([image, meta], L.Dense(2)(z)))


@pytest.mark.parametrize("form", ["list", "dict", "labelled", "dataset", "dataset_dict",
                                  "dataset_features"])
def test_data_for_a_model_of_two_inputs_in_every_form_moves_the_stale_batchnorms(form):
    """``compress(data=...)`` on a model of two inputs: a list of one array per input,
    a dict keyed by the input names, ``(x, y)``, a dataset of ``((x1, x2),)`` or of
    dicts. Each stale BN (no merge: prunes only) keeps its offset and ratio to its
    input's moments measured by Keras' forward pass on all the inputs (fewer than
    the sample wants)."""
    rng = np.random.default_rng(1)
    xs = [_images(96), rng.normal(size=(96, 5)).astype("float32")]
    named = {"image": xs[0], "meta": xs[1]}
    data = {"list": xs, "dict": named, "labelled": (xs, np.zeros(96)),
            "dataset": tf.data.Dataset.from_tensor_slices((tuple(xs),)).batch(32),
            "dataset_dict": tf.data.Dataset.from_tensor_slices(named).batch(32),
            # (features, labels), the features holding a key that is no input: ignored.
            "dataset_features": tf.data.Dataset.from_tensor_slices(
                ({**named, "id": np.arange(96)}, np.zeros(96))).batch(32)}[form]
    model = _two_input_model()
    before, inputs0 = _bn_stats(model), _bn_inputs(model, xs)
    result = hope_keras.compress(model, density=0.6, data=data, actions=("prune",),
                                 verbose=False)
    assert result.trajectory.meta["options"]["correct_statistics"] == "data"
    after, inputs1 = _bn_stats(model), _bn_inputs(model, xs)
    assert result.corrected
    for name in result.corrected:
        (mu0, var0), (mu1, var1) = before[name], after[name]
        (m0, v0), (m1, v1) = inputs0[name], inputs1[name]
        live = (v0 > 1e-6 * v0.mean()) & (v1 > 1e-6 * v0.mean())
        assert live.any()
        np.testing.assert_allclose((mu1 - m1)[live], (mu0 - m0)[live], atol=2e-4)
        np.testing.assert_allclose((var1 / v1)[live], (var0 / v0)[live], rtol=2e-3)


def test_a_dict_keyed_by_the_input_name_of_a_one_input_model_is_its_array():
    x = _images(96)
    by_array, by_name = small_resnet(seed=3), small_resnet(seed=3)
    hope_keras.compress(by_array, density=0.6, data=x, verbose=False)
    hope_keras.compress(by_name, density=0.6, data={"image": x}, verbose=False)
    for a, b in zip(by_array.get_weights(), by_name.get_weights()):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("data, match", [
    # Three arrays are not one per input: a list of batches, each one array.
    (lambda xs: xs[:1] + xs, "1 array\\(s\\) per batch, but model .* takes 2 input.*one "
                             "array per input"),
    (lambda xs: [xs[0], xs[1][:, :4]], "shape \\(96, 4\\) \\(input 1\\).*\\(None, 5\\)"),
    (lambda xs: {"image": xs[0], "other": xs[1]}, "named \\['image', 'meta'\\].*'other'"),
])
def test_bad_data_for_a_model_of_two_inputs_is_refused_by_input(data, match):
    rng = np.random.default_rng(1)
    xs = [_images(96), rng.normal(size=(96, 5)).astype("float32")]
    model = _two_input_model()
    weights = model.get_weights()
    with pytest.raises((ValueError, TypeError), match=match):
        hope_keras.compress(model, density=0.6, data=data(xs), verbose=False)
    assert all(np.array_equal(a, b) for a, b in zip(weights, model.get_weights()))


def test_data_is_sampled_by_values_per_channel():
    """Enough inputs that each stale BN sees `DATA_VALUES_PER_CHANNEL` values per
    channel: the Flatten → Dense BN sees one per input, so 1024 inputs of 2000; a
    10 × 10 map 100, so 11 inputs, but never fewer than `DATA_MIN_INPUTS`."""
    model = small_resnet(seed=3)
    graph = hope_keras.analyze(model, verbose=False).graph
    x = _images(2000)
    assert correction.DATA_VALUES_PER_CHANNEL == 1024 and correction.DATA_MIN_INPUTS == 16
    assert len(correction._sample(model, x, graph.flat, ["fc_bn"])) == 1024
    assert len(correction._sample(model, x, graph.flat, ["stem_bn"])) == 16
    assert len(correction._sample(model, x, graph.flat, ["stem_bn", "fc_bn"])) == 1024
    assert len(correction._sample(model, x[:10], graph.flat, ["fc_bn"])) == 10
    batches = (x[k:k + 100] for k in range(0, 2000, 100))
    assert len(correction._sample(model, batches, graph.flat, ["fc_bn"])) == 1024


def test_a_run_that_moves_no_stream_makes_no_synthetic_input(synthesis_calls):
    """The head's hidden layer (after the last residual sum) and an MLP: no stream
    moves, so no synthetic input is made; the surrogate corrects what it trusts."""
    enc = hope_keras.Encoder(small_resnet(seed=3), actions=("prune",), verbose=False)
    enc.execute(enc.best_group_action("fc"))
    assert "fc_bn" in enc.correct_statistics()  # the surrogate's prediction
    assert synthesis_calls == []
    # With data, only the BNs downstream of the edit move.
    model = small_resnet(seed=3)
    before = _bn_stats(model)
    enc = hope_keras.Encoder(model, actions=("prune",), data=_images(64), verbose=False)
    enc.execute(enc.best_group_action("fc"))
    assert sorted(enc.correct_statistics()) == ["fc_bn"]
    after = _bn_stats(model)
    for name in ("stem_bn", "b1a_bn", "b1b_bn", "c2_bn"):
        np.testing.assert_array_equal(after[name][1], before[name][1])
    hope_keras.compress(mlp(seed=1), density=0.5, verbose=False)
    assert synthesis_calls == []
    hope_keras.compress(small_resnet(seed=3), density=0.5, verbose=False)
    assert synthesis_calls == ["small_resnet"]  # the stream moved: made once


def test_synthetic_inputs_made_after_the_run_equal_those_made_before(synthesis_calls):
    """The data-free default makes its synthetic inputs from the original weights
    after the run: bit for bit what making them before the run gives."""
    model = small_resnet(seed=3)
    result = hope_keras.compress(model, density=0.5, verbose=False)
    assert synthesis_calls == ["small_resnet"]
    ref = small_resnet(seed=3)
    graph = hope_keras.analyze(ref, verbose=False).graph
    x = synthetic.synthesize_inputs(ref, verbose=False)
    reference = synthetic.StreamReference(ref, graph, x)
    enc = hope_keras.Encoder(ref, correction=False, verbose=False)
    enc.run(density=0.5)
    steps = enc.trajectory.steps
    untrusted = bn_stats.untrusted_tensors(enc.graph, steps, "auto")
    bn_stats.apply_correction(enc.graph.flat, enc.analysis.moments,
                              moments.propagate(enc.graph.flat), untrusted,
                              bn_stats.merged_parents(enc.graph, steps))
    synthetic.correct_stream_readers(reference, untrusted)
    assert result.corrected
    for a, b in zip(model.get_weights(), ref.get_weights()):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("data", [None, "x"])
def test_a_run_that_goes_on_corrects_from_the_models_own_statistics(data):
    """run(0.7) then run(0.5) = run(0.5): the second run puts back what the first
    correction wrote before editing, then corrects after all the steps."""
    x = _images(96) if data else None
    one, two = small_resnet(seed=3), small_resnet(seed=3)
    hope_keras.Encoder(one, data=x, verbose=False).run(density=0.5)
    enc = hope_keras.Encoder(two, data=x, verbose=False)
    enc.run(density=0.7)
    enc.run(density=0.5)
    for a, b in zip(one.get_weights(), two.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_replay_corrects_on_the_data_it_is_given():
    x = _images(96)
    model, original = small_resnet(seed=3), small_resnet(seed=3)
    result = hope_keras.compress(model, density=0.6, data=x, verbose=False)
    with pytest.warns(UserWarning, match="pass data= to replay"):
        result.trajectory.replay(copy_model(original), density=0.6)
    result.trajectory.replay(original, density=0.6, data=x)
    for a, b in zip(model.get_weights(), original.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_compress_with_data_announces_its_stages_and_is_silent_when_asked(capsys):
    hope_keras.compress(small_resnet(seed=3), density=0.6, data=_images(96), verbose=True)
    out = capsys.readouterr().out
    assert "Correcting" in out and "inputs given as data=" in out
    assert "Analyzing 'small_resnet'" in out and "Compressing 'small_resnet' (density=0.6)" in out
    hope_keras.compress(small_resnet(seed=3), density=0.5, verbose=True)
    out = capsys.readouterr().out
    assert "synthetic inputs" in out and "pass data=" in out
    for data in (None, _images(96)):
        hope_keras.compress(small_resnet(seed=3), density=0.5, data=data, verbose=False)
        captured = capsys.readouterr()
        assert captured.out == ""


def test_bad_data_is_refused_before_any_edit():
    model = small_resnet(seed=3)
    before = model.get_weights()
    with pytest.raises(TypeError, match="data must be inputs.*Received: 'images.npy'"):
        hope_keras.compress(model, density=0.5, data="images.npy", verbose=False)
    # A list of single images (no batch axis): each item is read as a batch, and
    # the error says so (small_resnet takes (None, 10, 10, 3)).
    single = list(_images(20))
    with pytest.raises(ValueError, match=r"holds inputs of shape \(\d+, 10, 3\).*"
                                         r"\(None, 10, 10, 3\).*np\.stack"):
        hope_keras.compress(model, density=0.5, data=single, verbose=False)
    with pytest.raises(ValueError, match=r"shape \(\d+, 10, 10, 4\)") as caught:
        hope_keras.compress(model, density=0.5, data=np.zeros((32, 10, 10, 4), "float32"),
                            verbose=False)
    assert "np.stack" not in str(caught.value)  # the hint only where an axis is missing
    for a, b in zip(model.get_weights(), before):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="correction must be.*Received: correction='yes'"):
        hope_keras.Encoder(model, correction="yes")


@pytest.mark.parametrize("where", ["making the synthetic inputs", "stream readers written",
                                   "data pass written"])
def test_ctrl_c_in_the_correction_leaves_the_steps_uncorrected_and_the_run_can_go_on(
        where, monkeypatch, synthesis_calls):
    """Ctrl-C while the statistics are corrected (the longest stage of a first
    data-free run): `CompressionInterrupted`, and the model holds every step of the
    trajectory with the statistics the steps left, bit for bit its replay (which
    the trajectory records as uncorrected), never the original weights the
    synthetic inputs are made from nor a half-written correction; the encoder then
    goes on to the uninterrupted result."""
    x = _images(96) if where == "data pass written" else None
    reference = small_resnet(seed=3)
    hope_keras.compress(reference, density=0.5, data=x, verbose=False)
    bn_stats._SYNTHETIC_INPUTS.clear()
    synthesis_calls.clear()

    def interrupt(real, write_first):
        def wrapper(*args, **kwargs):
            if write_first:
                real(*args, **kwargs)
            raise KeyboardInterrupt("interrupted")
        return wrapper

    owner, name, write_first = {
        "making the synthetic inputs": (synthetic, "synthesize_inputs", False),
        "stream readers written": (synthetic, "correct_stream_readers", True),
        "data pass written": (correction.StatisticsCorrection, "_correct_on_data", True),
    }[where]
    monkeypatch.setattr(owner, name, interrupt(getattr(owner, name), write_first))
    model = small_resnet(seed=3)
    with pytest.raises(hope_keras.CompressionInterrupted) as e:
        hope_keras.compress(model, density=0.5, data=x, verbose=False)
    monkeypatch.undo()
    trajectory = e.value.trajectory
    assert len(trajectory) > 0 and not trajectory.meta["options"]["correct_statistics"]
    replayed = trajectory.replay(small_resnet(seed=3), step=len(trajectory))
    for a, b in zip(model.get_weights(), replayed.get_weights()):
        np.testing.assert_array_equal(a, b)
    e.value.encoder.run(density=0.5, verbose=False)  # the budget is met: corrects only
    for a, b in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_array_equal(a, b)
