"""Exceptions lmkv raises. Engine adapters catch :class:`LMKVError` and recompute."""

from __future__ import annotations


class LMKVError(Exception):
    """Base of every error lmkv raises on purpose."""


class PageError(LMKVError):
    """A page's bytes cannot be trusted; the page is discarded and the tokens recomputed."""


class PageFormatError(PageError):
    """The header is not an lmkv page of this version, this key or this layout."""


class ChecksumError(PageError):
    """The payload does not match the checksum recorded when the page was made."""


class ShortReadError(PageError):
    """Fewer bytes came back than the page holds (torn file, truncated frame)."""


class TierFullError(LMKVError):
    """The tier cannot take the page (capacity, disk full); nothing half-written remains."""


class TierUnavailableError(LMKVError):
    """The backend cannot be reached now (down, timed out, restarting)."""


class PartlyStoredError(TierUnavailableError):
    """Some pages of a write reached the backend and some could not (a cluster node is down).

    ``stored`` is the per-page outcome the caller would have had; ``unreachable`` the indices of
    the pages that never reached a node (the ones to retry), as opposed to pages it refused.
    """

    def __init__(self, msg: str, stored: list[bool], unreachable: list[int]) -> None:
        super().__init__(msg)
        self.stored = stored
        self.unreachable = unreachable


class TierBusyError(LMKVError):
    """Every connection to the backend is in use: this call is a miss, the backend is not down."""
