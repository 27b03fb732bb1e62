"""One Messenger process: the gRPC server (MessengerService, health, reflection), the HTTP
endpoint, the Conductor client with its one KV event stream, and a relay per engine.

Lifecycle: `start()` binds the servers (so each instance registers with the address its
Messenger really listens on), opens the stream and starts the relays. `stop()` stops the
relays, deregisters every instance they registered, half-closes the stream after what is
queued, and closes the servers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import TypeAlias

import aiohttp
import grpc
from opentelemetry.sdk.trace import TracerProvider

from clients.python import ConductorClient, Interceptor
from clients.python.kv_stream import KvEventStream
from kvsched.api.messenger.v1 import messenger_service_pb2 as pb
from kvsched.api.messenger.v1 import messenger_service_pb2_grpc as pb_grpc
from services.common.security.tls import aio_channel, channel_credentials
from services.common.serving.grpc_server import GrpcApi, health_servicer, start_grpc_server
from services.common.telemetry import (
    TelemetrySettings,
    client_interceptors,
    get_tracer,
    setup_tracing,
    shutdown_tracing,
)
from services.dataplane import (
    Exporter,
    LocalKv,
    NodePool,
    PoolServer,
    TransferLimits,
    Transfers,
    open_backend,
)
from services.kv_events.vllm_wire import Event
from services.messenger.http import MessengerHttp
from services.messenger.metrics import MessengerMetrics
from services.messenger.relay import EngineRelay
from services.messenger.service import MessengerServicer
from services.messenger.settings import MessengerSettings

log = logging.getLogger(__name__)
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["MessengerService"].full_name
_PeerStub: TypeAlias = "pb_grpc.MessengerServiceAsyncStub"  # exists only in the stubs
DEREGISTER_TIMEOUT_S = 5.0


class Messenger:
    """A Messenger; `tracer_provider` defaults to one from `settings.otlp_endpoint`."""

    def __init__(
        self, settings: MessengerSettings, *, tracer_provider: TracerProvider | None = None
    ) -> None:
        self.settings = settings
        self.tracer_provider = tracer_provider or setup_tracing(
            TelemetrySettings("kvsched-messenger", settings.otlp_endpoint)
        )
        self._own_provider = tracer_provider is None
        self.relays: list[EngineRelay] = []
        self.stream: KvEventStream | None = None
        self.client: ConductorClient | None = None
        self.metrics = MessengerMetrics(lambda: self.relays, lambda: self.stream)
        self.http = MessengerHttp(
            self.metrics.registry, lambda: self.relays, lambda: self.stream, self._unready
        )
        self.health = health_servicer()
        self.server: grpc.aio.Server | None = None
        self._session: aiohttp.ClientSession | None = None
        self._tasks: list[asyncio.Task[None]] = []
        s = settings
        host = (s.advertise or s.listen).rpartition(":")[0]
        self.backend = open_backend(
            s.transfer_backend,
            host,
            timeout_s=s.transfer_io_timeout_s,
            mooncake_protocol=s.mooncake_protocol,
            mooncake_device=s.mooncake_device,
        )
        self.pool: NodePool | None = None
        self.pool_server: PoolServer | None = None
        if s.kv_pool_bytes:
            self.pool = NodePool(
                s.kv_pool_bytes,
                node=s.node,
                hasher_for=s.block_hashes.hasher,
                on_events=self._pool_events,
                directory=s.kv_pool_dir,
                format_file=Path(s.kv_pool_socket).with_suffix(".format"),
            )
            self.pool_server = PoolServer(self.pool, s.kv_pool_socket)
        self.local_kv = LocalKv(lambda: self.relays, self.backend, self.pool)
        self.exporter = Exporter(self.local_kv)
        self.transfers = Transfers(
            self.local_kv,
            TransferLimits(
                max_transfers=s.max_transfers,
                chunk_retries=s.chunk_retries,
                rate_bytes_per_s=s.transfer_rate,
                corrupt_chunks=s.fault_corrupt_chunks,
            ),
            self._peer,
            tracer=get_tracer(self.tracer_provider),
            on_end=self.metrics.on_transfer_end,
        )
        self.metrics.watch_transfers(self.transfers)
        if self.pool is not None:
            self.metrics.watch_pool(self.pool)
        self._peers: dict[str, tuple[grpc.aio.Channel, _PeerStub]] = {}

    @property
    def url(self) -> str:
        """The gRPC address instances register as their Messenger's."""
        return self.settings.url

    @property
    def http_url(self) -> str:
        return self.settings.http_url

    def relay(self, instance_id: str) -> EngineRelay | None:
        """The relay of the engine that is `instance_id`, if any."""
        return next((r for r in self.relays if r.instance_id == instance_id), None)

    # ---- lifecycle -------------------------------------------------------------------------

    def _peer(self, url: str) -> _PeerStub:
        """The MessengerService of another node's Messenger (a transfer's source)."""
        entry = self._peers.get(url)
        if entry is None:
            tracer = get_tracer(self.tracer_provider)
            channel = aio_channel(url, self.settings.tls, interceptors=client_interceptors(tracer))
            entry = self._peers[url] = (channel, pb_grpc.MessengerServiceStub(channel))
        return entry[1]

    async def start(self) -> None:
        s = self.settings
        await self.backend.start()
        port = await self._start_grpc()
        http_port = await self.http.start(s.http_listen)
        host = (s.advertise or s.listen).rpartition(":")[0]
        http_host = s.http_listen.rpartition(":")[0]
        self.settings = s = replace(
            s,
            advertise=s.advertise or f"{host}:{port}",
            http_listen=f"{http_host}:{http_port}",
        )
        tracer = get_tracer(self.tracer_provider)
        interceptors: list[Interceptor] = list(client_interceptors(tracer))  # type: ignore[arg-type]
        self.client = ConductorClient(
            list(s.conductors), credentials=channel_credentials(s.tls), interceptors=interceptors
        )
        self.stream = KvEventStream(
            self.client,
            on_resync=self._on_resync,
            on_unregistered=self._on_unregistered,
            on_sent=self.metrics.on_sent,
            log_batches=s.resend_batches,
            mirror_batches=s.mirror_batches,
        )
        self.stream.start()
        self._session = aiohttp.ClientSession()
        if self.pool_server is not None:
            await self.pool_server.start()
        self.relays = [
            EngineRelay(
                target,
                s,
                client=self.client,
                stream=self.stream,
                http=self._session,
                pool=self.pool,
            )
            for target in s.engines
        ]
        self._tasks = [
            asyncio.create_task(relay.run(), name=f"relay {relay.engine_url}")
            for relay in self.relays
        ]
        log.info(
            "Messenger of node %s listening on %s (http %s, KV by %s at %s), %d engine(s), "
            "Conductor %s",
            s.node,
            self.url,
            self.http_url,
            self.backend.name,
            self.backend.endpoint,
            len(self.relays),
            ",".join(s.conductors),
        )

    def _unready(self) -> str | None:
        """Why KV cannot move here yet: an engine has not answered yet, or the node's
        engines have not attached to its pool (they start first and attach within a second
        of the pool's socket appearing)."""
        waiting = [r.engine_url for r in self.relays if r.instance_id is None]
        if waiting:
            return f"engines not identified yet: {', '.join(waiting)}"
        if self.pool is not None and not self.pool.attached:
            return "no engine has attached to the KV pool yet"
        return None

    def _pool_events(self, events: list[Event]) -> None:
        """The pool's blocks are every engine's of this node that uses it, in host memory."""
        for relay in self.relays:
            if relay.uses_pool:
                relay.send_local(events)

    def _on_resync(self, instance_id: str) -> None:
        relay = self.relay(instance_id)
        if relay is not None:
            relay.want_resync("resume_point")

    def _on_unregistered(self, instance_id: str) -> None:
        relay = self.relay(instance_id)
        if relay is not None:
            relay.lost_registration()

    async def _start_grpc(self) -> int:
        s = self.settings
        servicer = MessengerServicer(self.transfers, self.exporter)
        api = GrpcApi(
            SERVICE_NAME, partial(pb_grpc.add_MessengerServiceServicer_to_server, servicer)
        )
        self.server, port = await start_grpc_server(
            s.listen,
            api,
            self.health,
            tracer=get_tracer(self.tracer_provider),
            tls=s.server_tls,
        )
        return port

    async def stop(self, grace_s: float = 2.0) -> None:
        """Deregister every instance, drain the stream, end the transfers (their imports are
        aborted) and exports, close everything."""
        await self.transfers.close()
        await self.exporter.close()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        # Deregistering takes the instances out of routing at once; if the Conductor does not
        # answer in time, their leases lapse on their own.
        leaving = asyncio.gather(*(r.leave() for r in self.relays), return_exceptions=True)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(DEREGISTER_TIMEOUT_S):
                await leaving
        if self.stream is not None:
            await self.stream.close()
        if self.client is not None:
            await self.client.close()
        if self._session is not None:
            await self._session.close()
        if self.server is not None:
            await self.health.enter_graceful_shutdown()
            await self.server.stop(grace_s)
        await self.backend.stop()
        if self.pool_server is not None:
            await self.pool_server.stop()
        self.local_kv.close()
        if self.pool is not None:
            self.pool.close()
        peers, self._peers = self._peers, {}
        for channel, _ in peers.values():
            await channel.close(None)
        await self.http.stop()
        if self._own_provider:
            with contextlib.suppress(Exception):
                await asyncio.to_thread(shutdown_tracing, self.tracer_provider)
