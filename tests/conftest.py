"""Shared test helpers: small Keras models built in the test, with non-trivial BN."""

import os
import subprocess
import sys
import textwrap

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")
# No synthetic inputs kept between runs unless asked: every test makes its own (a file
# an earlier run or another test process left cannot stand in for the computation);
# tests of the cache set HOPE_KERAS_CACHE themselves.
os.environ.setdefault("HOPE_KERAS_CACHE", "off")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

L = keras.layers


def randomize_bn(model, seed=0, gamma=(0.5, 1.5), beta_sd=0.5):
    """Gives every BN non-trivial γ, β, moving mean and variance."""
    rng = np.random.default_rng(seed)
    for layer in model.layers:
        if isinstance(layer, L.BatchNormalization):
            n = layer.moving_mean.shape[0]
            values = {
                "gamma": rng.uniform(*gamma, n),
                "beta": rng.normal(0, beta_sd, n),
                "moving_mean": rng.normal(0, 0.3, n),
                "moving_variance": rng.uniform(0.5, 2.0, n),
            }
            for w in layer.weights:
                w.assign(values[w.name].astype("float32"))
    return model


def bn_relu(x, name=None):
    x = L.BatchNormalization(name=None if name is None else name + "_bn")(x)
    return L.ReLU(name=None if name is None else name + "_relu")(x)


def mlp(widths=(12, 10), d_in=6, d_out=3, seed=0, name="mlp"):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((d_in,), name="x")
    x = inputs
    for k, w in enumerate(widths):
        x = bn_relu(L.Dense(w, name=f"fc{k}")(x), f"fc{k}")
    outputs = L.Dense(d_out, name="head")(x)
    return randomize_bn(keras.Model(inputs, outputs, name=name), seed)


