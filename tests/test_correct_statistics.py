"""Data-free BN statistics correction (`hope_keras.correct_statistics`), checked
against Monte Carlo where the Gaussian surrogate is exact."""

import keras
import numpy as np
import pytest

import hope_keras

L = keras.layers


def _exact_surrogate_model(seed=0, width=6, d_in=6):
    """x ~ N(0, I) → Dense with orthonormal columns, no bias → BN (moving stats the
    true ones: mean 0, variance 1) → ReLU → Dense → BN2. BN outputs are then exactly
    independent N(β, γ²), as `hope_keras.scoring.moments` assumes."""
    keras.utils.set_random_seed(seed)
    rng = np.random.default_rng(seed)
    inputs = keras.Input((d_in,))
    h = L.Dense(width, use_bias=False, name="fc0")(inputs)
    h = L.ReLU()(L.BatchNormalization(epsilon=1e-9, name="bn0")(h))
    y = L.BatchNormalization(name="bn1")(L.Dense(4, name="fc1")(h))
    model = keras.Model(inputs, L.Dense(3, name="head")(y))
    q, _ = np.linalg.qr(rng.normal(size=(d_in, width)))
    model.get_layer("fc0").kernel.assign(q.astype("float32"))
    bn0 = model.get_layer("bn0")
    bn0.gamma.assign(rng.uniform(0.5, 1.5, width).astype("float32"))
    bn0.beta.assign(rng.normal(0.3, 0.5, width).astype("float32"))
    bn0.moving_mean.assign(np.zeros(width, "float32"))
    bn0.moving_variance.assign(np.ones(width, "float32"))
    return model


def _bn1_input_moments(model, n=400_000, seed=1):
    """Monte Carlo mean and variance of bn1's input."""
    sub = keras.Model(model.inputs, model.get_layer("fc1").output)
    x = np.random.default_rng(seed).normal(size=(n, model.inputs[0].shape[-1]))
    z = np.asarray(sub.predict(x.astype("float32"), batch_size=65536, verbose=0),
                   dtype=np.float64)
    return z.mean(axis=0), z.var(axis=0), z.std(axis=0) / np.sqrt(n)


def test_corrected_statistics_match_monte_carlo_after_pruning():
    model = _exact_surrogate_model()
    m0, v0, _ = _bn1_input_moments(model)
    bn1 = model.get_layer("bn1")
    bn1.moving_mean.assign(m0.astype("float32"))
    bn1.moving_variance.assign(v0.astype("float32"))
    analysis = hope_keras.analyze(model)
    hope_keras.Encoder(model, actions=("prune",), analysis=analysis, correction=False, verbose=False).compress(steps=2)
    m1, v1, se = _bn1_input_moments(model)
    assert np.max(np.abs(m1 - m0) / se) > 50  # the pruning moved bn1's input
    new = hope_keras.correct_statistics(model, analysis)
    mean, var = new["bn1"]
    np.testing.assert_allclose(mean, m1, atol=5 * se.max())
    np.testing.assert_allclose(var, v1, rtol=0.02)
    np.testing.assert_allclose(bn1.moving_mean.numpy(), m1, atol=5 * se.max() + 1e-6)


def test_uncompressed_model_is_unchanged_and_other_models_are_refused():
    model = _exact_surrogate_model(seed=2)
    analysis = hope_keras.analyze(model)
    before = [w.copy() for w in model.get_weights()]
    hope_keras.correct_statistics(model, analysis)
    for a, b in zip(before, model.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="another model"):
        hope_keras.correct_statistics(_exact_surrogate_model(seed=2), analysis)


def _bn_stats(model):
    return {l.name: (l.moving_mean.numpy().copy(), l.moving_variance.numpy().copy())
            for l in model.layers if isinstance(l, L.BatchNormalization)}


