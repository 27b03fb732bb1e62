"""KV transfers between two Messengers in separate processes, each with a simulated engine of
its own node and the node's KV pool (which the engine saves to and loads from, as vLLM does
through kvsched's connector), through each backend: the bytes arrive exactly, layer by layer;
a corrupted chunk is read again or fails the transfer, never accepted; a Messenger killed
mid-transfer or a cancel leaves nothing half-committed; a hand-off streams while the prefill
runs. What a pool holds is asked through its socket, as an engine asks it."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import functools
import json
import mmap
import shutil
import tempfile
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest

from clients.python import ConductorClient
from kvsched.api.common.v1 import common_pb2 as common
from kvsched.api.messenger.v1 import messenger_service_pb2 as mpb
from kvsched.api.messenger.v1 import messenger_service_pb2_grpc as mpb_grpc
from kvsched.core.vllm_hashing import VllmBlockHasher
from services.common.security.admin_token import new_admin_token
from services.common.security.identity import Identity, Role
from services.common.security.pki import make_cluster_pki
from services.common.security.tls import ClientTls, aio_channel, channel_credentials
from services.dataplane.kv_layout import KvLayout, expected_chunk
from services.dataplane.kv_memory import DEFAULT_DIR as KV_MEMORY_DIR
from services.dataplane.kv_memory import PREFIX as KV_MEMORY_PREFIX
from services.vllm_connector.pool_client import PoolClient, PoolUnavailable
from tests.conductor.conftest import ConductorProcess
from tests.conftest import MOONCAKE
from tests.fixtures.etcd import start_etcd
from tests.fixtures.kv_content import blocks_in_file
from tests.fixtures.poll import wait_for
from tests.messenger.conftest import (
    BLOCK,
    EngineProcess,
    MessengerProcess,
    cached_tokens,
    instance_status,
)

SOURCE, TARGET = "node-0/e0", "node-1/e0"
BLOCKS = 24
POOL_BYTES = 64 << 20
BACKENDS = ["tcp", pytest.param("mooncake", marks=[pytest.mark.slow, MOONCAKE])]


def prompt(seed: int, blocks: int = BLOCKS) -> list[int]:
    return [2000 + seed * 131 + i for i in range(blocks * BLOCK + 1)]


@dataclass
class Nodes:
    """Two nodes' engines registered with one Conductor (a process), shared by a module's
    tests (each uses prompts of its own); every test starts both Messengers, and so both
    nodes' pools, anew (behind the same sockets, in the format they remember)."""

    conductor: ConductorProcess
    source: EngineProcess
    target: EngineProcess
    backend: str
    sockets: dict[str, str]  # instance id -> its node pool's socket

    def pool_flags(self, engine: EngineProcess) -> tuple[str, ...]:
        """A Messenger's flags for the pool of `engine`'s node."""
        socket = self.sockets[engine.instance_id]
        return ("--kv-pool-bytes", str(POOL_BYTES), "--kv-pool-socket", socket)


@pytest.fixture(scope="module", params=BACKENDS)
def nodes(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Nodes]:
    tmp = tmp_path_factory.mktemp("transfers")
    short = Path(tempfile.mkdtemp(prefix="kt"))  # a socket's path must fit in 108 bytes
    sockets = {SOURCE: str(short / "node-0.sock"), TARGET: str(short / "node-1.sock")}
    flags = ("--capacity-blocks", "96")
    with start_etcd(tmp / "etcd") as etcd:
        conductor = ConductorProcess(etcd, "c1", tmp / "conductor.log", max_instances=4)
        source = EngineProcess(
            tmp / "source.log", SOURCE, flags=(*flags, "--kv-pool-socket", sockets[SOURCE])
        )
        target = EngineProcess(
            tmp / "target.log", TARGET, flags=(*flags, "--kv-pool-socket", sockets[TARGET])
        )
        try:
            yield Nodes(conductor, source, target, request.param, sockets)
        finally:
            for proc in (target, source, conductor):
                proc.stop()
            shutil.rmtree(short, ignore_errors=True)


