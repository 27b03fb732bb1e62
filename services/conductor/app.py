"""One Conductor process: the composition of its pieces (the current term, the etcd replica,
the election, write-behind, the RPC parts, transfers, metrics, gRPC and HTTP servers) and
its lifecycle.

Lifecycle: `start()` loads the state from etcd (warm), binds the servers, then follows etcd
and campaigns. Only the elected leader serves writes (`serving`); a standby answers reads and
stays warm from the watch, renews instance leases, and probes the leader (`takeover.py`): a
leader whose process is gone loses its term at once instead of when its lease lapses. Every
write of the leader is guarded by its term (`fencing.py`). Losing the lease makes the process
a standby again, rebuilt from etcd so nothing it had not persisted survives. `stop()` resigns
first so a standby takes over at once, flushes, and lets in-flight RPCs finish.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import replace
from functools import partial

import grpc
from opentelemetry.sdk.trace import TracerProvider

from kvsched.api.conductor.v1 import conductor_service_pb2 as pb
from kvsched.api.conductor.v1 import conductor_service_pb2_grpc as pb_grpc
from services.common.serving.grpc_server import (
    NOT_SERVING,
    SERVING,
    GrpcApi,
    health_servicer,
    start_grpc_server,
)
from services.common.store.etcd import EtcdStore
from services.common.store.interface import Put, Store, StoreError
from services.common.telemetry import (
    TelemetrySettings,
    get_tracer,
    setup_tracing,
    shutdown_tracing,
)
from services.conductor import keys, replica
from services.conductor.admin_rpcs import AdminRpcs
from services.conductor.backpressure import PendingPlacements
from services.conductor.election import Election, LeaderInfo
from services.conductor.event_rpcs import KvEventRpcs
from services.conductor.explain import Explainer
from services.conductor.fencing import TermWriter
from services.conductor.http import AdminHttp
from services.conductor.instance_rpcs import InstanceRpcs
from services.conductor.keys import InstanceRecord
from services.conductor.leadership import Leadership
from services.conductor.metrics import ConductorMetrics, FailoverCounters, StateGauges
from services.conductor.mirror import MirroredBatches
from services.conductor.persist import Persister
from services.conductor.placement_rpcs import PlacementRpcs
from services.conductor.registration import Registrar
from services.conductor.service import conductor_servicer
from services.conductor.settings import ConductorSettings
from services.conductor.state import ConductorState
from services.conductor.streams import OpenStreams
from services.conductor.takeover import DeadLeaderProbe
from services.conductor.term import Term, TermHolder
from services.conductor.transfer_rpcs import TransferRpcs
from services.conductor.transfer_runner import TransferRunner

log = logging.getLogger(__name__)
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["ConductorService"].full_name


class Conductor:
    """A Conductor; `clock` is injectable (the parity test drives it)."""

    def __init__(
        self,
        settings: ConductorSettings,
        *,
        clock: Callable[[], float] | None = None,
        tracer_provider: TracerProvider | None = None,
        store: Store | None = None,
    ) -> None:
        self.settings = settings
        # Policy time runs as the engines' does: scaled when they run faster than a GPU would.
        self.clock = clock or (lambda: time.time() / settings.time_scale)
        self.store: Store = store or EtcdStore(settings.etcd)
        self.terms = TermHolder(self._new_term())
        current = self.terms.current
        # The election campaigns once the servers are bound and their addresses known.
        self.leadership = Leadership(
            settings.conductor_id, Election(self.store, LeaderInfo("", "", ""), 1)
        )
        leadership = self.leadership
        self.writer = TermWriter(
            self.store,
            leadership.guard,
            leadership.fenced,
        )
        self.persister = Persister(
            self.writer, lambda: current().outbox, settings.persist_interval_s
        )
        self.probe = DeadLeaderProbe(
            self.store,
            lambda: leadership.election,
            interval_s=settings.dead_leader_probe_s,
        )
        self.metrics = ConductorMetrics()
        self.pending = PendingPlacements(settings.placement_bounds)
        self.tracer_provider = tracer_provider or setup_tracing(
            TelemetrySettings("kvsched-conductor", settings.otlp_endpoint)
        )
        self._own_provider = tracer_provider is None
        self.health = health_servicer()
        self.server: grpc.aio.Server | None = None
        sync = self.persister.sync
        transfers = self.transfers = TransferRunner(
            settings,
            current,
            clock=self.clock,
            sync=sync,
            metrics=self.metrics,
            tracer=get_tracer(self.tracer_provider),
        )
        self.metrics.registry.register(
            StateGauges(current, self.leadership, lambda: transfers.running, self.pending)
        )
        probe, writer = self.probe, self.writer
        self.metrics.registry.register(
            FailoverCounters(lambda: probe.takeovers, lambda: writer.fenced)
        )
        hasher = settings.block_hashes.hasher(settings.block_size)  # explains token ids
        explainer = Explainer(current, hasher, self.clock)
        self.http = AdminHttp(
            current, self.leadership, explainer, self.metrics.registry, settings.admin_token
        )
        self.streams = OpenStreams()
        registrar = Registrar(self.store, self.writer, current, sync, settings.instance_ttl_s)
        self.events = KvEventRpcs(
            current, self.leadership, self.metrics, MirroredBatches(settings.mirror_batches)
        )
        self.rpcs = (
            InstanceRpcs(registrar, current, self.leadership),
            self.events,
            PlacementRpcs(
                current,
                self.leadership,
                clock=self.clock,
                metrics=self.metrics,
                transfers=transfers,
                sync=sync,
                streams=self.streams,
                pending=self.pending,
                time_scale=settings.time_scale,
            ),
            TransferRpcs(
                current,
                self.leadership,
                clock=self.clock,
                time_scale=settings.time_scale,
                transfers=transfers,
                sync=sync,
            ),
            AdminRpcs(current, self.leadership, self.writer, explainer),
        )
        self._tasks: list[asyncio.Task[None]] = []
        self._follow: asyncio.Task[None] | None = None

    def _new_term(self) -> Term:
        s = self.settings
        # Unique across terms and restarts: a Messenger still knows the last term's ids.
        return Term.build(s, f"{s.conductor_id}-{secrets.token_hex(4)}")

    @property
    def state(self) -> ConductorState:
        """The registry and control core of the term in force."""
        return self.terms.current().state

    @property
    def serving(self) -> bool:
        """Whether this Conductor leads and serves writes."""
        return self.leadership.serving

    @property
    def election(self) -> Election:
        return self.leadership.election

    # ---- lifecycle ---------------------------------------------------------------------

    async def start(self) -> None:
        s = self.settings
        await self.store.connect()
        revision = await replica.load(self.store, self.state)
        port = await self._start_grpc()
        host = (s.advertise or s.listen).rpartition(":")[0]
        http_port = await self.http.start(s.http_listen)
        http_host = s.http_listen.rpartition(":")[0]
        self.settings = replace(
            s, advertise=f"{host}:{port}", http_listen=f"{http_host}:{http_port}"
        )
        info = LeaderInfo(s.conductor_id, self.settings.url, self.settings.http_url)
        self.leadership.election = Election(self.store, info, s.leader_ttl_s)
        self._follow = asyncio.create_task(self._follow_from(revision))
        self._tasks = [
            asyncio.create_task(self.election.run(self._on_elected, self._on_lost)),
            asyncio.create_task(self.persister.run()),
        ]
        if s.dead_leader_probe_s > 0:
            self._tasks.append(asyncio.create_task(self.probe.run()))
        if s.session_sweep_s > 0:
            self._tasks.append(asyncio.create_task(self._sweep_sessions(s.session_sweep_s)))
        log.info("Conductor %s listening on %s (http %s)", s.conductor_id, self.url, self.http_url)

    @property
    def url(self) -> str:
        return self.settings.url

    @property
    def http_url(self) -> str:
        return self.settings.http_url

    async def _start_grpc(self) -> int:
        api = GrpcApi(
            SERVICE_NAME,
            partial(pb_grpc.add_ConductorServiceServicer_to_server, conductor_servicer(*self.rpcs)),
        )
        self.server, port = await start_grpc_server(
            self.settings.listen,
            api,
            self.health,
            tracer=get_tracer(self.tracer_provider),
            tls=self.settings.tls,
            serving=False,  # until elected
            max_receive_bytes=64 << 20,
        )
        return port

    async def _follow_from(self, revision: int) -> None:
        """Follow etcd; when the watch breaks (etcd restarted, history compacted), catch up
        and follow again: the leader re-reads instances and sessions, a standby rebuilds."""
        while True:
            try:
                await replica.follow(self.store, self.state, self.election, revision)
                return
            except StoreError as exc:
                log.warning("etcd watch broke (%s); catching up", exc)
            await asyncio.sleep(0.2)
            with contextlib.suppress(StoreError):
                if self.serving:
                    revision = await self.store.revision()
                    await self._reconcile()
                else:
                    term = self._new_term()
                    revision = await replica.load(self.store, term.state)
                    self.terms.swap(term)

    async def _sweep_sessions(self, every_s: float) -> None:
        """Forget idle sessions every `every_s` wall seconds, on the leader only (a standby
        follows the deletes from etcd)."""
        while True:
            await asyncio.sleep(every_s)
            if self.serving:
                self.forget_idle_sessions()

    def forget_idle_sessions(self) -> int:
        """Forget the sessions idle past the TTL, and over the cap, at the policy clock's
        now; their etcd records go with the next flush. Returns how many went."""
        s = self.settings
        gone = self.state.scheduler.forget_idle_sessions(
            self.clock(), s.session_ttl_s, s.max_sessions
        )
        if gone:
            self.metrics.sessions_forgotten.inc(len(gone))
            log.info("forgot %d idle sessions", len(gone))
        return len(gone)

    async def _on_elected(self) -> None:
        """Catch up on what the watch may not have applied yet, then serve."""
        # What the outbox collected as a standby mirrors etcd, possibly older than etcd by
        # now: the new term writes only what it changes itself. (No await before this line:
        # the persister cannot flush the old writes under the new guard.)
        self.terms.current().outbox.take()
        await self._reconcile()
        recorded = await self.store.get(keys.POLICY.encode())
        if recorded is None:
            spec = self.state.scheduler.spec.encode()
            await self.writer.commit([Put(keys.POLICY.encode(), spec)])
        # The dead leader's unflushed tail, mirrored here by the Messengers: applied on top of
        # the cursors just read, so it is not sent again. No await from here to `serving`:
        # nothing kept meanwhile is left behind, and KeepAlive (which answers the resume
        # point) waits for `serving` on an elected Conductor.
        self.events.apply_mirrored()
        self.leadership.serving = True
        await self.health.set(SERVICE_NAME, SERVING)
        log.info("Conductor %s leads", self.settings.conductor_id)

    async def _reconcile(self) -> None:
        state, store = self.state, self.store
        instances = await store.get_prefix(keys.INSTANCES.encode())
        live = set()
        for kv in instances:
            record = InstanceRecord.decode(kv.value)
            live.add(record.spec.instance_id)
            old = state.instances.get(record.spec.instance_id)
            state.add_instance(record, old.next_sequence if old else 0)
        for gone in set(state.instances) - live:
            state.remove_instance(gone)
        for kv in await store.get_prefix(keys.CURSORS.encode()):
            inst = state.instances.get(keys.tail(kv.key.decode(), keys.CURSORS))
            if inst is not None:
                inst.next_sequence = int(kv.value)
        for kv in await store.get_prefix(keys.SESSIONS.encode()):
            state.restore_session(keys.tail(kv.key.decode(), keys.SESSIONS), kv.value)
        policy = await store.get(keys.POLICY.encode())
        if policy is not None and policy.value.decode() != state.scheduler.spec:
            state.set_policy(policy.value.decode())

    async def _on_lost(self) -> None:
        """Stop serving and rebuild from etcd: unpersisted writes of the lost term are gone."""
        self.leadership.serving = False
        self.events.mirrored.clear()  # kept while leading, if anything: stale
        await self.transfers.stop()
        self.streams.end_all()
        await self.health.set(SERVICE_NAME, NOT_SERVING)
        if self._follow is not None:
            self._follow.cancel()
        term = self._new_term()
        revision = await replica.load(self.store, term.state)  # on failure: keep the old
        self.terms.swap(term)
        self._follow = asyncio.create_task(self._follow_from(revision))

    async def stop(self, grace_s: float = 2.0) -> None:
        """Resign, flush, drain RPCs, close."""
        self.leadership.serving = False
        with contextlib.suppress(Exception):
            await self.persister.flush()
        with contextlib.suppress(Exception):
            await self.election.resign()
        if self.server is not None:
            await self.server.stop(grace_s)
        await self.transfers.close()
        await self.http.stop()
        tasks = [*self._tasks, *([self._follow] if self._follow else [])]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.store.close()
        if self._own_provider:
            await asyncio.to_thread(shutdown_tracing, self.tracer_provider)
