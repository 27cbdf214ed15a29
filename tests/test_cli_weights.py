"""The weights-only checkpoint path of the CLI: build the model from its Python code,
load a .weights.h5 file, compress, save (`hope-keras compress module:function
--weights ...`)."""

import textwrap

import keras
import numpy as np

import hope_keras
from conftest import run_cli

BUILDER = textwrap.dedent('''
    import keras
    from keras import layers, ops


    class Net(keras.Model):
        def __init__(self):
            super().__init__()
            self.body = keras.Sequential([layers.Conv2D(12, 3, padding="same"),
                                          layers.BatchNormalization()], name="body")
            self.pool = layers.GlobalAveragePooling2D()
            self.head = layers.Dense(3)

        def call(self, x):
            return self.head(self.pool(ops.relu(self.body(x))))


    def build():
        return Net()
''')


def test_compress_a_weights_only_checkpoint(tmp_path, monkeypatch, capsys):
    (tmp_path / "ckpt_net.py").write_text(BUILDER)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    import ckpt_net

    rng = np.random.default_rng(0)
    trained = ckpt_net.build()
    trained(np.zeros((1, 8, 8, 3), "float32"))
    bn = trained.body.layers[1]
    bn.moving_mean.assign(rng.normal(size=12) * 0.3)
    bn.moving_variance.assign(rng.uniform(0.5, 2.0, size=12))
    trained.save_weights("net.weights.h5")

    status, out = run_cli(capsys, "compress", "ckpt_net:build", "--weights",
                          "net.weights.h5", "--input-shape", "8,8,3", "--density", "0.5",
                          "--out", "small.keras", "--quiet")
    assert status == 0, out.err
    small = keras.models.load_model("small.keras")
    # The same path in Python, on the user's subclassed model, edited in place.
    hope_keras.compress(trained, density=0.5, verbose=False)
    x = rng.normal(size=(4, 8, 8, 3)).astype("float32")
    np.testing.assert_allclose(small(x), trained(x), rtol=1e-4, atol=1e-5)
    assert small.count_params() < trained.count_params()

    # --data (unlabeled inputs for the BN statistics) on the traced subclassed model
    np.save("x.npy", rng.normal(size=(32, 8, 8, 3)).astype("float32"))
    status, out = run_cli(capsys, "compress", "ckpt_net:build", "--weights",
                          "net.weights.h5", "--input-shape", "8,8,3", "--density", "0.5",
                          "--data", "x.npy", "--out", "small_data.keras", "--quiet")
    assert status == 0, out.err
    assert keras.models.load_model("small_data.keras").count_params() == small.count_params()

    status, out = run_cli(capsys, "analyze", "ckpt_net:build", "--weights",
                          "net.weights.h5", "--input-shape", "8,8,3")
    assert status == 0 and "Compressible channels: 12 in 1 groups" in out.out


def test_weights_only_errors_name_what_was_received(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    status, out = run_cli(capsys, "compress", "no_such_module:build", "--weights",
                          "w.weights.h5", "--density", "0.5", "--out", "x.keras")
    assert status == 1 and "no_such_module:build" in out.err
    keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)]).save("m.keras")
    status, out = run_cli(capsys, "compress", "m.keras", "--weights", "w.weights.h5",
                          "--density", "0.5", "--out", "x.keras")
    assert status == 1 and "module:function" in out.err
    status, out = run_cli(capsys, "analyze", "m.keras", "--input-shape", "a,b")
    assert status == 2 and "'a,b'" in out.err
