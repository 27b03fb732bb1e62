"""The KV pool's local socket end to end: a real `PoolServer` on a Unix socket, called by the
connector's real `PoolClient` (blocking, so from a thread) and, for broken frames, by a raw
socket. A bad call gets an error answer and changes nothing; a connection that breaks the
framing is closed while the server goes on serving; what a connection held is let go when it
closes."""

from __future__ import annotations

import asyncio
import logging
import mmap
import os
import shutil
import socket
import stat
import tempfile
from collections.abc import AsyncIterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pytest

from kvsched.core.vllm_hashing import VllmBlockHasher
from services.dataplane.kv_layout import KvLayout, expected_chunk
from services.dataplane.kv_pool import NodePool
from services.dataplane.pool_server import PoolServer
from services.dataplane.pool_wire import HEADER, MAX_MESSAGE_BYTES, OPS
from services.kv_events.vllm_wire import BlockRemoved, BlockStored, Event
from services.vllm_connector.pool_client import PoolClient, PoolRefusal, PoolUnavailable
from tests.dataplane.test_kv_pool import (
    BLOCK_BYTES,
    BS,
    FMT,
    OTHER,
    chain,
    pinned_and_staged,
    read_chunk,
    tokens,
)
from tests.fixtures.poll import wait_for

FORMAT: dict[str, Any] = asdict(FMT)
PAGES = 4
HOLD_S = 30.0
MISSING = object()  # an argument left out of a call


@dataclass
class Served:
    """A pool served on a socket, and the clients a test made (closed after it)."""

    pool: NodePool
    server: PoolServer
    path: Path
    events: list[Event]
    clients: list[PoolClient] = field(default_factory=list)

    def client(self) -> PoolClient:
        client = PoolClient(str(self.path), timeout_s=2.0)
        self.clients.append(client)
        return client


@pytest.fixture
async def served() -> AsyncIterator[Served]:
    # Not under tmp_path: a Unix socket's path must fit in 108 bytes.
    directory = Path(tempfile.mkdtemp(prefix="kp"))
    events: list[Event] = []
    pool = NodePool(
        PAGES * BLOCK_BYTES,
        node="node-0",
        hasher_for=VllmBlockHasher,
        on_events=events.extend,
        directory=directory,
    )
    server = PoolServer(pool, directory / "pool.sock")
    await server.start()
    s = Served(pool, server, directory / "pool.sock", events)
    try:
        yield s
    finally:
        for client in s.clients:
            client.close()
        await server.stop()
        pool.close()
        shutil.rmtree(directory, ignore_errors=True)


async def call(client: PoolClient, op: str, **arguments: Any) -> dict[str, Any]:
    """One call from a thread (the server runs on this test's event loop)."""
    return await asyncio.to_thread(client.call, op, **arguments)


async def refusal(client: PoolClient, op: str, **arguments: Any) -> str:
    with pytest.raises(PoolRefusal) as refused:
        await call(client, op, **arguments)
    return str(refused.value)


def write_file(path: str, pages: Sequence[int], hashes: Sequence[int]) -> None:
    """What an engine's worker does for a save: write the blocks' chunks into the pool's file
    through its own mapping."""
    layout = KvLayout(FMT.layers, PAGES, FMT.chunk_bytes, BS)
    with open(path, "r+b") as f, mmap.mmap(f.fileno(), 0) as mm:
        for page, h in zip(pages, hashes, strict=True):
            for layer in range(layout.layers):
                offset = layout.offset(layer, page)
                mm[offset : offset + layout.chunk_bytes] = expected_chunk(
                    h, layer, layout.chunk_bytes
                )


async def save(client: PoolClient, ids: Sequence[int], salt: str | None = None) -> list[int]:
    """Save the full blocks of `ids` into the pool as a connector does: save, write, commit."""
    hashes = chain(ids, salt)
    slots = await call(client, "save", block_hashes=hashes, upto=len(hashes), hold_s=HOLD_S)
    assert slots["import_id"], slots
    write_file(slots["path"], slots["pages"], hashes[slots["have"] :])
    committed = await call(
        client,
        "commit",
        import_id=slots["import_id"],
        token_ids=list(ids[slots["have"] * BS :]),
        cache_salt=salt,
    )
    assert committed == {"ok": True, "stored": len(hashes) - slots["have"]}
    return hashes


def assert_nothing_held(pool: NodePool) -> None:
    pool.check_integrity()
    assert pinned_and_staged(pool) == (0, 0, 0)
    assert pool.memory.staged_pages == 0


