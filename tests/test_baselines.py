"""Magnitude baselines and Neuron Merging: global ranking, never an empty layer,
same edit/slim path as HOPE, exact merging of duplicated neurons."""

import numpy as np
import pytest

import hope_keras
from conftest import copy_model, mlp, outputs_equal, small_resnet
from hope_keras.search import baselines


def _x(model, n=16, seed=0):
    shape = (n,) + tuple(model.inputs[0].shape[1:])
    return np.random.default_rng(seed).normal(size=shape).astype("float32")


def _dead(model, group_name):
    """Neurons of a group whose filter, γ, β and output slice are all zero."""
    a = hope_keras.analyze(model)
    st = a.states[group_name]
    return set(np.flatnonzero(~np.any(st.w_raw != 0, axis=1) & (st.gamma == 0)
                              & (st.beta == 0) & ~np.any(st.u != 0, axis=1)).tolist())


@pytest.mark.parametrize("method", baselines.METHODS)
def test_global_ranking_removes_the_lowest_scores(method):
    model = mlp(widths=(12, 10), seed=3)
    a = hope_keras.analyze(model)
    sc = baselines.scores(a, method)
    flat = sorted((s, g, i) for g, arr in sc.items() for i, s in enumerate(arr))
    expected = {(g, i) for _, g, i in flat[:9]}  # 22 neurons → floor(0.6·22) = 13 left
    result = baselines.prune(model, density=0.6, method=method)
    assert set(result.removed) == expected
    assert result.density == pytest.approx(13 / 22)
    for g in ("fc0", "fc1"):
        assert _dead(model, g) == {i for gg, i in expected if gg == g}


def test_scores_match_their_definitions():
    model = mlp(widths=(5,), seed=1)
    a = hope_keras.analyze(model)
    k = model.get_layer("fc0").kernel.numpy()
    u = model.get_layer("head").kernel.numpy()
    gamma = model.get_layer("fc0_bn").gamma.numpy()
    np.testing.assert_allclose(baselines.scores(a, "l1_input")["fc0"],
                               np.abs(k).sum(0), rtol=1e-6)
    np.testing.assert_allclose(baselines.scores(a, "l1_joint")["fc0"],
                               np.abs(k).sum(0) + np.abs(u).sum(1), rtol=1e-6)
    np.testing.assert_allclose(baselines.scores(a, "bn_scale")["fc0"], np.abs(gamma),
                               rtol=1e-6)


def test_never_empties_a_layer():
    model = mlp(widths=(6, 8), seed=2)
    k = model.get_layer("fc1").kernel.numpy()
    model.get_layer("fc1").kernel.assign(k * 1e-4)  # fc1 scores are all the lowest
    order = baselines.removal_order(baselines.scores(hope_keras.analyze(model), "l1_input"))
    assert [g for g, _ in order[:7]] == ["fc1"] * 7 and all(g == "fc0" for g, _ in order[7:])
    assert len(order) == 12  # one neuron left in each layer
    result = baselines.prune(model, density=2 / 14, method="l1_input")
    assert len(_dead(model, "fc0")) == 5 and len(_dead(model, "fc1")) == 7
    with pytest.raises(ValueError, match="out of reach"):
        baselines.prune(copy_model(model), density=1 / 14, method="l1_input")
    assert result.density == pytest.approx(2 / 14)


def test_layer_scope_removes_the_same_fraction_per_layer():
    model = mlp(widths=(10, 20), seed=4)
    result = baselines.prune(model, density=0.5, method="l1_input", scope="layer")
    assert sum(g == "fc0" for g, _ in result.removed) == 5
    assert sum(g == "fc1" for g, _ in result.removed) == 10


