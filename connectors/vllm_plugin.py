"""vLLM general plugin: registers ``LMKVConnector`` by name once lmkv is installed.

With it, ``--kv-transfer-config '{"kv_connector": "LMKVConnector", "kv_role": "kv_both"}'``
works without ``kv_connector_module_path``. vLLM loads general plugins in every
process it starts (the entry point is declared in lmkv's ``pyproject.toml``), so
registering twice must be harmless.

It also carries lmkv's reason when an engine process vLLM started refuses lmkv's
configuration: vLLM's process then dies with its own last words ("Engine core
initialization failed. See root cause above"), the root cause scrolled away above
them. The engine process leaves lmkv's message for its parent (:func:`tell_parent`, a
file only this user can have made), and the parent, where this plugin registered an
exit hook, prints it as it exits: lmkv's reason is the last thing the user reads.
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import stat
import sys
import tempfile
from pathlib import Path

NAME = "LMKVConnector"
_hooked = False


def register() -> None:
    global _hooked
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if NAME not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(NAME, "lmkv.connectors.vllm", "LMKVConnector")
    if not _hooked:
        _hooked = True
        atexit.register(_print_childs_reason)


def _note(pid: int) -> Path:
    return Path(tempfile.gettempdir()) / f"lmkv-{os.getuid()}-{pid}.engine-error"


def tell_parent(message: str) -> None:
    """In a process vLLM started for its engine: leave ``message`` for the process that started it
    (printed there as it exits). Nothing in a process the user started itself."""
    if multiprocessing.parent_process() is None:
        return
    try:
        fd = os.open(_note(os.getppid()), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except OSError:  # one is there already (another engine process said it first)
        return
    with os.fdopen(fd, "w") as f:
        f.write(message[:8000])


def _print_childs_reason() -> None:
    path = _note(os.getpid())
    try:
        st = os.lstat(path)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
            return  # not one of ours
        text = path.read_text(errors="replace")[:8000]
        path.unlink()
    except OSError:
        return
    sys.stderr.write(f"\nlmkv: the engine did not start: {text}\n")
    sys.stderr.flush()
