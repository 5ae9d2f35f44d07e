"""A step's pages streamed to Redis: staging keys renamed over the pages' payload keys at the commit
(:mod:`lmkv.tiers.put_stream`).

Each page of the step gets a staging key of the stream's own under the page's hash tag, so it lives
in the page's slot on a cluster::

    <prefix>{<key hex>}:s:<stream token>   the payload so far

As each layer lands, its range of every page is appended (``APPEND``, one pipeline per node: the
reply, the key's new length, proves nothing was lost in between) while the later layers compute.
At the commit each page's staging key is renamed over its payload key (``RENAME``: atomic, no copy)
and then its header is written, as a whole page's write does: a reader sees a page only once its
header is there, so never a half-written one. Pages the step did not store, and every page of an
aborted step, have their staging keys deleted.

A staging key expires (:func:`staging_ttl_ms`, renewed with every range) so a writer that dies
mid-step leaves nothing behind for long; a stream whose step is silent for ``remote.timeout`` gives
up well before. Should Redis evict a staging key under ``maxmemory``, the next ``APPEND`` answers a
length that does not add up and the page is dropped from the stream (written through whole).
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from redis import exceptions as rexc

from lmkv.errors import TierUnavailableError
from lmkv.keys import PageKey
from lmkv.page import PageHeader, as_bytes_view
from lmkv.tiers.header_cache import HeaderCache
from lmkv.tiers.remote import PUBLISH_BYTES, batches

log = logging.getLogger(__name__)

#: the shortest life of a staging key between two ranges of its stream
STAGING_MIN_S = 60.0

#: ``per_node(names, job)``: ``job(client, indices)`` on each node serving some of ``names``; per
#: index, what its node's job returned (indices on a node that is down are left out)
PerNode = Callable[[Sequence[bytes], Callable[[Any, list[int]], Awaitable[list]]], dict[int, Any]]


def staging_ttl_ms(timeout: float) -> int:
    """How long a staging key outlives its last range: far longer than a live stream waits for its
    step (``remote.timeout``), so only a writer that died leaves one to expire."""
    return int(max(STAGING_MIN_S, 4 * timeout) * 1000)


def _moved(replies: list) -> None:
    """A slot that moved: raised, so the tier reads the slot map again and retries the node's pages."""
    for r in replies:
        if isinstance(r, rexc.MovedError):
            raise r