def send_raw(path: Path, data: bytes) -> bytes:
    """Send bytes on a connection of our own; what comes back before the server closes it."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(2.0)
        sock.connect(str(path))
        sock.sendall(data)
        try:
            return sock.recv(1 << 16)
        except ConnectionResetError:
            return b""


def current_umask() -> int:
    mask = os.umask(0o077)
    os.umask(mask)
    return mask


def frame(body: bytes) -> bytes:
    return HEADER.pack(len(body)) + body


# ---- the calls ------------------------------------------------------------------------------


async def test_attach_answers_the_pools_file_and_pages(served: Served) -> None:
    client = served.client()
    assert not served.pool.attached
    answer = await call(client, "attach", format=FORMAT)
    assert answer == {"ok": True, "path": str(served.pool.memory.path), "pages": PAGES}
    assert served.pool.format == FMT and Path(answer["path"]).exists()
    assert await call(served.client(), "attach", format=FORMAT) == answer  # a second engine
    await save(client, tokens(1, 1))
    message = await refusal(client, "attach", format=asdict(OTHER))
    assert message.startswith("attach: ") and "holds blocks of" in message
    assert served.pool.format == FMT and served.pool.usage().blocks == 1


async def test_calls_before_any_attach_are_refused(served: Served) -> None:
    client = served.client()
    hashes = chain(tokens(1, 2))
    message = await refusal(client, "load", block_hashes=hashes, start=0, end=1, hold_s=HOLD_S)
    assert message.startswith("load: ") and "attached" in message
    assert "attached" in await refusal(client, "save", block_hashes=hashes, upto=1, hold_s=1.0)
    assert not served.pool.attached


async def test_a_saved_chain_loads_back_from_the_same_pages(served: Served) -> None:
    client = served.client()
    path = (await call(client, "attach", format=FORMAT))["path"]
    ids = tokens(3, 3)
    hashes = chain(ids)
    slots = await call(client, "save", block_hashes=hashes, upto=3, hold_s=HOLD_S)
    assert slots["have"] == 0 and slots["pages"] == [0, 1, 2] and slots["path"] == path
    assert served.pool.usage().blocks == 0 and served.events == []  # staged, not visible yet
    write_file(path, slots["pages"], hashes)
    committed = await call(
        client, "commit", import_id=slots["import_id"], token_ids=ids, cache_salt=None
    )
    assert committed == {"ok": True, "stored": 3}
    [event] = served.events
    assert isinstance(event, BlockStored) and event.block_hashes == tuple(hashes)
    assert event.medium == "CPU" and event.token_ids == tuple(ids)

    loaded = await call(client, "load", block_hashes=hashes, start=0, end=3, hold_s=HOLD_S)
    assert loaded["export_id"] and loaded["blocks"] == 3
    assert loaded["pages"] == slots["pages"] and loaded["path"] == path
    layout = served.pool.memory.layout
    for page, h in zip(loaded["pages"], hashes, strict=True):
        for layer in range(layout.layers):
            got = read_chunk(Path(path), layout, layer, page)
            assert got == expected_chunk(h, layer, layout.chunk_bytes)
    assert pinned_and_staged(served.pool)[0] == 1
    tail = await call(client, "load", block_hashes=hashes, start=1, end=3, hold_s=HOLD_S)
    assert tail["blocks"] == 2 and tail["pages"] == slots["pages"][1:]
    again = await call(client, "save", block_hashes=hashes, upto=3, hold_s=HOLD_S)
    assert again["import_id"] is None and again["have"] == 3 and again["pages"] == []
    for export_id in (loaded["export_id"], tail["export_id"]):
        assert await call(client, "release", export_id=export_id) == {"ok": True, "released": True}
    assert_nothing_held(served.pool)
    assert served.pool.usage().blocks == 3


async def test_a_load_answers_only_the_blocks_before_one_written_over_after_its_save(
    served: Served,
) -> None:
    """What the connector in vLLM gets for a pool page gone bad at rest: the blocks before
    it (it recomputes the rest), never the bad bytes; the pool drops the bad block and the
    one after it."""
    client = served.client()
    path = (await call(client, "attach", format=FORMAT))["path"]
    ids = tokens(4, 9)
    hashes = await save(client, ids)
    layout = served.pool.memory.layout
    with open(path, "r+b") as f, mmap.mmap(f.fileno(), 0) as mm:  # through another mapping
        mm[layout.offset(0, served.pool.memory.page_of[hashes[2]])] ^= 0x04
    served.events.clear()

    loaded = await call(client, "load", block_hashes=hashes, start=1, end=4, hold_s=HOLD_S)
    assert loaded["blocks"] == 1 and len(loaded["pages"]) == 1
    assert [h for e in served.events if isinstance(e, BlockRemoved) for h in e.block_hashes] == (
        hashes[2:]
    )
    assert await call(client, "release", export_id=loaded["export_id"]) == {
        "ok": True,
        "released": True,
    }
    nothing = await call(client, "load", block_hashes=hashes, start=2, end=4, hold_s=HOLD_S)
    assert nothing["blocks"] == 0 and nothing["export_id"] is None
    assert_nothing_held(served.pool)


async def test_release_answers_true_then_false(served: Served) -> None:
    client = served.client()
    await call(client, "attach", format=FORMAT)
    hashes = await save(client, tokens(2, 4))
    loaded = await call(client, "load", block_hashes=hashes, start=0, end=2, hold_s=HOLD_S)
    assert pinned_and_staged(served.pool) == (1, 0, 2)
    first = await call(client, "release", export_id=loaded["export_id"])
    second = await call(client, "release", export_id=loaded["export_id"])
    assert (first["released"], second["released"]) == (True, False)
    assert_nothing_held(served.pool)


async def test_engines_copy_reports_are_counted_and_bad_ones_refused(served: Served) -> None:
    client = served.client()
    await call(client, "attach", format=FORMAT)
    hashes = chain(tokens(2, 6))
    slots = await call(client, "save", block_hashes=hashes, upto=2, hold_s=HOLD_S)
    write_file(slots["path"], slots["pages"], hashes)
    await call(client, "commit", import_id=slots["import_id"], token_ids=list(tokens(2, 6)),
               cache_salt=None, copied_bytes=1000, copy_s=0.5)  # fmt: skip
    loaded = await call(client, "load", block_hashes=hashes, start=0, end=2, hold_s=HOLD_S)
    for bad in ({"copy_s": -1.0}, {"copy_s": "1"}, {"copied_bytes": -5}, {"copy_s": True}):
        with pytest.raises(PoolRefusal, match="cop"):
            await call(client, "release", export_id=loaded["export_id"], **bad)
    await call(client, "release", export_id=loaded["export_id"], copied_bytes=300, copy_s=0.25)
    copies = served.pool.copies
    assert copies.bytes == {"load": 300, "save": 1000}
    assert copies.seconds == {"load": 0.25, "save": 0.5}
    assert_nothing_held(served.pool)


async def test_a_load_of_blocks_the_pool_lacks_pins_nothing(served: Served) -> None:
    client = served.client()
    await call(client, "attach", format=FORMAT)
    hashes = chain(tokens(2, 5))
    loaded = await call(client, "load", block_hashes=hashes, start=0, end=2, hold_s=HOLD_S)
    assert loaded["export_id"] is None and loaded["blocks"] == 0 and loaded["pages"] == []
    assert_nothing_held(served.pool)


async def test_abort_gives_a_save_back(served: Served) -> None:
    client = served.client()
    await call(client, "attach", format=FORMAT)
    slots = await call(client, "save", block_hashes=chain(tokens(2, 6)), upto=2, hold_s=HOLD_S)
    assert served.pool.memory.staged_pages == 2
    assert await call(client, "abort", import_id=slots["import_id"]) == {
        "ok": True,
        "aborted": True,
    }
    assert (await call(client, "abort", import_id=slots["import_id"]))["aborted"] is False
    assert_nothing_held(served.pool)
    assert served.pool.usage().blocks == 0 and served.events == []


async def test_a_commit_with_wrong_token_ids_is_refused_and_gives_the_save_back(
    served: Served,
) -> None:
    client = served.client()
    await call(client, "attach", format=FORMAT)
    ids = tokens(2, 7)
    slots = await call(client, "save", block_hashes=chain(ids), upto=2, hold_s=HOLD_S)
    wrong = [t + 1 for t in ids]
    message = await refusal(
        client, "commit", import_id=slots["import_id"], token_ids=wrong, cache_salt=None
    )
    assert message.startswith("commit: ") and "do not hash" in message
    assert_nothing_held(served.pool)
    assert served.pool.usage().blocks == 0 and served.events == []


async def test_a_commit_with_malformed_token_ids_leaves_the_save_staged(served: Served) -> None:
    client = served.client()
    await call(client, "attach", format=FORMAT)
    ids = tokens(1, 8)
    hashes = chain(ids)
    slots = await call(client, "save", block_hashes=hashes, upto=1, hold_s=HOLD_S)
    bad = [*ids[:-1], "1"]
    message = await refusal(
        client, "commit", import_id=slots["import_id"], token_ids=bad, cache_salt=None
    )
    assert "token_ids must be u32 integers" in message
    assert pinned_and_staged(served.pool)[1] == 1 and served.pool.memory.staged_pages == 1
    write_file(slots["path"], slots["pages"], hashes)
    committed = await call(
        client, "commit", import_id=slots["import_id"], token_ids=ids, cache_salt=None
    )
    assert committed["stored"] == 1
    assert_nothing_held(served.pool)


# ---- bad calls --------------------------------------------------------------------------------

BAD_CALLS: list[tuple[str, dict[str, Any], str]] = [
    ("nope", {}, "unknown op 'nope'"),
    ("", {}, "unknown op ''"),
    ("load", {"block_hashes": ["1", "2"]}, "block_hashes must be u64 integers"),
    ("load", {"block_hashes": [-1, 2]}, "block_hashes must be u64 integers"),
    ("load", {"block_hashes": [1 << 64, 2]}, "block_hashes must be u64 integers"),
    ("load", {"block_hashes": [True, 2]}, "block_hashes must be u64 integers"),
    ("load", {"block_hashes": [1.0, 2]}, "block_hashes must be u64 integers"),
    ("load", {"block_hashes": []}, "block_hashes must be a list of 1 to"),
    ("load", {"block_hashes": "12"}, "block_hashes must be a list of 1 to"),
    ("load", {"block_hashes": MISSING}, "block_hashes must be a list of 1 to"),
    ("load", {"start": -1}, "start must be an integer in [0, 2], got -1"),
    ("load", {"start": 3}, "start must be an integer in [0, 2], got 3"),
    ("load", {"start": "0"}, "start must be an integer in [0, 2]"),
    ("load", {"start": 0.0}, "start must be an integer in [0, 2]"),
    ("load", {"end": True}, "end must be an integer in [0, 2], got True"),
    ("load", {"end": MISSING}, "end must be an integer in [0, 2], got None"),
    ("load", {"start": 1, "end": 1}, "start 1 must be below end 1"),
    ("load", {"hold_s": 0}, "hold_s must be in (0, 600]"),
    ("load", {"hold_s": -1.0}, "hold_s must be in (0, 600]"),
    ("load", {"hold_s": 600.5}, "hold_s must be in (0, 600]"),
    ("load", {"hold_s": True}, "hold_s must be in (0, 600]"),
    ("load", {"hold_s": "5"}, "hold_s must be in (0, 600]"),
    ("load", {"hold_s": MISSING}, "hold_s must be in (0, 600]"),
    ("save", {"upto": 0}, "upto must be an integer in [1, 2], got 0"),
    ("save", {"upto": 3}, "upto must be an integer in [1, 2], got 3"),
    ("save", {"upto": False}, "upto must be an integer in [1, 2]"),
    ("save", {"hold_s": 0.0}, "hold_s must be in (0, 600]"),
    ("save", {"hold_s": 601}, "hold_s must be in (0, 600]"),
    ("save", {"block_hashes": [1 << 64]}, "block_hashes must be u64 integers"),
    ("release", {"export_id": ""}, "export_id must be a non-empty string"),
    ("release", {"export_id": 5}, "export_id must be a non-empty string"),
    ("release", {"export_id": "x" * 257}, "export_id must be a non-empty string"),
    ("release", {"export_id": MISSING}, "export_id must be a non-empty string"),
    ("commit", {"import_id": MISSING}, "import_id must be a non-empty string"),
    ("commit", {"token_ids": "1 2 3 4"}, "token_ids must be a list"),
    ("commit", {"token_ids": [-1, 2, 3, 4]}, "token_ids must be u32 integers"),
    ("commit", {"token_ids": [1 << 32, 2, 3, 4]}, "token_ids must be u32 integers"),
    ("commit", {"token_ids": [True, 2, 3, 4]}, "token_ids must be u32 integers"),
    ("commit", {"token_ids": [1.5, 2, 3, 4]}, "token_ids must be u32 integers"),
    ("commit", {"cache_salt": 5}, "cache_salt must be a string or null"),
    ("commit", {}, "no import 'i-nope'"),
    ("abort", {"import_id": None}, "import_id must be a non-empty string"),
    ("attach", {"format": MISSING}, "format must be an object with a kind"),
    ("attach", {"format": "vllm"}, "format must be an object with a kind"),
    ("attach", {"format": {**FORMAT, "kind": 5}}, "format must be an object with a kind"),
    ("attach", {"format": {**FORMAT, "kind": ""}}, "a block format needs a kind"),
    ("attach", {"format": {**FORMAT, "layers": 0}}, "a block format needs a kind"),
    ("attach", {"format": {**FORMAT, "layers": True}}, "layers must be an integer"),
    ("attach", {"format": {**FORMAT, "layers": 1 << 17}}, "layers must be an integer in"),
    ("attach", {"format": {**FORMAT, "chunk_bytes": "64"}}, "chunk_bytes must be an integer"),
    ("attach", {"format": {**FORMAT, "block_size": -4}}, "block_size must be an integer"),
    ("attach", {"format": asdict(OTHER)}, "holds blocks of"),
]


@pytest.mark.parametrize(
    ("op", "overrides", "expected"),
    BAD_CALLS,
    ids=[f"{op or 'no-op'}-{i}" for i, (op, _, _) in enumerate(BAD_CALLS)],
)
async def test_a_bad_call_is_refused_and_changes_nothing(
    served: Served, op: str, overrides: dict[str, Any], expected: str
) -> None:
    client = served.client()
    await call(client, "attach", format=FORMAT)
    held_ids = tokens(2, 9)
    held = await save(client, held_ids)
    new = chain(tokens(2, 10))
    base: dict[str, dict[str, Any]] = {
        "load": {"block_hashes": held, "start": 0, "end": 2, "hold_s": 5.0},
        "save": {"block_hashes": new, "upto": 2, "hold_s": 5.0},
        "release": {"export_id": "x-1"},
        "commit": {"import_id": "i-nope", "token_ids": held_ids, "cache_salt": None},
        "abort": {"import_id": "i-1"},
        "attach": {"format": FORMAT},
    }
    arguments = {**base.get(op, {}), **overrides}
    arguments = {k: v for k, v in arguments.items() if v is not MISSING}
    events = len(served.events)
    message = await refusal(client, op, **arguments)
    assert expected in message
    if op in OPS:
        assert message.startswith(f"{op}: ")
    assert_nothing_held(served.pool)
    assert served.pool.usage().blocks == 2 and len(served.events) == events
    assert served.pool.format == FMT
    # The connection is still up and serving.
    assert await call(client, "release", export_id="x-none") == {"ok": True, "released": False}


async def test_a_load_of_hashes_that_are_no_chain_pins_nothing(served: Served) -> None:
    client = served.client()
    await call(client, "attach", format=FORMAT)
    held = await save(client, tokens(2, 11))
    hashes = [held[0], 12345, held[1]]
    try:
        answer = await call(client, "load", block_hashes=hashes, start=0, end=3, hold_s=HOLD_S)
    except PoolRefusal:
        answer = {}
    if answer.get("export_id"):
        await call(client, "release", export_id=answer["export_id"])
    assert_nothing_held(served.pool)


async def test_an_attach_with_an_impossible_layout_is_refused(served: Served) -> None:
    client = served.client()
    await call(client, "attach", format=FORMAT)
    message = await refusal(client, "attach", format={**FORMAT, "chunk_bytes": 60})
    assert "chunk_bytes" in message
    assert served.pool.attached and served.pool.format == FMT


# ---- broken frames ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "data",
    [
        pytest.param(HEADER.pack(MAX_MESSAGE_BYTES + 1), id="over-the-max"),
        pytest.param(b"\xff\xff\xff\xff", id="4GiB"),
        pytest.param(frame(b"not json"), id="not-json"),
        pytest.param(frame(b"\xff\xfe{}"), id="not-utf8"),
        pytest.param(frame(b"[1, 2]"), id="not-an-object"),
        pytest.param(frame(b'"attach"'), id="a-string"),
        pytest.param(
            frame(b'{"op": "release", "export_id": ' + b"1" * 5000 + b"}"), id="5000-digits"
        ),
    ],
)
async def test_a_broken_frame_closes_only_its_connection(served: Served, data: bytes) -> None:
    client = served.client()
    await call(client, "attach", format=FORMAT)
    assert await asyncio.to_thread(send_raw, served.path, data) == b""  # closed, no answer
    assert (await call(client, "release", export_id="x-1"))["released"] is False
    assert (await call(served.client(), "release", export_id="x-1"))["ok"] is True


@pytest.mark.parametrize(
    "data",
    [
        pytest.param(HEADER.pack(MAX_MESSAGE_BYTES + 1), id="over-the-max"),
        pytest.param(frame(b"{not json"), id="not-json"),
    ],
)
async def test_a_call_on_a_connection_the_pool_closed_is_made_again_on_a_new_one(
    served: Served, data: bytes
) -> None:
    client = served.client()
    await call(client, "attach", format=FORMAT)
    broken = client._connected()
    broken.sendall(data)  # the client's own connection breaks the framing: the pool closes it
    assert (await call(client, "release", export_id="x-1"))["released"] is False
    assert client._connected() is not broken


async def test_a_pool_that_is_gone_is_unavailable(served: Served) -> None:
    client = served.client()
    await call(client, "attach", format=FORMAT)
    await served.server.stop()
    with pytest.raises(PoolUnavailable, match="the KV pool at"):
        await call(client, "release", export_id="x-1")


async def test_an_undecodable_body_is_closed_with_the_servers_warning(
    served: Served, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    data = frame(b'{"op": "release", "export_id": ' + b"1" * 5000 + b"}")
    assert await asyncio.to_thread(send_raw, served.path, data) == b""
    names = {"asyncio", "services.dataplane.pool_server"}

    def logged() -> list[logging.LogRecord]:
        return [r for r in caplog.records if r.name in names]

    records = await wait_for(logged, 2.0, message="the closed connection is logged")
    assert [r.name for r in records] == ["services.dataplane.pool_server"]


# ---- connections and the socket -------------------------------------------------------------


async def test_a_closed_connection_lets_go_of_what_it_held(served: Served) -> None:
    engine = served.client()
    await call(engine, "attach", format=FORMAT)
    held = await save(engine, tokens(2, 12))
    await call(engine, "load", block_hashes=held, start=0, end=2, hold_s=HOLD_S)
    staged = await call(engine, "save", block_hashes=chain(tokens(1, 13)), upto=1, hold_s=HOLD_S)
    assert staged["import_id"] and served.pool.memory.staged_pages == 1
    assert pinned_and_staged(served.pool) == (1, 1, 3)
    other = served.client()  # another engine's pin is its own
    mine = await call(other, "load", block_hashes=held, start=0, end=1, hold_s=HOLD_S)
    engine.close()  # the engine died
    await wait_for(
        lambda: pinned_and_staged(served.pool) == (1, 0, 1), 2.0, message="its holds ended"
    )
    assert served.pool.memory.staged_pages == 0 and served.pool.usage().blocks == 2
    served.pool.check_integrity()
    assert (await call(other, "release", export_id=mine["export_id"]))["released"] is True
    other.close()
    await wait_for(lambda: len(served.server._connections) == 0, 2.0, message="both closed")
    assert_nothing_held(served.pool)


async def test_the_socket_is_owner_only_and_replaces_a_stale_one(served: Served) -> None:
    mode = served.path.stat().st_mode
    assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o600
    stale = served.path.with_name("stale.sock")
    stale.write_text("left by a dead Messenger")
    server = PoolServer(served.pool, stale)
    umask = current_umask()
    await server.start()
    assert current_umask() == umask  # the server's owner-only umask was put back
    try:
        assert stat.S_ISSOCK(stale.stat().st_mode) and stat.S_IMODE(stale.stat().st_mode) == 0o600
        client = PoolClient(str(stale), timeout_s=2.0)
        served.clients.append(client)
        assert (await call(client, "attach", format=FORMAT))["pages"] == PAGES
    finally:
        await server.stop()


async def test_stop_closes_connections_and_removes_the_socket(served: Served) -> None:
    client = served.client()
    await call(client, "attach", format=FORMAT)
    hashes = await save(client, tokens(1, 14))
    await call(client, "load", block_hashes=hashes, start=0, end=1, hold_s=HOLD_S)
    await asyncio.wait_for(served.server.stop(), 2.0)  # an idle connection does not hold it up
    assert not served.path.exists()
    assert pinned_and_staged(served.pool) == (0, 0, 0)  # the connection's pin was let go
    with pytest.raises(PoolUnavailable):
        await call(client, "release", export_id="x-1")
    with pytest.raises(PoolUnavailable):  # nobody listens any more
        await call(served.client(), "release", export_id="x-1")
