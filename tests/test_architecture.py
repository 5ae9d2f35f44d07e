"""The package's shape: no import circle, a small top level, a core that knows no engine.

Imports are read from the source (every ``import`` statement, those inside functions and under
``TYPE_CHECKING`` too: a deferred import hides a circle, it does not remove it), not by importing.
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]
#: where each installed package's files live (pyproject.toml's package-dir)
PACKAGES = {"lmkv": ROOT / "lmkv", "lmkv.connectors": ROOT / "connectors",
            "lmkv.benchmarks": ROOT / "benchmarks", "lmkv.kernels": ROOT / "kernels"}
ENGINES = ("vllm", "sglang", "transformers")


def _modules() -> dict[str, Path]:
    mods: dict[str, Path] = {}
    for pkg, base in PACKAGES.items():
        for path in base.rglob("*.py"):
            parts = list(path.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            mods[".".join([pkg, *parts])] = path
    return mods


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """Every module ``name``'s source imports (internal ones resolved to the module they name)."""
    is_pkg = path.name == "__init__.py"
    package = name if is_pkg else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                out.add(sub if sub in MODULES else base)
    return out


def _graph() -> dict[str, set[str]]:
    return {m: {i for i in _imports(m, p) if i in MODULES and i != m} for m, p in MODULES.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_graph_is_read():
    """(The walk sees the edges it must: a test of the test.)"""
    g = _graph()
    assert "lmkv.store" in g["lmkv.engine.worker"]
    assert "lmkv.engine.blockcopy" in g["lmkv.kernels"]
    assert {"lmkv.tiers.redis", "lmkv.tiers.server_client"} <= g["lmkv.tiers.factory"]  # deferred imports count
    assert "lmkv.connectors.sglang_pools" in g["lmkv.connectors.sglang"]  # relative imports resolve
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_module_imports_one_that_imports_it_back():
    cycles = _cycles(_graph())
    assert not cycles, "import circles: " + "; ".join(" <-> ".join(c) for c in cycles)


#: each wing's floor in the house, lowest first: a module imports only modules on its floor or below
#: (the longest matching prefix names a module's wing)
FLOORS = {
    # the vocabulary every wing speaks
    "lmkv.errors": 0, "lmkv.keys": 0, "lmkv.layout": 0, "lmkv.page": 0, "lmkv.domains": 0, "lmkv.config": 0,
    # how every wing starts its threads and maps memory ahead of its first writes
    "lmkv.threads": 0, "lmkv.prefault": 0,
    # the server's wire, which both its ends speak; page digests on a GPU (the disk tier's GDS path uses them)
    "lmkv.wire": 1, "lmkv.kernels.digests": 1,
    # where pages live; the prefix rule over anything that holds pages
    "lmkv.tiers": 2, "lmkv.lookup": 2,
    # the tiers used as one
    "lmkv.store": 3, "lmkv.retries": 3, "lmkv.metrics": 3,
    # lazy offload's policy (its trace-driven evaluation sits on top)
    "lmkv.offload": 4,
    # the engine-facing half, and its GPU copier beside the CPU one
    "lmkv.engine": 5, "lmkv.kernels": 5,
    # the cache server
    "lmkv.serve": 6,
    # engine adapters
    "lmkv.connectors": 7,
    # what runs the house: the CLI, the harnesses, the benchmarks, the offload simulator, the package's face
    "lmkv.cli": 8, "lmkv.dev": 8, "lmkv.benchmarks": 8, "lmkv.offload.sim": 8, "lmkv.offload.traces": 8,
    "lmkv.offload.peer": 8, "lmkv": 8,
}


def _floor(module: str) -> int:
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in FLOORS:
            return FLOORS[".".join(parts[:n])]
    raise KeyError(f"{module}: no floor in FLOORS")


def test_wings_import_only_downward():
    """The tiers never import the server or the engine side, the store never imports the engine
    side, and so on up: every import goes to a wing on the same floor or below."""
    graph = _graph()
    upward = sorted(f"{a} -> {b}" for a, deps in graph.items() for b in deps if _floor(b) > _floor(a))
    assert not upward, "upward imports: " + "; ".join(upward)


def test_the_floors_are_read():
    """(A test of the test: an upward import is found, and every module has a floor.)"""
    assert _floor("lmkv.tiers.server_client") < _floor("lmkv.serve.server")
    assert _floor("lmkv.kernels.digests") < _floor("lmkv.tiers.disk") < _floor("lmkv.kernels")
    for module in MODULES:
        _floor(module)


def test_top_level_is_small():
    top = sorted(p.stem for p in (ROOT / "lmkv").glob("*.py"))
    assert len(top) <= 16, top


@pytest.mark.parametrize("name", sorted(MODULES))
def test_only_connectors_harnesses_and_the_simulator_import_an_engine(name):
    """The core knows no engine: vLLM, SGLang and transformers are imported only by the adapters
    (:mod:`lmkv.connectors`), the development harnesses (:mod:`lmkv.dev`), the offload simulator
    (it replays traces on vLLM's real KVCacheManager) and the benchmarks that run an engine."""
    engines = {i.split(".")[0] for i in _imports(name, MODULES[name])} & set(ENGINES)
    allowed = name.startswith(("lmkv.connectors", "lmkv.dev.", "lmkv.benchmarks")) or name == "lmkv.offload.sim"
    assert allowed or not engines, f"{name} imports {sorted(engines)}"


def test_every_package_is_listed_for_installation():
    """A package missing from pyproject.toml breaks only non-editable installs."""
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    packages = {m for m, p in MODULES.items() if p.name == "__init__.py"}
    assert packages == listed


def test_no_folder_of_the_checkout_hides_a_package_lmkv_imports():
    """``python -m`` and pytest run from the checkout put its root first on ``sys.path``: a
    folder there named like a package lmkv imports (a ``cuda/`` beside NVIDIA's ``cuda.bindings``
    and ``cuda.pathfinder``, which CuPy needs) hides that package on a GPU machine."""
    outside = {i.split(".")[0] for name, path in MODULES.items() for i in _imports(name, path)} - {"lmkv"}
    folders = {p.name for p in ROOT.iterdir() if p.is_dir()}
    assert "cuda" in outside and not folders & outside, sorted(folders & outside)


@pytest.mark.slow
def test_a_non_editable_install_holds_every_module(tmp_path):
    """``pip install .`` (not editable) installs every module where its import name says, the
    kernel source beside the CUDA package; each imports from there."""
    # built from a copy: a build/ folder left in the checkout would lend the build its stale files
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".*", "build", "*.egg-info", "models", "__pycache__"))
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                    "--disable-pip-version-check", "--target", str(site), str(src)],
                   check=True, timeout=300, capture_output=True)
    probe = ("import importlib, importlib.resources, json, sys\n"
             "files = {m: importlib.import_module(m).__file__ for m in sys.argv[1:]}\n"
             "kernel = all(importlib.resources.files('lmkv.kernels').joinpath(f).is_file()\n"
             "             for f in ('block_copy.cu', 'xxh3.cu'))\n"
             "print(json.dumps({'files': files, 'kernel': kernel}))\n")
    out = subprocess.run([sys.executable, "-c", probe, *sorted(MODULES)], check=True, timeout=300,
                         capture_output=True, text=True, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(site)})
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["kernel"]
    outside = {m: f for m, f in got["files"].items() if not f.startswith(str(site))}
    assert not outside, f"imported from outside the installed tree: {outside}"