def clustered_mlp(seed, widths=(24, 20), noise=0.05):
    """An MLP whose hidden neurons come in noisy pairs and triples (input filter,
    BN statistics and output rows), so merges compete with prunes."""
    model = mlp(widths, d_in=7, seed=seed)
    rng = np.random.default_rng(seed)
    names = [f"fc{k}" for k in range(len(widths))] + ["head"]
    for k, w in enumerate(widths):
        src = rng.integers(0, w // 3, size=w)  # each neuron copies one of the first third
        src[: w // 3] = np.arange(w // 3)
        scale = rng.uniform(0.5, 2.0, size=w)
        p, bn, nxt = (model.get_layer(n) for n in (names[k], names[k] + "_bn", names[k + 1]))
        kern = p.kernel.numpy()
        new = kern[:, src] * (1 + noise * rng.normal(size=kern.shape))
        p.kernel.assign(new.astype("float32"))
        p.bias.assign((p.bias.numpy()[src] * (1 + noise * rng.normal(size=w))).astype("float32"))
        for attr in ("gamma", "beta", "moving_mean", "moving_variance"):
            v = getattr(bn, attr).numpy()[src]
            getattr(bn, attr).assign((v * (1 + noise * np.abs(rng.normal(size=w)))).astype("float32"))
        out = nxt.kernel.numpy()
        out = out[src] / scale[:, None] * (1 + noise * rng.normal(size=out.shape))
        nxt.kernel.assign(out.astype("float32"))
    return model


def small_resnet(seed=0, name="small_resnet"):
    """Conv stem, one identity block, Conv → pool → Flatten → Dense → BN → ReLU → head."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((10, 10, 3), name="image")
    x = bn_relu(L.Conv2D(8, 3, padding="same", name="stem")(inputs), "stem")
    y = bn_relu(L.Conv2D(6, 3, padding="same", name="b1a")(x), "b1a")
    y = L.Conv2D(8, 1, name="b1b")(y)
    y = L.BatchNormalization(name="b1b_bn")(y)
    x = L.ReLU(name="b1_out")(L.Add(name="b1_add")([x, y]))
    x = bn_relu(L.Conv2D(7, 3, name="c2")(x), "c2")
    x = L.MaxPooling2D(name="pool")(x)
    x = L.Flatten(name="flat")(x)
    x = bn_relu(L.Dense(9, name="fc")(x), "fc")
    outputs = L.Dense(4, name="head")(x)
    return randomize_bn(keras.Model(inputs, outputs, name=name), seed)


def conv_net(seed=0, widths=(24, 32, 20, 16)):
    """Plain conv net on 12 × 12 × 3: convs c1, c2 (same padding), max-pool, c3
    (valid), global pooling, Dense fc, head of 4; every hidden layer BN → ReLU, BN
    statistics randomised."""
    keras.utils.set_random_seed(seed)
    c1, c2, c3, fc = widths
    inputs = keras.Input((12, 12, 3))
    x = bn_relu(L.Conv2D(c1, 3, padding="same", name="c1")(inputs), "c1")
    x = bn_relu(L.Conv2D(c2, 3, padding="same", name="c2")(x), "c2")
    x = L.MaxPooling2D()(x)
    x = bn_relu(L.Conv2D(c3, 3, name="c3")(x), "c3")
    x = L.GlobalAveragePooling2D()(x)
    x = bn_relu(L.Dense(fc, name="fc")(x), "fc")
    return randomize_bn(keras.Model(inputs, L.Dense(4, name="head")(x), name="conv"), seed)


def run_cli(capsys, *args):
    """Runs ``hope-keras ARGS`` in this process (no TensorFlow start); returns
    (exit status, what it printed: pytest's captured ``out`` and ``err``)."""
    from hope_keras import cli

    capsys.readouterr()
    try:
        status = cli.main([str(a) for a in args])
    except SystemExit as e:
        status = e.code
    return status, capsys.readouterr()


def copy_model(model):
    clone = keras.models.clone_model(model)
    clone.set_weights(model.get_weights())
    return clone


def outputs_equal(a, b, x, rtol=1e-5, atol=1e-6):
    ya, yb = np.asarray(a(x)), np.asarray(b(x))
    scale = max(1.0, float(np.abs(ya).max()))
    return float(np.abs(ya - yb).max()) <= atol + rtol * scale


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


_TWO_CPUS = textwrap.dedent("""
    import os, sys
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
    import tensorflow as tf
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    sys.path.insert(0, sys.argv[1])
""")


def run_on_two_logical_cpus(script: str, timeout: int = 300) -> None:
    """Runs `script` in a fresh Python process whose CPU is split into two logical
    devices (``/cpu:0``, ``/cpu:1``: `tf.distribute.MirroredStrategy` needs them set
    before TensorFlow starts), with the tests folder importable; it must print
    ``MIRRORED_OK``."""
    tests = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", KERAS_BACKEND="tensorflow",
               CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "-c", _TWO_CPUS + textwrap.dedent(script), tests],
                          env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0 and "MIRRORED_OK" in proc.stdout, (
        proc.stdout[-3000:] + proc.stderr[-3000:])


def plant_duplicate(model, producer, consumer, src, dst, noise=0.05, seed=0):
    """Makes neuron `dst` of a Dense group a noisy copy of neuron `src` (inputs, BN and
    output row), so that merging them is cheap."""
    rng = np.random.default_rng(seed)
    p, bn, c = (model.get_layer(n) for n in (producer, producer + "_bn", consumer))
    k = p.kernel.numpy()
    k[..., dst] = k[..., src] * (1 + noise * rng.normal(size=k[..., src].shape))
    p.kernel.assign(k)
    for w in bn.weights:
        a = w.numpy()
        a[dst] = a[src]
        w.assign(a)
    u = c.kernel.numpy()
    u[dst] = u[src] * (1 + noise * rng.normal(size=u[src].shape))
    c.kernel.assign(u)
    return model


def widths_by_step(trajectory):
    """``(k, step, widths)`` after each step ``k`` (from 1) of `trajectory`:
    ``widths`` maps every group to its live channels, followed from the trajectory's
    metadata alone (an eviction empties its block's groups). One dict, updated in
    place between yields."""
    width = dict(trajectory.meta["groups"])
    active = trajectory.meta["num_neurons"]
    for k, s in enumerate(trajectory.steps, start=1):
        if s.kind == "evict":
            for g in trajectory.meta["block_groups"][s.unit]:
                width[g] = 0
        else:
            width[s.unit] -= active - s.active_after
        active = s.active_after
        yield k, s, width
