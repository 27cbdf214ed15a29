"""Progress bars for long work (`keras.utils.Progbar`), with Keras-style ``verbose``.

``verbose="auto"`` shows a bar only when standard output is a terminal (or a
notebook), so logs and pipes stay clean; ``True`` forces it, ``False`` silences it.
Bars show the current value of each quantity (not Progbar's running average), count
the planned work, and always end their line.
"""

from __future__ import annotations

import sys
from typing import Iterable, Optional


def interactive() -> bool:
    """True when standard output is a terminal or an IPython kernel."""
    try:
        tty = bool(sys.stdout.isatty())
    except (AttributeError, ValueError):  # no stdout, or a closed one
        tty = False
    return tty or "ipykernel" in sys.modules


def resolve_verbose(verbose) -> bool:
    """Whether to show progress: ``"auto"`` (only when interactive), True or False.

    Example:

    >>> resolve_verbose(False), resolve_verbose(1)
    (False, True)
    """
    if isinstance(verbose, str):
        if verbose == "auto":
            return interactive()
    elif verbose in (0, 1):  # True, False and the integers Keras accepts
        return bool(verbose)
    raise ValueError(f"verbose must be True, False or 'auto'. Received: verbose={verbose!r}")


class WorkBar:
    """A progress bar over planned work that shows current values and ends its line.

    Args:
        total: The planned amount of work (None if unknown).
        unit: What one unit of work is (``"neuron"``, ``"step"``…), for the rate.
        verbose: ``"auto"``, True or False (see `resolve_verbose`).

    Example:

    >>> bar = WorkBar(10, "neuron", verbose=False)
    >>> bar.update(4, density=0.6)
    >>> bar.close()
    """

    def __init__(self, total: Optional[int], unit: str = "step", verbose="auto"):
        self.total = total
        self.done = 0
        self.values: dict = {}
        self._bar = None
        if resolve_verbose(verbose):
            import keras

            # No stateless metrics: every value is displayed as it is now.
            self._bar = keras.utils.Progbar(total, unit_name=unit, stateless_metrics=())

    def update(self, done: int, **values) -> None:
        """Work done so far (clipped to the total) and the current values."""
        self.done = done if self.total is None else min(done, self.total)
        self.values.update(values)
        if self._bar is not None:
            self._bar.update(self.done, list(self.values.items()), finalize=False)

    def close(self) -> None:
        """Draws the final state and ends the line (once)."""
        if self._bar is not None:
            self._bar.update(self.done, list(self.values.items()), finalize=True)
            self._bar = None


def progress(items: Iterable, verbose="auto", what: str = "", total: Optional[int] = None):
    """Yields `items`, showing a Keras progress bar when `verbose` asks for one.

    Example:

    >>> list(progress([1, 2, 3], verbose=False))
    [1, 2, 3]
    """
    if not resolve_verbose(verbose):
        yield from items
        return
    items = list(items) if total is None else items
    total = len(items) if total is None else total
    bar = WorkBar(total, what or "step", verbose=True)
    try:
        for k, item in enumerate(items):
            yield item
            bar.update(k + 1)
    finally:
        bar.close()
