"""Random networks that draw every pattern README.md and docs/hope.md claim
(tests/fuzz_plan.py lists them), every budget kind, cost and action subset; each
compressed and checked by `fuzz_checks.check` (slim exact, live parameter count and
`profile`'s FLOPs, replay bit-identical, `.keras` reload in safe mode, documented
refusals).

`make test` compresses the few seeds 0..499 whose plans together draw every pattern
(`fuzz_plan.covering_seeds`); `make fuzz` compresses all 500 (``HOPE_FUZZ_N`` and
``HOPE_FUZZ_START`` choose another range) and prints the coverage table: per pattern,
how many networks drew it, in how many a group flows through it, and in how many a
step edited it. With 500 networks or more, every pattern must be drawn by at least
`MIN_DRAWS` of them.

The coverage comes from the plans, which depend on the seed alone: it holds whichever
processes ran the networks. The table's other columns come from the checks: those run
in this process, those written to ``HOPE_FUZZ_RESULTS`` (a folder; `make fuzz` runs the
networks on several pytest-xdist workers, then this test) and, for any seed in
neither, a check run here.
"""

import json
import os

import pytest

import fuzz_checks
import fuzz_plan
import fuzz_report

N = os.environ.get("HOPE_FUZZ_N")
START = int(os.environ.get("HOPE_FUZZ_START", "0"))
SEEDS = (list(range(START, START + int(N))) if N
         else fuzz_plan.covering_seeds(range(500)))
RESULTS = os.environ.get("HOPE_FUZZ_RESULTS")
MIN_DRAWS = 20
_INFOS = {}


def _to_json(info):
    return {k: (sorted(v) if isinstance(v, (set, frozenset)) else
                dict(v) if isinstance(v, dict) else list(v) if isinstance(v, tuple) else v)
            for k, v in info.items() if k not in ("targets", "cost")}


def _from_json(data):
    import collections

    data = dict(data)
    data["kinds"] = collections.Counter(data["kinds"])
    for key in ("patterns", "in_group", "edited"):
        data[key] = set(data[key])
    return data


@pytest.mark.parametrize("seed", SEEDS)
def test_random_network(seed):
    info = fuzz_checks.check(seed)
    _INFOS[seed] = info
    if RESULTS:
        os.makedirs(RESULTS, exist_ok=True)
        with open(os.path.join(RESULTS, f"{seed}.json"), "w") as f:
            json.dump(_to_json(info), f)


def test_the_plans_draw_every_pattern_often_enough():
    """The generator alone (no network built): each pattern in at least `MIN_DRAWS`
    of the 500 networks of `make fuzz`, in at least 5 % of 2000 others, and all of
    them in the networks `make test` compresses."""
    counts = fuzz_plan.coverage(range(500))
    assert not {k: v for k, v in counts.items() if v < MIN_DRAWS}, counts
    others = fuzz_plan.coverage(range(10_000, 12_000))
    assert not {k: v for k, v in others.items() if v < 0.05 * 2000}, others
    covered = fuzz_plan.coverage(fuzz_plan.covering_seeds(range(500)))
    assert all(covered.values()), covered


def _info(seed):
    if seed in _INFOS:
        return _INFOS[seed]
    path = os.path.join(RESULTS or "", f"{seed}.json")
    if RESULTS and os.path.exists(path):
        with open(path) as f:
            info = _from_json(json.load(f))
        if info["patterns"] == set(fuzz_plan.draw(seed).patterns):  # not a stale file
            return info
    _INFOS[seed] = fuzz_checks.check(seed)
    return _INFOS[seed]


def test_fuzz_coverage():
    infos = [_info(seed) for seed in SEEDS]
    rows, table = fuzz_report.coverage_table(SEEDS, infos)
    summary = fuzz_report.summarize(infos)
    print(f"\n{len(SEEDS)} networks (seeds {SEEDS[0]}..{SEEDS[-1]}): {summary}\n{table}")
    if len(SEEDS) >= 500:
        low = {r["pattern"]: r["drawn"] for r in rows if r["drawn"] < MIN_DRAWS}
        assert not low, f"patterns drawn by fewer than {MIN_DRAWS} networks: {low}"
        # A pattern the walker supports lies in a group in most networks that draw it
        # (the others: pinned by a neighbour, e.g. a shared layer or a fork).
        rare = {r["pattern"]: (r["in_group"], r["drawn"]) for r in rows if "in_group" in r
                and r["pattern"] not in fuzz_checks.PINNED_PATTERNS
                and r["in_group"] < 0.5 * r["drawn"]}
        assert not rare, f"patterns rarely inside a group (in group, drawn): {rare}"
    if len(SEEDS) >= 100:
        # Of the networks whose actions allowed it, the share in which it happened.
        assert summary["prune"] >= 0.5 and summary["merge"] >= 0.3, summary
        assert summary["evict"] >= 0.1, summary
        # Most latency runs meet their ratio (the others stop where documented).
        stops = summary["latency_stopped"]
        assert stops.get("budget", 0) >= 0.5 * sum(stops.values()) > 0, summary