@dataclass
class Pair:
    """The two nodes with a Messenger each."""

    nodes: Nodes
    client: ConductorClient
    source_messenger: MessengerProcess
    target_messenger: MessengerProcess
    http: aiohttp.ClientSession
    stub: Any  # the target Messenger's MessengerService

    @property
    def source(self) -> EngineProcess:
        return self.nodes.source

    @property
    def target(self) -> EngineProcess:
        return self.nodes.target

    async def pool(self, engine: EngineProcess, op: str, **arguments: Any) -> dict[str, Any]:
        """One call to the pool of `engine`'s node, as an engine makes it."""
        client = PoolClient(self.nodes.sockets[engine.instance_id], timeout_s=5.0)
        try:
            return await asyncio.to_thread(client.call, op, **arguments)
        finally:
            client.close()

    async def layout(self, engine: EngineProcess) -> tuple[str, KvLayout]:
        """The memory file of `engine`'s node pool and its layout."""
        socket = Path(self.nodes.sockets[engine.instance_id])
        fmt = json.loads(socket.with_suffix(".format").read_text(encoding="utf-8"))
        answer = await self.pool(engine, "attach", format=fmt)
        return answer["path"], KvLayout(
            fmt["layers"], answer["pages"], fmt["chunk_bytes"], fmt["block_size"]
        )

    async def start(
        self, hashes: Sequence[int], *, kind: int = common.TRANSFER_KIND_MIGRATE_SESSION,
        timeout_s: float = 20.0,
    ) -> str:  # fmt: skip
        tid = f"t-{uuid.uuid4().hex[:8]}"
        plan = common.TransferPlan(
            transfer_id=tid,
            kind=kind,  # type: ignore[arg-type]
            source_instance_id=SOURCE,
            target_instance_id=TARGET,
            block_hashes=hashes,
        )
        request = mpb.StartTransferRequest(
            plan=plan, source_messenger_url=self.source_messenger.url
        )
        request.timeout.FromNanoseconds(round(timeout_s * 1e9))
        answer = await self.stub.StartTransfer(request, timeout=5.0)
        assert answer.transfer_id == tid
        return tid

    async def watch(self, tid: str) -> list[mpb.WatchTransferResponse]:
        request = mpb.WatchTransferRequest(transfer_id=tid)
        return [p async for p in self.stub.WatchTransfer(request, timeout=30.0)]

    async def visible(self, engine: EngineProcess, hashes: Sequence[int]) -> list[int] | None:
        """The pages the pool of `engine`'s node holds `hashes` in, when it holds them all
        (pinning them for an instant), else None (also when there is no pool to ask)."""
        try:
            answer = await self.pool(
                engine, "load", block_hashes=list(hashes), start=0, end=len(hashes), hold_s=5.0
            )
        except PoolUnavailable:
            return None
        if answer["export_id"] is not None:
            await self.pool(engine, "release", export_id=answer["export_id"])
        return answer["pages"] if answer["blocks"] == len(hashes) else None

    async def free_for(self, engine: EngineProcess, hashes: Sequence[int]) -> bool:
        """Whether the pool of `engine`'s node can stage pages for all of `hashes` now (its
        pages came back)."""
        answer = await self.pool(
            engine, "save", block_hashes=list(hashes), upto=len(hashes), hold_s=5.0
        )
        if answer["import_id"] is not None:
            await self.pool(engine, "abort", import_id=answer["import_id"])
        return answer["have"] == 0 and len(answer["pages"]) == len(hashes)

    async def computed(self, tokens: Sequence[int]) -> list[int]:
        """The source engine computes `tokens`, and its node's pool holds their blocks (the
        engine saves them once computed); their hashes."""
        await self.source.complete(self.http, tokens)
        hashes = VllmBlockHasher(BLOCK).hash_prompt(tokens)
        await wait_for(
            lambda: self.visible(self.source, hashes), 10.0, message="the source saved them"
        )
        return hashes


