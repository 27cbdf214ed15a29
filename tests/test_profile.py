"""`profile` (parameters, FLOPs, latency), `export_tflite`, and CompressionResult.profile.

FLOPs are checked against a brute-force count: with every kernel entry and every
input equal to one and no bias, each output of a valid (unpadded) linear layer is the
number of multiply-accumulates that produced it, so the outputs sum to the layer's
multiply-accumulates (FLOPs / 2).
"""

import keras
import numpy as np
import pytest

import hope_keras
from conftest import small_resnet
from hope_keras.graph import layers as layer_rules
from hope_keras.deploy.profile import layer_flops, model_flops

L = keras.layers

CASES = [
    ("dense", (6,), lambda: L.Dense(5, use_bias=False)),
    ("dense_seq", (4, 5), lambda: L.Dense(3, use_bias=False)),
    ("conv1d_stride", (11, 3), lambda: L.Conv1D(4, 3, strides=2, use_bias=False)),
    ("conv2d", (9, 8, 3), lambda: L.Conv2D(5, (3, 2), use_bias=False)),
    ("conv2d_grouped", (7, 7, 4), lambda: L.Conv2D(6, 3, groups=2, use_bias=False)),
    ("conv3d", (5, 6, 4, 2), lambda: L.Conv3D(3, 2, use_bias=False)),
    ("depthwise1d", (10, 3), lambda: L.DepthwiseConv1D(3, depth_multiplier=2,
                                                       use_bias=False)),
    ("depthwise2d", (8, 8, 3), lambda: L.DepthwiseConv2D(3, strides=2, depth_multiplier=2,
                                                         use_bias=False)),
    ("conv1d_t", (6, 3), lambda: L.Conv1DTranspose(4, 3, strides=2, use_bias=False)),
    ("conv2d_t", (5, 4, 3), lambda: L.Conv2DTranspose(2, 3, strides=2, use_bias=False)),
    ("conv3d_t", (3, 3, 2, 2), lambda: L.Conv3DTranspose(2, 2, use_bias=False)),
]


@pytest.mark.parametrize("name,shape,make", CASES, ids=[c[0] for c in CASES])
def test_flops_equal_a_brute_force_count_of_multiply_accumulates(name, shape, make):
    layer = make()
    inputs = keras.Input(shape)
    model = keras.Model(inputs, layer(inputs))
    for w in layer.weights:
        w.assign(np.ones(w.shape, "float32"))
    macs = float(np.sum(model(np.ones((1, *shape), "float32"))))
    assert layer_flops(layer) == model_flops(model) == 2 * macs > 0


def test_separable_is_its_depthwise_plus_its_pointwise():
    inputs = keras.Input((9, 9, 4))
    sep = L.SeparableConv2D(6, 3, depth_multiplier=2)
    keras.Model(inputs, sep(inputs))
    dw, pw = L.DepthwiseConv2D(3, depth_multiplier=2), L.Conv2D(6, 1)
    keras.Model(inputs, pw(dw(inputs)))
    assert layer_flops(sep) == layer_flops(dw) + layer_flops(pw) == \
        2 * 7 * 7 * (3 * 3 * 4 * 2 + 8 * 6)


def test_nested_sequential_and_shared_layers():
    inner_in = keras.Input((8,))
    inner = keras.Model(inner_in, L.Dense(4, name="fc")(inner_in), name="inner")
    shared = L.Dense(8, name="shared")
    inputs = keras.Input((8,))
    outer = keras.Model(inputs, L.Dense(2, name="head")(inner(shared(shared(inputs)))))
    total, table = model_flops(outer, per_layer=True)
    assert table == {"shared": 2 * 2 * 64, "fc": 2 * 32, "head": 2 * 8}  # keys: layer names
    assert total == sum(table.values())
    seq = keras.Sequential([keras.Input((8,)), L.Dense(4), L.ReLU(), L.Dense(2)])
    assert model_flops(seq) == 2 * (32 + 8)
    for cls in (L.Dense, L.Conv2D, L.DepthwiseConv2D, L.SeparableConv2D, L.Conv2DTranspose):
        assert type(layer_rules.get(cls.__new__(cls))).flops is not layer_rules.LayerRule.flops


def test_unknown_spatial_shape_is_refused_with_the_layer_name():
    inputs = keras.Input((None, None, 3))
    model = keras.Model(inputs, L.Conv2D(4, 3, name="conv")(inputs))
    with pytest.raises(ValueError, match="'conv'.*unknown output dimension"):
        model_flops(model)
    with pytest.raises(ValueError, match="methods must be among"):
        hope_keras.profile(small_resnet(), methods=("fast",))


