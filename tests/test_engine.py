"""The greedy engine: function-preserving edits, brute-force first action, budgets,
interruptions and bad input."""

import dataclasses
import itertools
import math

import keras
import numpy as np
import pytest
from scipy.stats import norm

import hope_keras
from conftest import L, copy_model, mlp, outputs_equal, randomize_bn, small_resnet
from hope_keras.search.encoder import Action, Encoder


def _x(model, n=6, seed=0):
    shape = (n,) + tuple(model.inputs[0].shape[1:])
    return np.random.default_rng(seed).normal(size=shape).astype("float32")


def _set(layer, attr, fn):
    var = getattr(layer, attr)
    var.assign(fn(var.numpy()).astype("float32"))


def test_pruning_a_dead_neuron_leaves_outputs_unchanged():
    model = mlp((6, 5))
    bn = model.get_layer("fc0_bn")
    _set(bn, "gamma", lambda g: np.where(np.arange(6) == 2, 0.0, g))
    _set(bn, "beta", lambda b: np.where(np.arange(6) == 2, 0.0, b))
    before = copy_model(model)
    enc = Encoder(model, actions=("prune",))
    # `slim` would drop it (γ = β = 0): the run counts it as removed from the start.
    assert not enc.groups["fc0"].active[2] and enc.active == enc.num_neurons - 1
    assert enc.best_group_action("fc0").i != 2
    with enc.editor.step():
        enc.editor.prune("fc0", 2)
    enc.editor.commit()
    assert outputs_equal(model, before, _x(model))
    assert np.all(model.get_layer("fc1").kernel.numpy()[2] == 0)


def _duplicate_neuron(model, group, src, dst, consumer, out_scale=1.0):
    p, bn, nxt = (model.get_layer(n) for n in (group, group + "_bn", consumer))
    _set(p, "kernel", lambda w: np.concatenate([w[..., :dst], w[..., src:src + 1],
                                                w[..., dst + 1:]], axis=-1))
    for attr in ("gamma", "beta", "moving_mean", "moving_variance"):
        _set(bn, attr, lambda a: np.where(np.arange(a.size) == dst, a[src], a))


@pytest.mark.parametrize("out_scale", [1.0, -0.4])
def test_merging_duplicated_neurons_with_sum_scale_leaves_outputs_unchanged(out_scale):
    model = mlp((6, 5), seed=2)
    _duplicate_neuron(model, "fc0", 1, 4, "fc1")
    # Different output slices: only the input side is duplicated.
    nxt = model.get_layer("fc1")
    _set(nxt, "kernel", lambda w: np.where((np.arange(6) == 4)[:, None], out_scale * w[1] + 0.3,
                                           w))
    before = copy_model(model)
    enc = Encoder(model, cost=hope_keras.costs.HopeCost(merge_scale="sum"), actions=("merge",))
    gs = enc.groups["fc0"]
    cap = gs.cache.capacity
    J = hope_keras.costs.j_merge(cap[1] ** 2 + cap[4] ** 2, gs.cache.B[1, 4],
                                 gs.C - cap[1] - cap[4], 1)
    enc.execute(Action("merge", "fc0", 1, 4, float(J), 0.0, 1.0, 1))
    enc.editor.commit()
    assert outputs_equal(model, before, _x(model), rtol=1e-5, atol=1e-5)
    assert np.all(model.get_layer("fc0").kernel.numpy()[:, 4] == 0)


def test_identical_neurons_are_the_first_merge_and_cost_zero():
    model = mlp((6,), seed=3)
    _duplicate_neuron(model, "fc0", 0, 3, "head")
    _set(model.get_layer("head"), "kernel", lambda w: np.where((np.arange(6) == 3)[:, None],
                                                              w[0], w))
    before = copy_model(model)
    result = hope_keras.compress(model, steps=1, actions=("merge",), verbose=False)
    (step,) = result.trajectory.steps
    assert (step.kind, step.i, step.j) == ("merge", 0, 3)
    assert step.J == pytest.approx(0.0, abs=1e-6)
    assert outputs_equal(model, before, _x(model))