class RedisPutTarget:
    """One step's staging keys (:class:`~lmkv.tiers.put_stream.PutTarget`); see the module's docstring."""

    def __init__(self, keys: Sequence[PageKey], bufs: Sequence, names: Callable[[PageKey], tuple[bytes, bytes]],
                 per_node: PerNode, px: int | None, staging_ms: int, headers: HeaderCache,
                 refused: Callable[[object], None]) -> None:
        """``names(key)``: a page's header and payload keys; ``px``: pages' expiry (ms; None: none);
        ``headers``: the tier's header cache; ``refused(reply)``: counts a write Redis refused."""
        token = secrets.token_hex(6)
        self._keys = list(keys)
        self._views = [as_bytes_view(b) for b in bufs]
        self._names = [names(k) for k in keys]
        self._staging = [p[: -len(b":p")] + f":s:{token}".encode() for _, p in self._names]
        self._per_node = per_node
        self._px, self._staging_ms = px, staging_ms
        self._headers, self._refused = headers, refused
        self._length = [0] * len(self._keys)  # per page, the bytes appended from its start
        self._touched = [False] * len(self._keys)  # a staging key may exist

    def send(self, pages: list[int], start: int, end: int) -> list[int]:
        """``APPEND`` where the range follows what the key holds (the reply checks it), else ``SETRANGE``."""

        async def job(client, idx: list[int]) -> list[bool]:
            ok: list[bool] = []
            for r in batches([end - start] * len(idx), PUBLISH_BYTES, len(idx)):
                part = [pages[j] for j in idx[r.start : r.stop]]
                appends = [start == self._length[i] for i in part]
                async with client.pipeline(transaction=False) as pipe:
                    for i, appended in zip(part, appends):
                        data = self._views[i][start:end]
                        if appended:
                            pipe.append(self._staging[i], data)
                        else:
                            pipe.setrange(self._staging[i], start, data)
                        pipe.pexpire(self._staging[i], self._staging_ms)
                    replies = await pipe.execute(raise_on_error=False)
                _moved(replies)
                for k, (i, appended) in enumerate(zip(part, appends)):
                    got = replies[2 * k]
                    good = isinstance(got, int) and (got == end if appended else got >= end)
                    if isinstance(got, rexc.ResponseError):
                        self._refused(got)
                    if good and appended:
                        self._length[i] = end
                    ok.append(good)
            return ok

        for i in pages:
            self._touched[i] = True
        done = self._per_node([self._staging[i] for i in pages], job)
        return [pages[j] for j, good in done.items() if good]

    def end(self, headers: list[PageHeader | None]) -> list[bool]:
        """Rename the staging keys of pages with a header over their payload keys, then write those
        headers; delete the other staging keys."""
        todo = [i for i, h in enumerate(headers) if h is not None]
        dropped = [i for i, h in enumerate(headers) if h is None and self._touched[i]]

        async def job(client, idx: list[int]) -> list[bool]:
            part = [todo[j] for j in idx]
            async with client.pipeline(transaction=False) as pipe:
                for i in part:
                    payload = self._names[i][1]
                    pipe.rename(self._staging[i], payload)
                    if self._px:  # (the payload takes the staging key's expiry with its name)
                        pipe.pexpire(payload, self._px)
                    else:
                        pipe.persist(payload)
                replies = await pipe.execute(raise_on_error=False)
            _moved(replies)
            renamed = [replies[2 * k] is True for k in range(len(part))]
            live = [i for i, r in zip(part, renamed) if r]
            if not live:
                return renamed
            async with client.pipeline(transaction=False) as pipe:
                for i in live:
                    pipe.set(self._names[i][0], headers[i].pack(), px=self._px)  # type: ignore[union-attr]
                published = dict(zip(live, await pipe.execute(raise_on_error=False)))
            out = []
            for i, r in zip(part, renamed):
                good = r and published[i] is True
                if r and not good:
                    self._refused(published[i])
                if good:
                    self._headers.put(self._keys[i], headers[i])  # type: ignore[arg-type]
                out.append(good)
            return out

        stored = [False] * len(headers)
        if todo:
            for j, good in self._per_node([self._names[i][0] for i in todo], job).items():
                stored[todo[j]] = good
        self._discard(dropped)
        return stored

    def abort(self) -> None:
        self._discard([i for i, t in enumerate(self._touched) if t])

    def _discard(self, pages: list[int]) -> None:
        """Delete the staging keys of ``pages`` (where Redis is down, they expire)."""
        if not pages:
            return

        async def job(client, idx: list[int]) -> list[int]:
            async with client.pipeline(transaction=False) as pipe:
                for j in idx:
                    pipe.delete(self._staging[pages[j]])
                return await pipe.execute(raise_on_error=False)

        self._per_node([self._staging[i] for i in pages], job)
        for i in pages:
            self._touched[i] = False


def redis_session(target: RedisPutTarget) -> Callable[[], Any]:
    """The :data:`~lmkv.tiers.put_stream.Opener` of ``target``: nothing to open in Redis (a staging key
    comes with its first range); a stream that fails for another reason than Redis being unreachable
    deletes what it staged."""

    @contextmanager
    def opened() -> Iterator[RedisPutTarget]:
        try:
            yield target
        except TierUnavailableError:
            raise  # (their expiry takes the staging keys)
        except Exception:
            try:
                target.abort()
            except Exception as err:  # (the stream's own failure is the one to report)
                log.debug("lmkv: redis tier: staging keys left to expire (%s)", err)
            raise

    return opened