def _two_layer_mlp(seed):
    """fc0 → BN → ReLU → fc1 → BN → ReLU → head: merges in fc1 leave bn0 upstream."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((5,))
    x = inputs
    for k, w in enumerate((10, 12)):
        x = L.ReLU()(L.BatchNormalization(name=f"fc{k}_bn")(L.Dense(w, name=f"fc{k}")(x)))
    model = keras.Model(inputs, L.Dense(3, name="head")(x))
    rng = np.random.default_rng(seed)
    for layer in model.layers:
        if isinstance(layer, L.BatchNormalization):
            n = layer.gamma.shape[0]
            layer.gamma.assign(rng.uniform(0.5, 1.5, n).astype("float32"))
            layer.beta.assign(rng.normal(0, 0.5, n).astype("float32"))
            layer.moving_mean.assign(rng.normal(0, 0.3, n).astype("float32"))
            layer.moving_variance.assign(rng.uniform(0.5, 2, n).astype("float32"))
    return model


@pytest.mark.parametrize("mode", [True, "auto"])
def test_compress_option_equals_the_function_after_prune_only_runs(mode):
    """After prunes only, "auto" and True both correct every BN, exactly as
    `correct_statistics` called after the run; the option is recorded and replayed."""
    ref = _two_layer_mlp(0)
    ref_result = hope_keras.Encoder(ref, actions=("prune",), correction=False, verbose=False).compress(steps=6)
    expected = hope_keras.correct_statistics(ref, ref_result.analysis)
    assert sorted(expected) == ["fc0_bn", "fc1_bn"]
    model = _two_layer_mlp(0)
    result = hope_keras.Encoder(model, actions=("prune",), correction=mode, verbose=False).compress(steps=6)
    assert result.trajectory.meta["options"]["correct_statistics"] == mode
    for a, b in zip(model.get_weights(), ref.get_weights()):
        np.testing.assert_array_equal(a, b)
    replayed = result.trajectory.replay(_two_layer_mlp(0), step=6)
    for a, b in zip(replayed.get_weights(), model.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_auto_leaves_the_statistics_behind_merges_and_replays_prefixes():
    """"auto": after a prune in fc0 and a merge in fc1, fc1's BN (downstream of the
    merge) keeps its statistics; a replay decides on the steps it replays: after the
    prune alone, fc1's BN (whose input lost a channel) is corrected."""
    from hope_keras.search.encoder import Action

    enc = hope_keras.Encoder(_two_layer_mlp(1))
    enc.execute(Action("prune", "fc0", 3, -1, 0.0, 0.0, 1.0, 1))
    enc.execute(Action("merge", "fc1", 0, 1, 0.0, 0.0, 1.0, 1))
    enc.editor.commit()
    meta = dict(enc.trajectory.meta)
    plain = hope_keras.Trajectory(meta, enc.trajectory.steps)
    auto = hope_keras.Trajectory(
        {**meta, "options": {**meta["options"], "correct_statistics": "auto"}},
        enc.trajectory.steps)
    for n, corrected in ((2, {"fc0_bn"}), (1, {"fc0_bn", "fc1_bn"})):
        ref = _two_layer_mlp(1)
        analysis = hope_keras.analyze(ref)
        ref_stats = _bn_stats(plain.replay(ref, step=n))
        new = hope_keras.correct_statistics(ref, analysis, exclude=["fc1"] if n == 2 else [])
        assert set(new) == corrected
        got = _bn_stats(auto.replay(_two_layer_mlp(1), step=n))
        for name, (mean, var) in got.items():
            if name in corrected:
                if name == "fc1_bn":  # the prune in fc0 moved its input
                    assert not np.allclose(mean, ref_stats[name][0])
                np.testing.assert_allclose(mean, new[name][0], rtol=1e-6, atol=1e-7)
                np.testing.assert_allclose(var, new[name][1], rtol=1e-6)
            else:
                np.testing.assert_array_equal(mean, ref_stats[name][0])
                np.testing.assert_array_equal(var, ref_stats[name][1])


def test_correction_option_and_exclude_are_validated():
    model = _two_layer_mlp(2)
    with pytest.raises(ValueError, match="correction must be.*Received: "
                                         "correction='yes'"):
        hope_keras.Encoder(model, correction="yes", verbose=False).compress(steps=1)
    analysis = hope_keras.analyze(model)
    with pytest.raises(ValueError, match="exclude names no group.*'fc9'"):
        hope_keras.correct_statistics(model, analysis, exclude=["fc9"])


