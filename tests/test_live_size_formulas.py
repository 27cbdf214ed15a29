"""The engine's live parameter and FLOPs counts against hand formulas, step by step.

A network of every layer type whose size follows its channels (strided Conv2D,
DepthwiseConv2D, SeparableConv2D, a dilated grouped Conv2D, a 1 × 1 Conv2D read
through LayerNormalization and a Reshape, a strided causal Conv1D, Flatten → Dense,
BatchNormalization after each) is compressed one step at a time. After every step
its parameters and FLOPs are written out here from the live width of each group
(counted off the executed steps) with each layer's formula and the spatial sizes
computed by hand (``ceil(n / s)`` for ``"same"``/``"causal"``, ``n − d (k − 1)`` for
``"valid"``); the engine's counts, the step's recorded ratios, and — under a FLOPs
budget — the FLOPs each step's ranking divides by (``DR = J / sqrt(k·S)``,
docs/theory.md §3) must equal them. At the end `hope_keras.profile` of the slimmed
model gives the same numbers.
"""

import math

import keras
import numpy as np
import pytest

import hope_keras
from conftest import L, randomize_bn
from hope_keras.search.encoder import Encoder

WIDTHS = {"c1": 8, "pw": 5, "c1d": 7, "fc": 9}


def build_model(seed):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((12, 12, 3))
    x = L.Conv2D(8, 3, strides=2, padding="same", name="c1")(inputs)     # 12 → 6
    x = L.ReLU()(L.BatchNormalization(name="c1_bn")(x))
    x = L.DepthwiseConv2D(3, padding="same", name="dw")(x)                # 6 → 6
    x = L.ReLU()(L.BatchNormalization(name="dw_bn")(x))
    x = L.SeparableConv2D(6, 3, name="sep")(x)                           # 6 → 4
    x = L.ReLU()(L.BatchNormalization(name="sep_bn")(x))
    x = L.Conv2D(6, 3, dilation_rate=2, padding="same", groups=2, name="grp")(x)
    x = L.ReLU()(L.BatchNormalization(name="grp_bn")(x))
    x = L.Conv2D(5, 1, name="pw")(x)
    x = L.ReLU()(L.LayerNormalization(name="ln")(x))
    x = L.Reshape((16, 5))(x)
    x = L.Conv1D(7, 3, strides=2, padding="causal", name="c1d")(x)     # 16 → 8
    x = L.ReLU()(L.BatchNormalization(name="c1d_bn")(x))
    x = L.Dense(9, name="fc")(L.Flatten()(x))
    x = L.ReLU()(L.BatchNormalization(name="fc_bn")(x))
    model = keras.Model(inputs, L.Dense(3, name="head")(x))
    return randomize_bn(model, seed)


def hand_counts(w):
    """(parameters, FLOPs) with group widths `w` (FLOPs: 2 × multiply-adds)."""
    c1, pw, c1d, fc = w["c1"], w["pw"], w["c1d"], w["fc"]
    layers = [  # (params, flops) per layer
        (3 * 3 * 3 * c1 + c1, 2 * 6 * 6 * 3 * 3 * 3 * c1),        # c1: 3×3, 3 → c1, 6×6
        (4 * c1, 0),                                              # c1_bn
        (3 * 3 * c1 + c1, 2 * 6 * 6 * 3 * 3 * c1),                # dw: 3×3 per channel
        (4 * c1, 0),                                              # dw_bn
        (3 * 3 * c1 + c1 * 6 + 6, 2 * 4 * 4 * (3 * 3 * c1 + c1 * 6)),  # sep → 6, 4×4
        (4 * 6, 0),                                               # sep_bn
        (3 * 3 * 3 * 6 + 6, 2 * 4 * 4 * 3 * 3 * 3 * 6),          # grp: 2 groups of 3 → 3
        (4 * 6, 0),                                               # grp_bn
        (6 * pw + pw, 2 * 4 * 4 * 6 * pw),                        # pw: 1×1
        (2 * pw, 0),                                              # ln: γ, β
        (3 * pw * c1d + c1d, 2 * 8 * 3 * pw * c1d),               # c1d: k 3, 16 → 8
        (4 * c1d, 0),                                             # c1d_bn
        (8 * c1d * fc + fc, 2 * 8 * c1d * fc),                    # fc after Flatten
        (4 * fc, 0),                                              # fc_bn
        (fc * 3 + 3, 2 * fc * 3),                                 # head
    ]
    return sum(p for p, _ in layers), sum(f for _, f in layers)


def test_the_hand_formulas_count_the_model_as_keras_and_profile_do():
    model = build_model(0)
    params, flops = hand_counts(WIDTHS)
    assert model.count_params() == params
    assert hope_keras.profile(model, latency=False).flops == flops


@pytest.mark.parametrize("budget", ["density", "flops"])
def test_live_counts_and_flops_ranking_equal_the_hand_formulas_at_every_step(budget):
    model = build_model(1)
    enc = Encoder(model, verbose=False)
    enc.set_budget(budget)
    assert set(enc.groups) == set(WIDTHS)  # sep, grp: pinned by the grouped convolution
    widths = dict(WIDTHS)
    params0, flops0 = hand_counts(widths)
    assert (enc.sizes.params0, enc.sizes.flops0) == (params0, flops0)
    readers = {name: gs.readers for name, gs in enc.groups.items()}
    assert readers == {"c1": 1.0, "pw": 1.0, "c1d": 1.0, "fc": 1.0}
    for k in range(14):
        action = enc.next_action()
        if budget == "flops":  # DR = J / sqrt(k·S), S the FLOPs one channel less saves
            fewer = dict(widths, **{action.unit: widths[action.unit] - 1})
            saved = hand_counts(widths)[1] - hand_counts(fewer)[1]
            assert saved > 0
            assert action.DR == pytest.approx(action.J / math.sqrt(saved), rel=1e-12)
        step = enc.execute(action)
        widths[step.unit] -= 1
        params, flops = hand_counts(widths)
        assert (enc.sizes.params, enc.sizes.flops) == (params, flops), (k, step)
        assert step.params_after == pytest.approx(params / params0, rel=1e-12)
        assert step.flops_after == pytest.approx(flops / flops0, rel=1e-12)
    assert min(widths.values()) < max(WIDTHS.values())
    enc.run(steps=0)  # commits the edits (and corrects the statistics)
    slim_profile = hope_keras.profile(hope_keras.slim(model), latency=False)
    assert (slim_profile.params, slim_profile.flops) == hand_counts(widths)
    assert {g: int(v) for g, v in widths.items()} == {
        g: int(np.count_nonzero(gs.active)) for g, gs in enc.groups.items()}
