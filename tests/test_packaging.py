"""The wheel ships the bundled data and the py.typed marker.

Building a wheel needs the network for the build isolation, so this checks the
declaration instead: every file under src/hope_keras/data/ that is not Python is
matched by a package-data pattern of pyproject.toml, and py.typed is declared and
present. (The wheel itself was inspected with
`pip wheel . --no-deps -w /tmp/w && python -m zipfile -l /tmp/w/*.whl`.)
"""

import fnmatch
import pathlib

try:
    import tomllib
except ImportError:  # Python 3.10: tomli is a test requirement there (pyproject.toml)
    import tomli as tomllib

ROOT = pathlib.Path(__file__).resolve().parent.parent
PKG = ROOT / "src" / "hope_keras"


def test_package_data_covers_the_bundled_files_and_py_typed():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    patterns = config["tool"]["setuptools"]["package-data"]["hope_keras"]
    assert "py.typed" in patterns and (PKG / "py.typed").exists()
    data = [p.relative_to(PKG).as_posix() for p in (PKG / "data").iterdir()
            if p.is_file() and p.suffix not in (".py", ".pyc")]
    assert data, "no bundled data found"
    for name in data:
        assert any(fnmatch.fnmatch(name, pat) for pat in patterns), (
            f"{name} would be missing from the wheel: add it to package-data")
