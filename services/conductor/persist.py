"""Write-behind persistence: the current term's outbox goes to etcd in batched transactions, off
the placement path, in rounds. Each round writes every pending session binding first, then at
most `round_records` other records from the oldest: a burst of block records (a long prompt's,
a flood's) is written over several rounds, and a binding queued meanwhile waits for one round,
not for the whole burst. A caller that needs its bindings durable awaits `sync_bindings()`, one
that needs everything queued so far `sync()`; both join rounds (group commit) instead of
writing on their own. Every transaction is guarded by the term (`TermWriter`): a Conductor that
does not lead drops what its outbox collected (a standby's state follows etcd, it is not its to
write), and a fenced round ends the term."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from services.common.etcd.transactions import MAX_TXN_OPS
from services.common.store import Delete, Fenced, Op, Put, StoreError
from services.conductor.fencing import TermWriter
from services.conductor.records import Outbox

log = logging.getLogger(__name__)

ROUND_RECORDS = 8 * MAX_TXN_OPS
"""Records other than session bindings written per round: eight transactions."""


class Persister:
    """Drains the outbox of the term in force into the store every `interval_s`, at once when
    asked, and round after round while records remain. One persister outlives the terms: a
    waiter of a term that is lost is answered by the next round, of the new term's outbox."""

    def __init__(
        self,
        writer: TermWriter,
        outbox: Callable[[], Outbox],
        interval_s: float = 0.05,
        round_records: int = ROUND_RECORDS,
    ) -> None:
        self.writer = writer
        self.outbox = outbox
        self.interval_s = interval_s
        self.round_records = round_records
        self.ops_written = 0
        self.batches = 0
        self.failures = 0
        self.dropped = 0  # writes dropped because this Conductor did not lead
        self._wake = asyncio.Event()
        self._one_at_a_time = asyncio.Lock()  # a round's waiters see only finished rounds
        self._bindings: asyncio.Future[None] | None = None  # the next round resolves it
        # sync() waiters: each waits until its outbox has nothing pending from before its mark.
        self._marks: list[tuple[Outbox, int, asyncio.Future[None]]] = []

    def _next_round(self) -> asyncio.Future[None]:
        """The future the next round resolves (made on the loop, when first asked)."""
        if self._bindings is None:
            self._bindings = asyncio.get_running_loop().create_future()
        return self._bindings

    async def sync_bindings(self) -> None:
        """Return once every session binding queued so far is in etcd (raises StoreError)."""
        fut = self._next_round()
        self._wake.set()
        await asyncio.shield(fut)

    async def sync(self) -> None:
        """Return once every write queued so far is in etcd (raises StoreError)."""
        outbox = self.outbox()
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._marks.append((outbox, outbox.queued, fut))
        self._wake.set()
        await asyncio.shield(fut)

    async def run(self) -> None:
        """Flush round after round until cancelled: while records remain, at once; else
        every `interval_s` or when asked. A failed round puts its writes back and retries."""
        more = False
        while True:
            if not more:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.interval_s):
                        await self._wake.wait()
            self._wake.clear()
            more = await self._round(self.round_records)

    async def flush(self) -> None:
        """Write everything pending now, in one round."""
        await self._round(None)

    async def _round(self, records: int | None) -> bool:
        """Write the pending bindings and `records` other writes (all when None); returns
        whether writes remain (or a failed round wants a retry)."""
        async with self._one_at_a_time:
            return await self._write(records)

    async def _write(self, records: int | None) -> bool:
        fut, self._bindings = self._next_round(), None
        outbox = self.outbox()
        if not len(outbox):
            fut.set_result(None)
            self._settle(outbox, None)
            return False
        if not self.writer.leading:  # all of it: none is ours to write
            dropped = outbox.take()
            self.dropped += len(dropped)
            log.debug("dropped %d writes: this Conductor does not lead", len(dropped))
            self._fail(fut, Fenced("this Conductor does not lead"))
            return False
        writes = outbox.take(records)
        ops: list[Op] = [
            Put(k.encode(), v, lease) if v is not None else Delete(k.encode())
            for k, v, lease, _ in writes
        ]
        try:
            await self.writer.commit(ops)
        except Fenced as exc:  # the term is over: its writes are not ours to make any more
            self.dropped += len(writes)
            log.warning("dropped %d writes: %s", len(writes), exc)
            self._fail(fut, exc)
            return bool(len(outbox))
        except StoreError as exc:
            self.failures += 1
            log.warning("persisting %d writes failed (%s); will retry", len(ops), exc)
            outbox.restore(writes)
            self._fail(fut, exc)
            await asyncio.sleep(self.interval_s)  # back off before the retry
            return True
        self.ops_written += len(ops)
        self.batches += 1
        fut.set_result(None)
        self._settle(outbox, None)
        return bool(len(outbox))

    def _settle(self, outbox: Outbox, error: StoreError | None) -> None:
        """Answer the sync() waiters this round answers: all of them with `error`; else those
        whose writes `outbox` no longer holds, and those of an outbox no longer in force."""
        oldest = outbox.oldest()
        waiting = []
        for box, mark, fut in self._marks:
            if fut.done():
                continue
            if error is not None:
                fut.set_exception(error)
                fut.exception()  # retrieved: waiters may have gone
            elif box is not outbox or mark <= oldest:
                fut.set_result(None)
            else:
                waiting.append((box, mark, fut))
        self._marks = waiting

    def _fail(self, fut: asyncio.Future[None], error: StoreError) -> None:
        fut.set_exception(error)
        fut.exception()  # retrieved: waiters may have gone
        self._settle(self.outbox(), error)
