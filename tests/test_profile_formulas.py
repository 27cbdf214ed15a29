"""`hope_keras.profile`'s parameter and FLOPs counts against hand formulas.

Each case is a model of one layer type (Dense, Conv1D/2D/3D with strides, padding,
dilation and groups, depthwise and separable 1-D/2-D convolutions with depth
multipliers, Conv2DTranspose, BatchNormalization and LayerNormalization with and
without center/scale) whose output
shape, parameter count and FLOPs are written out here from the layer's definition,
with no Keras or hope_keras shape inference: output length ``ceil(n / s)`` for
``"same"``/``"causal"`` and ``floor((n - d (k - 1) - 1) / s) + 1`` for ``"valid"``
(a transposed convolution: ``n·s`` and ``(n − 1)·s + k``, each input position
scattering the whole kernel);
FLOPs = 2 × multiply-accumulates per example at every output position (the
convention of docs/api.md's `profile`: a ``"same"`` border counts the whole kernel;
biases, BatchNormalization and activations count none). The brute-force count of
test_profile.py covers unpadded layers; this covers the padded and strided ones and
the parameter counts.
"""

import math

import keras
import pytest

import hope_keras

L = keras.layers


def _out(n, k, s, padding, d=1):
    if padding in ("same", "causal"):
        return math.ceil(n / s)
    return (n - d * (k - 1) - 1) // s + 1


def _dense(shape, units, bias=True):
    *lead, d = shape
    positions = math.prod(lead)
    return ((*lead, units), d * units + (units if bias else 0), 2 * positions * d * units)