def test_slim_comparison_counts_and_compress_result_profiles_lazily():
    model = small_resnet(seed=4)
    flops0, params0 = model_flops(model), model.count_params()
    result = hope_keras.compress(model, density=0.5, verbose=False)
    p = result.profile(latency=False)
    small = hope_keras.slim(model)
    assert p.reference.params == params0 and p.reference.flops == flops0
    assert p.params == small.count_params() and p.flops == model_flops(small)
    assert p.ratio("params") == pytest.approx(result.params_ratio, abs=1e-12)
    assert 0 < p.ratio("flops") < 1 and p.latency == {}
    lines = []
    p.summary(print_fn=lines.append)
    assert any(line.startswith("FLOPs / example") and f"{flops0:,}" in line
               for line in lines), lines


@pytest.fixture(scope="module")
def compressed_and_slim():
    """A residual net compressed in place to density 0.5, and its slimmed copy (read
    only: shared by the tests below)."""
    model = small_resnet(seed=4)
    hope_keras.compress(model, density=0.5, verbose=False)
    return model, hope_keras.slim(model)


def test_latency_methods_interleaved_and_tflite(compressed_and_slim, tmp_path):
    model, small = compressed_and_slim
    p = hope_keras.profile(small, reference=model, methods=("predict", "call", "tflite"),
                           repeats=3, warmup=1, batch_size=2)
    for prof in (p, p.reference):
        assert set(prof.latency) == {"predict", "call", "tflite"}
        assert all(t > 0 for t in prof.latency.values())
        assert prof.size_bytes > 0 and prof.batch_size == 2
    assert p.size_bytes < p.reference.size_bytes
    lines = []
    p.summary(print_fn=lines.append, layers=True)
    assert any("latency tflite" in line for line in lines)
    path = tmp_path / "small.tflite"
    hope_keras.export_tflite(small, path)
    q = hope_keras.profile(str(path), repeats=2, warmup=1)
    assert set(q.latency) == {"tflite"} and q.params is None
    assert q.size_bytes == path.stat().st_size


def test_a_reference_of_other_inputs_is_refused_by_shape_unless_nothing_is_timed(
        compressed_and_slim, tmp_path):
    model, small = compressed_and_slim
    other = keras.Sequential([keras.Input((12, 12, 3)), keras.layers.Conv2D(2, 3),
                              keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(2)])
    with pytest.raises(ValueError, match=r"\(12, 12, 3\).*latency=False"):
        hope_keras.profile(other, reference=model, methods=("call",), repeats=1)
    with pytest.raises(ValueError, match=r"model takes inputs of shape \[\(12, 12, 3\)\]"):
        hope_keras.latency_ratio(other, model)
    path = tmp_path / "small.tflite"
    hope_keras.export_tflite(small, path)
    with pytest.raises(ValueError, match="reference"):  # a .tflite file is read too
        hope_keras.profile(str(path), reference=other, repeats=1)
    p = hope_keras.profile(other, reference=model, latency=False)
    assert p.params == other.count_params() and p.reference.params == model.count_params()


def test_tflite_float32_matches_keras_and_int8_is_smaller(compressed_and_slim, tmp_path):
    from hope_keras.deploy.export import tflite_predict

    _, small = compressed_and_slim
    x = np.random.default_rng(0).normal(size=(8, 10, 10, 3)).astype("float32")
    want = np.asarray(small(x, training=False))
    f32 = hope_keras.export_tflite(small, tmp_path / "f32.tflite")
    assert (tmp_path / "f32.tflite").read_bytes() == f32
    np.testing.assert_allclose(tflite_predict(tmp_path / "f32.tflite", x), want,
                               rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="quantize must be one of"):
        hope_keras.export_tflite(small, quantize="int4")
    with pytest.raises(FileNotFoundError, match="No TFLite file"):
        tflite_predict(tmp_path / "missing.tflite", x)


def test_dynamic_range_int8_runs_agrees_and_is_smaller():
    # Dynamic-range quantisation skips tensors under 1024 entries: use the demo CNN.
    from hope_keras.data import load_demo_data, load_demo_model
    from hope_keras.deploy.export import tflite_predict

    model = load_demo_model()
    hope_keras.compress(model, density=0.8, verbose=False)
    small = hope_keras.slim(model)
    x = load_demo_data().x_test[:200]
    f32 = hope_keras.export_tflite(small)
    int8 = hope_keras.export_tflite(small, quantize="dynamic")
    assert len(int8) < 0.4 * len(f32)
    want = np.argmax(small.predict(x, verbose=0), -1)
    got = tflite_predict(int8, x)
    assert got.shape == (200, 10) and np.all(np.isfinite(got))
    assert np.mean(np.argmax(got, -1) == want) >= 0.95
