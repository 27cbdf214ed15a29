"""BN folding, output vectors and P_init against direct evaluation of the layers."""

import keras
import numpy as np
import pytest

from conftest import L, randomize_bn
from hope_keras.graph.walker import walk
from hope_keras.scoring.neurons import consumer_rows, extract_group, rows_to_kernel


def test_neurons_state_keeps_filters_in_kernel_dtype_and_folds_in_float64(rng):
    """A "neurons" group's filters stay in the kernel's dtype (a copy: half the bytes
    of float64); the folded vectors are bit for bit those of a float64 copy."""
    inputs = keras.Input((5,))
    y = L.BatchNormalization(name="bn")(L.Dense(4, name="p")(inputs))
    model = keras.Model(inputs, L.Dense(2, name="q")(L.ReLU()(y)))
    randomize_bn(model)
    state = extract_group(model, walk(model).groups["p"])
    kernel = model.get_layer("p").kernel
    assert state.w_raw.dtype == np.float32
    bn = model.get_layer("bn")
    scale = bn.gamma.numpy().astype(np.float64) / np.sqrt(
        bn.moving_variance.numpy().astype(np.float64) + bn.epsilon)
    ref = scale[:, None] * kernel.numpy().astype(np.float64).T
    assert state.w_eff.dtype == np.float64
    np.testing.assert_array_equal(state.w_eff, ref)
    kernel.assign(np.zeros((5, 4), "float32"))  # the state does not follow the model
    np.testing.assert_array_equal(state.w_eff, ref)


@pytest.mark.parametrize("center,scale,use_bias", [(True, True, True), (False, True, True),
                                                   (True, False, False), (False, False, True)])
def test_folded_dense_neurons_reproduce_bn_output(center, scale, use_bias, rng):
    inputs = keras.Input((5,))
    z = L.Dense(4, use_bias=use_bias, name="p")(inputs)
    y = L.BatchNormalization(center=center, scale=scale, name="bn")(z)
    model = keras.Model(inputs, L.Dense(2, name="q")(L.ReLU()(y)))
    randomize_bn(model)
    if use_bias:
        model.get_layer("p").bias.assign(rng.normal(size=4).astype("float32"))
    state = extract_group(model, walk(model).groups["p"])
    x = rng.normal(size=(7, 5))
    pre = keras.Model(inputs, y)(x.astype("float32"), training=False).numpy()
    folded = x @ state.w_eff.T + state.b_eff
    np.testing.assert_allclose(folded, pre, rtol=1e-4, atol=1e-5)
    if not scale:
        assert np.all(state.gamma == 1)
    if not center:
        assert np.all(state.beta == 0)


def test_folded_conv_neurons_with_bias(rng):
    inputs = keras.Input((5, 5, 2))
    z = L.Conv2D(3, 3, name="p")(inputs)
    y = L.BatchNormalization(name="bn")(z)
    model = keras.Model(inputs, L.Conv2D(2, 1, name="q")(L.ReLU()(y)))
    randomize_bn(model)
    model.get_layer("p").bias.assign(rng.normal(size=3).astype("float32"))
    state = extract_group(model, walk(model).groups["p"])
    x = rng.normal(size=(1, 5, 5, 2)).astype("float32")
    pre = keras.Model(inputs, y)(x, training=False).numpy()[0, 1, 2]
    patch = x[0, 1:4, 2:5, :].reshape(-1)  # kernel flattening order (kh, kw, c_in)
    np.testing.assert_allclose(state.w_eff @ patch + state.b_eff, pre, rtol=1e-4, atol=1e-5)


def test_flatten_dense_rows_are_interleaved():
    C, S, units = 3, 4, 2
    kernel = np.arange(S * C * units, dtype=float).reshape(S * C, units)
    rows = consumer_rows(kernel, "dense", C)
    for c in range(C):
        expected = kernel[[c + C * s for s in range(S)]].reshape(-1)
        np.testing.assert_array_equal(rows[c], expected)
    np.testing.assert_array_equal(rows_to_kernel(rows, "dense", kernel.shape), kernel)
    conv = np.arange(3 * 3 * C * units, dtype=float).reshape(3, 3, C, units)
    np.testing.assert_array_equal(rows_to_kernel(consumer_rows(conv, "conv", C), "conv",
                                                 conv.shape), conv)


def test_u_concatenates_consumers_and_p_init_counts_nonzeros():
    inputs = keras.Input((4, 4, 2))
    x = L.ReLU()(L.BatchNormalization()(L.Conv2D(3, 1, name="p")(inputs)))
    a = L.Conv2D(5, 3, name="a")(x)
    b = L.Dense(2, name="b")(L.Flatten()(x))
    model = keras.Model(inputs, [a, b])
    model.get_layer("p").kernel.assign(np.array([[[[1, 0, 2], [0, 0, 3]]]], "float32"))
    state = extract_group(model, walk(model).groups["p"])
    ka = model.get_layer("a").kernel.numpy()
    kb = model.get_layer("b").kernel.numpy()
    expected_u1 = np.concatenate([ka[:, :, 1, :].reshape(-1), kb[1::3].reshape(-1)])
    np.testing.assert_allclose(state.u[1], expected_u1)
    assert state.u_split == [0, 45, 45 + 32]
    # nnz(filter) + bias + nnz(u) + 4 BN parameters
    nnz_u = np.count_nonzero(state.u, axis=1)
    np.testing.assert_array_equal(state.p_init, np.array([1, 0, 2]) + 1 + nnz_u + 4)


