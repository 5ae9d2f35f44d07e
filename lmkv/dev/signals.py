"""Pausing a helper process (a server, a master) the way tests and benches simulate a stall."""

from __future__ import annotations

import os
import signal
import time


def pause(pid: int, timeout: float = 5.0) -> bool:
    """SIGSTOP ``pid`` and wait (at most ``timeout``) until it is stopped: the kernel stops it after
    ``kill`` returns, and a request sent in between is still answered. Whether it stopped."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout
    while not _stopped(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True


def _stopped(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return any(line.startswith("State:") and line.split()[1] == "T" for line in f)
    except OSError:
        return False
