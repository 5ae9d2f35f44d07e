"""lmkv's own threads, kept off the cores an engine pins its compute to.

An engine may pin its compute threads one to a core: vLLM's CPU backend binds each OpenMP
thread, the worker's main thread included, to a core of its own. A thread inherits the mask of
the thread that starts it, so lmkv's I/O threads, started from the worker's main thread, would
all share that one core with the engine's busiest thread, which spins while it waits for the
next step. Measured on vLLM's CPU engine: a producer's write-through of 62 pages (248 MiB) to
an lmkv server stalled after its first page and timed out after 10 s, where the same write from
an unpinned process took 0.1-0.6 s.

So each lmkv thread starts by widening its mask to the CPUs its engine process was given as a
whole: those of the parent process (the engine core or ``vllm serve``), which a user's own
``taskset`` or cpuset still bounds. Where that cannot be read, the mask stays as inherited.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor


def widen_affinity() -> None:
    """Let the calling thread run on every CPU its process tree was given (see the module doc)."""
    try:
        mine = os.sched_getaffinity(0)
        given = os.sched_getaffinity(os.getppid()) if os.getppid() > 1 else mine
        if not given <= mine:
            os.sched_setaffinity(0, mine | given)
    except (AttributeError, OSError):  # (no affinity on this platform, a parent gone or not ours)
        pass


def pool(workers: int, name: str) -> ThreadPoolExecutor:
    """A thread pool whose threads run on the engine's CPUs, not its pinned compute core."""
    return ThreadPoolExecutor(workers, thread_name_prefix=name, initializer=widen_affinity)


def start(target: Callable[..., object], name: str, *args: object) -> threading.Thread:
    """A daemon thread running ``target(*args)`` on the engine's CPUs, started."""

    def run() -> None:
        widen_affinity()
        target(*args)

    th = threading.Thread(target=run, name=name, daemon=True)
    th.start()
    return th
