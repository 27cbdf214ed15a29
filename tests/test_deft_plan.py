"""DEFT planning: τ_lock edge cases (eq. 26), vessels from duplicated neurons,
elasticities, masks (eq. 28), save/load and apply."""

import math

import keras
import numpy as np
import pytest

from conftest import copy_model, mlp, outputs_equal, plant_duplicate, small_resnet
from hope_keras import deft
from hope_keras.deft.plan import DeftPlan


# ------------------------------------------------------------------ eq. 25–26
def test_lock_threshold_uses_the_percentile_when_it_is_at_least_eps():
    tau, tau_p, tau_sup, n = deft.lock_threshold([1.0, 2.0, 3.0, 4.0, 5.0], [1.0] * 5, 50)
    assert (tau, tau_p, tau_sup, n) == (3.0, 3.0, 5.0, 5)


def test_lock_threshold_drops_costs_whose_remaining_capacity_is_below_eps():
    # The 100.0 cost has C_rem = 1e-9 < ε: an extinction artifact, not in C.
    tau, _, tau_sup, n = deft.lock_threshold([1.0, 2.0, 100.0], [1.0, 1.0, 1e-9], 100,
                                             eps=1e-6)
    assert (tau, tau_sup, n) == (2.0, 2.0, 2)


def test_lock_threshold_falls_back_to_the_supremum():
    # τ_p = percentile 10 of {0, 0, 0, 0.5} = 0 < ε, τ_sup = 0.5 ≥ ε.
    tau, tau_p, tau_sup, _ = deft.lock_threshold([0.0, 0.0, 0.0, 0.5], [1.0] * 4, 10)
    assert tau_p < 1e-6 and tau == tau_sup == 0.5


def test_lock_threshold_falls_back_to_one():
    tau, tau_p, tau_sup, _ = deft.lock_threshold([0.0, 1e-9], [1.0, 1.0], 50)
    assert tau == 1.0 and tau_sup < 1e-6
    # Empty C (every remainder below ε, or nothing pruned) also gives 1.
    tau, tau_p, tau_sup, n = deft.lock_threshold([3.0], [0.0], 50)
    assert tau == 1.0 and n == 0 and math.isnan(tau_p) and math.isnan(tau_sup)
    assert deft.lock_threshold([], [], 50)[0] == 1.0


def test_lock_threshold_rejects_bad_arguments():
    with pytest.raises(ValueError, match="percentile=120"):
        deft.lock_threshold([1.0], [1.0], 120)
    with pytest.raises(ValueError, match="differ in size"):
        deft.lock_threshold([1.0, 2.0], [1.0], 50)


# ------------------------------------------------------------------- the plan
def _elastic_by_rule(p):
    for g, e in p.elasticity.items():
        rule = (p.j_prune[g] < p.tau_groups[g]).astype(np.float32)
        rule[p.vessels[g]] = 1.0
        np.testing.assert_array_equal(e, rule)


def test_plan_on_duplicated_neurons_frees_vessels():
    model = mlp((12, 10), seed=3)
    plant_duplicate(model, "fc0", "fc1", src=1, dst=5, noise=0.0)
    before = copy_model(model)
    p = deft.plan(model, percentile=30)
    merged = [s for s in p.merges if s.unit == "fc0"]
    assert merged and {merged[0].i, merged[0].j} == {1, 5}
    vessel = merged[0].j
    assert vessel in p.vessels["fc0"] and p.elasticity["fc0"][vessel] == 1.0
    assert not np.isfinite(p.j_prune["fc0"][vessel])  # never pruned: only the vessel rule
    _elastic_by_rule(p)
    # Merging exact duplicates (sum scale) keeps the function; the vessel is freed.
    p.apply(model, mask=False, reinit_vessels=False)
    x = np.random.default_rng(0).normal(size=(16, 6)).astype("float32")
    assert outputs_equal(model, before, x, rtol=1e-4, atol=1e-5)
    assert np.all(model.get_layer("fc1").kernel.numpy()[vessel] == 0)


def test_vessels_are_reinitialised_with_zero_output_rows():
    model = mlp((12, 10), seed=3)
    plant_duplicate(model, "fc0", "fc1", src=1, dst=5, noise=0.0)
    p = deft.plan(model, percentile=30)
    p.apply(model)
    for j in p.vessels["fc0"]:
        assert np.any(model.get_layer("fc0").kernel.numpy()[:, j] != 0)
        assert model.get_layer("fc0_bn").gamma.numpy()[j] == 1.0
        assert np.all(model.get_layer("fc1").kernel.numpy()[j] == 0)