@pytest.fixture
async def pair_of(
    nodes: Nodes,
    start_messenger_process: Callable[..., MessengerProcess],
    client_of: Callable[[Sequence[str]], ConductorClient],
    http: aiohttp.ClientSession,
) -> AsyncIterator[Callable[..., Any]]:
    channels: list[grpc.aio.Channel] = []

    async def make(*, target_flags: Sequence[str] = ()) -> Pair:
        await nodes.source.ready(http)
        await nodes.target.ready(http)
        client = client_of([nodes.conductor.url])
        backend = ("--transfer-backend", nodes.backend)
        conductor = nodes.conductor.url
        source_m = start_messenger_process(
            conductor, "node-0", [nodes.source.url], *backend, *nodes.pool_flags(nodes.source)
        )
        target_m = start_messenger_process(
            conductor, "node-1", [nodes.target.url], *backend,
            *nodes.pool_flags(nodes.target), *target_flags,
        )  # fmt: skip
        for m, engine in ((source_m, nodes.source), (target_m, nodes.target)):
            await wait_for(
                functools.partial(_registered_by, client, engine.instance_id, m.url),
                20.0,
                message=f"{engine.instance_id} registered (log: {m.log})",
            )
            await wait_for(
                functools.partial(_ready, http, m), 20.0, message=f"{m.log.name}'s pool ready"
            )
        channel = grpc.aio.insecure_channel(target_m.url)
        channels.append(channel)
        stub = mpb_grpc.MessengerServiceStub(channel)
        return Pair(nodes, client, source_m, target_m, http, stub)

    yield make
    for channel in channels:
        await channel.close(None)


async def _ready(http: aiohttp.ClientSession, messenger: MessengerProcess) -> bool:
    """Whether the Messenger is ready to move KV (its engines answered, its pool attached)."""
    with contextlib.suppress(aiohttp.ClientError):
        async with http.get(messenger.http_url + "/ready") as r:
            return r.status == 200
    return False


async def _registered_by(client: ConductorClient, instance_id: str, messenger: str) -> bool:
    status = await instance_status(client, instance_id)
    return status is not None and status.spec.messenger_url == messenger


def read_chunks(path: str, layout: KvLayout, pages: Sequence[int]) -> list[list[bytes]]:
    """Every layer's chunk of every page, as the engine's memory holds them."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), layout.size, prot=mmap.PROT_READ) as m:
        return [
            [m[layout.offset(layer, p) : layout.offset(layer, p) + layout.chunk_bytes]
             for layer in range(layout.layers)]
            for p in pages
        ]  # fmt: skip


async def test_blocks_arrive_byte_exact_layer_by_layer_and_become_cache_hits(
    pair_of: Callable[..., Any],
) -> None:
    pair: Pair = await pair_of()
    tokens = prompt(1)
    hashes = await pair.computed(tokens)
    assert len(hashes) == BLOCKS and await pair.visible(pair.target, hashes) is None

    progress = await pair.watch(await pair.start(hashes))
    last = progress[-1]
    assert last.state == mpb.TRANSFER_STATE_DONE, last.error
    path, layout = await pair.layout(pair.target)
    assert (last.blocks, last.blocks_done, last.layers_done) == (BLOCKS, BLOCKS, layout.layers)
    assert last.bytes_done == BLOCKS * layout.layers * layout.chunk_bytes
    assert last.bytes_per_second > 0
    layers = [p.layers_done for p in progress]
    assert layers == sorted(layers) and layers[-1] == layout.layers  # reported as they arrive

    pages = await pair.visible(pair.target, hashes)
    assert pages is not None
    got = read_chunks(path, layout, pages)
    source_path, _ = await pair.layout(pair.source)
    source_pages = await pair.visible(pair.source, hashes)
    assert source_pages is not None
    assert got == read_chunks(source_path, layout, source_pages)  # the source's very bytes
    for block, h in enumerate(hashes):  # and the content a block's hash and layer imply
        for layer in range(layout.layers):
            assert got[block][layer] == expected_chunk(h, layer, layout.chunk_bytes)

    # Imported blocks are the target's cache: the next prompt hits them, and the Conductor
    # learns them from the target's KV events.
    answer = await pair.target.complete(pair.http, tokens)
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == BLOCKS * BLOCK
    # Loaded into the target's engine (which never computed them): its memory holds every
    # block's content, as computed apart from the code that moved it.
    assert engine_holds(pair.target, layout, hashes)
    await wait_for(
        lambda: cached_tokens(pair.client, tokens), 10.0, message="the Conductor indexes them"
    )

    async def in_its_engine() -> bool:  # the pool's blocks were indexed first, as CPU tier
        status = await instance_status(pair.client, TARGET)
        return status is not None and status.gpu_blocks >= BLOCKS

    await wait_for(in_its_engine, 10.0, message="the Conductor indexes the engine's blocks")


def engine_holds(engine: EngineProcess, layout: KvLayout, hashes: Sequence[int]) -> bool:
    """Whether the KV memory of `engine` (a process) holds every block of `hashes` in some
    page, each layer's bytes as its hash and the layer imply."""
    (path,) = Path(KV_MEMORY_DIR).glob(f"{KV_MEMORY_PREFIX}{engine.process.pid}-*")
    found = blocks_in_file(path, layout.layers, layout.chunk_bytes, hashes)
    return all(found[h] for h in hashes)


