"""Start a real ``mooncake_master`` (and a storage client, ``mooncake_client``) on loopback, for
tests and benchmarks.

lmkv never starts Mooncake for users; this is what the test-suite and ``lmkv bench`` use so that
they test against the real store. The master binds loopback only (by default it listens on
every address, its metrics port too).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from lmkv.dev.redis_server import free_port
from lmkv.dev.signals import pause


def _binary(name: str = "mooncake_master") -> str:
    here = Path(sys.executable).parent / name  # (installed beside this interpreter)
    path = str(here) if here.exists() else shutil.which(name)
    if path is None:
        raise RuntimeError(f"{name} not found: pip install 'lmkv[mooncake]'")
    return path


@dataclass
class MooncakeMaster:
    """A ``mooncake_master`` child process; ``url`` is what ``remote.url`` takes."""

    proc: subprocess.Popen
    port: int

    @property
    def url(self) -> str:
        return f"mooncake://127.0.0.1:{self.port}"

    def signal(self, sig: int) -> None:
        """Send ``sig``; a SIGSTOP is waited for (up to 2 s) until the process is stopped
        (:func:`lmkv.dev.signals.pause`)."""
        if self.proc.poll() is None:
            if sig == signal.SIGSTOP:
                pause(self.proc.pid, 2.0)
            else:
                os.kill(self.proc.pid, sig)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> MooncakeMaster:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _listening(proc: subprocess.Popen, port: int, what: str, timeout: float) -> MooncakeMaster:
    """``proc`` once it accepts connections on ``port`` (killed if it does not within ``timeout``)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} on port {port} exited with {proc.returncode} (port in use?)")
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return MooncakeMaster(proc, port)
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError(f"{what} on port {port} did not listen within {timeout} s")


def start_master(port: int | None = None, timeout: float = 20.0, flags: Sequence[str] = ()) -> MooncakeMaster:
    """``mooncake_master`` on 127.0.0.1 (its RPC and metrics ports both), once it accepts connections."""
    port = port or free_port()
    proc = subprocess.Popen(
        [_binary(), "--rpc_address=127.0.0.1", f"--rpc_port={port}", "--metrics_host=127.0.0.1",
         f"--metrics_port={free_port()}", *flags],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    return _listening(proc, port, "mooncake_master", timeout)


def start_storage(master: MooncakeMaster, size: int, timeout: float = 20.0) -> MooncakeMaster:
    """A storage client (``mooncake_client``) contributing ``size`` bytes of memory to the master's
    pool: pages live there whatever engine wrote them (engines with ``segment_size: 0``)."""
    port = free_port()
    proc = subprocess.Popen(
        [_binary("mooncake_client"), f"--master_server_address=127.0.0.1:{master.port}",
         "--metadata_server=P2PHANDSHAKE", "--host=127.0.0.1", f"--port={port}",
         f"--global_segment_size={size >> 20} MB", "--protocol=tcp"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    return _listening(proc, port, "mooncake_client", timeout)
