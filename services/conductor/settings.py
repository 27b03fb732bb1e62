"""Conductor settings: command-line flags, each with an environment variable default
(`KVSCHED_CONDUCTOR_<FLAG>`), etcd from `KVSCHED_ETCD_*`, tracing from `OTEL_*`."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvsched.core.cluster import ClusterConfig, SloConfig
from kvsched.core.cost_model import default_pool_link
from kvsched.core.latency import DEFAULT_LATENCY
from kvsched.core.topology import LinkClass
from services.common.security.admin_token import read_admin_token
from services.common.security.tls import ClientTls, ServerTls
from services.common.security.tls_flags import (
    ClientTlsFlags,
    ServerTlsFlags,
    add_insecure,
    require_secure,
)
from services.common.serving.flags import env_flags, otlp_endpoint, process_id
from services.common.serving.logs import LogSettings, add_log_flags, read_log_settings
from services.common.store.interface import EtcdSettings
from services.conductor.backpressure import PlacementBounds
from services.dataplane import BlockHashes, add_block_hash_flags, block_hashes_from_args

ENV = "KVSCHED_CONDUCTOR_"
_flag = env_flags(ENV)
SERVER_TLS = ServerTlsFlags("tls-")
MESSENGER_TLS = ClientTlsFlags("messenger-tls-", "the Messengers")


@dataclass(frozen=True, slots=True)
class ConductorSettings:
    """Everything a Conductor process is configured with."""

    conductor_id: str = field(default_factory=process_id)
    listen: str = "127.0.0.1:50051"
    http_listen: str = "127.0.0.1:8081"
    advertise: str = ""  # address clients reach (defaults to `listen`)
    policy: str = "elastic"
    seed: int = 0
    max_instances: int = 64
    block_size: int = 16
    block_hashes: BlockHashes = field(default_factory=BlockHashes)  # how engines name blocks
    model: str = "meta-llama/Llama-3.1-8B-Instruct"
    latency_profile: str = DEFAULT_LATENCY
    kv_capacity_tokens: int = 0  # KV cache per instance; 0: the latency profile's measured one
    # The host link an engine loads its node pool's KV over (prices a pool-only prefix).
    pool_link: LinkClass = field(default_factory=default_pool_link)
    ttft_slo_s: float = 2.0
    tpot_slo_s: float = 0.1
    max_prompt_tokens: int = 131_072
    leader_ttl_s: int = 3
    instance_ttl_s: int = 10
    persist_interval_s: float = 0.05
    dead_leader_probe_s: float = 0.1  # a standby probes the leader's port this often; 0: never
    persist_blocks: bool = True
    mirror_batches: int = 512  # KV event batches a standby keeps per instance for takeover
    session_ttl_s: float = 3600.0  # policy seconds an idle session is kept; 0: forever
    max_sessions: int = 1_000_000  # sessions kept at most (least recently active go); 0: any
    # Sessions one tenant keeps at most (its least recently touched idle one makes room for
    # its new one: `kvsched.core.sessions`); 0: no cap.
    max_sessions_per_tenant: int = 100_000
    time_scale: float = 1.0  # wall seconds per policy second (engines running faster than real)
    # The core's pure-Python index and numpy scoring rather than its compiled kernels: the
    # same decisions, slower (where the C extensions could not be built).
    pure_kernels: bool = False
    execute_transfers: bool = True  # order planned transfers from the Messengers
    transfer_timeout_s: float = 5.0  # a transfer's deadline: this many wall seconds ...
    transfer_timeout_factor: float = 10.0  # ... plus this multiple of its estimated time
    # Overload bounds (see `backpressure`): beyond each a placement is refused at once.
    placement_bounds: PlacementBounds = field(default_factory=PlacementBounds)
    etcd: EtcdSettings = field(default_factory=EtcdSettings)
    tls: ServerTls | None = None
    messenger_tls: ClientTls | None = None  # towards the Messengers, when they serve TLS
    # The admin HTTP API's bearer token (`/api/...` but /api/leader); None: open to all.
    admin_token: str | None = field(default=None, repr=False)
    otlp_endpoint: str | None = None
    log: LogSettings = field(default_factory=LogSettings)

    @property
    def url(self) -> str:
        return self.advertise or self.listen

    @property
    def session_sweep_s(self) -> float:
        """Wall seconds between sweeps of idle sessions: a tenth of the TTL, at most 30;
        0 when nothing is ever forgotten."""
        if self.session_ttl_s <= 0:
            capped = self.max_sessions > 0 or self.max_sessions_per_tenant > 0
            return 30.0 if capped else 0.0
        return min(self.session_ttl_s * self.time_scale / 10, 30.0)

    @property
    def http_url(self) -> str:
        return f"http://{self.http_listen}"

    def cluster_config(self) -> ClusterConfig:
        return ClusterConfig(
            n_instances=self.max_instances,
            latency_profile=self.latency_profile,
            model=self.model,
            block_size=self.block_size,
            kv_capacity_tokens=self.kv_capacity_tokens,
            pool_link=self.pool_link,
            slo=SloConfig(self.ttft_slo_s, self.tpot_slo_s),
        )


def parse(argv: Sequence[str] | None = None) -> ConductorSettings:
    d = ConductorSettings(conductor_id="")
    p = argparse.ArgumentParser(prog="kvsched conductor", description="Run a Conductor.")
    _flag(p, "id", "", "this Conductor's id (default host-pid)")
    _flag(p, "listen", d.listen, "gRPC listen address")
    _flag(p, "http-listen", d.http_listen, "HTTP admin listen address")
    _flag(p, "advertise", d.advertise, "gRPC address clients reach (default: --listen)")
    _flag(p, "policy", d.policy, "placement policy spec, used when etcd records none")
    _flag(p, "seed", d.seed, "seed of the policy's random source")
    _flag(p, "max-instances", d.max_instances, "instance slots")
    _flag(p, "block-size", d.block_size, "tokens per KV block")
    add_block_hash_flags(_flag, p)
    _flag(p, "model", d.model, "served model (sizes KV transfers)")
    _flag(p, "latency-profile", d.latency_profile, "latency model profile")
    _flag(
        p,
        "kv-capacity-tokens",
        d.kv_capacity_tokens,
        "KV cache tokens an instance holds (0: profile's)",
    )
    _flag(
        p,
        "pool-bandwidth",
        d.pool_link.bandwidth_bytes_per_s,
        "bytes/s an engine loads KV from its node's pool into GPU memory at (host link)",
    )
    _flag(p, "pool-setup", d.pool_link.setup_s, "seconds each such load adds to its bytes' time")
    _flag(p, "ttft-slo", d.ttft_slo_s, "time-to-first-token objective, seconds")
    _flag(p, "tpot-slo", d.tpot_slo_s, "time-per-output-token objective, seconds")
    _flag(p, "max-prompt-tokens", d.max_prompt_tokens, "longest prompt accepted")
    _flag(p, "leader-ttl", d.leader_ttl_s, "leader lease, seconds")
    _flag(p, "instance-ttl", d.instance_ttl_s, "default instance lease, seconds")
    _flag(p, "persist-interval", d.persist_interval_s, "write-behind flush period, seconds")
    _flag(
        p,
        "dead-leader-probe",
        d.dead_leader_probe_s,
        "a standby probes the leader's HTTP port this often (seconds); two refused "
        "connections in a row end its term at once (0: wait for its lease)",
    )
    _flag(p, "persist-blocks", d.persist_blocks, "persist block metadata for warm restarts")
    _flag(
        p,
        "mirror-batches",
        d.mirror_batches,
        "KV event batches a standby keeps per instance, mirrored by the Messengers, to apply "
        "if it takes over",
    )
    _flag(p, "session-ttl", d.session_ttl_s, "policy seconds an idle session is kept (0: forever)")
    _flag(
        p,
        "max-sessions",
        d.max_sessions,
        "sessions kept at most, least recently active go first (0: no cap)",
    )
    _flag(
        p,
        "max-sessions-per-tenant",
        d.max_sessions_per_tenant,
        "sessions one tenant keeps at most: its new one forgets its least recently touched "
        "idle one (0: no cap)",
    )
    _flag(p, "time-scale", d.time_scale, "wall seconds per policy second, as the engines run")
    _flag(
        p,
        "pure-kernels",
        d.pure_kernels,
        "the core's pure-Python index and numpy scoring instead of its compiled kernels (the "
        "same decisions, slower)",
    )
    _flag(
        p,
        "execute-transfers",
        d.execute_transfers,
        "order planned KV transfers from the Messengers (off: an executor of your own runs them "
        "and reports each with ReportTransfer)",
    )
    _flag(p, "transfer-timeout", d.transfer_timeout_s, "KV transfer deadline floor, seconds")
    _flag(p, "transfer-timeout-factor", d.transfer_timeout_factor, "plus this × its estimate")
    bounds = d.placement_bounds
    _flag(
        p,
        "max-pending-placements",
        bounds.max_pending,
        "placements waiting for an answer, all streams; more are refused",
    )
    _flag(
        p,
        "max-placement-wait",
        bounds.max_wait_s,
        "wall seconds a placement may wait to be decided before it is refused",
    )
    _flag(
        p,
        "max-persist-pending",
        bounds.max_outbox,
        "session bindings waiting for etcd beyond which new placements are refused",
    )
    SERVER_TLS.add(_flag, p)
    MESSENGER_TLS.add(_flag, p)
    add_insecure(_flag, p)
    _flag(p, "admin-token-file", "", "file holding the admin HTTP API's bearer token")
    add_log_flags(_flag, p)
    a = p.parse_args(argv)
    if a.time_scale <= 0:
        p.error("--time-scale must be positive")
    if a.session_ttl < 0 or a.max_sessions < 0 or a.max_sessions_per_tenant < 0:
        p.error("--session-ttl, --max-sessions and --max-sessions-per-tenant must not be negative")
    if a.mirror_batches < 1:
        p.error("--mirror-batches must be at least 1")
    if not (a.pool_bandwidth > 0 and a.pool_setup >= 0):
        p.error("--pool-bandwidth must be positive and --pool-setup not negative")
    if a.transfer_timeout <= 0 or a.transfer_timeout_factor < 0:
        p.error("--transfer-timeout must be positive and --transfer-timeout-factor not negative")
    tls = SERVER_TLS.read(p, a)
    messenger_tls = MESSENGER_TLS.read(p, a)
    require_secure(p, a, (SERVER_TLS, tls), [(MESSENGER_TLS, messenger_tls)])
    if not a.insecure and not a.admin_token_file:
        p.error("the admin HTTP API needs --admin-token-file (or --insecure to leave it open)")
    admin_token = read_admin_token(p, a.admin_token_file) if a.admin_token_file else None
    try:
        hashes = block_hashes_from_args(a)
        placement_bounds = PlacementBounds(
            a.max_pending_placements, a.max_placement_wait, a.max_persist_pending
        )
    except ValueError as exc:
        p.error(str(exc))
    return ConductorSettings(
        conductor_id=a.id or process_id(),
        listen=a.listen,
        http_listen=a.http_listen,
        advertise=a.advertise,
        policy=a.policy,
        seed=a.seed,
        max_instances=a.max_instances,
        block_size=a.block_size,
        block_hashes=hashes,
        model=a.model,
        latency_profile=a.latency_profile,
        kv_capacity_tokens=a.kv_capacity_tokens,
        pool_link=LinkClass(a.pool_bandwidth, a.pool_setup),
        ttft_slo_s=a.ttft_slo,
        tpot_slo_s=a.tpot_slo,
        max_prompt_tokens=a.max_prompt_tokens,
        leader_ttl_s=a.leader_ttl,
        instance_ttl_s=a.instance_ttl,
        persist_interval_s=a.persist_interval,
        dead_leader_probe_s=a.dead_leader_probe,
        persist_blocks=a.persist_blocks,
        mirror_batches=a.mirror_batches,
        session_ttl_s=a.session_ttl,
        max_sessions=a.max_sessions,
        max_sessions_per_tenant=a.max_sessions_per_tenant,
        time_scale=a.time_scale,
        pure_kernels=a.pure_kernels,
        execute_transfers=a.execute_transfers,
        transfer_timeout_s=a.transfer_timeout,
        transfer_timeout_factor=a.transfer_timeout_factor,
        placement_bounds=placement_bounds,
        etcd=EtcdSettings.from_env(),
        tls=tls,
        messenger_tls=messenger_tls,
        admin_token=admin_token,
        otlp_endpoint=otlp_endpoint(),
        log=read_log_settings(p, a),
    )
