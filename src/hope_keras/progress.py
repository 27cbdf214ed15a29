"""Progress bars for long work (`keras.utils.Progbar`), silenceable with ``verbose=False``."""

from __future__ import annotations

from typing import Iterable, Optional


def progress(items: Iterable, verbose: bool = True, what: str = "", total: Optional[int] = None):
    """Yields `items`, showing a Keras progress bar when `verbose` is true.

    Example:

    >>> list(progress([1, 2, 3], verbose=False))
    [1, 2, 3]
    """
    if not verbose:
        yield from items
        return
    import keras

    items = list(items) if total is None else items
    total = len(items) if total is None else total
    bar = keras.utils.Progbar(total, unit_name=what or "step")
    for k, item in enumerate(items):
        yield item
        bar.update(k + 1)