async def test_a_block_written_over_in_the_source_pool_is_not_exported_but_recomputed(
    pair_of: Callable[..., Any],
) -> None:
    """The chunk checksums guard the wire only: computed from the source pool's bytes, they
    would pass on a page written over there. The source pool's own check ends the export
    before that block (and drops it and the blocks after it), so the transfer moves the
    intact prefix and the target's engine computes the rest, never serving bad bytes."""
    pair: Pair = await pair_of()
    tokens = prompt(8)
    hashes = await pair.computed(tokens)
    path, layout = await pair.layout(pair.source)
    pages = await pair.visible(pair.source, hashes)
    assert pages is not None
    bad = 5
    with open(path, "r+b") as f, mmap.mmap(f.fileno(), layout.size) as m:
        at = layout.offset(layout.layers - 1, pages[bad]) + layout.chunk_bytes - 1
        m[at] ^= 0xFF

    last = (await pair.watch(await pair.start(hashes)))[-1]
    assert last.state == mpb.TRANSFER_STATE_DONE, last.error
    assert await pair.visible(pair.target, hashes[:bad]) is not None
    assert await pair.visible(pair.target, hashes[: bad + 1]) is None  # never moved
    assert await pair.visible(pair.source, hashes[: bad + 1]) is None  # dropped there
    answer = await pair.target.complete(pair.http, tokens)
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == bad * BLOCK
    assert engine_holds(pair.target, layout, hashes)


async def test_a_corrupted_chunk_is_read_again(pair_of: Callable[..., Any]) -> None:
    pair: Pair = await pair_of(target_flags=("--fault-corrupt-chunks", "3"))
    tokens = prompt(2)
    hashes = await pair.computed(tokens)
    last = (await pair.watch(await pair.start(hashes)))[-1]
    assert last.state == mpb.TRANSFER_STATE_DONE, last.error
    metrics = await pair.target_messenger.metrics(pair.http)
    assert "kvsched_messenger_transfer_chunks_retried_total 3.0" in metrics
    assert 'kvsched_messenger_transfers_total{outcome="done"} 1.0' in metrics
    assert "kvsched_messenger_transfers_running 0.0" in metrics
    pages = await pair.visible(pair.target, hashes)
    assert pages is not None
    path, layout = await pair.layout(pair.target)
    got = read_chunks(path, layout, pages)
    assert all(
        got[b][layer] == expected_chunk(h, layer, layout.chunk_bytes)
        for b, h in enumerate(hashes)
        for layer in range(layout.layers)
    )


