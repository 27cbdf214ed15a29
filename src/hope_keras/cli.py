"""The `hope-keras` command line.

    hope-keras analyze MODEL.keras
    hope-keras compress MODEL.keras (--density D | --params P | --flops F | --steps N
                                     | --latency-budget R)
                        --out SLIM.keras [--trajectory T.npz] [--cost hope|paper]
                        [--actions prune,merge,evict] [--data X.npy]
                        [--round-to N] [--fold-batchnorm] [--latency] [--quiet]
    hope-keras replay MODEL.keras T.npz (--density D | --params P | --flops F | --step K)
                      --out OUT.keras [--no-slim]
    hope-keras report T.npz --out report.png [--model MODEL.keras [--latency]]
    hope-keras export SLIM.keras --out SLIM.tflite [--quantize dynamic]

`compress` (and `report` given the original model) print the parameters and FLOPs
of the original and the slimmed model (`hope_keras.profile`); `--latency` also times
both (interleaved, `predict` and a compiled call). `--latency-budget R` is a different
thing: a budget, run until the slimmed model's measured latency is at most R times the
original's (`compress(latency=R)`: a compiled call, batch 1, on this machine).

Exit status: 0 on success, 1 when the library refuses the input (the message says
why), 2 on a usage error (checked before any work, output paths included), 130 when
interrupted (Ctrl-C).

TensorFlow is imported only once the arguments are valid (``--help`` and
``--version`` answer at once), and its start-up lines (absl, oneDNN, CUDA, CPU
features) are kept off standard error.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import zipfile

ACTIONS = ("prune", "merge", "evict")

# TensorFlow's start-up chatter: absl's pre-init warning, glog-style INFO/WARNING lines
# (oneDNN, cudart stub, CPU feature guard), CUDA errors on machines without a GPU, and
# the CPU-instructions note.
_NOISE = re.compile(
    r"WARNING: All log messages before absl::InitializeLog\(\) is called"
    r"|[IW]\d{4} [\d:.]+\s+\d+ \S+:\d+\] "
    r"|E\d{4} [\d:.]+\s+\d+ \S*cuda\S*:\d+\] "
    r"|E\d{4} .*(cuInit|cuDNN|cuFFT|cuBLAS)"
    r"|To enable the following instructions: .*rebuild TensorFlow"
    r"|This TensorFlow binary is optimized to use available CPU instructions"
)


def _import_tensorflow_quietly() -> None:
    """Imports TensorFlow and Keras with their start-up lines kept off stderr.

    TensorFlow's C++ logging writes to file descriptor 2 before any Python setting
    applies, so the descriptor is pointed at a temporary file during the import (and
    the first device initialisation); lines that are not start-up noise are passed on.
    """
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    if "tensorflow" in sys.modules:
        return
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (AttributeError, OSError, ValueError):  # no real stderr: nothing to keep clean
        import keras  # noqa: F401
        return
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            import tensorflow as tf
            import keras  # noqa: F401

            tf.constant(0.0)  # device initialisation logs its CUDA lines here
        finally:
            try:
                sys.stderr.flush()
            finally:
                os.dup2(saved, 2)
                os.close(saved)
            tmp.seek(0)
            kept = [line for line in tmp.read().decode(errors="replace").splitlines(True)
                    if not _NOISE.search(line)]
            if kept:
                sys.stderr.write("".join(kept))
                sys.stderr.flush()
    try:
        import absl.logging

        absl.logging.set_verbosity(absl.logging.ERROR)
    except ImportError:
        pass


def _build(spec: str, input_shape=None):
    """``module:function`` (the model's Python code): the model it returns, built."""
    import importlib

    import keras

    module, _, name = spec.partition(":")
    sys.path.insert(0, os.getcwd())  # a builder in the current folder
    try:
        builder = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"Could not import the model builder '{spec}' ({type(e).__name__}: "
                         f"{e}). Give module:function, e.g. mypackage.models:build_model.") from None
    finally:
        sys.path.pop(0)
    model = builder()
    if not isinstance(model, keras.Model):
        raise ValueError(f"The builder '{spec}' returned {type(model).__name__}, not a "
                         "keras.Model.")
    if input_shape is not None:
        import numpy as np

        model(np.zeros((1, *input_shape), "float32"))  # builds every layer, as a call does
    return model


