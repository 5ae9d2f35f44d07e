"""The examples run as a user would run them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _run(script: str, *args: str, tmp_path: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "LMKV_MODEL_DIR": str(tmp_path / "models"), "VLLM_LOGGING_LEVEL": "WARNING"}
    return subprocess.run([sys.executable, str(EXAMPLES / script), *args], capture_output=True, text=True,
                          timeout=900, env=env, cwd=tmp_path)


def test_two_engines_share_one_disk_tier(tmp_path):
    out = _run("two_engines_shared_disk.py", str(tmp_path / "disk"), tmp_path=tmp_path)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["b_loaded_pages"] == 3 * 1024 // 32
    assert result["b_disk_hits"] == 3 * 1024 // 32


def test_offline_example(tmp_path):
    out = _run("vllm_offline.py", tmp_path=tmp_path)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith(("cold", "after", "pages loaded"))]
    assert lines[2] == "pages loaded from lmkv: 93"  # (3000 - 1) // 32
    assert lines[0].split("tokens ")[1] == lines[1].split("tokens ")[1]