async def test_a_chunk_that_stays_corrupt_fails_the_transfer_and_nothing_is_committed(
    pair_of: Callable[..., Any],
) -> None:
    flags = ("--fault-corrupt-chunks", "1000000", "--chunk-retries", "2")
    pair: Pair = await pair_of(target_flags=flags)
    tokens = prompt(3)
    hashes = await pair.computed(tokens)
    last = (await pair.watch(await pair.start(hashes)))[-1]
    assert last.state == mpb.TRANSFER_STATE_FAILED
    assert "checksum" in last.error and "nothing was committed" in last.error
    assert await pair.visible(pair.target, hashes[:1]) is None  # not even the first block
    assert await pair.free_for(pair.target, hashes)  # every reserved page came back
    answer = await pair.target.complete(pair.http, tokens)
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


async def _until_running(pair: Pair, tid: str) -> None:
    """Wait until a (paced) transfer has verified its first layer."""
    request = mpb.WatchTransferRequest(transfer_id=tid)
    async for progress in pair.stub.WatchTransfer(request, timeout=30.0):
        if progress.layers_done >= 1:
            return
        assert progress.state in (mpb.TRANSFER_STATE_QUEUED, mpb.TRANSFER_STATE_RUNNING)
    raise AssertionError("the transfer ended before its first layer")