def _load(path, weights=None, input_shape=None):
    """A .keras/.h5 model file, or ``module:function`` then ``--weights`` loaded into it
    (a weights-only checkpoint: build the model, load the weights, compress, save)."""
    if ":" in path and not os.path.exists(path):
        model = _build(path, input_shape)
        if weights:
            if not os.path.exists(weights):
                raise FileNotFoundError(f"No weights file at '{weights}'.")
            model.load_weights(weights)
        return model
    if weights:
        raise ValueError(f"--weights needs the model's code: give MODEL as "
                         f"module:function, not the file '{path}'.")
    return _load_file(path)


def _load_file(path):
    if not os.path.exists(path):
        raise FileNotFoundError(f"No model file at '{path}'.")
    if os.path.isdir(path):
        raise ValueError(f"'{path}' is a directory, not a .keras model file.")
    if path.endswith(".keras") and not zipfile.is_zipfile(path):
        raise ValueError(
            f"'{path}' is not a Keras model file: a .keras file is a zip archive and this "
            "one is not (corrupt, truncated or another format). Save models with "
            "model.save('name.keras').")
    import keras

    try:
        return keras.models.load_model(path, compile=False)
    except Exception as e:  # whatever Keras says, the file is the problem
        raise ValueError(f"Could not load the Keras model '{path}' ({type(e).__name__}: "
                         f"{e}).") from None


def _analyze(args):
    import hope_keras

    hope_keras.analyze(_load(args.model, args.weights, args.input_shape),
                       kernel=args.kernel).summary()


def _compress(args):
    import hope_keras

    model = _load(args.model, args.weights, args.input_shape)
    n_params = model.count_params()
    try:
        result = hope_keras.Encoder(
            model, cost=args.cost, actions=args.actions,
            data=_load_data(args.data, model) if args.data else None,
            search={"round_to": args.round_to},
            verbose=False if args.quiet else "auto").compress(
            density=args.density, params=args.params, flops=args.flops, steps=args.steps,
            latency=None if args.latency_budget is None else hope_keras.LatencyBudget(
                args.latency_budget, fold_batchnorm=args.fold_batchnorm))
    except hope_keras.CompressionInterrupted as e:
        if args.trajectory:
            e.trajectory.save(args.trajectory)
            print(f"Interrupted after {len(e.trajectory)} steps; wrote them to "
                  f"{args.trajectory} (hope-keras replay can apply them).", file=sys.stderr)
        raise
    # The trajectory first: whatever happens to the slim model, the run is kept.
    if args.trajectory:
        result.trajectory.save(args.trajectory)
    small = hope_keras.slim(model)
    if args.fold_batchnorm:
        small = hope_keras.fold_batchnorm(small)
    small.save(args.out)
    if not args.quiet:
        print(f"{len(result.trajectory)} steps, neuron density {result.density:.4f}, "
              f"parameters {small.count_params()} ({result.params_ratio:.4f} of "
              f"{n_params})"
              + ("" if result.latency_ratio is None else
                 f", measured latency ratio {result.latency_ratio:.3f}")
              + f"; stopped: {result.stopped}. Wrote {args.out}"
              + (f" and {args.trajectory}" if args.trajectory else ""))
        # `model` is the in-place result: the original's shapes, hence its cost.
        hope_keras.profile(small, reference=model, latency=args.latency).summary()


