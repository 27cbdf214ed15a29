"""The quality benchmark's own bookkeeping (benchmarks/quality.py).

Its parameter / FLOPs axes and the `cost="paper"` density conversion are computed
by the benchmark, not read from the engine: checked here against the engine's
trajectory and `hope_keras.profile` of the slimmed model.
"""

import importlib.util
import pathlib

import numpy as np
import pytest

import hope_keras
from conftest import copy_model, small_resnet

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def quality():
    spec = importlib.util.spec_from_file_location("quality_bench",
                                                  ROOT / "benchmarks" / "quality.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("cost,density", [("hope", 0.5), ("paper", 0.6), ("hope", 0.1)])
def test_sizes_and_alive_match_engine_and_slim_model(quality, cost, density):
    model = small_resnet(seed=3)
    original = copy_model(model)
    analysis = hope_keras.analyze(model)
    sizes = quality.Sizes(model, analysis)
    block_groups = {b.name: list(b.groups) for b in analysis.graph.blocks}
    res = hope_keras.compress(model, density=density, cost=cost, verbose=False,
                              actions=("prune", "merge", "evict"))
    traj = res.trajectory
    assert len(traj) > 0
    # Density 0.1 (the lowest reachable) forces the eviction of the one residual block.
    if density == 0.1:
        assert "evict" in set(traj.field("kind"))
    alive, evicted = quality.alive_after(traj, len(traj), sizes.sizes, block_groups)
    params, flops = sizes(alive, evicted)
    last = traj.steps[-1]
    assert params == pytest.approx(last.params_after, abs=1e-12)
    assert flops == pytest.approx(last.flops_after, abs=1e-12)
    # Independently: the slimmed model's own count, and its live widths.
    slim = hope_keras.slim(model)
    p_slim = hope_keras.profile(slim, reference=original, latency=False)
    assert params == pytest.approx(p_slim.ratio("params"), abs=1e-12)
    assert flops == pytest.approx(p_slim.ratio("flops"), abs=1e-12)
    # A cost that prices fewer groups: the benchmark's density counts every neuron.
    n_priced = traj.meta["num_neurons"]
    assert sum(alive.values()) == analysis.num_neurons - (n_priced - last.active_after)
    for g, n in alive.items():
        assert 0 <= n <= sizes.sizes[g]


def test_sizes_is_stateless(quality):
    model = small_resnet(seed=4)
    analysis = hope_keras.analyze(model)
    sizes = quality.Sizes(model, analysis)
    full = dict(sizes.sizes)
    assert sizes(full) == (1.0, 1.0)
    g = next(iter(full))
    half = dict(full, **{g: full[g] // 2})
    first = sizes(half)
    assert first[0] < 1.0 and first[1] < 1.0
    assert sizes(full) == (1.0, 1.0)  # the counter was copied, not consumed
    assert sizes(half) == first
    assert np.isfinite(sizes.mean_params) and sizes.mean_flops > 0


def test_variant_costs_price_the_scope_their_names_claim(quality):
    # A scope set as a class attribute is overwritten by HopeCost.__init__: the
    # "neuron layers only" variant then priced every group, the default itself.
    ctx = {"mean_params": 1.0, "mean_flops": 1.0, "mean_n0": 1.0}
    methods = quality.hope_methods(ctx)
    scope = {name: opts["cost"].groups for name, (opts, _) in methods.items()
             if hasattr(opts.get("cost"), "groups")}
    assert scope["hope_neurons"] == "neurons"
    assert scope["hope_nostreams"] == "no_streams"
    assert scope["order_param"] == "no_streams"
    assert scope["hope_one_reader"] == "all"
    model = small_resnet(seed=5)
    analysis = hope_keras.analyze(model)
    enc = hope_keras.Encoder(model, cost=methods["hope_neurons"][0]["cost"],
                             analysis=analysis, verbose=False)
    streams = sum(g.size for g in analysis.graph.groups.values() if g.kind != "neurons")
    assert streams > 0
    assert enc.num_neurons == analysis.num_neurons - streams


@pytest.fixture(scope="module")
def quality_report(quality):  # `quality` puts benchmarks/ on the path
    import _quality_report as quality_report

    return quality_report


def test_kept_counts_stream_channels_and_other_neurons(quality, quality_report, tmp_path,
                                                       monkeypatch, capsys):
    """`quality.py --kept` splits each stored point's live channels into the residual
    streams and the rest, with the stream groups taken from an analysis of the model
    when the results predate their recording (the demo: one stream group, `conv2`)."""
    import json

    streams = quality.stream_groups(hope_keras.analyze(
        hope_keras.data.load_demo_model()))
    assert streams == ["conv2"]
    groups = {"conv1": 32, "conv2": 64, "res_conv1": 64, "conv3": 64, "fc1": 128}
    alive = {"conv1": 30, "conv2": 50, "res_conv1": 60, "conv3": 64, "fc1": 100}
    point = {"target": 0.9, "acc": {"sel": 0.9123, "heldout": 0.8876}, "alive": alive}
    info = {"groups": groups}
    (tmp_path / "quality_demo.json").write_text(json.dumps(
        {"info": info, "results": {"hope": {"density": [point]}}}))
    monkeypatch.setattr(quality_report, "RESULTS", tmp_path)
    quality_report.kept("demo", ["hope"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert "of 64" in rows[0] and "of 288" in rows[0]
    assert rows[-1] == "| hope | 0.9 | 50 | 254 | 91.2 / 88.8 |"
    info["streams"] = ["fc1"]  # recorded with the results: read, not re-derived
    (tmp_path / "quality_demo.json").write_text(json.dumps(
        {"info": info, "results": {"hope": {"density": [point]}}}))
    quality_report.kept("demo", ["hope"])
    assert capsys.readouterr().out.splitlines()[-1] == "| hope | 0.9 | 100 | 204 | 91.2 / 88.8 |"


def test_surrogate_behind_merges_trusts_merged_groups_only_inside(quality):
    """`hope_trust_merges`' switch: inside it the data-free correction's untrusted
    tensors leave out what only a merge reaches (an eviction or a moved residual sum
    still counts); outside, and after an error, the library's rule is back."""
    from hope_keras.search.encoder import Action
    from hope_keras.stats import bn_stats

    model = small_resnet(seed=3)
    enc = hope_keras.Encoder(model, correction=False, verbose=False)
    merged = next(n for n, g in enc.graph.groups.items() if g.kind == "neurons" and not g.stream)
    enc.execute(Action("merge", merged, 0, 1, 0.0, 0.0, 1.0, 1))
    steps = enc.trajectory.steps
    library = bn_stats.untrusted_tensors
    behind = bn_stats.downstream_of(enc.graph, {merged})
    assert behind and behind <= library(enc.graph, steps, "auto")
    with quality.surrogate_behind_merges(True):
        inside = bn_stats.untrusted_tensors(enc.graph, steps, "auto")
        assert bn_stats.untrusted_tensors(enc.graph, steps, True) == set()
    rule = library(enc.graph, steps, "auto")
    assert inside < rule and (rule - inside) <= behind
    with pytest.raises(RuntimeError):
        with quality.surrogate_behind_merges(True):
            raise RuntimeError("restored after an error")
    assert bn_stats.untrusted_tensors is library
    with quality.surrogate_behind_merges(False):
        assert bn_stats.untrusted_tensors is library


def test_the_benchmarks_merges_setting_patches_only_when_asked(quality, monkeypatch):
    """``HOPE_BENCH_MERGES``: unset or ``untrusted`` keeps the library's rule,
    ``trusted`` is `hope_trust_merges`' rule for a whole script, anything else is
    refused with the value echoed."""
    import sys

    from hope_keras.search.encoder import Action
    from hope_keras.stats import bn_stats

    common = sys.modules["_common"]
    library = bn_stats.untrusted_tensors
    monkeypatch.setattr(bn_stats, "untrusted_tensors", library)
    assert common.apply_merges_setting({}) is False
    assert common.apply_merges_setting({common.MERGES_ENV: "untrusted"}) is False
    assert bn_stats.untrusted_tensors is library
    with pytest.raises(SystemExit, match="Received: 'maybe'"):
        common.apply_merges_setting({common.MERGES_ENV: "maybe"})
    assert common.apply_merges_setting({common.MERGES_ENV: "trusted"}) is True
    assert common.apply_merges_setting({common.MERGES_ENV: "trusted"}) is True  # once
    model = small_resnet(seed=3)
    enc = hope_keras.Encoder(model, correction=False, verbose=False)
    merged = next(n for n, g in enc.graph.groups.items() if g.kind == "neurons" and not g.stream)
    enc.execute(Action("merge", merged, 0, 1, 0.0, 0.0, 1.0, 1))
    steps = enc.trajectory.steps
    assert bn_stats.untrusted_tensors(enc.graph, steps, "auto") == library(
        enc.graph, steps, "auto", trust_merges=True)
    assert bn_stats.untrusted_tensors.func is library