def _conv2d(shape, filters, k, s, padding, d=1, groups=1, bias=True):
    (h, w, c), (kh, kw), (sh, sw) = shape, k, s
    ho, wo = _out(h, kh, sh, padding, d), _out(w, kw, sw, padding, d)
    per_position = kh * kw * (c // groups) * filters
    return ((ho, wo, filters), per_position + (filters if bias else 0),
            2 * ho * wo * per_position)


def _conv1d(shape, filters, k, s, padding, d=1, bias=True):
    n, c = shape
    no = _out(n, k, s, padding, d)
    return (no, filters), k * c * filters + (filters if bias else 0), 2 * no * k * c * filters


def _depthwise2d(shape, k, s, padding, m=1, bias=True):
    (h, w, c), (kh, kw), (sh, sw) = shape, k, s
    ho, wo = _out(h, kh, sh, padding), _out(w, kw, sw, padding)
    return ((ho, wo, c * m), kh * kw * c * m + (c * m if bias else 0),
            2 * ho * wo * kh * kw * c * m)


def _separable2d(shape, filters, k, s, padding, m=1, bias=True):
    (h, w, c), (kh, kw), (sh, sw) = shape, k, s
    ho, wo = _out(h, kh, sh, padding), _out(w, kw, sw, padding)
    depthwise, pointwise = kh * kw * c * m, c * m * filters
    return ((ho, wo, filters), depthwise + pointwise + (filters if bias else 0),
            2 * ho * wo * (depthwise + pointwise))


def _conv3d(shape, filters, k, s, padding, bias=True):
    (d, h, w, c) = shape
    out = tuple(_out(n, kk, ss, padding) for n, kk, ss in zip((d, h, w), k, s))
    per_position = math.prod(k) * c * filters
    return ((*out, filters), per_position + (filters if bias else 0),
            2 * math.prod(out) * per_position)


def _conv1d_groups(shape, filters, k, groups, padding, bias=True):
    n, c = shape
    no = _out(n, k, 1, padding)
    per_position = k * (c // groups) * filters
    return (no, filters), per_position + (filters if bias else 0), 2 * no * per_position


def _depthwise1d(shape, k, s, padding, m=1, bias=True):
    n, c = shape
    no = _out(n, k, s, padding)
    return (no, c * m), k * c * m + (c * m if bias else 0), 2 * no * k * c * m


def _separable1d(shape, filters, k, padding, m=1, bias=True):
    n, c = shape
    no = _out(n, k, 1, padding)
    depthwise, pointwise = k * c * m, c * m * filters
    return ((no, filters), depthwise + pointwise + (filters if bias else 0),
            2 * no * (depthwise + pointwise))


def _transpose2d(shape, filters, k, s, padding, bias=True):
    """Each input position scatters the whole kernel: in positions × kh·kw·c·filters
    multiply-adds; the output side is (n − 1)·s + k ("valid") or n·s ("same")."""
    (h, w, c), (kh, kw), (sh, sw) = shape, k, s
    out = [n * st if padding == "same" else (n - 1) * st + kk
           for n, kk, st in ((h, kh, sh), (w, kw, sw))]
    per_position = kh * kw * c * filters
    return ((*out, filters), per_position + (filters if bias else 0), 2 * h * w * per_position)


def _layernorm(shape, center=True, scale=True):
    c = shape[-1]  # β and γ over the channel axis
    return tuple(shape), c * (center + scale), 0


def _batchnorm(shape, center=True, scale=True):
    c = shape[-1]  # moving mean and variance, plus β and γ when used
    return tuple(shape), c * (2 + center + scale), 0


# (id, input shape, layer, hand-computed (output shape, params, FLOPs))
CASES = [
    ("dense", (7,), lambda: L.Dense(5), _dense((7,), 5)),
    ("dense_no_bias", (7,), lambda: L.Dense(5, use_bias=False), _dense((7,), 5, bias=False)),
    ("dense_on_sequence", (4, 6), lambda: L.Dense(3), _dense((4, 6), 3)),
    ("dense_on_feature_map", (3, 5, 6), lambda: L.Dense(2), _dense((3, 5, 6), 2)),
    ("conv2d_same_stride2", (9, 8, 3), lambda: L.Conv2D(5, 3, strides=2, padding="same"),
     _conv2d((9, 8, 3), 5, (3, 3), (2, 2), "same")),
    ("conv2d_valid_stride2", (9, 8, 3), lambda: L.Conv2D(5, 3, strides=2),
     _conv2d((9, 8, 3), 5, (3, 3), (2, 2), "valid")),
    ("conv2d_rect_strides", (11, 10, 2),
     lambda: L.Conv2D(4, (3, 1), strides=(3, 2), padding="same", use_bias=False),
     _conv2d((11, 10, 2), 4, (3, 1), (3, 2), "same", bias=False)),
    ("conv2d_dilated", (12, 12, 3), lambda: L.Conv2D(4, 3, dilation_rate=2),
     _conv2d((12, 12, 3), 4, (3, 3), (1, 1), "valid", d=2)),
    ("conv2d_groups", (8, 8, 6), lambda: L.Conv2D(9, 3, padding="same", groups=3),
     _conv2d((8, 8, 6), 9, (3, 3), (1, 1), "same", groups=3)),
    ("depthwise2d_same_stride2", (9, 9, 4),
     lambda: L.DepthwiseConv2D(3, strides=2, padding="same"),
     _depthwise2d((9, 9, 4), (3, 3), (2, 2), "same")),
    ("depthwise2d_valid_multiplier", (10, 7, 3),
     lambda: L.DepthwiseConv2D((3, 2), depth_multiplier=3, use_bias=False),
     _depthwise2d((10, 7, 3), (3, 2), (1, 1), "valid", m=3, bias=False)),
    ("separable2d_same_stride2", (9, 9, 4),
     lambda: L.SeparableConv2D(6, 3, strides=2, padding="same", depth_multiplier=2),
     _separable2d((9, 9, 4), 6, (3, 3), (2, 2), "same", m=2)),
    ("separable2d_valid", (8, 10, 3), lambda: L.SeparableConv2D(5, (3, 5)),
     _separable2d((8, 10, 3), 5, (3, 5), (1, 1), "valid")),
    ("conv1d_same_stride3", (20, 4), lambda: L.Conv1D(6, 5, strides=3, padding="same"),
     _conv1d((20, 4), 6, 5, 3, "same")),
    ("conv1d_valid_stride2", (20, 4), lambda: L.Conv1D(6, 5, strides=2),
     _conv1d((20, 4), 6, 5, 2, "valid")),
    ("conv1d_causal_dilated", (16, 3),
     lambda: L.Conv1D(2, 3, padding="causal", dilation_rate=2, use_bias=False),
     _conv1d((16, 3), 2, 3, 1, "causal", d=2, bias=False)),
    ("conv3d_same_stride", (5, 6, 7, 2), lambda: L.Conv3D(3, (3, 2, 3), strides=(2, 1, 3),
                                                          padding="same"),
     _conv3d((5, 6, 7, 2), 3, (3, 2, 3), (2, 1, 3), "same")),
    ("conv3d_valid", (5, 6, 7, 2), lambda: L.Conv3D(4, 2, use_bias=False),
     _conv3d((5, 6, 7, 2), 4, (2, 2, 2), (1, 1, 1), "valid", bias=False)),
    ("conv1d_groups", (12, 6), lambda: L.Conv1D(4, 3, groups=2, padding="same"),
     _conv1d_groups((12, 6), 4, 3, 2, "same")),
    ("depthwise1d_stride2_multiplier", (15, 4),
     lambda: L.DepthwiseConv1D(3, strides=2, depth_multiplier=2),
     _depthwise1d((15, 4), 3, 2, "valid", m=2)),
    ("separable1d_same", (11, 3), lambda: L.SeparableConv1D(5, 4, padding="same"),
     _separable1d((11, 3), 5, 4, "same")),
    ("conv2d_transpose_valid_stride2", (4, 5, 3),
     lambda: L.Conv2DTranspose(6, 3, strides=2),
     _transpose2d((4, 5, 3), 6, (3, 3), (2, 2), "valid")),
    ("conv2d_transpose_same_no_bias", (4, 5, 3),
     lambda: L.Conv2DTranspose(2, (2, 3), strides=(2, 1), padding="same", use_bias=False),
     _transpose2d((4, 5, 3), 2, (2, 3), (2, 1), "same", bias=False)),
    ("layernorm", (4, 6), lambda: L.LayerNormalization(), _layernorm((4, 6))),
    ("layernorm_no_center", (3, 3, 5), lambda: L.LayerNormalization(center=False),
     _layernorm((3, 3, 5), center=False)),
    ("batchnorm", (5, 5, 7), lambda: L.BatchNormalization(), _batchnorm((5, 5, 7))),
    ("batchnorm_no_center_scale", (9,),
     lambda: L.BatchNormalization(center=False, scale=False),
     _batchnorm((9,), center=False, scale=False)),
    ("batchnorm_scale_only", (4, 6), lambda: L.BatchNormalization(center=False),
     _batchnorm((4, 6), center=False)),
]


@pytest.mark.parametrize("name,shape,make,expected", CASES, ids=[c[0] for c in CASES])
def test_one_layer_counts_equal_the_hand_formulas(name, shape, make, expected):
    out_shape, params, flops = expected
    layer = make()
    inputs = keras.Input(shape)
    model = keras.Model(inputs, layer(inputs))
    assert tuple(model.outputs[0].shape[1:]) == out_shape  # the formula's shape is Keras's
    p = hope_keras.profile(model, latency=False)
    assert (p.params, p.flops) == (params, flops)
    assert p.layers == ({layer.name: flops} if flops else {})


def test_a_network_of_every_type_sums_its_layers_and_is_priced_once_per_call():
    """A chain of every type: the total is the sum of the hand counts along the chain
    (shapes propagated by the formulas), a layer called twice counts twice in FLOPs
    and once in parameters, and a reference's ratios are the quotients."""
    shape, total_params, total_flops, per_layer = (16, 16, 3), 0, 0, {}

    def add(name, counts):
        nonlocal shape, total_params, total_flops
        shape, params, flops = counts
        total_params += params
        total_flops += flops
        if flops:
            per_layer[name] = per_layer.get(name, 0) + flops

    inputs = keras.Input(shape)
    x = L.Conv2D(8, 3, strides=2, padding="same", name="stem")(inputs)
    add("stem", _conv2d(shape, 8, (3, 3), (2, 2), "same"))
    x = L.BatchNormalization(name="stem_bn")(x)
    add("stem_bn", _batchnorm(shape))
    x = L.ReLU()(x)
    x = L.DepthwiseConv2D(3, padding="same", depth_multiplier=2, name="dw")(x)
    add("dw", _depthwise2d(shape, (3, 3), (1, 1), "same", m=2))
    x = L.SeparableConv2D(12, 3, strides=2, name="sep")(x)
    add("sep", _separable2d(shape, 12, (3, 3), (2, 2), "valid"))
    x = L.Reshape((shape[0] * shape[1], shape[2]))(x)
    shape = (shape[0] * shape[1], shape[2])
    x = L.Conv1D(10, 2, strides=2, padding="same", name="c1")(x)
    add("c1", _conv1d(shape, 10, 2, 2, "same"))
    x = L.Flatten()(x)
    shape = (math.prod(shape),)
    shared = L.Dense(shape[0], name="shared")  # square, so it can be called twice
    x = shared(shared(x))
    add("shared", _dense(shape, shape[0]))
    total_params -= shape[0] * shape[0] + shape[0]  # one set of weights for two calls
    add("shared", _dense(shape, shape[0]))
    features = shape
    outputs = L.Dense(3, name="head")(x)
    add("head", _dense(features, 3))
    model = keras.Model(inputs, outputs)

    p = hope_keras.profile(model, latency=False)
    assert (p.params, p.flops, p.layers) == (total_params, total_flops, per_layer)
    # A reference with a second head: its counts by the formula, the ratios quotients.
    _, head_params, head_flops = _dense(features, 3)
    wider = keras.Model(model.inputs, [outputs, L.Dense(3, name="head2")(x)])
    q = hope_keras.profile(model, reference=wider, latency=False)
    assert (q.reference.params, q.reference.flops) == (total_params + head_params,
                                                       total_flops + head_flops)
    assert q.ratio("params") == total_params / (total_params + head_params)
    assert q.ratio("flops") == total_flops / (total_flops + head_flops)