def test_evicting_a_zero_branch_leaves_outputs_unchanged():
    model = small_resnet()
    bn = model.get_layer("b1b_bn")
    _set(bn, "gamma", np.zeros_like)
    _set(bn, "beta", np.zeros_like)
    before = copy_model(model)
    enc = Encoder(model, actions=("evict",))
    action = enc.eviction_action("b1_add")
    assert action.J == 0.0  # a zero branch costs nothing to evict
    enc.execute(action)
    enc.editor.commit()
    assert outputs_equal(model, before, _x(model))
    assert enc.active == enc.num_neurons - 6


# ----------------------------------------------------------------- brute force
def _self_k(g, b):
    g = abs(g)
    if g == 0:
        return max(b, 0.0) ** 2
    t = b / g
    return (g * g + b * b) * norm.cdf(t) + b * g * norm.pdf(t)


def _cross_k(rho, kii, kjj):
    rho = np.clip(rho, -1, 1)
    return (np.sqrt(1 - rho * rho) + (np.pi - np.arccos(rho)) * rho) / np.pi * np.sqrt(kii * kjj)


def _brute_force_first_action(model, groups, blocks):
    """Every admissible action's DR, from the spec's formulas, read off raw weights."""
    cands = []
    info = {}
    for name, consumer in groups.items():
        p, bn, nxt = (model.get_layer(n) for n in (name, name + "_bn", consumer))
        W, c = p.kernel.numpy().astype(float).T, p.bias.numpy().astype(float)
        g, b = bn.gamma.numpy().astype(float), bn.beta.numpy().astype(float)
        mu, var = bn.moving_mean.numpy().astype(float), bn.moving_variance.numpy().astype(float)
        s = np.sqrt(var + bn.epsilon)
        Weff = (g / s)[:, None] * W
        beff = b - g * (mu - c) / s
        V = np.hstack([Weff, beff[:, None]])
        U = nxt.kernel.numpy().astype(float)
        n = len(g)
        K = np.array([_self_k(g[i], b[i]) for i in range(n)])
        cap = np.linalg.norm(U, axis=1) * np.sqrt(K)
        C = cap.sum()
        P = np.count_nonzero(W, axis=1) + 1 + np.count_nonzero(U, axis=1) + 4
        info[name] = (n, C)
        for i in range(n):
            J = n * cap[i] / (C - cap[i])
            cands.append((J / P[i], "prune", name, i, -1, J))
        for i, j in itertools.combinations(range(n), 2):
            wi, wj = np.linalg.norm(Weff[i]), np.linalg.norm(Weff[j])
            re = np.clip(Weff[i] @ Weff[j] / wi / wj, -1 + 1e-12, 1 - 1e-12)
            kap = re / (1 - re * re) * abs(g[i]) / wi * abs(g[j]) / wj
            rt = 2 * kap / (1 + np.sqrt(1 + 4 * kap * kap))
            M = np.outer(U[i], V[i]) + np.outer(U[j], V[j])
            direction = np.linalg.svd(M)[2][0]
            lam = np.linalg.lstsq(V[[i, j]].T, direction, rcond=None)[0]
            best_B = -1
            for sign in (1, -1):
                l1, l2 = sign * lam
                mean = l1 * b[i] + l2 * b[j]
                cij = abs(g[i] * g[j]) * rt
                sd = np.sqrt(l1 * l1 * g[i] ** 2 + l2 * l2 * g[j] ** 2 + 2 * l1 * l2 * cij)
                kvv = _self_k(sd, mean)
                kvi = _cross_k((l1 * g[i] ** 2 + l2 * cij) / (sd * abs(g[i])), kvv, K[i])
                kvj = _cross_k((l1 * cij + l2 * g[j] ** 2) / (sd * abs(g[j])), kvv, K[j])
                best_B = max(best_B, np.linalg.norm(kvi * U[i] + kvj * U[j]) / np.sqrt(kvv))
            A = cap[i] ** 2 + cap[j] ** 2
            c_rem = C - cap[i] - cap[j]
            a = (A + best_B * c_rem) / (2 * c_rem + best_B)
            J = n * np.sqrt(2 * a * a - 2 * a * best_B + A) / (c_rem + a)
            cands.append((J / P[j], "merge", name, i, j, J))
    for block, (internal, in_bn) in blocks.items():
        bn = model.get_layer(in_bn)
        c_id = np.sqrt(bn.gamma.numpy().astype(float) ** 2
                       + bn.beta.numpy().astype(float) ** 2).sum()
        J = sum(info[g][0] * info[g][1] for g in internal) / c_id
        P = 0
        for g in internal:
            P += np.count_nonzero(model.get_layer(g).kernel.numpy()) + np.count_nonzero(
                model.get_layer(g).bias.numpy())
        for layer in model.layers:
            if isinstance(layer, L.BatchNormalization) and layer.name in internal_bns(block):
                P += 4 * layer.moving_mean.shape[0]
        cands.append((J / P, "evict", block, -1, -1, J))
    return min(cands)


