"""The write-behind's rounds: session bindings first, other records oldest first and a round's
worth at a time, cursors after the blocks they count."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from kvsched.core.index import Tier
from services.common.store import Op
from services.conductor import keys
from services.conductor.persist import Persister
from services.conductor.records import Outbox


def _block(h: int) -> str:
    return keys.block_key("i0", Tier.GPU, h)


def _keys(batch: Sequence[tuple[str, bytes | None, int, int]]) -> list[str]:
    return [key for key, _, _, _ in batch]


def test_the_outbox_gives_bindings_first_then_the_oldest_records_in_their_places() -> None:
    outbox = Outbox()
    for h in (1, 2, 3):
        outbox.put(_block(h), b"x", 7)
    outbox.put(keys.session_key("s"), b"bound")
    outbox.put(_block(1), b"newer", 7)  # coalesced, in the place of its first write
    first = outbox.take(2)
    assert _keys(first) == [keys.session_key("s"), _block(1), _block(2)]
    assert first[1][1] == b"newer"
    assert outbox.oldest() == 2  # block 3's place: everything before it was taken
    outbox.restore(first)  # etcd refused them: back in their places, before block 3
    assert _keys(outbox.take()) == [keys.session_key("s"), _block(1), _block(2), _block(3)]
    assert outbox.oldest() == outbox.queued == 4


def test_a_write_put_last_goes_after_everything_queued_before_it() -> None:
    outbox = Outbox()
    outbox.put(keys.cursor_key("i0"), b"1")
    outbox.put(_block(1), b"x")
    outbox.put_last(keys.cursor_key("i0"), b"2")
    assert [(k, v) for k, v, _, _ in outbox.take()] == [
        (_block(1), b"x"),
        (keys.cursor_key("i0"), b"2"),
    ]


class _Etcd:
    """A leading term's writer that records each transaction batch it commits."""

    leading = True

    def __init__(self) -> None:
        self.commits: list[list[bytes]] = []

    async def commit(self, ops: Sequence[Op]) -> None:
        self.commits.append([op.key for op in ops])  # type: ignore[union-attr]
        await asyncio.sleep(0)


async def test_a_binding_waits_for_one_round_not_for_a_burst_of_block_records() -> None:
    outbox, etcd = Outbox(), _Etcd()
    persister = Persister(etcd, lambda: outbox, round_records=4)  # type: ignore[arg-type]
    for h in range(10):
        outbox.put(_block(h), b"x", 7)
    outbox.put(keys.session_key("s"), b"bound")
    runner = asyncio.create_task(persister.run())
    try:
        await persister.sync_bindings()
        first = etcd.commits[0]
        assert first[0] == keys.session_key("s").encode() and len(first) == 5
        outbox.put_last(keys.cursor_key("i0"), b"10", 7)
        await persister.sync()  # everything queued so far, a round's worth at a time
        written = [key for batch in etcd.commits for key in batch]
        assert sorted(written[1:-1]) == sorted(_block(h).encode() for h in range(10))
        assert written[-1] == keys.cursor_key("i0").encode()
        assert max(len(batch) for batch in etcd.commits[1:]) <= 4
    finally:
        runner.cancel()
