"""Where numba may cache the library's compiled functions.

Compiled functions are cached on disk where numba finds a writable place: a
``NUMBA_CACHE_DIR`` the user set, ``__pycache__`` next to the module that defines
them, or numba's user cache directory (``~/.cache/numba``); with none writable they
are compiled in each process, uncached. Nothing here changes numba's settings for
other code.
"""

from __future__ import annotations

import os
import tempfile

from numba.misc.appdirs import AppDirs

__all__ = ["can_cache", "jit_options"]


def _writable(path: str) -> bool:
    """Whether files can be written under `path` (created if missing)."""
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            return True
    except OSError:
        return False


def can_cache(module_file: str) -> bool:
    """Whether numba has a writable cache location for the module `module_file`
    (where it looks, in its order); ``cache=True`` without one fails when the
    function is defined.

    Example:
        >>> import hope_keras._jit as jit
        >>> isinstance(jit.can_cache(jit.__file__), bool)
        True
    """
    if os.environ.get("NUMBA_CACHE_DIR"):
        return _writable(os.environ["NUMBA_CACHE_DIR"])
    here = os.path.join(os.path.dirname(os.path.abspath(module_file)), "__pycache__")
    return _writable(here) or _writable(AppDirs("numba", appauthor=False).user_cache_dir)


def jit_options(module_file: str) -> dict:
    """The ``numba.njit`` options of the library's kernels defined in `module_file`:
    cached where possible, and releasing the GIL."""
    return dict(cache=can_cache(module_file), nogil=True)