def _paced(layout_bytes: int = BLOCKS * 32 * BLOCK * 64) -> tuple[str, str]:
    """A rate that spreads a transfer of the test's blocks over about four seconds."""
    return ("--transfer-rate", str(layout_bytes // 4))


async def test_a_source_messenger_killed_mid_transfer_fails_it_cleanly(
    pair_of: Callable[..., Any],
) -> None:
    pair: Pair = await pair_of(target_flags=_paced())
    tokens = prompt(4)
    hashes = await pair.computed(tokens)
    tid = await pair.start(hashes)
    await _until_running(pair, tid)
    pair.source_messenger.kill()
    last = (await pair.watch(tid))[-1]
    assert last.state == mpb.TRANSFER_STATE_FAILED and last.error
    assert await pair.visible(pair.target, hashes[:1]) is None
    assert await pair.free_for(pair.target, hashes)
    assert pair.target_messenger.process.poll() is None  # the target's Messenger serves on


async def test_a_target_messenger_killed_mid_transfer_leaves_nothing_on_its_node(
    pair_of: Callable[..., Any],
) -> None:
    pair: Pair = await pair_of(target_flags=_paced())
    tokens = prompt(5)
    hashes = await pair.computed(tokens)
    tid = await pair.start(hashes, timeout_s=3.0)
    await _until_running(pair, tid)
    pair.target_messenger.kill()
    # The node's pool went with its Messenger, the staged blocks with it: the engine has
    # nothing of them, and computes the prompt (its pool link a miss, not an error).
    assert await pair.visible(pair.target, hashes[:1]) is None
    answer = await pair.target.complete(pair.http, tokens)
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


async def test_a_cancelled_transfer_commits_nothing(
    pair_of: Callable[..., Any],
) -> None:
    pair: Pair = await pair_of(target_flags=_paced())
    tokens = prompt(6)
    hashes = await pair.computed(tokens)
    tid = await pair.start(hashes)
    await _until_running(pair, tid)
    answer = await pair.stub.CancelTransfer(mpb.CancelTransferRequest(transfer_id=tid))
    assert answer.state == mpb.TRANSFER_STATE_CANCELLED
    last = (await pair.watch(tid))[-1]
    assert last.state == mpb.TRANSFER_STATE_CANCELLED and last.layers_done < 32
    assert await pair.visible(pair.target, hashes[:1]) is None
    await wait_for(lambda: pair.free_for(pair.target, hashes), 5.0, message="pages back")
    again = await pair.stub.CancelTransfer(mpb.CancelTransferRequest(transfer_id=tid))
    assert again.state == mpb.TRANSFER_STATE_CANCELLED  # idempotent, and it stays ended


async def test_a_handoff_streams_the_prompt_while_its_prefill_runs(
    pair_of: Callable[..., Any],
) -> None:
    pair: Pair = await pair_of()
    tokens = prompt(7)
    hashes = VllmBlockHasher(BLOCK).hash_prompt(tokens)
    tid = await pair.start(hashes, kind=common.TRANSFER_KIND_HANDOFF)  # before the prefill
    watching = [p async for p in _first(pair, tid)]
    assert watching[-1].state == mpb.TRANSFER_STATE_RUNNING and watching[-1].blocks_done == 0
    # The prefill computes the first half of the prompt: those blocks move at once...
    half = BLOCKS // 2
    await pair.source.complete(pair.http, tokens[: half * BLOCK + 1])
    request = mpb.WatchTransferRequest(transfer_id=tid)
    async for progress in pair.stub.WatchTransfer(request, timeout=20.0):
        if progress.blocks_done >= half:
            break
    assert progress.state == mpb.TRANSFER_STATE_RUNNING and progress.blocks_done == half
    # ... and the rest as soon as they are computed.
    await pair.source.complete(pair.http, tokens)
    last = (await pair.watch(tid))[-1]
    assert last.state == mpb.TRANSFER_STATE_DONE, last.error
    assert last.blocks_done == BLOCKS
    assert await pair.visible(pair.target, hashes) is not None


async def _first(pair: Pair, tid: str) -> AsyncIterator[mpb.WatchTransferResponse]:
    """The transfer's progress until it runs (it then waits for the source's blocks)."""
    request = mpb.WatchTransferRequest(transfer_id=tid)
    async for progress in pair.stub.WatchTransfer(request, timeout=10.0):
        yield progress
        if progress.state == mpb.TRANSFER_STATE_RUNNING:
            return


@pytest.mark.parametrize(
    ("mutate", "code"),
    [
        (lambda r: r.plan.ClearField("transfer_id"), grpc.StatusCode.INVALID_ARGUMENT),
        (lambda r: r.plan.ClearField("block_hashes"), grpc.StatusCode.INVALID_ARGUMENT),
        (lambda r: r.ClearField("source_messenger_url"), grpc.StatusCode.INVALID_ARGUMENT),
        (lambda r: setattr(r.plan, "target_instance_id", "elsewhere"), grpc.StatusCode.NOT_FOUND),
        (lambda r: r.layers.extend([0, 1]), grpc.StatusCode.INVALID_ARGUMENT),
        (lambda r: setattr(r.plan, "kind", 99), grpc.StatusCode.INVALID_ARGUMENT),
        (lambda r: r.ClearField("timeout"), grpc.StatusCode.INVALID_ARGUMENT),
        (lambda r: setattr(r, "backend", 3 - r.backend), None),  # the other backend
    ],
)
async def test_bad_transfer_requests_are_refused_and_change_nothing(
    pair_of: Callable[..., Any], mutate: Callable[[mpb.StartTransferRequest], None],
    code: grpc.StatusCode | None,
) -> None:  # fmt: skip
    pair: Pair = await pair_of()
    hashes = VllmBlockHasher(BLOCK).hash_prompt(prompt(8))
    plan = common.TransferPlan(
        transfer_id="bad-1",
        kind=common.TRANSFER_KIND_MIGRATE_SESSION,
        source_instance_id=SOURCE,
        target_instance_id=TARGET,
        block_hashes=hashes,
    )
    request = mpb.StartTransferRequest(
        plan=plan,
        source_messenger_url=pair.source_messenger.url,
        backend=mpb.TRANSFER_BACKEND_TCP
        if pair.nodes.backend == "tcp"
        else mpb.TRANSFER_BACKEND_MOONCAKE,
    )
    request.timeout.FromSeconds(5)
    mutate(request)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await pair.stub.StartTransfer(request, timeout=5.0)
    assert err.value.code() == (code or grpc.StatusCode.FAILED_PRECONDITION)
    assert err.value.details()
    with contextlib.suppress(grpc.aio.AioRpcError):
        watch = pair.stub.WatchTransfer(mpb.WatchTransferRequest(transfer_id="bad-1"))
        async for _ in watch:
            raise AssertionError("a refused transfer exists")
    assert pair.target_messenger.process.poll() is None
    for instance_id, m in ((SOURCE, pair.source_messenger), (TARGET, pair.target_messenger)):
        assert await _registered_by(pair.client, instance_id, m.url)


async def test_messengers_serving_mutual_tls_move_kv_and_refuse_anonymous_clients(
    nodes: Nodes,
    start_messenger_process: Callable[..., MessengerProcess],
    http: aiohttp.ClientSession,
    tmp_path: Path,
) -> None:
    """Every gRPC hop secured: the Conductor and both Messengers serve mTLS; the Messengers
    present a client certificate to the Conductor and to each other."""
    if nodes.backend != "tcp":
        pytest.skip("the secured hops are gRPC's: one backend shows them")
    # One identity each (a Messenger speaks for its own node only), minted as `kvsched up`
    # mints them; the test calls as the Conductor (transfers) and as an operator (reads).
    conductor_id = Identity(Role.CONDUCTOR, "c-tls")
    admin = Identity(Role.ADMIN, "test-operator")
    node_ids = {node: Identity(Role.MESSENGER, node) for node in ("node-0", "node-1")}
    now = datetime.datetime.now(datetime.UTC)
    pki = make_cluster_pki(tmp_path / "pki", (conductor_id, admin, *node_ids.values()), now)
    ca = str(pki[admin].ca)

    def messenger_flags(node: str) -> list[str]:
        mine = pki[node_ids[node]]
        cert, key = str(mine.cert), str(mine.key)
        return [
            "--transfer-backend", nodes.backend, "--tls-ca", ca, "--tls-cert", cert,
            "--tls-key", key, "--serve-tls-cert", cert, "--serve-tls-key", key,
            "--serve-tls-client-ca", ca,
        ]  # fmt: skip

    source_flags = [*messenger_flags("node-0"), *nodes.pool_flags(nodes.source)]
    target_flags = [*messenger_flags("node-1"), *nodes.pool_flags(nodes.target)]
    await nodes.source.ready(http)
    await nodes.target.ready(http)
    token_file = tmp_path / "admin-token"
    new_admin_token(token_file)
    me = pki[conductor_id]
    with start_etcd(tmp_path / "etcd") as etcd:
        conductor = ConductorProcess(
            etcd, "c-tls", tmp_path / "c-tls.log", max_instances=4,
            tls_cert=me.cert, tls_key=me.key, tls_client_ca=ca,
            messenger_tls_ca=ca, messenger_tls_cert=me.cert, messenger_tls_key=me.key,
            admin_token_file=token_file,
        )  # fmt: skip
        try:
            source_m = start_messenger_process(
                conductor.url, "node-0", [nodes.source.url], *source_flags
            )
            target_m = start_messenger_process(
                conductor.url, "node-1", [nodes.target.url], *target_flags
            )
            credentials = channel_credentials(pki[admin].client())
            async with ConductorClient(
                [conductor.url], credentials=credentials, deadline_s=2.0, retries=30
            ) as client:
                for m, engine in ((source_m, nodes.source), (target_m, nodes.target)):
                    await wait_for(
                        functools.partial(_registered_by, client, engine.instance_id, m.url),
                        20.0,
                        message=f"{engine.instance_id} registered over TLS (log: {m.log})",
                    )
                    await wait_for(functools.partial(_ready, http, m), 20.0, message="ready")
            async with aio_channel(target_m.url, me.client()) as channel:
                stub = mpb_grpc.MessengerServiceStub(channel)
                pair = Pair(nodes, client, source_m, target_m, http, stub)
                hashes = await pair.computed(prompt(9))
                last = (await pair.watch(await pair.start(hashes)))[-1]
                assert last.state == mpb.TRANSFER_STATE_DONE, last.error
            async with aio_channel(target_m.url, ClientTls(ca)) as channel:  # no certificate
                stub = mpb_grpc.MessengerServiceStub(channel)
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.CancelTransfer(mpb.CancelTransferRequest(transfer_id="x"), timeout=2)
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            async with aio_channel(target_m.url, pki[admin].client()) as channel:  # not its role
                stub = mpb_grpc.MessengerServiceStub(channel)
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.CancelTransfer(mpb.CancelTransferRequest(transfer_id="x"), timeout=2)
                assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        finally:
            conductor.stop()
