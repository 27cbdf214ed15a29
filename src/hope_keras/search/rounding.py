"""Hardware-friendly widths: every group a HOPE run touches ends at a multiple of
``round_to`` channels (`SearchOptions(round_to=...)`, docs/hope.md, "Widths that suit
the hardware").

CPU and GPU kernels vectorise over blocks of 8 or 16 channels: a convolution with 34
output channels can be slower than one with 32. With ``round_to = r``, a group is
removed from in *rounds*: the run's ranking picks the cheapest action anywhere, as
without rounding; if it acts on a group of width ``w``, that group's next cheapest
actions follow until its width is the largest multiple of ``r`` below ``w``
(`WidthRounding.target`), and only then does the ranking look at every group again.
A budget is tested only between rounds, so the run stops at the first point where
every group is a multiple of ``r`` (or as it started) and the budget is met: the
budget is met from below, by at most one round. A group never goes below ``r``
channels by prunes and merges (an eviction still removes a whole block), so a group
of ``r`` channels or fewer is left whole.

Every step is an ordinary prune or merge, recorded as such: the trajectory replays
bit for bit, and `hope_keras.Trajectory.step_for` stops only between rounds (the
steps inside a round are listed in its metadata, ``"unrounded_steps"``), so a
replay to a budget gives the widths a direct run to that budget gives.
"""

from __future__ import annotations

import numbers
from typing import Optional, Tuple


def check_round_to(round_to) -> int:
    """``round_to`` as an int ≥ 1; a clear error otherwise."""
    if isinstance(round_to, bool) or not isinstance(round_to, numbers.Integral) \
            or round_to < 1:
        raise ValueError(f"round_to must be an integer ≥ 1 (1: any width). "
                         f"Received: round_to={round_to!r}")
    return int(round_to)


class WidthRounding:
    """The rounds of a run with ``round_to = multiple`` (1: every step is a round).

    Example:

    >>> from hope_keras.search.rounding import WidthRounding
    >>> r = WidthRounding(8)
    >>> r.target(30), r.target(32), r.target(8), r.min_width(100), r.min_width(5)
    (24, 24, None, 8, 5)
    """

    def __init__(self, multiple: int = 1):
        self.multiple = check_round_to(multiple)
        #: The group being rounded and the width its round ends at, or None.
        self.open: Optional[Tuple[str, int]] = None

    def target(self, width: int) -> Optional[int]:
        """The width a round started at `width` ends at: the largest multiple below
        `width`, or None when that is below `multiple` (the group stays as it is)."""
        r = self.multiple
        t = ((int(width) - 1) // r) * r
        return t if t >= r else None

    def min_width(self, width: int) -> int:
        """The narrowest a group of `width` live channels can get by prunes and
        merges: `multiple`, or `width` itself when it is not wider."""
        return int(width) if width <= self.multiple else self.multiple

    def start(self, group: str, width: int) -> None:
        """A prune or merge of `group` (now `width` wide) is executed: it opens a
        round unless one is open."""
        if self.open is None:
            target = self.target(width)
            if target is not None:
                self.open = (group, target)

    def after(self, group: str, width: int, trajectory=None) -> None:
        """`group` is now `width` wide: the round closes at its target, or goes on to
        the next multiple below when a merge of two dead neurons passed the target.
        A step inside a round is listed in ``trajectory.meta["unrounded_steps"]``
        (`Trajectory.step_for` stops only between rounds)."""
        self._close(group, width)
        if self.open is not None and trajectory is not None:
            trajectory.meta.setdefault("unrounded_steps", []).append(len(trajectory))

    def _close(self, group: str, width: int) -> None:
        if self.open is None or self.open[0] != group or width > self.open[1]:
            return
        if width % self.multiple == 0:
            self.open = None
        else:
            target = self.target(width)
            self.open = None if target is None else (group, target)
