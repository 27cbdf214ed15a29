"""Writes docs/api.md, the API reference, from the public docstrings.

    .venv/bin/python scripts/make_api_docs.py          # rewrite docs/api.md
    .venv/bin/python scripts/make_api_docs.py --check  # exit 1 if docs/api.md is stale
"""

import importlib
import inspect
import os
import pathlib
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

MODULES = [
    "hope_keras",
    "hope_keras.costs",
    "hope_keras.layers",
    "hope_keras.activations",
    "hope_keras.plots",
    "hope_keras.deploy.profile",
    "hope_keras.deploy.export",
    "hope_keras.deploy.fold",
    "hope_keras.baselines",
    "hope_keras.graph.tracing",
    "hope_keras.deft",
    "hope_keras.derivative_matching",
]
OUT = pathlib.Path(__file__).resolve().parent.parent / "docs" / "api.md"


def _public(module):
    names = getattr(module, "__all__", None)
    if names is None:
        names = [n for n, obj in vars(module).items()
                 if not n.startswith("_") and (inspect.isfunction(obj) or inspect.isclass(obj))
                 and getattr(obj, "__module__", "") == module.__name__]
    return sorted(names)


def _signature(obj):
    try:
        return str(inspect.signature(obj))
    except (TypeError, ValueError):
        return "(...)"


def render() -> str:
    lines = ["# API reference", "",
             "Generated from the docstrings by `scripts/make_api_docs.py`; do not edit by "
             "hand (a test checks it is current).", ""]
    for name in MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        lines += [f"## `{name}`", ""]
        doc = inspect.getdoc(module)
        if doc:
            lines += [doc.split("\n\n")[0], ""]
        for attr in _public(module):
            obj = getattr(module, attr)
            if inspect.ismodule(obj):
                continue
            kind = "class" if inspect.isclass(obj) else "function"
            sig = _signature(obj) if callable(obj) else ""
            lines += [f"### `{name}.{attr}{sig}`", "", f"*{kind}*", ""]
            doc = inspect.getdoc(obj)
            if doc:
                lines += ["```text", doc, "```", ""]
    return "\n".join(lines).rstrip() + "\n"


def main():
    text = render()
    if "--check" in sys.argv:
        if not OUT.exists() or OUT.read_text() != text:
            print(f"{OUT} is stale: run scripts/make_api_docs.py")
            return 1
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
