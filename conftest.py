"""Every pytest run of this repository (tests and doctests): `compress` keeps no
synthetic inputs on disk, so tests never write to the user's cache directory
(tests/test_synthetic.py turns the cache on in a temporary directory)."""

import os

os.environ["HOPE_KERAS_CACHE"] = "off"