def test_surrogate_skips_what_a_moved_residual_sum_reaches():
    """On a residual net: pruning c2 (after the block) moves fc's BN input, which
    "surrogate" (the surrogate part of "auto") corrects; pruning b1a (inside the branch) moves b1b's BN (corrected) and
    the Add's input, and then every BN after the Add keeps its statistics (the
    propagation adds the branch and the shortcut as if independent). True corrects
    those whose input the propagation predicts to move."""
    from conftest import small_resnet
    from hope_keras.search.encoder import Action

    enc = hope_keras.Encoder(small_resnet(seed=3), actions=("prune",))
    enc.execute(Action("prune", "c2", 0, -1, 0.0, 0.0, 1.0, 1))
    enc.execute(Action("prune", "b1a", 1, -1, 0.0, 0.0, 1.0, 1))
    meta = dict(enc.trajectory.meta)

    def replay(mode, n):
        t = hope_keras.Trajectory({**meta, "options": {**meta["options"],
                                                        "correct_statistics": mode}},
                                  enc.trajectory.steps)
        return _bn_stats(t.replay(small_resnet(seed=3), step=n))

    # The propagation restarts at every BN (its output is N(β, γ²)), so True moves
    # only the first BN after an edit: fc_bn (c2 lost a channel) but not c2_bn, whose
    # live channels' input did not move (its pruned channel keeps what the prune wrote).
    for n, moved, kept, true_moves in ((1, {"fc_bn"}, set(), set()),
                                       (2, {"b1b_bn"}, {"c2_bn", "fc_bn"}, {"fc_bn"})):
        plain, auto, every = replay(False, n), replay("surrogate", n), replay(True, n)
        for name in moved:
            assert not np.allclose(auto[name][0], plain[name][0]), (n, name)
            np.testing.assert_allclose(auto[name][0], every[name][0], rtol=1e-6)
        for name in kept:
            np.testing.assert_array_equal(auto[name][0], plain[name][0])
            np.testing.assert_array_equal(auto[name][1], plain[name][1])
            if name in true_moves:
                assert not np.allclose(every[name][1], plain[name][1]), (n, name)
            else:
                np.testing.assert_array_equal(every[name][1], plain[name][1])


@pytest.mark.parametrize("mode", [True, "auto"])
def test_correction_keeps_an_evicted_branch_without_gamma_beta_at_zero(mode):
    """A branch ending in a BN without γ and β is evicted by zeroing its producer and
    the BN's moving mean; the correction must not re-normalise that now-constant
    channel (it brought the branch back as a constant, and `slim` then kept it: a
    500-network fuzz run caught it, seeds 179 and 371)."""
    keras.utils.set_random_seed(2)
    inputs = keras.Input((5,))
    x = L.ReLU()(L.BatchNormalization(name="bn0")(L.Dense(4, name="fc0")(inputs)))
    y = L.ReLU()(L.BatchNormalization(name="bn1")(L.Dense(3, name="fc1")(x)))
    y = L.Dense(4, use_bias=False, name="fc2")(y)
    y = L.BatchNormalization(scale=False, center=False, name="bn2")(y)
    out = L.Dense(2, name="head")(L.Add(name="add")([x, y]))
    model = keras.Model(inputs, out)
    rng = np.random.default_rng(0)
    for name in ("bn0", "bn1", "bn2"):
        bn = model.get_layer(name)
        bn.moving_mean.assign(rng.normal(0, 0.3, bn.moving_mean.shape).astype("float32"))
        bn.moving_variance.assign(rng.uniform(0.5, 2, bn.moving_variance.shape)
                                  .astype("float32"))
    count0 = model.count_params()
    result = hope_keras.Encoder(model, actions=("evict",), correction=mode, verbose=False).compress(steps=1)
    assert [s.kind for s in result.trajectory.steps] == ["evict"]
    np.testing.assert_array_equal(model.get_layer("bn2").moving_mean.numpy(), 0.0)
    small = hope_keras.slim(model)
    assert "bn2" not in [layer.name for layer in small.layers]  # the branch is gone
    assert small.count_params() == round(result.params_ratio * count0)
    x = rng.normal(size=(8, 5)).astype("float32")
    np.testing.assert_allclose(small(x), model(x), rtol=1e-5, atol=1e-6)


