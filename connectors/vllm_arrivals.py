"""Whether vLLM's engine loop has a request to take in: a pause in a step that runs nothing ends
when one comes.

While a consumer waits for a producer's pages, lmkv pauses the engine's empty steps (an engine
with a waiting request steps in a tight loop, and every step crosses to the worker processes:
see :meth:`lmkv.engine.scheduler.OffloadScheduler.pause_idle`). A request sent to the engine
meanwhile lands in the engine core's input queue, which its loop reads only between steps: the
pause would hold it up. vLLM gives a connector no handle on that queue, so the connector finds
it once, as vLLM builds it: the engine core (``EngineCoreProc``) creates its input queue, then
its scheduler, which builds the connector; the queue is an attribute of an object a few frames
up. Where it is not found (an engine core without one, a scheduler built alone in tests) the
pause keeps its own timing.
"""

from __future__ import annotations

import queue
import sys
from collections.abc import Callable
from types import FrameType

#: how many frames up from the connector's constructor the engine core's may be
MAX_DEPTH = 12


def engine_arrivals(depth: int = 2) -> Callable[[], bool] | None:
    """Whether the engine core whose construction called the caller (``depth`` frames up and
    beyond) has a request in its input queue; None where no such queue is found."""
    frame: FrameType | None
    try:
        frame = sys._getframe(depth)
    except ValueError:
        return None
    for _ in range(MAX_DEPTH):
        if frame is None:
            return None
        inputs = getattr(frame.f_locals.get("self"), "input_queue", None)
        if isinstance(inputs, queue.Queue):
            pending = inputs.queue  # (its length read without its lock: a momentary answer is enough)
            return lambda: len(pending) > 0
        frame = frame.f_back
    return None