def internal_bns(block):
    return {"b_in_bn", "b_out_bn"}


def _brute_model(seed):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((5,))
    x = L.ReLU(name="stem_relu")(L.BatchNormalization(name="stem_bn")(L.Dense(6, name="stem")(inputs)))
    y = L.ReLU()(L.BatchNormalization(name="b_in_bn")(L.Dense(4, name="b_in")(x)))
    y = L.BatchNormalization(name="b_out_bn")(L.Dense(6, name="b_out")(y))
    x = L.ReLU()(L.Add(name="blk")([x, y]))
    x = L.ReLU()(L.BatchNormalization(name="h_bn")(L.Dense(5, name="h")(x)))
    model = keras.Model(inputs, L.Dense(3, name="head")(x))
    rng = np.random.default_rng(seed)
    for layer in model.layers:
        if hasattr(layer, "bias") and layer.bias is not None:
            layer.bias.assign(rng.normal(0, 0.2, layer.bias.shape).astype("float32"))
    from conftest import randomize_bn

    return randomize_bn(model, seed, gamma=(0.2, 1.5))


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_first_action_equals_brute_force_argmin(seed):
    model = _brute_model(seed)
    expected = _brute_force_first_action(
        model, {"b_in": "b_out", "h": "head"}, {"blk": (["b_in"], "stem_bn")})
    result = hope_keras.compress(model, steps=1, cost="paper", verbose=False)
    step = result.trajectory.steps[0]
    assert (step.kind, step.unit, step.i, step.j) == expected[1:5]
    assert step.J == pytest.approx(expected[5], rel=1e-6)
    assert step.DR == pytest.approx(expected[0], rel=1e-6)


# --------------------------------------------------------------------- budgets
def test_density_budget_is_met_exactly_and_params_tracked():
    model = small_resnet()
    result = hope_keras.compress(model, density=0.5, verbose=False)
    n0 = result.trajectory.meta["num_neurons"]
    assert result.stopped == "budget"
    assert result.density == np.floor(0.5 * n0) / n0
    assert result.trajectory.steps[-2].active_after > np.floor(0.5 * n0)
    slim = hope_keras.slim(model)
    assert slim.count_params() == round(result.params_ratio * model.count_params())


def test_params_budget_and_steps_budget():
    model = mlp((20, 16), seed=4)
    result = hope_keras.compress(model, params=0.6, verbose=False)
    assert result.params_ratio <= 0.6
    assert result.trajectory.steps[-2].params_after > 0.6
    model2 = mlp((20, 16), seed=4)
    assert len(hope_keras.compress(model2, steps=7, verbose=False).trajectory) == 7


def test_compress_needs_a_budget_and_the_encoder_runs_on_to_one_neuron_per_layer():
    model = mlp((5, 4), seed=5)
    before = model.get_weights()
    with pytest.raises(ValueError, match="needs a budget.*Nothing was changed"):
        hope_keras.compress(model, actions=("prune",), verbose=False)
    with pytest.raises(ValueError, match="needs a budget"):
        hope_keras.Encoder(model, verbose=False).compress()
    assert all(np.array_equal(a, b) for a, b in zip(before, model.get_weights()))
    enc = hope_keras.Encoder(model, actions=("prune",), verbose=False)
    assert enc.run() == "no_action"
    assert enc.trajectory.steps[-1].active_after == 2


@pytest.mark.parametrize("merge_scale,refresh,kernel", [("paper", "local", "approx"),
                                                        ("sum", "neighbors", "exact")])
def test_options_run_and_slim_matches(merge_scale, refresh, kernel):
    model = small_resnet(seed=6)
    hope_keras.Encoder(model, cost=hope_keras.costs.HopeCost(merge_scale=merge_scale, kernel=kernel), search=dict(refresh=refresh), verbose=False).compress(density=0.4)
    assert outputs_equal(hope_keras.slim(model), model, _x(model))