def _duplicate_pair_model(seed=0):
    """x → Dense(6) → BN → ReLU → Dense(3), neurons 0 and 1 identical (weights, bias,
    BN parameters and statistics; moving variance 2–6, so the BN's fold factor is not
    1): their merge is exact."""
    keras.utils.set_random_seed(seed)
    rng = np.random.default_rng(seed)
    inputs = keras.Input((5,))
    h = L.Dense(6, name="fc0")(inputs)
    h = L.ReLU()(L.BatchNormalization(name="bn0")(h))
    model = keras.Model(inputs, L.Dense(3, name="head")(h))
    fc0, bn0 = model.get_layer("fc0"), model.get_layer("bn0")
    k = rng.normal(size=(5, 6))
    k[:, 1] = k[:, 0]
    b = rng.normal(size=6)
    b[1] = b[0]
    fc0.kernel.assign(k.astype("float32"))
    fc0.bias.assign(b.astype("float32"))
    for attr, values in (("gamma", rng.uniform(0.5, 1.5, 6)), ("beta", rng.normal(0.2, 0.3, 6)),
                         ("moving_mean", rng.normal(0, 0.5, 6)),
                         ("moving_variance", rng.uniform(2.0, 6.0, 6))):
        values[1] = values[0]
        getattr(bn0, attr).assign(values.astype("float32"))
    return model


def test_a_merged_parent_keeps_the_statistics_its_merge_wrote():
    """A merge of two identical neurons is exact; the BN statistics it writes for the
    parent are not its input's (they make the BN compute the parent exactly). Given
    the trajectory, `correct_statistics` keeps them and the model computes what it
    computed before; without it the parent is moved by the change from the channel
    whose slot it took, and the output changes. `Encoder(correction=True)` keeps
    them too."""
    x = np.random.default_rng(1).normal(size=(256, 5)).astype("float32")
    y0 = _duplicate_pair_model().predict(x, verbose=0)
    outputs = {}
    for how in ("trajectory", "none", "encoder"):
        model = _duplicate_pair_model()
        analysis = hope_keras.analyze(model)
        result = hope_keras.Encoder(model, analysis=analysis, actions=("merge",),
                                    correction=True if how == "encoder" else False,
                                    verbose=False).compress(steps=1)
        (step,) = result.trajectory.steps
        assert (step.kind, step.unit, {step.i, step.j}) == ("merge", "fc0", {0, 1})
        if how != "encoder":
            np.testing.assert_allclose(model.predict(x, verbose=0), y0, rtol=1e-4, atol=1e-4)
            hope_keras.correct_statistics(
                model, analysis, trajectory=result.trajectory if how == "trajectory" else None)
        outputs[how] = model.predict(x, verbose=0)
    np.testing.assert_allclose(outputs["trajectory"], y0, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(outputs["encoder"], y0, rtol=1e-4, atol=1e-4)
    assert np.max(np.abs(outputs["none"] - y0)) > 1e-2


def test_correct_statistics_refuses_a_trajectory_of_another_model():
    model = _duplicate_pair_model()
    analysis = hope_keras.analyze(model)
    inputs = keras.Input((5,))
    h = L.ReLU()(L.BatchNormalization()(L.Dense(6, name="other_fc")(inputs)))
    other = keras.Model(inputs, L.Dense(3)(h))
    result = hope_keras.Encoder(other, actions=("merge",), correction=False,
                                verbose=False).compress(steps=1)
    assert result.trajectory.steps[0].unit == "other_fc"
    with pytest.raises(ValueError, match="trajectory merges groups the analysis does not have"):
        hope_keras.correct_statistics(model, analysis, trajectory=result.trajectory)