def test_baselines_prune_the_coupled_residual_stream_in_every_writer():
    model = small_resnet(seed=5)
    a = hope_keras.analyze(model)
    assert a.graph.groups["stem"].kind == "coupled"  # the stem → Add stream
    for method in baselines.METHODS:
        m = copy_model(model)
        result = baselines.prune(m, density=0.5, method=method)
        assert {g for g, _ in result.removed} <= set(a.graph.groups)
        for g, i in result.removed:
            if g == "stem":  # a removed stream channel is zero in both writers
                for writer in ("stem", "b1b"):
                    assert not m.get_layer(writer).kernel.numpy()[..., i].any()
        small = hope_keras.slim(m)
        assert small.count_params() < model.count_params()
        assert outputs_equal(small, m, _x(model))


def _duplicated_mlp(scale=2.5):
    """fc0 neuron 3 is an exact positive multiple of neuron 1 after BN."""
    model = mlp(widths=(8,), seed=6)
    p, bn = model.get_layer("fc0"), model.get_layer("fc0_bn")
    k, b = p.kernel.numpy(), p.bias.numpy()
    k[:, 3] = 0.01 * k[:, 1]      # tiny raw filter: ranked lowest by any norm
    b[3] = 0.01 * b[1]
    p.kernel.assign(k)
    p.bias.assign(b)
    g, be, mu, var = (w.numpy() for w in bn.weights)
    # y3 = γ3 (0.01 z1 − μ3)/s + β3 must equal scale·y1 with the same s:
    # γ3 = scale·γ1/0.01, μ3 = 0.01 μ1, β3 = scale·β1.
    var[3] = var[1]
    g[3], mu[3], be[3] = scale * g[1] / 0.01, 0.01 * mu[1], scale * be[1]
    for w, v in zip(bn.weights, (g, be, mu, var)):
        w.assign(v)
    return model


def test_neuron_merging_exact_duplicate_preserves_output():
    model = _duplicated_mlp()
    original = copy_model(model)
    x = _x(model, 64)
    result = baselines.neuron_merging(model, density=7 / 8, criterion="l1")
    assert result.removed == [("fc0", 3)]
    (g, p, k, s, c), = result.merges
    assert (g, p, k) == ("fc0", 3, 1) and c == pytest.approx(1.0, abs=1e-6)
    assert s == pytest.approx(2.5, rel=1e-4)
    assert outputs_equal(model, original, x, rtol=1e-4, atol=1e-5)
    # Plain pruning of the same neuron changes the output; slim keeps the merge.
    pruned = copy_model(original)
    baselines.prune(pruned, density=7 / 8, method="l1_input")
    assert not outputs_equal(pruned, original, x, rtol=1e-3, atol=1e-3)
    assert outputs_equal(hope_keras.slim(model), original, x, rtol=1e-4, atol=1e-5)


def test_neuron_merging_threshold_and_raw_variant():
    model = _duplicated_mlp()
    # A threshold above 1 forbids every merge: Neuron Merging = plain norm pruning.
    result = baselines.neuron_merging(copy_model(model), density=0.5, threshold=1.01)
    assert result.merges == []
    # Raw variant (no BN folding): neuron 3's raw [w; c] is 0.01·neuron 1's, cos = 1.
    result = baselines.neuron_merging(copy_model(model), density=7 / 8, bn_aware=False)
    assert result.merges[0][:3] == ("fc0", 3, 1)
    assert result.merges[0][3] == pytest.approx(0.01, rel=1e-4)


def test_neuron_merging_on_conv_flatten_dense():
    model = small_resnet(seed=7)
    original = copy_model(model)
    result = baselines.neuron_merging(model, density=0.6)
    assert result.merges and result.density <= 0.6 + 1e-9
    small = hope_keras.slim(model)
    assert outputs_equal(small, model, _x(model))
    assert not outputs_equal(model, original, _x(model))


def test_bad_arguments():
    model = mlp(seed=0)
    with pytest.raises(ValueError, match="method"):
        baselines.prune(model, 0.5, method="l3")
    with pytest.raises(ValueError, match="density"):
        baselines.prune(model, 1.5)
    with pytest.raises(ValueError, match="scope"):
        baselines.prune(model, 0.5, scope="net")
    with pytest.raises(ValueError, match="criterion"):
        baselines.neuron_merging(model, 0.5, criterion="l0")