def test_met_or_unreachable_budgets_raise_and_leave_model_untouched():
    model = mlp((5, 4), seed=7)
    weights = [w.copy() for w in model.get_weights()]
    with pytest.raises(ValueError, match="already met"):
        hope_keras.compress(model, density=1.0, verbose=False)
    with pytest.raises(ValueError, match="out of reach"):
        hope_keras.compress(model, density=0.1, verbose=False)
    with pytest.raises(ValueError, match="out of reach"):
        hope_keras.compress(model, params=0.01, verbose=False)
    with pytest.raises(ValueError, match="merge_scale"):
        hope_keras.Encoder(model, cost=hope_keras.costs.HopeCost(merge_scale="half"), verbose=False).compress(density=0.5)
    with pytest.raises(ValueError, match="actions"):
        hope_keras.compress(model, density=0.5, actions=("shrink",), verbose=False)
    for a, b in zip(weights, model.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_model_without_groups_raises():
    inputs = keras.Input((4,))
    model = keras.Model(inputs, L.Dense(2, activation="relu", name="only")(inputs))
    with pytest.raises(ValueError, match="no compressible neuron group.*only"):
        hope_keras.compress(model, density=0.5, verbose=False)


def test_zero_moving_variance_is_pinned_with_a_reason():
    model = mlp((5, 4), seed=8)
    _set(model.get_layer("fc1_bn"), "moving_variance", np.zeros_like)
    analysis = hope_keras.analyze(model)
    assert [g.name for g in analysis.groups] == ["fc0"]
    reasons = {p.layer: p.reason for p in analysis.pinned}
    assert "zero moving variance" in reasons["fc1"] and "fc1_bn" in reasons["fc1"]


# ---------------------------------------------------------------- interruption
@pytest.mark.parametrize("exc", [RuntimeError, KeyboardInterrupt])
def test_interruption_leaves_model_at_last_completed_step(exc, monkeypatch):
    model = small_resnet(seed=9)
    original = copy_model(model)
    from hope_keras.edit import editor as edit

    calls = {"n": 0}
    real_prune = edit.ModelEditor.prune

    def flaky_prune(self, group, i, **kwargs):  # merges call it too (compensate=)
        calls["n"] += 1
        real_prune(self, group, i, **kwargs)  # writes half of the step, then fails
        if calls["n"] == 6:
            raise exc("interrupted")

    monkeypatch.setattr(edit.ModelEditor, "prune", flaky_prune)
    enc = Encoder(model)
    with pytest.raises(exc):
        enc.run(density=0.3, verbose=False)
    done = len(enc.trajectory)
    assert done >= 1
    monkeypatch.setattr(edit.ModelEditor, "prune", real_prune)
    replayed = enc.trajectory.replay(original, step=done)
    for a, b in zip(replayed.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_hope_cost_ranks_width_free_distortion_per_neuron():
    model = small_resnet(seed=4)
    enc = Encoder(model)  # the default cost
    assert enc.cost.name == "hope"
    # The residual stream (stem + b1b, through the Add) is read by b1a and c2; every
    # other group by one layer. One neuron removed: DR = J × readers.
    readers = {"stem": 2, "b1a": 1, "c2": 1, "fc": 1}
    assert set(enc.groups) == set(readers)
    for name, gs in enc.groups.items():
        a = enc.best_group_action(name)
        assert a.DR == pytest.approx(a.J * readers[name])
        cap = gs.cache.capacity
        prunes = cap / (gs.C - cap)  # no width factor n
        if a.kind == "prune":
            assert a.J == pytest.approx(prunes.min())
        else:
            assert a.J <= prunes.min() + 1e-12
    # Eviction: C_branch / C_stream per neuron of the block. The block input is
    # ReLU(z), z ~ N(β, γ²) per channel of stem_bn: E[ReLU(z)²] in closed form.
    a = enc.eviction_action("b1_add")
    bn_end, bn_in = model.get_layer("b1b_bn"), model.get_layer("stem_bn")
    g, b = (np.abs(bn_end.gamma.numpy().astype(float)), bn_end.beta.numpy().astype(float))
    c_branch = np.sqrt(g ** 2 + b ** 2).sum()
    g, b = (np.abs(bn_in.gamma.numpy().astype(float)), bn_in.beta.numpy().astype(float))
    t = b / g
    cdf = 0.5 * (1.0 + np.vectorize(math.erf)(t / math.sqrt(2.0)))
    pdf = np.exp(-0.5 * t * t) / math.sqrt(2.0 * math.pi)
    c_stream = np.sqrt((b * b + g * g) * cdf + b * g * pdf).sum()
    assert a.J == pytest.approx(c_branch / c_stream, rel=1e-6)
    assert a.DR == pytest.approx(a.J / 6) and a.neurons == 6
    # Where the moments do not reach the block input, the paper's C_identity.
    rep = enc.block_reports["b1_add"]
    enc.block_reports["b1_add"] = dataclasses.replace(rep, c_stream=float("nan"))
    assert enc.eviction_action("b1_add").J == pytest.approx(
        c_branch / np.sqrt(g ** 2 + b ** 2).sum())


def test_default_cost_evicts_the_later_of_two_like_blocks_first():
    """Two identity blocks whose branches end in BNs of equal (γ, β): the paper's
    C_identity (one BN's RMS) prices them alike; the stream the second is added to
    carries the first branch too, so the default prices its eviction lower."""
    keras.utils.set_random_seed(3)
    inputs = keras.Input((6, 6, 3))
    x = L.ReLU()(L.BatchNormalization(name="stem_bn")(L.Conv2D(8, 3, padding="same")(inputs)))
    for k in (1, 2):
        y = L.ReLU()(L.BatchNormalization()(L.Conv2D(5, 3, padding="same")(x)))
        y = L.BatchNormalization(name=f"b{k}_end")(L.Conv2D(8, 1)(y))
        x = L.ReLU()(L.Add(name=f"b{k}_add")([x, y]))
    outputs = L.Dense(3)(L.Flatten()(x))
    model = randomize_bn(keras.Model(inputs, outputs), seed=3)
    stem = model.get_layer("stem_bn").get_weights()
    for k in (1, 2):  # γ, β as the stem's: equal C_branch and C_identity everywhere
        w = model.get_layer(f"b{k}_end").get_weights()
        model.get_layer(f"b{k}_end").set_weights(stem[:2] + w[2:])
    analysis = hope_keras.analyze(model, verbose=False)
    reps = {b.name: b for b in analysis.blocks}
    assert reps["b1_add"].c_identity == pytest.approx(reps["b2_add"].c_identity)
    assert reps["b2_add"].c_stream > 1.2 * reps["b1_add"].c_stream
    default = Encoder(model, analysis=analysis)
    assert default.eviction_action("b2_add").J < default.eviction_action("b1_add").J


def test_paper_cost_reproduces_a_saved_demo_trajectory():
    """tests/data/demo_paper_trajectory_v1.npz: the bundled demo CNN compressed to
    density 0.3 with the paper's cost, saved (version 1 files): cost="paper" gives the same
    actions, step for step, and the same costs and parent coefficients up to float64
    rounding (the Gram products are NumPy's on CPUs, the recording TensorFlow's)."""
    from hope_keras.data import load_demo_model
    from pathlib import Path

    ref = hope_keras.Trajectory.load(str(Path(__file__).parent / "data"
                                         / "demo_paper_trajectory_v1.npz"))
    result = hope_keras.compress(load_demo_model(), density=0.3, cost="paper",
                                 verbose=False)
    assert len(result.trajectory) == len(ref) == 158
    for new, old in zip(result.trajectory.steps, ref.steps):
        assert (new.kind, new.unit, new.i, new.j) == (old.kind, old.unit, old.i, old.j)
        assert new.J == pytest.approx(old.J, rel=1e-10)
        assert new.DR == pytest.approx(old.DR, rel=1e-10)
        np.testing.assert_allclose(new.coef, old.coef, rtol=1e-9, atol=1e-12)
    assert result.trajectory.meta["options"]["cost"] == {
        "name": "paper", "merge_scale": "sum", "kernel": "approx", "mean_compensation": False}


def test_cost_option_resolves_names_and_objects_and_rejects_others():
    model = mlp((6, 5), seed=3)
    hope = hope_keras.costs.get("hope")
    per_param = hope_keras.costs.Cost.from_functions(
        "per_param", hope.prune, hope.merge, hope.evict, lambda J, info: J / info.p_init)
    enc = Encoder(model, cost=per_param)
    a = enc.best_group_action("fc0")
    assert a.DR == pytest.approx(a.J / a.P_init)
    with pytest.raises(ValueError, match="Unknown cost.*Received: cost='cheap'"):
        Encoder(model, cost="cheap")
    with pytest.raises(TypeError, match="Action"):
        enc.execute(("prune", "fc0", 1))


def test_mean_compensation_moves_the_pruned_mean_into_the_consumer_bias():
    """Pruning with mean compensation equals replacing the neuron's output by the
    constant E[ReLU(N(β, γ²))] (computed here with scipy, independently)."""
    model = mlp((6, 5), seed=11)
    x = _x(model, n=4)
    before = copy_model(model)
    result = hope_keras.Encoder(model, cost=hope_keras.costs.HopeCost(mean_compensation=True), actions=("prune",), verbose=False).compress(steps=1)
    (step,) = result.trajectory.steps
    assert result.trajectory.meta["options"]["mean_compensation"] is True
    bn = before.get_layer(step.unit + "_bn")
    g, b = abs(float(bn.gamma.numpy()[step.i])), float(bn.beta.numpy()[step.i])
    mean = b * norm.cdf(b / g) + g * norm.pdf(b / g)
    # The same network with neuron i's activation replaced by that constant.
    acts = keras.Model(before.inputs, before.get_layer(step.unit + "_bn").output)
    consumer = "fc1" if step.unit == "fc0" else "head"
    nxt = before.get_layer(consumer)
    pre = np.maximum(acts.predict(x, verbose=0), 0)
    pre[:, step.i] = mean
    expected_next = pre @ nxt.kernel.numpy() + nxt.bias.numpy()
    probe = keras.Model(model.inputs, model.get_layer(consumer).output)
    np.testing.assert_allclose(probe.predict(x, verbose=0), expected_next, rtol=1e-5, atol=1e-5)
    # Replay reproduces it bit for bit; slim matches the in-place model.
    replayed = result.trajectory.replay(before, step=1)
    for a, c in zip(replayed.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(a, c)
    assert outputs_equal(hope_keras.slim(model), model, x)


def test_mean_compensation_of_a_bias_free_consumer_goes_into_its_bn_mean():
    keras.utils.set_random_seed(12)
    inputs = keras.Input((6,))
    h = L.ReLU()(L.BatchNormalization(name="a_bn")(L.Dense(6, name="a")(inputs)))
    h = L.BatchNormalization(name="b_bn")(L.Dense(5, use_bias=False, name="b")(h))
    model = keras.Model(inputs, L.Dense(3, name="head")(L.ReLU()(h)))
    from conftest import randomize_bn

    model = randomize_bn(model, 12)
    before = copy_model(model)
    editor = hope_keras.edit.editor.ModelEditor(model, hope_keras.walk(model),
                                         mean_compensation=True)
    with editor.step():
        editor.prune("a", 2)
    editor.commit()
    bn = before.get_layer("a_bn")
    g, b = abs(float(bn.gamma.numpy()[2])), float(bn.beta.numpy()[2])
    mean = b * norm.cdf(b / g) + g * norm.pdf(b / g)
    x = _x(model, n=4)
    acts = np.maximum(keras.Model(before.inputs, bn.output).predict(x, verbose=0), 0)
    acts[:, 2] = mean
    z = acts @ before.get_layer("b").kernel.numpy()
    ref_bn = before.get_layer("b_bn")
    expected = ref_bn(z.astype("float32"), training=False).numpy()
    probe = keras.Model(model.inputs, model.get_layer("b_bn").output)
    np.testing.assert_allclose(probe.predict(x, verbose=0), expected, rtol=1e-5, atol=1e-5)


def _flops(model):
    """2 × multiply-adds of the Dense/Conv layers for one example (independent count)."""
    total = 0
    for layer in model.layers:
        if isinstance(layer, (L.Dense, L.Conv2D)):
            spatial = int(np.prod(layer.output.shape[1:-1] or [1]))
            total += 2 * spatial * int(np.prod(layer.kernel.shape))
    return total


def test_hope_cost_ranks_a_flops_budget_by_the_geometric_mean_of_neurons_and_flops():
    """Under flops=, DR = J / sqrt(k·S), S the FLOPs the slimmed model loses (counted
    here by slimming the edited model), k the neurons removed."""
    from hope_keras.edit.editor import ModelEditor

    model = small_resnet(seed=5)
    base = _flops(hope_keras.slim(model))

    def saved(edit):
        m = copy_model(model)
        editor = ModelEditor(m, hope_keras.analyze(m).graph)  # the copy's layers
        with editor.step():
            edit(editor)
        editor.commit()
        return base - _flops(hope_keras.slim(m))

    enc = Encoder(model)
    enc.set_budget("flops")
    readers = {"stem": 2, "b1a": 1, "c2": 1, "fc": 1}  # as in the test above
    drs = []
    for name in enc.groups:
        a = enc.best_group_action(name)
        S = saved(lambda e: e.prune(name, 0))
        assert S > 0 and a.DR == pytest.approx(readers[name] * a.J / np.sqrt(S), rel=1e-9)
        drs.append(a.DR)
    a = enc.eviction_action("b1_add")
    S = saved(lambda e: e.evict("b1_add"))
    assert a.neurons == 6 and a.DR == pytest.approx(a.J / np.sqrt(6 * S), rel=1e-9)
    drs.append(a.DR)
    step = hope_keras.compress(copy_model(model), flops=0.5, steps=1,
                               verbose=False).trajectory.steps[0]
    assert step.DR == pytest.approx(min(drs), rel=1e-9)
    # Density and params budgets keep J per neuron removed.
    for budget in ("density", "params"):
        enc.set_budget(budget)
        assert enc.eviction_action("b1_add").DR == pytest.approx(a.J / 6)


def test_hope_cost_prices_the_sum_scale_parent_it_builds():
    """Neuron 4 of fc0 is neuron 1 scaled by 2 (y_4 = 2·y_1) with another output
    vector: f_1 + f_4 is one neuron, so the sum-scale merge is lossless and the default
    cost prices it at 0; the paper's α*-scaled parent shrinks the output (J > 0)."""
    model = mlp((6, 5), seed=7)
    p, bn = model.get_layer("fc0"), model.get_layer("fc0_bn")
    _set(p, "kernel", lambda w: np.where(np.arange(6) == 4, 2 * w[:, 1:2], w))
    _set(p, "bias", lambda b: np.where(np.arange(6) == 4, 2 * b[1], b))
    eps = bn.epsilon
    for attr, fn in (("gamma", lambda a: 2 * a[1]), ("beta", lambda a: 2 * a[1]),
                     ("moving_mean", lambda a: 2 * a[1]),
                     ("moving_variance", lambda a: 4 * a[1] + 3 * eps)):
        _set(bn, attr, lambda a, fn=fn: np.where(np.arange(6) == 4, fn(a), a))
    x = _x(model)
    relu = keras.Model(model.input, model.get_layer("fc0_relu").output)(x).numpy()
    np.testing.assert_allclose(relu[:, 4], 2 * relu[:, 1], rtol=1e-5, atol=1e-6)
    before = copy_model(model)
    enc = Encoder(model, actions=("merge",))
    a = enc.best_group_action("fc0")
    assert (a.kind, a.i, a.j) == ("merge", 1, 4) and a.J == pytest.approx(0.0, abs=1e-6)
    gs = enc.groups["fc0"]
    cap = gs.cache.capacity
    paper_J = hope_keras.costs.j_merge(cap[1] ** 2 + cap[4] ** 2, gs.cache.B[1, 4],
                                       gs.C - cap[1] - cap[4], 1)
    assert paper_J > 1e-3
    enc.execute(a)
    enc.editor.commit()
    assert outputs_equal(model, before, x, rtol=1e-5, atol=1e-5)


def test_default_cost_prices_residual_streams_and_no_streams_leaves_them_whole():
    """The default prices every group, the residual streams included (ranked once
    per reader, docs/quality.md, "Every layer that reads a group counts");
    ``HopeCost(groups="no_streams")`` leaves them whole, and both runs slim exactly."""
    model = small_resnet(seed=3)
    analysis = hope_keras.analyze(model)
    streams = [n for n, g in analysis.graph.groups.items() if g.stream]
    assert streams == ["stem"]  # stem, b1b and b1_add share the stream's channels
    assert not any(g.stream for n, g in analysis.graph.groups.items() if n != "stem")
    x = _x(model)
    no_streams = hope_keras.costs.HopeCost(groups="no_streams")
    for cost, stream_kept in ((None, False), (no_streams, True)):
        m = copy_model(model)
        kw = {} if cost is None else {"cost": cost}
        result = hope_keras.compress(m, density=0.3, verbose=False, **kw)
        touched = {s.unit for s in result.trajectory.steps if s.kind != "evict"}
        assert ("stem" not in touched) == stream_kept, touched
        assert result.trajectory.meta["options"]["cost"] == {
            "name": "hope", "groups": "no_streams" if stream_kept else "all",
            "merge_scale": "sum", "kernel": "approx", "mean_compensation": False}
        assert outputs_equal(hope_keras.slim(m), m, x, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="groups must be one of"):
        hope_keras.costs.HopeCost(groups="streams")


def test_cost_subclass_settings_declared_on_the_class_are_kept():
    """A subclass of a built-in cost may declare its scope and options as class
    attributes, as `Cost` documents them: the built-in ``__init__`` keeps them
    (it used to overwrite them with its own defaults, silently pricing the
    streams), an argument still overrides them, and a bad class value is
    rejected as an argument is."""
    costs = hope_keras.costs

    class StreamsWhole(costs.HopeCost):
        name = "streams_whole"
        groups = "no_streams"
        mean_compensation = True
        kernel = "exact"

    c = StreamsWhole()
    assert (c.groups, c.mean_compensation, c.kernel, c.merge_scale) == (
        "no_streams", True, "exact", "sum")
    assert StreamsWhole(groups="all", kernel="approx").get_config() == {
        "name": "streams_whole", "groups": "all", "merge_scale": "sum",
        "kernel": "approx", "mean_compensation": True}

    class PaperExact(costs.PaperCost):
        kernel = "exact"

    assert PaperExact().kernel == "exact" and PaperExact(kernel="approx").kernel == "approx"

    class Bad(costs.HopeCost):
        groups = "streams"

    with pytest.raises(ValueError, match="groups must be one of .* Received: groups='streams'"):
        Bad()
    model = small_resnet(seed=3)
    result = hope_keras.compress(model, density=0.3, cost=StreamsWhole(), verbose=False)
    assert "stem" not in {s.unit for s in result.trajectory.steps if s.kind != "evict"}
    assert result.trajectory.meta["options"]["cost"]["groups"] == "no_streams"


def test_dead_neurons_are_pruned_not_merged_into_an_overflowing_parent():
    """Neurons that never fire under the BN surrogate (beta/gamma from -15 to -35,
    as an untrained VGG16's calibrated fc layers have) have self-kernels that
    underflow; a merge of two of them can price at J = 0 (rounding makes B exceed
    ||f_i + f_j||) and need a parent scale B / sqrt(K_vv) of 1e9 and more (on VGG16,
    float32 overflow, then NaNs). Such neurons are pruned, never merged (this seed
    merged two of them with a coefficient of 2.6e9 before the guard)."""
    model = mlp((16,), d_in=32, seed=38)
    rng = np.random.default_rng(38)
    bn = model.get_layer("fc0_bn")
    g, b = bn.gamma.numpy(), bn.beta.numpy()
    dead = rng.choice(16, 6, replace=False)
    g[dead] = rng.uniform(0.01, 0.03, 6)
    b[dead] = -g[dead] * rng.uniform(15, 35, 6)
    bn.gamma.assign(g)
    bn.beta.assign(b)
    result = hope_keras.compress(model, density=0.5, verbose=False)
    steps = result.trajectory.steps
    merges = [s for s in steps if s.kind == "merge"]
    assert merges and all(np.all(np.abs(s.coef) < 1e3) for s in merges)
    assert {s.i for s in steps[:6] if s.kind == "prune"} == set(dead.tolist())
    assert all(np.all(np.isfinite(w)) for w in model.get_weights())


def test_neighbor_refresh_skips_groups_the_cost_leaves_whole():
    """refresh="neighbors" on the demo CNN, whose residual stream the default cost
    leaves whole: the stream group is a neighbour with no cache to rebuild (this
    raised KeyError: 'conv2'); the run edits exactly (slim equals in place)."""
    from hope_keras.data import load_demo_data, load_demo_model

    model = load_demo_model()
    result = hope_keras.Encoder(model, search=dict(refresh="neighbors"), verbose=False).compress(density=0.4)
    assert result.density == pytest.approx(0.4, abs=0.01)
    x = load_demo_data()[0][:64]
    assert outputs_equal(hope_keras.slim(model), model, x)
