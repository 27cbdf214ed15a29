"""DEFT on the fuzzer's random networks (tests/fuzz_plan.py): every pattern the
compression fuzzing draws — residual sums, concatenations, Flatten, depthwise,
separable and transposed convolutions, LayerNormalization, nested and subclassed
models — planned, applied and fine-tuned, and checked against what DEFT promises:

* `deft.plan` (the default, and ``cost="hope", actions=("prune",)``, which gives the
  residual streams and concatenations slack of their own) leaves the model's weights
  as they were, or refuses with one of its documented errors (and changes nothing);
* a saved plan loads with the same elasticities; `diagonal_fisher`'s closed form
  (Dense, Conv2D and BN variables) equals the per-example gradients of ``vmap``, and
  the head-only, PEFT and EWC baselines train what they free (`BASELINE_SEEDS` and
  every fourth network of the slow tier);
* after `apply`, two epochs of `ElasticOptimizer` leave every frozen parameter
  bit-identical and the grafted source logits where `apply` put them (theorem H.2);
* `replace_head` refuses a model Keras cannot clone with an error that says what to do.

`make test` runs `FAST_SEEDS`; the slow tier runs the first `SLOW_N` networks.
"""

import numpy as np
import pytest

import keras

import fuzz_networks
import fuzz_plan
import hope_keras
from hope_keras import deft
from hope_keras.deft.retention import example_slice

# Functional, Sequential and subclassed networks with residual sums, concatenations,
# transposed and depthwise convolutions and a second input among them (seeds chosen
# by their plans).
FAST_SEEDS = (6, 9, 13, 18, 20, 21, 27, 28, 32)
# ... of which these also check the Fisher and the baselines (the costliest checks;
# the slow tier: every fourth network).
BASELINE_SEEDS = (9, 18, 27)
SLOW_N = 120
REFUSALS = ("outputs; pass head=", "no compressible neuron group", "No Dense head found",
            "must be a Dense layer", "no neuron group the cost")


def _weights_equal(model, weights):
    return all(np.array_equal(a, b) for a, b in zip(model.get_weights(), weights,
                                                    strict=True))


VARIANTS = {"default": {}, "hope_prune": {"cost": "hope", "actions": ("prune",)}}


def _check(seed, variant, tmp_path):
    plan = fuzz_plan.draw(seed)
    model = fuzz_networks.build(plan)
    rng = np.random.default_rng([seed, 7])
    shapes = [plan.shape] + ([plan.second_input["shape"]] if plan.second_input else [])

    def inputs(n):
        xs = [rng.normal(size=(n,) + tuple(s)).astype("float32") for s in shapes]
        return xs if len(xs) > 1 else xs[0]

    x = inputs(24)
    y = (np.arange(24) % 3).astype("int64")
    if plan.bn_free:
        model = hope_keras.calibrate(model, inputs(64))
    weights = model.get_weights()
    try:
        p = deft.plan(model, percentile=30, verbose=False, **VARIANTS[variant])
    except ValueError as e:
        assert any(r in str(e) for r in REFUSALS), f"seed {seed}: {e}"
        assert _weights_equal(model, weights), f"seed {seed}: a refused plan changed the model"
        return "refused"
    assert _weights_equal(model, weights), f"seed {seed}: plan changed the model"
    saved = tmp_path / "plan.npz"
    p.save(str(saved))
    assert deft.DeftPlan.load(str(saved)).elasticity_map() == p.elasticity_map()
    p.apply(model)
    retention = deft.SourceRetention(model, plan=p)
    try:
        target = deft.replace_head(model, 3, seed=0)
    except ValueError as e:
        assert isinstance(model, fuzz_networks.FuzzNet), f"seed {seed}: {e}"
        assert "Build the target model yourself" in str(e)
        return "subclassed"
    if variant == "default" and (seed in BASELINE_SEEDS or seed % 4 == 0):
        # The closed-form Fisher where it applies, else vmap's (the costliest check).
        xs, ys = example_slice(x, 0, 10), y[:10]
        auto = deft.diagonal_fisher(target, xs, ys, batch_size=5)
        vmap = deft.diagonal_fisher(target, xs, ys, batch_size=5, method="vmap")
        assert set(auto) == set(vmap)
        for k in auto:
            np.testing.assert_allclose(auto[k], vmap[k], rtol=2e-3,
                                       atol=1e-6 * max(float(vmap[k].max()), 1e-30),
                                       err_msg=f"seed {seed}: {k}")
        _check_baselines(model, auto, x, y, seed)
    before = retention.logits(target, x)
    start = {v.path: v.numpy().copy() for v in target.trainable_variables}
    opt = deft.ElasticOptimizer(keras.optimizers.SGD(0.05, momentum=0.9), p)
    history = deft.Trainer(target, opt, retention=retention).fit(
        (x, y), epochs=2, batch_size=8, target_val=(x, y), restore_best=False)
    assert 0.0 <= history.best["target_acc"] <= 1.0, f"seed {seed}"  # one array per input
    after = retention.logits(target, x)
    assert np.all(np.isfinite(after)), f"seed {seed}"
    scale = max(1.0, float(np.max(np.abs(before))))
    np.testing.assert_allclose(after, before, rtol=0, atol=1e-5 * scale,
                               err_msg=f"seed {seed}: the source moved")
    for v in target.trainable_variables:
        frozen = np.broadcast_to(np.asarray(opt.elasticity_of(v), dtype=np.float64),
                                 v.shape) == 0
        np.testing.assert_array_equal(v.numpy()[frozen], start[v.path][frozen],
                                      err_msg=f"seed {seed}: {v.path}")
    return "trained"


def _check_baselines(model, fisher, x, y, seed):
    """The baselines on another target of the same source: ``"head"`` and ``"peft"``
    move only what they free (the head; every tensor of rank < 2 and the head), and
    EWC trains with its penalty."""
    for method in ("head", "peft", "ewc"):
        target = deft.replace_head(model, 3, seed=1)
        opt = deft.ElasticOptimizer(keras.optimizers.SGD(0.05),
                                    elasticity=deft.method_elasticity(method, target))
        penalties = [deft.EWCPenalty(target, fisher, 10.0)] if method == "ewc" else []
        start = {v.path: v.numpy().copy() for v in target.trainable_variables}
        history = deft.Trainer(target, opt, penalties=penalties).fit(
            (x, y), epochs=1, batch_size=8, restore_best=False)
        assert np.isfinite(history.epochs[-1]["loss"]), f"seed {seed}: {method}"
        for v in target.trainable_variables:
            frozen = np.broadcast_to(np.asarray(opt.elasticity_of(v), dtype=np.float64),
                                     v.shape) == 0
            if method == "head":
                assert "_target" in v.path or frozen.all(), f"seed {seed}: {v.path}"
            if method == "peft":
                assert frozen.all() == (len(v.shape) >= 2 and "_target" not in v.path), \
                    f"seed {seed}: {v.path}"
            np.testing.assert_array_equal(v.numpy()[frozen], start[v.path][frozen],
                                          err_msg=f"seed {seed}: {method} {v.path}")


pytestmark = pytest.mark.filterwarnings("ignore:No slack channel of this plan")


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("seed", FAST_SEEDS)
def test_deft_keeps_its_promises_on_random_networks(seed, variant, tmp_path):
    assert _check(seed, variant, tmp_path) in ("trained", "subclassed", "refused")


@pytest.mark.slow
@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("seed", range(SLOW_N))
def test_deft_keeps_its_promises_on_more_random_networks(seed, variant, tmp_path):
    assert _check(seed, variant, tmp_path) in ("trained", "subclassed", "refused")