def _load_data(path, model):
    """The unlabeled inputs of ``--data``: a ``.npy`` array, or the first array of a
    ``.npz`` (its ``x`` if it has one), cast to the model's input dtype; for a model
    of several inputs, a ``.npz`` of one array per input, named as its inputs."""
    import numpy as np

    from hope_keras.graph import adapter as kg

    inputs = kg.functional_of(model).inputs  # a subclassed model: its traced graph's
    names = kg.input_names(model)
    try:
        loaded = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise ValueError(f"Could not read --data '{path}' as a .npy or .npz array ({e}).") \
            from None
    several = (f"model '{model.name}' takes {len(names)} inputs: give a .npz of one "
               f"array per input, named {names}")
    if isinstance(loaded, np.lib.npyio.NpzFile):
        with loaded:
            if not loaded.files:
                raise ValueError(f"--data '{path}' holds no array.")
            if len(inputs) > 1:
                missing = [n for n in names if n not in loaded.files]
                if missing:
                    raise ValueError(f"--data '{path}' holds {loaded.files}; {several} "
                                     f"(missing {missing}).")
                return {n: loaded[n].astype(t.dtype) for n, t in zip(names, inputs)}
            loaded = loaded["x" if "x" in loaded.files else loaded.files[0]]
    if len(inputs) > 1:
        raise ValueError(f"--data '{path}' holds one array; {several}.")
    want = tuple(inputs[0].shape[1:])
    if loaded.ndim != len(want) + 1 or any(
            w is not None and w != g for w, g in zip(want, loaded.shape[1:])):
        raise ValueError(f"--data '{path}' holds an array of shape {loaded.shape}; model "
                         f"'{model.name}' takes inputs of shape {(None,) + want}.")
    return loaded.astype(inputs[0].dtype)


def _replay_on(trajectory, model, no_check, **target):
    """`Trajectory.replay`, its advice in this command's terms (``--no-check``)."""
    try:
        trajectory.replay(model, check=not no_check, **target)
    except ValueError as e:
        raise ValueError(str(e).replace("pass check=False", "pass --no-check")) from None


def _replay(args):
    import hope_keras

    model = _load(args.model)
    trajectory = hope_keras.Trajectory.load(args.trajectory)
    target = {k: getattr(args, k) for k in ("density", "params", "flops", "step")
              if getattr(args, k) is not None}
    _replay_on(trajectory, model, args.no_check, **target)
    out = model if args.no_slim else hope_keras.slim(model)
    out.save(args.out)
    if not args.quiet:
        (what, value), = target.items()
        print(f"Replayed to {what} {value}; {out.count_params()} parameters. "
              f"Wrote {args.out}")


def _report(args):
    from hope_keras import plots
    from hope_keras.search.trajectory import Trajectory

    trajectory = Trajectory.load(args.trajectory)
    model = None
    if args.model:  # replayed first: a model the trajectory does not fit writes nothing
        model = _load(args.model)
        _replay_on(trajectory, model, args.no_check, step=len(trajectory))
    plots.report(trajectory, args.out)
    if not args.quiet:
        print(f"Wrote {args.out}")
    if model is not None:
        import hope_keras

        if not args.quiet:
            hope_keras.profile(hope_keras.slim(model), reference=model,
                               latency=args.latency).summary()


def _export(args):
    import hope_keras

    flatbuffer = hope_keras.export_tflite(_load(args.model), args.out,
                                          quantize=args.quantize)
    if not args.quiet:
        print(f"Wrote {args.out} ({len(flatbuffer)} bytes)")


# ------------------------------------------------------------- argument types
def _fraction(text):
    try:
        value = float(text)
    except ValueError:
        value = None
    if value is None or not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be a number in (0, 1], got {text!r}")
    return value


def _count(minimum):
    def parse(text):
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum:
            raise argparse.ArgumentTypeError(f"must be an integer ≥ {minimum}, got {text!r}")
        return value
    return parse


def _actions(text):
    actions = tuple(a.strip() for a in text.split(",") if a.strip())
    bad = [a for a in actions if a not in ACTIONS]
    if bad or not actions:
        raise argparse.ArgumentTypeError(
            f"must be a comma-separated subset of {','.join(ACTIONS)}, got {text!r}")
    return actions


