"""Write-behind persistence: the current term's outbox goes to etcd in batched transactions, off
the placement path. A caller that needs a write durable (a session binding) awaits `sync()`,
which joins the next batch (group commit) instead of writing on its own. Every transaction is
guarded by the term (`TermWriter`): a Conductor that does not lead drops what its outbox
collected (a standby's state follows etcd, it is not its to write), and a fenced flush ends
the term."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from services.common.store.interface import Delete, Fenced, Op, Put, StoreError
from services.conductor.fencing import TermWriter
from services.conductor.records import Outbox

log = logging.getLogger(__name__)


class Persister:
    """Drains the outbox of the term in force into the store every `interval_s`, or at once
    when asked. One persister outlives the terms: a `sync()` waiting when a term is lost is
    answered by the next flush, of the new term's outbox."""

    def __init__(
        self, writer: TermWriter, outbox: Callable[[], Outbox], interval_s: float = 0.05
    ) -> None:
        self.writer = writer
        self.outbox = outbox
        self.interval_s = interval_s
        self.ops_written = 0
        self.batches = 0
        self.failures = 0
        self.dropped = 0  # writes dropped because this Conductor did not lead
        self._wake = asyncio.Event()
        self._next: asyncio.Future[None] | None = None  # made on the loop, when first asked

    def _pending(self) -> asyncio.Future[None]:
        """The future the next flush resolves."""
        if self._next is None:
            self._next = asyncio.get_running_loop().create_future()
        return self._next

    async def sync(self) -> None:
        """Return once everything queued so far is in etcd (raises StoreError)."""
        fut = self._pending()
        self._wake.set()
        await asyncio.shield(fut)

    async def run(self) -> None:
        """Flush until cancelled; a failed flush puts its writes back and retries."""
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.interval_s):
                    await self._wake.wait()
            self._wake.clear()
            await self.flush()

    async def flush(self) -> None:
        fut, self._next = self._pending(), asyncio.get_running_loop().create_future()
        outbox = self.outbox()
        if not len(outbox):
            fut.set_result(None)
            return
        writes = outbox.take()
        if not self.writer.leading:
            self.dropped += len(writes)
            log.debug("dropped %d writes: this Conductor does not lead", len(writes))
            fut.set_exception(Fenced("this Conductor does not lead"))
            fut.exception()  # retrieved: waiters may have gone
            return
        ops: list[Op] = [
            Put(k.encode(), v, lease) if v is not None else Delete(k.encode())
            for k, v, lease in writes
        ]
        try:
            await self.writer.commit(ops)
        except Fenced as exc:  # the term is over: its writes are not ours to make any more
            self.dropped += len(writes)
            log.warning("dropped %d writes: %s", len(writes), exc)
            fut.set_exception(exc)
            fut.exception()
            return
        except StoreError as exc:
            self.failures += 1
            log.warning("persisting %d writes failed (%s); will retry", len(ops), exc)
            outbox.restore(writes)
            fut.set_exception(exc)
            fut.exception()  # retrieved: waiters may have gone
            self._wake.set()
            await asyncio.sleep(self.interval_s)  # back off before the retry
            return
        self.ops_written += len(ops)
        self.batches += 1
        fut.set_result(None)