def test_plan_counts_masks_and_summary():
    model = small_resnet()
    p = deft.plan(model, percentile=50)
    _elastic_by_rule(p)
    assert p.head == "head" and p.feature_layer == "fc_relu"
    for g, (core, slack, ves) in p.counts().items():
        assert core + slack + ves == p.groups[g] and core >= 1  # the last neuron is core
    lines = []
    p.summary(print_fn=lines.append)
    assert "τ_lock" in lines[0] and "c2" in lines[0]
    # Pinned layers (stem, residual branch end) are core; the head is elastic.
    emap = p.elasticity_map()
    assert emap["stem"] == 0.0 and emap["b1b"] == 0.0 and emap["head"] == 1.0
    p.apply(model)
    # eq. 28: every weight from a drifting input to a core output is zero.
    for name, drift in p.input_drift.items():
        k = model.get_layer(name).kernel.numpy()
        e_out = np.broadcast_to(np.asarray(p.layer_elasticity[name]), (k.shape[-1],))
        cut = k[..., drift > 0, :][..., e_out == 0]
        assert np.all(cut == 0), name
    # Flatten → Dense: row r reads channel r % C of c2's output.
    c = p.groups["c2"]
    np.testing.assert_array_equal(p.input_drift["fc"],
                                  np.tile(p.elasticity["c2"], len(p.input_drift["fc"]) // c))


def test_plan_save_load_roundtrip_and_apply_once(tmp_path):
    model = small_resnet(seed=1)
    twin = copy_model(model)
    p = deft.plan(model, percentile=40)
    p.save(tmp_path / "plan.npz")
    q = DeftPlan.load(tmp_path / "plan.npz")
    assert (q.tau_lock, q.percentile, q.head, q.groups) == (p.tau_lock, p.percentile,
                                                           p.head, p.groups)
    for g in p.groups:
        np.testing.assert_array_equal(q.elasticity[g], p.elasticity[g])
        np.testing.assert_array_equal(q.j_prune[g], p.j_prune[g])
    assert q.merges == p.merges and q.elasticity_map() == p.elasticity_map()
    p.apply(model)
    q.apply(twin)
    for a, b in zip(model.get_weights(), twin.get_weights()):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="already applied"):
        p.apply(model)
    with pytest.raises(ValueError, match="not a readable DEFT plan"):
        (tmp_path / "bad.npz").write_text("nope")
        DeftPlan.load(tmp_path / "bad.npz")


def _rewrite(src, dst, meta_edit=None, drop=(), arrays=None):
    """A copy of saved plan `src` at `dst`, its metadata or arrays altered."""
    import json

    with np.load(src, allow_pickle=False) as data:
        out = {k: data[k] for k in data.files if k not in drop}
    meta = json.loads(str(out["meta"]))
    if meta_edit:
        meta_edit(meta)
    out["meta"] = np.array(json.dumps(meta))
    out.update(arrays or {})
    with open(dst, "wb") as f:
        np.savez(f, **out)
    return dst


@pytest.mark.parametrize("how, message", [
    ("drop j_0", "missing entry 'j_0'"),
    ("drop head", "missing entry 'head'"),
    ("short e_0", "elasticity of group .* has shape \\(3,\\)"),
    ("elasticity 2", "elasticities of group .* not all in \\[0, 1\\]"),
    ("vessel 999", "vessels of group .* out of range: \\[999\\]"),
    ("vessel 1.5", "vessel of .* not a whole number: 1.5"),
    ("vessel of no group", "vessels name group 'nope'"),
    ("merge out of range", "merge 0 .* not a merge of two neurons"),
])
def test_a_corrupt_plan_file_is_refused_naming_the_file(tmp_path, how, message):
    """`DeftPlan.load` names the file and what is wrong with it; a plan altered in
    memory is refused by `apply` before it edits anything."""
    model = mlp((12, 10), seed=3)
    plant_duplicate(model, "fc0", "fc1", src=1, dst=5, noise=0.0)
    p = deft.plan(model, percentile=30)
    assert p.merges, "the fixture's plan merges"
    src = tmp_path / "plan.npz"
    p.save(src)
    g0 = next(iter(p.groups))

    def vessel(value, group=g0):
        return lambda meta: meta["vessels"].__setitem__(group, [value])

    def merge_out(meta):
        meta["merges"][0]["i"] = 10 ** 6

    edits = {
        "drop j_0": dict(drop=("j_0",)),
        "drop head": dict(meta_edit=lambda meta: meta.pop("head")),
        "short e_0": dict(arrays={"e_0": np.ones(3)}),
        "elasticity 2": dict(arrays={"e_0": np.full(p.groups[g0], 2.0)}),
        "vessel 999": dict(meta_edit=vessel(999)),
        "vessel 1.5": dict(meta_edit=vessel(1.5)),
        "vessel of no group": dict(meta_edit=vessel(0, "nope")),
        "merge out of range": dict(meta_edit=merge_out),
    }
    bad = _rewrite(src, tmp_path / "bad.npz", **edits[how])
    with pytest.raises(ValueError, match=f"bad.npz.*{message}"):
        DeftPlan.load(bad)


def test_apply_checks_the_plan_before_editing():
    model = small_resnet(seed=1)
    p = deft.plan(model, percentile=40)
    g0 = next(iter(p.groups))
    p.vessels[g0] = [999]
    before = [w.copy() for w in model.get_weights()]
    with pytest.raises(ValueError, match="out of range: \\[999\\]"):
        p.apply(model)
    for a, b in zip(before, model.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_plan_rejects_a_non_dense_head():
    inputs = keras.Input((6,))
    x = keras.layers.ReLU()(keras.layers.BatchNormalization()(
        keras.layers.Dense(4, name="fc")(inputs)))
    model = keras.Model(inputs, keras.layers.Dense(2, name="head")(x))
    with pytest.raises(ValueError, match="no layer named 'nope'"):
        deft.plan(model, head="nope")
    with pytest.raises(ValueError, match="pinned_elasticity"):
        deft.plan(model, pinned_elasticity=0.5)


# ------------------------------------------------------ shock reduction (compensate)
def _bias_choice_mlp(use_bias, seed=0):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((6,))
    x = inputs
    for k, w in enumerate((12, 10)):
        x = keras.layers.Dense(w, use_bias=use_bias, name=f"fc{k}")(x)
        x = keras.layers.ReLU()(keras.layers.BatchNormalization(name=f"fc{k}_bn")(x))
    model = keras.Model(inputs, keras.layers.Dense(3, name="head")(x))
    rng = np.random.default_rng(seed)
    for layer in model.layers:
        if isinstance(layer, keras.layers.BatchNormalization):
            n = layer.gamma.shape[0]
            layer.gamma.assign(rng.uniform(0.5, 1.5, n))
            layer.beta.assign(rng.normal(0.0, 0.5, n))
            layer.moving_mean.assign(rng.normal(0.0, 0.3, n))
            layer.moving_variance.assign(rng.uniform(0.5, 2.0, n))
    return model


@pytest.mark.parametrize("use_bias", [True, False])
def test_mean_compensation_is_exact_when_the_cut_signal_is_constant(use_bias):
    # Slack neurons with γ = 0 output the constant ReLU(β): replacing their cut
    # weights by weight × mean (into the core bias, or the core BN's moving mean when
    # there is no bias) must leave every output unchanged, the grafted head included.
    model = _bias_choice_mlp(use_bias)
    p = deft.plan(model, percentile=40)
    assert p.options["compensate"] == "mean_var"  # the default
    assert p.options["threshold"] == "layer"
    for g in p.groups:
        bn = model.get_layer(p.options["bn_of"][g])
        gamma = bn.gamma.numpy()
        gamma[p.elasticity[g] > 0] = 0.0
        bn.gamma.assign(gamma)
    assert p.mask("fc1", model.get_layer("fc1").kernel.shape) is not None
    x = np.random.default_rng(1).normal(size=(64, 6)).astype("float32")
    want = np.asarray(model(x))
    errors = {}
    for comp in ("none", "mean"):
        m = copy_model(model)
        deft.apply_plan(m, p, merges=False, check=False, compensate=comp)
        graft = deft.SourceRetention(m, plan=p, compensate=comp).logits(m, x)
        errors[comp] = (np.abs(np.asarray(m(x)) - want).max(), np.abs(graft - want).max())
    assert min(errors["none"]) > 1e-2, errors
    assert max(errors["mean"]) < 1e-5, errors


def test_mean_var_compensation_against_an_explicit_loop():
    model = small_resnet(seed=3)
    p = deft.plan(model, percentile=50, compensate="mean_var")
    m = copy_model(model)
    p.apply(m)
    from hope_keras.scoring import moments
    from hope_keras.graph.walker import walk

    # Reference: the merged (unmasked) model's surrogate moments, explicit loops.
    ref = copy_model(model)
    p.apply(ref, mask=False)
    fg = walk(ref).flat
    table = moments.propagate(fg)
    checked = 0
    for name in p.input_drift:
        layer = ref.get_layer(name)
        mask = p.mask(name, layer.kernel.shape)
        if mask is None or name == p.head:
            continue
        k = layer.kernel.numpy().astype(np.float64)
        k = k.reshape(-1, k.shape[-2], k.shape[-1])
        mean, var = table[fg.node_of(name).inputs[0]]
        cut = mask.reshape(k.shape[1:]) == 0
        bn = [c for c in fg.children(fg.node_of(name))][0].op
        for b in range(k.shape[2]):
            shift = lost = total = 0.0
            for a in range(k.shape[1]):
                for s in range(k.shape[0]):
                    total += k[s, a, b] ** 2 * var[a]
                    if cut[a, b]:
                        shift += k[s, a, b] * mean[a]
                        lost += k[s, a, b] ** 2 * var[a]
            new_bias = m.get_layer(name).bias.numpy()[b]
            np.testing.assert_allclose(new_bias, layer.bias.numpy()[b] + shift,
                                       rtol=1e-5, atol=1e-6)
            kept = max(1.0 - lost / total, 1e-2) if total > 0 else 1.0
            np.testing.assert_allclose(m.get_layer(bn.name).moving_variance.numpy()[b],
                                       bn.moving_variance.numpy()[b] * kept, rtol=1e-5)
            checked += int(cut[:, b].any())
    assert checked > 0


def test_per_layer_threshold_and_summary(tmp_path):
    model = small_resnet(seed=2)
    p = deft.plan(model, percentile=40, threshold="layer", compensate="none")
    for g in p.groups:
        tau = deft.lock_threshold(p.j_prune[g], p.c_rem[g], 40)[1]
        assert p.tau_groups[g] == (tau if tau >= 1e-6 else 1e-6)
        rule = (p.j_prune[g] < tau).astype(np.float32)
        rule[p.vessels[g]] = 1.0
        np.testing.assert_array_equal(p.elasticity[g], rule)
        assert p.counts()[g][0] >= 1
    lines = []
    p.summary(print_fn=lines.append)
    assert "threshold layer" in lines[0] and "inputs from slack" in lines[0]
    p.save(tmp_path / "p.npz")
    q = DeftPlan.load(tmp_path / "p.npz")
    assert q.tau_groups == p.tau_groups and q.options["compensate"] == "none"
    with pytest.raises(ValueError, match="threshold='per-layer'"):
        deft.plan(model, threshold="per-layer")
    with pytest.raises(ValueError, match="compensate='median'"):
        deft.plan(model, compensate="median")


def _errors_by_compensation(model, p, measure, compensations):
    """Per compensation, ``|measure(applied copy) − measure(model)|``."""
    want = measure(model)
    err = {}
    for comp in compensations:
        m = copy_model(model)
        deft.apply_plan(m, p, merges=False, check=False, compensate=comp)
        err[comp] = np.abs(measure(m) - want)
    return err


@pytest.mark.parametrize("use_bias", [True, False])
def test_mean_compensation_keeps_the_core_mean_against_monte_carlo(use_bias):
    # Inputs N(0, I) and fc0_bn's moving statistics set to fc0's exact output moments
    # make the BN surrogate exact for fc0's group: its ReLU outputs have exactly the
    # surrogate's E[x]. The masked fc1 (slack fc0 neurons → core fc1 neurons cut) must
    # then keep the data mean of every fc1_bn output with compensate="mean", and lose
    # it with "none" (Monte Carlo over 200k inputs).
    model = _bias_choice_mlp(use_bias, seed=4)
    for layer in model.layers:
        if isinstance(layer, keras.layers.BatchNormalization):
            layer.epsilon = 1e-7
    fc0, bn0 = model.get_layer("fc0"), model.get_layer("fc0_bn")
    w0 = fc0.kernel.numpy().astype(np.float64)
    bn0.moving_mean.assign(fc0.bias.numpy() if use_bias else np.zeros(w0.shape[1]))
    bn0.moving_variance.assign((w0 ** 2).sum(0))
    p = deft.plan(model, percentile=40)
    mask = p.mask("fc1", model.get_layer("fc1").kernel.shape)
    assert mask is not None and (mask == 0).any()
    x = np.random.default_rng(7).normal(size=(200_000, 6)).astype("float32")

    def fc1_bn_mean(m):
        probe = keras.Model(m.inputs, m.get_layer("fc1_bn").output)
        return np.asarray(probe.predict(x, batch_size=20_000, verbose=0),
                          dtype=np.float64).mean(0)

    err = _errors_by_compensation(model, p, fc1_bn_mean, ("none", "mean"))
    cut_cols = (mask == 0).any(0)
    assert err["none"][cut_cols].max() > 0.1, err
    assert err["mean"].max() < 5e-3, err


def test_mean_compensation_counts_a_transposed_convolution_by_its_taps():
    # A strided transposed convolution reads its drifting inputs at 9 / 4 taps per
    # output position on average (3 × 3 kernel, stride 2): the cut signal's mean over
    # positions is that share of its kernel-summed mean. c0's BN statistics are its
    # exact output moments on N(0, I) inputs (the surrogate exact); "mean" must keep
    # each core output's mean over positions up to the borders (a few %), where
    # counting every tap would leave three times the cut mean (Monte Carlo).
    keras.utils.set_random_seed(3)
    L = keras.layers
    inputs = keras.Input((24, 24, 4))
    x = L.Conv2D(6, 1, name="c0")(inputs)
    x = L.ReLU()(L.BatchNormalization(epsilon=1e-7, name="c0_bn")(x))
    x = L.Conv2DTranspose(6, 3, strides=2, padding="same", name="up")(x)
    x = L.ReLU()(L.BatchNormalization(name="up_bn")(x))
    model = keras.Model(inputs, L.Dense(3, name="head")(L.GlobalAveragePooling2D()(x)))
    c0, bn0 = model.get_layer("c0"), model.get_layer("c0_bn")
    rng = np.random.default_rng(5)
    bn0.gamma.assign(rng.uniform(0.5, 1.5, 6))
    bn0.beta.assign(rng.normal(0.0, 0.5, 6))
    bn0.moving_mean.assign(c0.bias.numpy())
    bn0.moving_variance.assign((c0.kernel.numpy().astype(np.float64)[0, 0] ** 2).sum(0))
    p = deft.plan(model, percentile=40, threshold="layer")
    up = model.get_layer("up")
    mask = p.mask("up", up.kernel.shape, out_axis=-2)  # (1, 1, outputs, inputs)
    assert mask is not None and (mask == 0).any()
    cut_rows = (mask[0, 0] == 0).any(1)
    data = rng.normal(size=(400, 24, 24, 4)).astype("float32")

    def up_mean(m):
        out = keras.Model(m.inputs, m.get_layer("up").output).predict(
            data, batch_size=100, verbose=0)
        return np.asarray(out, dtype=np.float64).mean((0, 1, 2))

    err = _errors_by_compensation(model, p, up_mean, ("none", "mean"))
    assert err["none"][cut_rows].min() > 0.01, err
    assert np.all(err["mean"][cut_rows] < 0.1 * err["none"][cut_rows]), err
    assert err["mean"][~cut_rows].max() < 1e-5, err


def test_mean_var_compensation_keeps_the_core_variance_against_monte_carlo():
    # fc0 diagonal on N(0, I) inputs: fc0's ReLU outputs are independent with exactly
    # the surrogate's moments, so the variance a cut removes from an fc1 neuron is
    # exactly Σ_cut W² Var[x]. fc1_bn's moving statistics are set to fc1's data
    # moments; "mean_var" must then keep every fc1_bn output's data mean and standard
    # deviation, "mean" the mean only.
    keras.utils.set_random_seed(0)
    inputs = keras.Input((12,))
    x = keras.layers.Dense(12, name="fc0")(inputs)
    x = keras.layers.ReLU()(keras.layers.BatchNormalization(epsilon=1e-7,
                                                            name="fc0_bn")(x))
    x = keras.layers.Dense(10, name="fc1")(x)
    x = keras.layers.ReLU()(keras.layers.BatchNormalization(epsilon=1e-7,
                                                            name="fc1_bn")(x))
    model = keras.Model(inputs, keras.layers.Dense(3, name="head")(x))
    rng = np.random.default_rng(2)
    fc0 = model.get_layer("fc0")
    d = rng.uniform(0.5, 2.0, 12)
    fc0.kernel.assign(np.diag(d))
    bn0 = model.get_layer("fc0_bn")
    bn0.gamma.assign(rng.uniform(0.5, 1.5, 12))
    bn0.beta.assign(rng.normal(0.0, 0.5, 12))
    bn0.moving_mean.assign(fc0.bias.numpy())
    bn0.moving_variance.assign(d ** 2)
    data = rng.normal(size=(200_000, 12)).astype("float32")

    def probe(m, name):
        out = keras.Model(m.inputs, m.get_layer(name).output).predict(
            data, batch_size=20_000, verbose=0)
        return np.asarray(out, dtype=np.float64)

    z = probe(model, "fc1")
    bn1 = model.get_layer("fc1_bn")
    bn1.moving_mean.assign(z.mean(0))
    bn1.moving_variance.assign(z.var(0))
    p = deft.plan(model, percentile=40)
    mask = p.mask("fc1", model.get_layer("fc1").kernel.shape)
    assert mask is not None and (mask == 0).any()
    cut_cols = (mask == 0).any(0)
    want = probe(model, "fc1_bn")
    stats = {}
    for comp in ("mean", "mean_var"):
        m = copy_model(model)
        deft.apply_plan(m, p, merges=False, check=False, compensate=comp)
        got = probe(m, "fc1_bn")
        stats[comp] = (np.abs(got.mean(0) - want.mean(0)).max(),
                       np.abs(got.std(0) / want.std(0) - 1.0))
    assert stats["mean"][0] < 5e-3 and stats["mean_var"][0] < 5e-3, stats
    assert stats["mean"][1][cut_cols].max() > 0.05, stats
    assert stats["mean_var"][1].max() < 1e-2, stats  # "mean" alone: 0.06 to 0.26


def test_layer_threshold_makes_only_dead_neurons_slack_when_most_are_dead():
    # Eq. 26 per group would fall back to τ_sup (all but the costliest slack); the
    # per-layer rule keeps ε, so exactly the zero-cost neurons become slack.
    from hope_keras.deft.plan import layer_threshold

    j = np.array([0.0, 0.0, 0.0, 0.3, 0.5, 0.9])
    assert deft.lock_threshold(j, np.ones(6), 40)[0] == 0.9
    tau = layer_threshold(j, np.ones(6), 40)
    assert tau == 1e-6 and int(np.count_nonzero(j < tau)) == 3
    assert layer_threshold(j, np.ones(6), 80) == pytest.approx(0.5)
    assert layer_threshold([1.0], [0.0], 50) == 1e-6  # no measurable cost


@pytest.mark.parametrize("cost", ["paper", "hope"])
def test_plan_covers_exactly_the_groups_its_cost_prices(cost):
    from hope_keras.scoring import costs
    from hope_keras.graph.walker import walk

    model = small_resnet(seed=1)
    p = deft.plan(model, percentile=20, cost=cost)
    scope = costs.get(cost).groups
    want = {k for k, g in walk(model).groups.items() if costs.in_scope(scope, g)}
    assert set(p.groups) == want and want


def _relu6_cnn(seed=0):
    keras.utils.set_random_seed(seed)
    L = keras.layers
    inputs = keras.Input((8, 8, 3))
    x = L.ReLU(6.0)(L.BatchNormalization()(L.Conv2D(8, 3, padding="same")(inputs)))
    x = L.ReLU(6.0)(L.BatchNormalization()(L.Conv2D(8, 3, padding="same")(x)))
    return keras.Model(inputs, L.Dense(3, name="head")(L.GlobalAveragePooling2D()(x)))


def test_the_default_cost_is_the_papers_where_a_neuron_layer_exists_else_the_width_free_one():
    """ReLU6 groups are not the paper's neuron layers: with ``cost="paper"`` the plan
    has nothing to price; ``"auto"`` (the default) then plans with the width-free
    cost, and keeps the paper's wherever the model has a neuron layer."""
    model = _relu6_cnn()
    with pytest.raises(ValueError, match="no neuron group the cost 'paper' can price"):
        deft.plan(model, cost="paper", verbose=False)
    auto = deft.plan(model, percentile=30, verbose=False)
    hope = deft.plan(model, percentile=30, cost="hope", verbose=False)
    assert auto.options["cost"] == hope.options["cost"] != {}
    assert auto.groups == hope.groups and len(auto.groups) == 2
    for g in auto.groups:
        np.testing.assert_array_equal(auto.elasticity[g], hope.elasticity[g])
    resnet = small_resnet(seed=1)
    assert deft.plan(resnet, percentile=20, verbose=False).options["cost"] == \
        deft.plan(resnet, percentile=20, cost="paper", verbose=False).options["cost"]


def test_a_convolution_head_is_refused_with_what_to_do_instead():
    """MobileNetV3's top: a 1 × 1 Conv2D on pooled features, then Flatten."""
    L = keras.layers
    inputs = keras.Input((8, 8, 3))
    x = L.ReLU()(L.BatchNormalization()(L.Conv2D(8, 3)(inputs)))
    x = L.Conv2D(4, 1, name="logits")(L.GlobalAveragePooling2D(keepdims=True)(x))
    model = keras.Model(inputs, L.Activation("softmax")(L.Flatten()(x)))
    with pytest.raises(ValueError, match=r"'logits' is a Conv2D, not a Dense layer.*"
                                         r"include_top=False"):
        deft.plan(model, verbose=False)


def test_a_batch_norm_on_axis_3_is_on_the_channel_axis_for_the_plan():
    """keras.applications' ResNets write ``BatchNormalization(axis=3)``: its slack
    channels are elastic and drift alone, as with ``axis=-1``."""
    def build(axis):
        keras.utils.set_random_seed(0)
        L = keras.layers
        inputs = keras.Input((8, 8, 3))
        x = L.ReLU()(L.BatchNormalization(axis=axis, name="bn1")(L.Conv2D(8, 3, name="c1")(inputs)))
        x = L.ReLU()(L.BatchNormalization(axis=axis, name="bn2")(L.Conv2D(8, 3, name="c2")(x)))
        return keras.Model(inputs, L.Dense(3, name="head")(L.GlobalAveragePooling2D()(x)))

    plans = [deft.plan(build(axis), percentile=40, cost="hope", actions=("prune",),
                       verbose=False) for axis in (-1, 3)]
    for p in plans:
        e = np.asarray(p.layer_elasticity["bn2"])
        assert e.shape == (8,) and 0 < e.sum() < 8
        np.testing.assert_array_equal(p.head_input_drift > 0, e > 0)
    assert plans[0].elasticity_map() == plans[1].elasticity_map()


class _Subclassed(keras.Model):
    """A subclassed model without ``get_config``: Keras cannot clone it."""

    def __init__(self, units, **kwargs):
        super().__init__(**kwargs)
        L = keras.layers
        self.fc = L.Dense(16, name="fc")
        self.bn = L.BatchNormalization(name="fc_bn")
        self.head = L.Dense(units, name="head")

    def call(self, x):
        return self.head(keras.ops.relu(self.bn(self.fc(x))))


def test_a_model_keras_cannot_clone_is_planned_in_place_and_put_back(monkeypatch):
    """`plan` runs the encoder on a clone; a subclassed model cannot be cloned, so it
    runs on the model and puts its weights back, after a Ctrl-C too."""
    keras.utils.set_random_seed(0)
    model = _Subclassed(3, name="sub")
    model(np.zeros((1, 6), "float32"))
    rng = np.random.default_rng(0)
    bn = model.bn
    bn.moving_mean.assign(rng.normal(0, 0.5, 16).astype("float32"))
    bn.moving_variance.assign(rng.uniform(0.5, 2.0, 16).astype("float32"))
    with pytest.raises(NotImplementedError):
        keras.models.clone_model(model)
    weights = [w.copy() for w in model.get_weights()]
    p = deft.plan(model, percentile=40, verbose=False)
    assert p.counts() and len(p.trajectory) > 0
    assert all(np.array_equal(a, b) for a, b in zip(model.get_weights(), weights))
    from hope_keras.search.encoder import Encoder

    run = Encoder.run

    def interrupted(self, *args, **kwargs):
        run(self, steps=3)
        assert not all(np.array_equal(a, b) for a, b in zip(model.get_weights(), weights))
        raise KeyboardInterrupt

    monkeypatch.setattr(Encoder, "run", interrupted)
    with pytest.raises(KeyboardInterrupt):
        deft.plan(model, percentile=40, verbose=False)
    assert all(np.array_equal(a, b) for a, b in zip(model.get_weights(), weights))
