"""The `hope-keras` command line.

    hope-keras analyze MODEL.keras
    hope-keras compress MODEL.keras (--density D | --params P | --flops F | --steps N)
                        --out SLIM.keras [--trajectory T.npz] [--cost hope|paper]
                        [--merge-scale sum|paper] [--refresh local|neighbors]
                        [--actions prune,merge,evict] [--kernel approx|exact] [--quiet]
    hope-keras replay MODEL.keras T.npz (--density D | --params P | --flops F | --step K)
                      --out OUT.keras [--no-slim]
    hope-keras report T.npz --out report.png

Exit status: 0 on success, 1 when the library refuses the input (the message says
why), 2 on a usage error.
"""

from __future__ import annotations

import argparse
import os
import sys


def _load(path):
    import keras

    if not os.path.exists(path):
        raise FileNotFoundError(f"No model file at '{path}'.")
    return keras.models.load_model(path, compile=False)


def _analyze(args):
    import hope_keras

    hope_keras.analyze(_load(args.model), kernel=args.kernel).summary()


def _compress(args):
    import hope_keras

    model = _load(args.model)
    result = hope_keras.compress(
        model, density=args.density, params=args.params, flops=args.flops, steps=args.steps,
        cost=args.cost,
        actions=tuple(a.strip() for a in args.actions.split(",") if a.strip()),
        merge_scale=args.merge_scale, refresh=args.refresh, kernel=args.kernel,
        verbose=not args.quiet)
    small = hope_keras.slim(model)
    small.save(args.out)
    if args.trajectory:
        result.trajectory.save(args.trajectory)
    if not args.quiet:
        print(f"{len(result.trajectory)} steps, neuron density {result.density:.4f}, "
              f"parameters {small.count_params()} ({result.params_ratio:.4f} of "
              f"{model.count_params()}); stopped: {result.stopped}. Wrote {args.out}"
              + (f" and {args.trajectory}" if args.trajectory else ""))


def _replay(args):
    import hope_keras

    model = _load(args.model)
    trajectory = hope_keras.Trajectory.load(args.trajectory)
    target = {k: getattr(args, k) for k in ("density", "params", "flops", "step")
              if getattr(args, k) is not None}
    trajectory.replay(model, **target)
    out = model if args.no_slim else hope_keras.slim(model)
    out.save(args.out)
    if not args.quiet:
        (what, value), = target.items()
        print(f"Replayed to {what} {value}; {out.count_params()} parameters. "
              f"Wrote {args.out}")


def _report(args):
    from hope_keras import plots
    from hope_keras.trajectory import Trajectory

    plots.report(Trajectory.load(args.trajectory), args.out)
    if not args.quiet:
        print(f"Wrote {args.out}")


def _parser():
    p = argparse.ArgumentParser(prog="hope-keras",
                                description="Data-free compression of Keras models (HOPE).")
    sub = p.add_subparsers(dest="command", required=True)

    def common(sp):
        sp.add_argument("--quiet", "-q", action="store_true", help="no progress or summary")
        return sp

    a = common(sub.add_parser("analyze", help="print the compressible groups of a model"))
    a.add_argument("model", help="a .keras file")
    a.add_argument("--kernel", choices=("approx", "exact"), default="approx")
    a.set_defaults(fn=_analyze)

    c = common(sub.add_parser("compress", help="compress a model and save the slim one"))
    c.add_argument("model")
    budget = c.add_mutually_exclusive_group(required=True)
    budget.add_argument("--density", type=float, help="target neuron density in (0, 1]")
    budget.add_argument("--params", type=float, help="target parameter ratio in (0, 1]")
    budget.add_argument("--flops", type=float, help="target FLOPs ratio in (0, 1]")
    budget.add_argument("--steps", type=int, help="number of actions")
    c.add_argument("--out", required=True, help="where to save the slimmed .keras model")
    c.add_argument("--trajectory", help="also save the trajectory (.npz)")
    c.add_argument("--merge-scale", choices=("sum", "paper"), default="sum")
    c.add_argument("--refresh", choices=("local", "neighbors"), default="local")
    c.add_argument("--actions", default="prune,merge,evict")
    c.add_argument("--kernel", choices=("approx", "exact"), default="approx")
    c.add_argument("--cost", choices=("hope", "paper"), default="hope",
                   help="the library's width-free cost (default) or the paper's J / P_init")
    c.set_defaults(fn=_compress)

    r = common(sub.add_parser("replay", help="replay a trajectory on the original model"))
    r.add_argument("model")
    r.add_argument("trajectory")
    target = r.add_mutually_exclusive_group(required=True)
    target.add_argument("--density", type=float)
    target.add_argument("--params", type=float)
    target.add_argument("--flops", type=float)
    target.add_argument("--step", type=int)
    r.add_argument("--out", required=True)
    r.add_argument("--no-slim", action="store_true", help="save the in-place model")
    r.set_defaults(fn=_replay)

    rep = common(sub.add_parser("report", help="plot a trajectory (needs matplotlib)"))
    rep.add_argument("trajectory")
    rep.add_argument("--out", required=True, help="PNG path")
    rep.set_defaults(fn=_report)
    return p


def main(argv=None) -> int:
    """Entry point of `hope-keras`; returns the exit status."""
    args = _parser().parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    try:
        args.fn(args)
    except (ValueError, FileNotFoundError, ImportError) as e:
        print(f"hope-keras {args.command}: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
