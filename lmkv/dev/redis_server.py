"""Start a real ``redis-server`` (one node, or a cluster) on loopback, for tests and benchmarks.

lmkv never starts Redis for users; this is what ``lmkv bench redis`` and the
test-suite use so that they measure and test against the real thing.
"""

from __future__ import annotations

import shutil
import socket
import ssl
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cluster_port() -> int:
    """A free port whose cluster bus port (port + 10000) is free and valid too."""
    while True:
        port = free_port()
        if port + 10000 > 65535:
            continue
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port + 10000))
            return port
        except OSError:
            continue


def _binary(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise RuntimeError(f"{name} not found: install it (Debian/Ubuntu: apt-get install redis-server)")
    return path


def _wait_ready(port: int, proc: subprocess.Popen, timeout: float = 10.0, ca: str | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"redis-server on port {port} exited with {proc.returncode} (port in use?)")
        try:
            raw = socket.create_connection(("127.0.0.1", port), 0.2)
            tls = ssl.create_default_context(cafile=ca) if ca else None
            with (tls.wrap_socket(raw, server_hostname="127.0.0.1") if tls else raw) as s:
                s.sendall(b"PING\r\n")
                if s.recv(64).startswith((b"+PONG", b"-NOAUTH")):  # up (maybe asking for a password)
                    return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"redis-server on port {port} did not answer within {timeout} s")


@dataclass
class RedisProcesses:
    """Running servers; ``url`` is what ``remote.url`` takes."""

    url: str
    ports: list[int]
    procs: list[subprocess.Popen] = field(default_factory=list)
    workdir: Path | None = None

    def stop(self) -> None:
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                p.kill()
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> RedisProcesses:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _spawn(port: int, workdir: Path, extra: list[str], tls: tuple[str, str] | None = None) -> subprocess.Popen:
    listen = ["--port", str(port)]
    if tls:  # TLS only: the plain port is closed
        cert, key = tls
        listen = ["--port", "0", "--tls-port", str(port), "--tls-cert-file", cert, "--tls-key-file", key,
                  "--tls-ca-cert-file", cert, "--tls-auth-clients", "no"]
    args = [_binary("redis-server"), *listen, "--bind", "127.0.0.1", "--save", "",
            "--appendonly", "no", "--dir", str(workdir), "--protected-mode", "no", *extra]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _wait_ready(port, proc, ca=tls[0] if tls else None)
    return proc


def start_redis(port: int | None = None, maxmemory: str | None = None, password: str | None = None,
                tls: tuple[str, str] | None = None) -> RedisProcesses:
    """One redis-server with no persistence; ``maxmemory`` evicts with allkeys-lru; ``tls`` =
    (certificate, key) serves TLS only (``rediss://``)."""
    port = port or free_port()
    workdir = Path(tempfile.mkdtemp(prefix="lmkv-redis-"))
    extra = ["--maxmemory", maxmemory, "--maxmemory-policy", "allkeys-lru"] if maxmemory else []
    if password:
        extra += ["--requirepass", password]
    proc = _spawn(port, workdir, extra, tls)
    return RedisProcesses(f"{'rediss' if tls else 'redis'}://127.0.0.1:{port}", [port], [proc], workdir)


def start_cluster(nodes: int = 3, replicas: int = 0, node_timeout_ms: int = 2000) -> RedisProcesses:
    """``nodes`` primaries on loopback, slots spread across them, each with ``replicas`` replicas
    (promoted by the cluster when their primary has not answered for ``node_timeout_ms``).

    The nodes serve their slots while another node's are uncovered
    (``cluster-require-full-coverage no``, what a cache wants: with ``yes``, Redis refuses every
    slot until the lost one is served again)."""
    workdir = Path(tempfile.mkdtemp(prefix="lmkv-redis-cluster-"))
    ports = [cluster_port() for _ in range(nodes * (1 + replicas))]
    procs = []
    try:
        for port in ports:
            d = workdir / str(port)
            d.mkdir()
            procs.append(_spawn(port, d, ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                                          "--cluster-node-timeout", str(node_timeout_ms),
                                          "--cluster-require-full-coverage", "no"]))
        subprocess.run([_binary("redis-cli"), "--cluster", "create", *[f"127.0.0.1:{p}" for p in ports],
                        "--cluster-replicas", str(replicas), "--cluster-yes"],
                       check=True, capture_output=True, timeout=30)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # every node must know every slot's owner
            if all("cluster_state:ok" in subprocess.run([_binary("redis-cli"), "-p", str(p), "cluster", "info"],
                                                        capture_output=True, text=True).stdout for p in ports):
                break
            time.sleep(0.1)
        else:
            raise RuntimeError("redis cluster did not reach cluster_state:ok on every node")
    except BaseException:
        RedisProcesses("", ports, procs, workdir).stop()
        raise
    url = "redis-cluster://" + ",".join(f"127.0.0.1:{p}" for p in ports)
    return RedisProcesses(url, ports, procs, workdir)


def cluster_primaries(port: int) -> list[int]:
    """The ports of the nodes serving slots now, as the node on ``port`` sees the cluster."""
    out = subprocess.run([_binary("redis-cli"), "-p", str(port), "cluster", "nodes"], capture_output=True,
                         text=True, timeout=10).stdout
    return sorted(int(f[1].split("@")[0].rsplit(":", 1)[1]) for f in (line.split() for line in out.splitlines())
                  if len(f) > 8 and "master" in f[2] and "fail" not in f[2])
