"""What the fuzzer's checks found, as tables: per pattern how often the plans draw it
and how often a group flows through it and a step edits it, and a summary of the runs.

``python tests/fuzz_report.py --n 500`` checks 500 networks and prints both.
"""

from __future__ import annotations

import collections
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402

import fuzz_plan  # noqa: E402
from fuzz_checks import MODEL_PATTERNS, RUN_PATTERNS, check  # noqa: E402


def coverage_table(seeds, infos=None):
    """``(rows, text)``: per pattern the networks of `seeds` whose plan draws it and,
    from the checks' `infos` when given, in how many a group flows through it and a
    step edited it."""
    drawn = fuzz_plan.coverage(seeds)
    rows = []
    for tag, description in fuzz_plan.PATTERNS.items():
        row = {"pattern": tag, "drawn": drawn[tag], "description": description}
        if infos is not None and tag not in RUN_PATTERNS | MODEL_PATTERNS:
            row["in_group"] = sum(tag in i.get("in_group", ()) for i in infos)
            row["edited"] = sum(tag in i.get("edited", ()) for i in infos)
        rows.append(row)
    head = f"{'pattern':24s} {'drawn':>6s} {'in group':>9s} {'edited':>7s}  description"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['pattern']:24s} {r['drawn']:6d} {str(r.get('in_group', '')):>9s} "
                     f"{str(r.get('edited', '')):>7s}  {r['description']}")
    return rows, "\n".join(lines)


def summarize(infos):
    """What the checks found: networks compressed, the share of those whose actions
    allowed prune / merge / evict in which one happened, why runs stopped (and why
    the latency runs did), documented refusals met, slims with a zero-padded
    LayerNormalization, the largest slim errors (relative to each output's scale) and
    the mean seconds per network."""
    out = {"networks": len(infos)}
    done = [i for i in infos if sum(i["kinds"].values())]
    out["compressed"] = len(done)
    for kind in ("prune", "merge", "evict"):
        allowed = [i for i in done if kind in i["actions"]]
        out[kind] = round(sum(i["kinds"][kind] > 0 for i in allowed) / max(len(allowed), 1), 3)
    out["stopped"] = dict(collections.Counter(i["stopped"] for i in infos))
    out["refusals"] = sum(len(i["refusals"]) for i in infos)
    out["latency_stopped"] = dict(collections.Counter(
        i["latency_stopped"] for i in infos if i.get("latency_stopped")))
    out["layer_norm_zero_padded"] = sum(bool(i.get("zero_padded_ln")) for i in infos)
    for what, mixed in (("float32", False), ("mixed", True)):
        errs = [i["slim_rel_err"] for i in infos if i.get("mixed") == mixed]
        out[f"max_slim_rel_err_{what}"] = float(f"{max(errs, default=0.0):.2g}")
    out["mean_seconds"] = round(float(np.mean([i["seconds"] for i in infos])), 2) \
        if infos else 0.0
    return out


def main(argv=None):
    import argparse

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=500, help="number of networks")
    p.add_argument("--start", type=int, default=0, help="first seed")
    args = p.parse_args(argv)
    seeds = range(args.start, args.start + args.n)
    t0 = time.perf_counter()
    infos = [check(seed) for seed in seeds]
    print(f"{args.n} networks (seeds {seeds[0]}..{seeds[-1]}) in "
          f"{time.perf_counter() - t0:.1f} s: {summarize(infos)}")
    print(coverage_table(seeds, infos)[1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
