"""The BLAS threads of a HOPE run: merge tables filled in worker threads, and the
run loop's single BLAS thread where sketched groups compute rows in the background."""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading

from hope_keras.scoring.cache import wait_background


def cpu_count() -> int:
    """CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


_ONE_THREAD_LOCK = threading.Lock()
_one_thread_holders = [0, None]  # how many hold the limit, and its threadpoolctl limiter


@contextlib.contextmanager
def one_blas_thread():
    """BLAS (NumPy's OpenBLAS/MKL) limited to one thread (`threadpoolctl`) while any
    holder is inside: the first in sets the limit, the last out restores what was
    there before. Two encoders in two threads can overlap; limits nested per holder
    would be restored out of order and leave the process at one thread."""
    import threadpoolctl

    with _ONE_THREAD_LOCK:
        if _one_thread_holders[0] == 0:
            _one_thread_holders[1] = threadpoolctl.threadpool_limits(1, user_api="blas")
        _one_thread_holders[0] += 1
    try:
        yield
    finally:
        with _ONE_THREAD_LOCK:
            _one_thread_holders[0] -= 1
            if _one_thread_holders[0] == 0:
                limiter, _one_thread_holders[1] = _one_thread_holders[1], None
                limiter.restore_original_limits()


@contextlib.contextmanager
def run_threads(sketched: bool):
    """The run loop's BLAS threads: one where sketched groups merge. Their merged
    parents' Gram rows are products on a background thread
    (`SketchCache.prefetch_parent_rows`) while the main thread edits the model;
    with OpenBLAS's own threads on every core that product takes the main
    thread's core (the 4 × 8192 MLP's first 3000 steps: 28.73–30.09 s, 26.60–28.81
    s with one thread, CPU time halved; `benchmarks/scale.py`'s MLP). Products still running
    are waited for before the limit is lifted."""
    if not sketched:
        yield
        return
    with one_blas_thread():
        try:
            yield
        finally:
            wait_background()


def release_free_memory() -> None:
    """Returns the C allocator's free memory to the system (glibc's ``malloc_trim``;
    nothing elsewhere): the fill threads' temporaries stay in their own arenas, which
    the run's later allocations do not reuse (the 4 × 8192 MLP's first 1500 steps
    peaked at 3.23 GB without the trim, 3.14 with it, 3.12 filling one table after
    another)."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (AttributeError, OSError):
        pass
