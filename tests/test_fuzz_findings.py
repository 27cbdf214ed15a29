"""Bugs the random-network fuzzer (tests/test_fuzz.py) found, each pinned by a small
hand-built model."""

import warnings

import keras
import numpy as np
import pytest

import hope_keras
from conftest import L, randomize_bn


def _mixed_activations(seed=0):
    """A swish group (coupled: prune only) and a ReLU group (mergeable)."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((5,))
    x = L.Activation("swish")(L.BatchNormalization()(L.Dense(6, name="swish_fc")(inputs)))
    x = L.ReLU()(L.BatchNormalization()(L.Dense(4, name="relu_fc")(x)))
    return randomize_bn(keras.Model(inputs, L.Dense(2, name="head")(x)), seed)


def test_merge_only_budgets_count_the_groups_merges_cannot_shrink():
    """Without prunes, a group that cannot merge keeps every neuron: a budget only
    prunes could reach is refused before any edit (it used to run to "no_action")."""
    model = _mixed_activations()
    before = model.get_weights()
    enc = hope_keras.Encoder(model, actions=("merge",), verbose=False)
    min_active, min_params, _ = enc.min_reachable()
    assert min_active == 6 + 1  # the swish group whole, the ReLU group merged to one
    for budget in ({"density": 5.5 / 10}, {"params": min_params * 0.99}):
        with pytest.raises(ValueError, match="out of reach"):
            hope_keras.compress(model, actions=("merge",), verbose=False, **budget)
        assert all(np.array_equal(a, b) for a, b in zip(model.get_weights(), before))
    result = hope_keras.compress(model, actions=("merge",), density=7.5 / 10, verbose=False)
    assert result.stopped == "budget" and result.trajectory[-1].active_after == 7
    assert {s.unit for s in result.trajectory} == {"relu_fc"}


@pytest.mark.parametrize("budgets", [{"flops": 0.05}, {"density": 0.5, "flops": 0.9}])
def test_flops_budget_on_unknown_spatial_dimensions_is_refused_for_that_reason(budgets):
    """docs/hope.md: flops= needs every dimension but the batch. It was refused as
    "out of reach" (FLOPs counted as if each unknown dimension were 1), or, behind a
    density budget, not refused at all."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((None, None, 3))
    x = L.ReLU()(L.BatchNormalization()(L.Conv2D(8, 3, padding="same")(inputs)))
    model = randomize_bn(keras.Model(inputs, L.Dense(2)(L.GlobalAveragePooling2D()(x))))
    before = model.get_weights()
    with pytest.raises(ValueError, match="unknown output dimension.*fixed input shape"):
        hope_keras.compress(model, verbose=False, **budgets)
    assert all(np.array_equal(a, b) for a, b in zip(model.get_weights(), before))
    with pytest.raises(ValueError, match="fixed input shape"):
        hope_keras.Encoder(model, verbose=False).run(**budgets)
    assert all(np.array_equal(a, b) for a, b in zip(model.get_weights(), before))


