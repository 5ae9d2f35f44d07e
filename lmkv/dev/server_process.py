"""``lmkv serve`` as a child process, for tests, benchmarks and the demo."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass


@dataclass
class ServerProcess:
    """An ``lmkv serve`` child process (tests, benchmarks, the demo); ``url`` is what ``remote.url`` takes."""

    proc: subprocess.Popen
    url: str
    port: int

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def spawn(*args: str, port: int = 0, env: dict[str, str] | None = None, timeout: float = 60.0) -> ServerProcess:
    """Start ``lmkv serve --port PORT ARGS...`` and wait until it listens."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "lmkv.cli", "serve", "--port", str(port), *args],
        stdout=subprocess.PIPE, text=True, env={**os.environ, **(env or {})},
    )
    ready = threading.Event()
    line: list[str] = []

    def first_line() -> None:
        assert proc.stdout is not None
        line.append(proc.stdout.readline())
        ready.set()
        for _ in proc.stdout:  # keep draining so the child never blocks on a full pipe
            pass

    threading.Thread(target=first_line, daemon=True).start()
    if not ready.wait(timeout) or not line[0].startswith("lmkv serve: lmkv://"):
        proc.kill()
        raise RuntimeError(f"lmkv serve did not start: {line[0] if line else 'no output'!r}")
    url = line[0].split()[2]
    return ServerProcess(proc, url, int(url.rsplit(":", 1)[1]))