def _check_output(parser, option, path, extensions=None):
    """A usage error now rather than after the run: a writable file path."""
    if path is None:
        return
    if extensions and not path.endswith(extensions):
        parser.error(f"{option} must end with {' or '.join(extensions)}, got '{path}'")
    if os.path.isdir(path):
        parser.error(f"{option} '{path}' is a directory; give a file path")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        parser.error(f"{option} '{path}': the folder '{folder}' does not exist")
    if not os.access(folder, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        parser.error(f"{option} '{path}' is not writable")


def _shape(text):
    try:
        dims = tuple(int(d) for d in text.split(","))
    except ValueError:
        dims = ()
    if not dims or min(dims) < 1:
        raise argparse.ArgumentTypeError(
            f"expected the input shape without the batch axis, e.g. 64,64,3. Received: "
            f"{text!r}")
    return dims


def _weights_options(parser):
    parser.add_argument("--weights", help="a weights file (.weights.h5) to load into the "
                                          "model that module:function builds")
    parser.add_argument("--input-shape", type=_shape,
                        help="build the module:function model for this input shape "
                             "(no batch axis, e.g. 64,64,3) before loading --weights")


def _parser():
    from hope_keras import __version__

    p = argparse.ArgumentParser(prog="hope-keras",
                                description="Data-free compression of Keras models (HOPE).")
    p.add_argument("--version", action="version", version=f"hope-keras {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name, help):
        sp = sub.add_parser(name, help=help, description=help[0].upper() + help[1:] + ".")
        sp.add_argument("--quiet", "-q", action="store_true",
                        help="no progress bar and no summary line")
        return sp

    a = command("analyze", "print the compressible groups, blocks and pinned layers")
    a.add_argument("model", help="the model: a .keras (or .h5) file, or module:function "
                                 "that builds it (then --weights)")
    _weights_options(a)
    a.add_argument("--kernel", choices=("approx", "exact"), default="approx",
                   help="cross-kernel: the paper's zero-bias approximation (default) or "
                        "the exact one")
    a.set_defaults(fn=_analyze)

    c = command("compress", "compress a model and save the slimmed one")
    c.add_argument("model", help="the model to compress: a .keras (or .h5) file (not "
                                 "changed), or module:function that builds it (then "
                                 "--weights)")
    _weights_options(c)
    budget = c.add_mutually_exclusive_group(required=True)
    budget.add_argument("--density", type=_fraction,
                        help="target neuron density in (0, 1]: compressible neurons kept")
    budget.add_argument("--params", type=_fraction,
                        help="target ratio of parameters kept, in (0, 1]")
    budget.add_argument("--flops", type=_fraction,
                        help="target ratio of FLOPs per example kept, in (0, 1]")
    budget.add_argument("--steps", type=_count(1), help="number of actions to execute")
    budget.add_argument("--latency-budget", type=_fraction, metavar="R",
                        help="target ratio of measured latency, slimmed / original, in "
                             "(0, 1]: timed on this machine (compiled call, batch 1)")
    c.add_argument("-o", "--out", required=True, help="where to save the slimmed model (.keras)")
    c.add_argument("--trajectory", help="also save the trajectory (.npz), to replay or "
                                        "plot the run")
    c.add_argument("--cost", choices=("hope", "paper"), default="hope",
                   help="the library's width-free cost (default) or the paper's J / P_init")
    c.add_argument("--actions", type=_actions, default=ACTIONS,
                   help="comma-separated actions allowed (default: prune,merge,evict)")
    c.add_argument("--data", help="unlabeled inputs of the model (.npy, or .npz with "
                                  "an array x; a model of several inputs: a .npz of one "
                                  "array per input, named as its inputs): the BatchNorm "
                                  "statistics the run leaves stale are re-estimated on "
                                  "them (default: data-free)")
    c.add_argument("--round-to", type=_count(1), default=1, metavar="N",
                   help="every layer the run narrows ends at a multiple of N channels "
                        "(or whole): 8 suits CPU kernels (default: 1, any width)")
    c.add_argument("--fold-batchnorm", action="store_true",
                   help="fold BatchNormalization layers into the layers before them in the "
                        "saved model (deployment: faster, no statistics left to fine-tune; "
                        "--latency-budget then times the folded model)")
    c.add_argument("--latency", action="store_true",
                   help="also time the original and the slimmed model")
    c.set_defaults(fn=_compress)

    r = command("replay", "replay a saved trajectory on the original model")
    r.add_argument("model", help="the original model the trajectory was recorded on (.keras)")
    r.add_argument("trajectory", help="the trajectory file (.npz) written by compress")
    target = r.add_mutually_exclusive_group(required=True)
    target.add_argument("--density", type=_fraction,
                        help="replay until the neuron density is ≤ this, in (0, 1]")
    target.add_argument("--params", type=_fraction,
                        help="replay until the parameter ratio is ≤ this, in (0, 1]")
    target.add_argument("--flops", type=_fraction,
                        help="replay until the FLOPs ratio is ≤ this, in (0, 1]")
    target.add_argument("--step", type=_count(0), help="replay exactly this many steps")
    r.add_argument("-o", "--out", required=True, help="where to save the result (.keras)")
    r.add_argument("--no-slim", action="store_true",
                   help="save the edited model at full size instead of the slimmed one")
    r.add_argument("--no-check", action="store_true",
                   help="replay on a model whose weights differ from those recorded (the "
                        "steps must still fit its groups)")
    r.set_defaults(fn=_replay)

    rep = command("report", "plot a trajectory (needs matplotlib)")
    rep.add_argument("trajectory", help="the trajectory file (.npz) written by compress")
    rep.add_argument("-o", "--out", required=True, help="the image to write (.png, .pdf or .svg)")
    rep.add_argument("--model", help="the original .keras model: also print the "
                     "profile of the trajectory's result against it")
    rep.add_argument("--latency", action="store_true", help="with --model: also time")
    rep.add_argument("--no-check", action="store_true",
                     help="with --model: replay on it even if its weights differ from "
                          "those recorded")
    rep.set_defaults(fn=_report)

    e = command("export", "convert a model to TensorFlow Lite")
    e.add_argument("model", help="a .keras file (e.g. the slimmed model)")
    e.add_argument("-o", "--out", required=True, help="the .tflite file to write")
    e.add_argument("--quantize", choices=("dynamic",), default=None,
                   help="dynamic-range quantisation (int8 weights)")
    e.set_defaults(fn=_export)
    p.commands = {"analyze": a, "compress": c, "replay": r, "report": rep, "export": e}
    return p


def _same_file(a, b) -> bool:
    if not a or not b:
        return False
    if os.path.exists(a) and os.path.exists(b):
        return os.path.samefile(a, b)
    return os.path.abspath(a) == os.path.abspath(b)


def _check_distinct(parser, args) -> None:
    """An output must not overwrite the input model or another output."""
    model = getattr(args, "model", None)
    out = getattr(args, "out", None)
    if args.command in ("compress", "replay") and _same_file(out, model):
        parser.error(f"--out '{args.out}' is the input model: it would be overwritten "
                     "(the input is not changed); give another path")
    if _same_file(out, getattr(args, "trajectory", None)) and args.command == "compress":
        parser.error(f"--out and --trajectory are the same file '{args.out}'")


def main(argv=None) -> int:
    """Entry point of `hope-keras`; returns the exit status."""
    parser = _parser()
    args = parser.parse_args(argv)
    sub = parser.commands[args.command]
    if args.command in ("compress", "replay"):
        _check_output(sub, "--out", args.out, (".keras",))
    if args.command == "report":
        _check_output(sub, "--out", args.out, (".png", ".pdf", ".svg"))
    if args.command == "export":
        _check_output(sub, "--out", args.out, (".tflite",))
    if getattr(args, "trajectory", None) and args.command == "compress":
        _check_output(sub, "--trajectory", args.trajectory, (".npz",))
    if getattr(args, "data", None) and not os.path.isfile(args.data):
        sub.error(f"--data '{args.data}' is not a file")
    _check_distinct(sub, args)
    _import_tensorflow_quietly()
    try:
        args.fn(args)
    except (ValueError, OSError, ImportError) as e:
        print(f"hope-keras {args.command}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"hope-keras {args.command}: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
