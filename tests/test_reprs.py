"""The results a notebook cell ends with print one short line, whatever the model's size.

A dataclass's generated repr prints every field: every per-channel array, and for
`Analysis` every cache (3.3 MB of text for the ResNet-50 fixture).
"""

import pytest

import hope_keras
from conftest import copy_model, mlp
from hope_keras import deft
from hope_keras.search import baselines


def _results(widths):
    model = mlp(widths, d_in=20, d_out=4, seed=1)
    analysis = hope_keras.analyze(copy_model(model), verbose=False)
    group = analysis.graph.groups["fc0"]
    compressed = copy_model(model)
    result = hope_keras.compress(compressed, density=0.5, verbose=False)
    return {
        "Analysis": analysis,
        "GroupReport": analysis.groups[0],
        "ModelGraph": analysis.graph,
        "NeuronGroup": group,
        "Coupling": group.couplings[0],
        "CompressionResult": result,
        "BaselineResult": baselines.prune(copy_model(model), 0.5, method="bn_scale"),
        "Profile": hope_keras.profile(hope_keras.slim(compressed), reference=compressed,
                                      latency=False),
        "DeftPlan": deft.plan(copy_model(model), percentile=30),
    }


@pytest.fixture(scope="module")
def narrow_and_wide():
    return _results((8, 6)), _results((160, 120))  # 20× wider: a list would show


@pytest.mark.parametrize("kind", ["Analysis", "GroupReport", "ModelGraph", "NeuronGroup",
                                  "Coupling", "CompressionResult", "BaselineResult",
                                  "Profile", "DeftPlan"])
def test_repr_is_one_short_line_independent_of_width(narrow_and_wide, kind):
    narrow, wide = (repr(r[kind]) for r in narrow_and_wide)
    assert wide.startswith(kind + "(") and "\n" not in wide, wide
    # The wide model's numbers have a few more digits; nothing grows with the width.
    assert len(wide) <= len(narrow) + 40 and len(wide) < 400, (len(narrow), wide)


def test_reprs_carry_the_numbers_a_user_looks_for(narrow_and_wide):
    r = narrow_and_wide[1]
    a = r["Analysis"]
    assert f"channels={a.num_neurons}" in repr(a) and f"groups={len(a.groups)}" in repr(a)
    c = r["CompressionResult"]
    assert f"steps={len(c.trajectory)}" in repr(c)
    assert f"density={c.density:.4f}" in repr(c) and f"stopped={c.stopped!r}" in repr(c)
    assert f"size={r['GroupReport'].size}" in repr(r["GroupReport"])
    assert f"removed={len(r['BaselineResult'].removed)}" in repr(r["BaselineResult"])
    assert f"params={r['Profile'].params}" in repr(r["Profile"])
    p = r["DeftPlan"]
    assert f"merges={len(p.merges)}" in repr(p) and f"head={p.head!r}" in repr(p)


def test_demo_data_and_trajectory_read_as_a_user_expects(narrow_and_wide):
    from hope_keras.data import load_demo_data

    text = repr(load_demo_data())
    assert text.startswith("DemoData(x_test=<float32 (2000, 28, 28, 1)>") and len(text) < 300
    trajectory = narrow_and_wide[0]["CompressionResult"].trajectory
    assert trajectory[0] == trajectory.steps[0] and trajectory[-1] == trajectory.steps[-1]
    assert list(trajectory) == trajectory.steps and trajectory[:2] == trajectory.steps[:2]