def test_nan_weights_raise_and_name_the_layer():
    inputs = keras.Input((4,))
    x = L.ReLU()(L.BatchNormalization(name="bn")(L.Dense(3, name="p")(inputs)))
    model = keras.Model(inputs, L.Dense(2)(x))
    k = model.get_layer("p").kernel.numpy()
    k[0, 0] = np.nan
    model.get_layer("p").kernel.assign(k)
    with pytest.raises(ValueError, match="'p'.*NaN"):
        extract_group(model, walk(model).groups["p"])


def test_coupled_state_builds_its_arrays_on_access_from_the_weights_as_extracted():
    """A coupled group's float64 arrays are built lazily (`CoupledState`): equal to the
    writers' filters and readers' slices read directly, a snapshot of the weights at
    extraction, with row norms equal (bit for bit) to those of the built ``u``."""
    from conftest import small_resnet

    model = small_resnet(seed=4)
    group = walk(model).groups["stem"]
    assert group.kind == "coupled"
    state = extract_group(model, group)
    assert "u" not in state.__dict__ and "w_raw" not in state.__dict__
    norms = state.u_sq_norms()  # before u is built: row blocks
    k = {n: model.get_layer(n).kernel.numpy().astype(np.float64) for n in ("stem", "b1b",
                                                                             "b1a", "c2")}
    bias_nnz = sum((model.get_layer(n).bias.numpy() != 0).astype(int) for n in ("stem", "b1b"))
    w_raw = np.concatenate([k["stem"].reshape(-1, 8).T, k["b1b"].reshape(-1, 8).T], axis=1)
    u = np.concatenate([np.moveaxis(k["b1a"], 2, 0).reshape(8, -1),
                        np.moveaxis(k["c2"], 2, 0).reshape(8, -1)], axis=1)
    for layer in ("stem", "b1a"):  # edits after extraction do not reach the state
        model.get_layer(layer).kernel.assign(np.zeros(model.get_layer(layer).kernel.shape))
    np.testing.assert_array_equal(state.w_raw, w_raw)
    np.testing.assert_array_equal(state.u, u)
    assert state.u_split == [0, 54, 54 + 63]
    np.testing.assert_array_equal(norms, np.einsum("ij,ij->i", state.u, state.u))
    np.testing.assert_array_equal(
        state.p_init, np.count_nonzero(w_raw, axis=1) + bias_nnz + np.count_nonzero(u, axis=1)
        + 8)  # 4 per BatchNormalization channel
    assert state.size == 8 and state.w_raw.dtype == state.u.dtype == np.float64


def test_groups_read_from_the_editors_mirror_equal_those_read_from_the_model():
    """``refresh="neighbors"`` re-extracts groups from the editor's mirror (a view that
    wraps each layer): before any edit every array equals the model's, the coupled
    group's BatchNormalization included (the layer registry sees through the mirror;
    read by class, the mirror's BN was missed and γ, σ² read as ones)."""
    from conftest import small_resnet
    from hope_keras.edit.editor import ModelEditor

    model = small_resnet(seed=4)
    randomize_bn(model, seed=5, gamma=(0.3, 3.0))
    graph = walk(model)
    editor = ModelEditor(model, graph)
    assert {g.kind for g in graph.groups.values()} == {"coupled", "neurons"}
    for name, group in graph.groups.items():
        direct = extract_group(model, group, graph)
        mirrored = extract_group(editor.mirror_model(), group)
        for attr in ("gamma", "beta", "mean", "var", "w_raw", "u", "p_init"):
            np.testing.assert_array_equal(getattr(mirrored, attr), getattr(direct, attr),
                                          err_msg=f"{name}.{attr}")
    assert not np.all(extract_group(model, graph.groups["stem"], graph).gamma == 1.0)


def test_check_finite_counts_nan_and_inf_and_accepts_huge_finite_values():
    from hope_keras.scoring.neurons import check_finite as _check_finite

    _check_finite("p", "kernel", np.array([1e308, 1e308, -1e308]))  # the sum overflows
    _check_finite("p", "kernel", np.ones((3, 4), np.float32))
    for bad in (np.nan, np.inf, -np.inf):
        x = np.ones((3, 4), np.float32)
        x[1, 2] = x[2, 0] = bad
        with pytest.raises(ValueError, match="Layer 'p' has 2 NaN/Inf value"):
            _check_finite("p", "kernel", x)
