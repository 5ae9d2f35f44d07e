"""lmkv's threads run on the CPUs the engine process was given, not on the one core an engine
pinned the thread that started them to (vLLM's CPU backend pins its worker's main thread)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or (os.cpu_count() or 1) < 2,
                                reason="needs CPU affinity and two CPUs")


def test_threads_started_from_a_pinned_thread_run_on_the_process_trees_cpus():
    """A child process (an engine worker) pins its main thread to one CPU, as vLLM's CPU backend
    does, then starts lmkv threads: they run on every CPU its parent may use; a plain thread
    stays pinned (the case the module exists for)."""
    code = textwrap.dedent("""
        import os, threading
        from lmkv import threads
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
        seen = {}
        def note(name):
            seen[name] = sorted(os.sched_getaffinity(0))
        threads.start(note, "t", "started").join()
        threads.pool(1, "p").submit(note, "pooled").result()
        t = threading.Thread(target=note, args=("plain",)); t.start(); t.join()
        print(seen)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    seen = eval(out)  # noqa: S307 (our own child's repr of a dict of lists)
    given = sorted(os.sched_getaffinity(0))
    assert seen["started"] == given and seen["pooled"] == given
    assert len(seen["plain"]) == 1


CHILD = """
import os
from lmkv import threads
os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
seen = []
threads.start(lambda: seen.append(sorted(os.sched_getaffinity(0))), "t").join()
print(seen[0])
"""


def test_a_users_own_pinning_still_bounds_lmkvs_threads(tmp_path):
    """``taskset`` on the engine (here: its parent pinned to one CPU) bounds lmkv's threads too:
    they widen to the parent's CPUs, never to the whole machine."""
    child = tmp_path / "child.py"
    child.write_text(CHILD)
    first = min(os.sched_getaffinity(0))
    middle = f"import subprocess, sys; subprocess.run([sys.executable, {str(child)!r}], check=True)"
    out = subprocess.run([sys.executable, "-c", middle], capture_output=True, text=True, check=True,
                         preexec_fn=lambda: os.sched_setaffinity(0, {first})).stdout
    assert eval(out.strip()) == [first]  # noqa: S307
