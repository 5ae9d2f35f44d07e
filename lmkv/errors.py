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


class TierBusyError(LMKVError):
    """Every connection to the backend is in use: this call is a miss, the backend is not down."""