@pytest.mark.parametrize("center", [True, False])
def test_a_block_evicted_into_a_bn_without_scale_stays_evicted_when_compressed_again(center):
    """The eviction zeroes the final producer and what the BN has of β and moving mean;
    a run on the compressed model must see the block as gone (slim drops it), so that
    its live counts are slim's. With ``scale=False`` it took γ = 1 for a live branch."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6,))
    x = L.ReLU()(L.BatchNormalization()(L.Dense(5, name="stem")(inputs)))
    y = L.ReLU()(L.BatchNormalization()(L.Dense(4, name="inner")(x)))
    y = L.BatchNormalization(scale=False, center=center, name="final_bn")(L.Dense(5)(y))
    x = L.Add(name="block")([x, y])
    model = randomize_bn(keras.Model(inputs, L.Dense(2)(L.ReLU()(x))))
    result = hope_keras.compress(model, actions=("evict",), steps=1, verbose=False)
    assert [s.kind for s in result.trajectory] == ["evict"]
    small = hope_keras.slim(model)
    assert small.count_params() == round(result.params_ratio * model.count_params())
    again = hope_keras.Encoder(model, verbose=False)
    assert again.evicted == {"block"}
    assert again.active == result.trajectory[-1].active_after
    assert again.sizes.params_ratio == pytest.approx(result.params_ratio, rel=1e-12)


def test_a_run_left_only_overshooting_evictions_warns_and_changes_nothing():
    """A density budget that only an eviction could reach, and that would overshoot
    it (skipped): the run stops without a step, and says so (it used to return a
    "no_action" result in silence, the model uncompressed)."""
    keras.utils.set_random_seed(3)
    inputs = keras.Input((6,))
    s = L.LeakyReLU()(L.BatchNormalization()(L.Dense(4, name="stream")(inputs)))
    h = L.LeakyReLU()(L.BatchNormalization()(L.Dense(5, name="inner")(s)))
    h = L.BatchNormalization()(L.Dense(4, name="back")(h))
    x = L.LeakyReLU()(L.Add(name="block")([s, h]))
    model = randomize_bn(keras.Model(inputs, L.Dense(2, name="head")(x)), 3)
    before = model.get_weights()
    with pytest.warns(UserWarning, match=r"stopped before density=0\.9.*evict blocks "
                                         r"\(next: 'block'\).*0 step"):
        result = hope_keras.compress(model, density=0.9, actions=("merge", "evict"),
                                     verbose=False)
    assert result.stopped == "no_action" and not result.trajectory.steps
    assert all(np.array_equal(a, b) for a, b in zip(model.get_weights(), before))
    # The eviction is what a FLOPs budget alone takes: met, and no warning.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        result = hope_keras.compress(model, flops=0.9, actions=("merge", "evict"),
                                     verbose=False)
    assert result.stopped == "budget" and [s.kind for s in result.trajectory] == ["evict"]


def _weak_pair(chain=False):
    """A group of two weak neurons: the parent of their merge has a pre-activation
    spread below the BN's ε (inactive, γ_k² < ε: both neurons would go). `chain`: a
    group before it, read by it alone."""
    keras.utils.set_random_seed(1)
    inputs = keras.Input((4,))
    x = inputs
    if chain:
        x = L.ReLU()(L.BatchNormalization(name="first_bn")(L.Dense(3, name="first")(x)))
    x = L.Dense(2, name="pair")(x)
    bn = L.BatchNormalization(epsilon=1e-3, name="pair_bn")
    x = L.ReLU()(bn(x))
    model = keras.Model(inputs, L.Dense(3, name="head")(x))
    bn.set_weights([np.array([0.01, 0.012], "float32"), np.array([0.3, 0.2], "float32"),
                    np.zeros(2, "float32"), np.ones(2, "float32")])
    return model


@pytest.mark.parametrize("chain", [False, True])
def test_a_merge_that_would_empty_a_group_is_not_taken(chain):
    """A merge of a group's last two neurons into an inactive parent would leave the
    layer no live neuron; with a group before it (read by it alone), `slim` then
    dropped that group's channels too, which the run's counts did not follow (fuzz
    seeds 60127, 150501). Such a merge is not admissible, as a prune of a layer's
    last neuron is not: merges alone stop there; with prunes, one neuron is pruned."""
    for actions, density in ((("merge",), 0.5 if not chain else 0.4),
                             (("prune", "merge"), 0.5 if not chain else 0.6)):
        model = _weak_pair(chain)
        weights, count0 = model.get_weights(), model.count_params()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = hope_keras.compress(model, density=density, actions=actions,
                                         verbose=False)
        pair = [s for s in result.trajectory.steps if s.unit == "pair"]
        if actions == ("merge",):  # the pair stays whole: the run stops short, and says so
            assert not pair and result.stopped == "no_action"
            assert any("stopped before" in str(w.message) for w in caught)
            if not chain:
                assert all(np.array_equal(a, b) for a, b in zip(model.get_weights(), weights))
        small = hope_keras.slim(model)
        assert small.get_layer("pair").units >= 1 and small.get_layer("first" if chain
                                                                        else "pair").units
        assert small.count_params() == round(result.params_ratio * count0)
