"""Messenger settings: command-line flags, each with an environment variable default
(`KVSCHED_MESSENGER_<FLAG>`), tracing from `OTEL_*`."""

from __future__ import annotations

import argparse
import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass, field

from services.common.security.tls import ClientTls, ServerTls
from services.common.security.tls_flags import (
    ClientTlsFlags,
    ServerTlsFlags,
    add_insecure,
    require_secure,
)
from services.common.serving.flags import env_flags, otlp_endpoint
from services.common.serving.logs import LogSettings, add_log_flags, read_log_settings
from services.dataplane import (
    TRANSFER_BACKENDS,
    BlockHashes,
    add_block_hash_flags,
    backend_missing,
    block_hashes_from_args,
)
from services.messenger.engines import EngineTarget, parse_engines

ENV = "KVSCHED_MESSENGER_"
_flag = env_flags(ENV)
# Towards the Conductors and the other Messengers; its own server's.
CLIENT_TLS = ClientTlsFlags("tls-", "the Conductors and the other Messengers")
SERVER_TLS = ServerTlsFlags("serve-tls-")


@dataclass(frozen=True, slots=True)
class MessengerSettings:
    """Everything a Messenger process is configured with."""

    listen: str = "127.0.0.1:50071"
    http_listen: str = "127.0.0.1:8082"
    advertise: str = ""  # gRPC address the Conductor and engines reach (default: --listen)
    conductors: tuple[str, ...] = ("127.0.0.1:50051",)
    engines: tuple[EngineTarget, ...] = ()  # the engines of this node
    node: str = field(default_factory=socket.gethostname)
    instance_ttl_s: float = 10.0  # lease of each registered instance
    load_interval_s: float = 0.05  # how often each engine's load is read
    engine_dead_after_s: float = 1.0  # refused or reset for this long: the engine is gone
    # Timed out for this long (it takes the connection, answers nothing): hung, so gone too. A
    # busy engine on a loaded host can be silent for a second; a process that is gone refuses.
    engine_hung_after_s: float = 10.0
    engine_timeout_s: float = 0.5  # per HTTP request to an engine (snapshots excepted)
    snapshot_timeout_s: float = 10.0
    probe_interval_s: float = 0.25  # how often a gone engine is asked whether it is back
    batch_window_s: float = 0.005  # events wait at most this long to share a batch
    batch_max_events: int = 256
    resend_batches: int = 1024  # batches kept per instance to resend after a resume point
    mirror_batches: int = 1024  # batches queued per standby Conductor for its mirror; 0: none
    block_hashes: BlockHashes = field(default_factory=BlockHashes)  # how engines name blocks
    # The cluster's tokens per KV block (the Conductor's and the Routers'): an engine whose
    # blocks hold another number is refused, as one hashing blocks another way is.
    block_size: int = 16
    vllm_metrics_interval_s: float = 1.0  # how often a vLLM engine's /metrics is read
    # How KV bytes move: our TCP stream (the faster on loopback and plain Ethernet, see
    # bench.transfer), or mooncake (RDMA where the NICs have it; needs libibverbs).
    transfer_backend: str = "tcp"
    mooncake_protocol: str = "tcp"  # tcp, or rdma where the NICs have it
    mooncake_device: str = ""  # the RDMA device(s), e.g. mlx5_0
    transfer_io_timeout_s: float = 10.0  # a read making no progress this long fails
    max_transfers: int = 4  # transfers running at once (more wait, queued)
    transfer_rate: float = 0.0  # bytes per second each transfer may move (0: no limit)
    chunk_retries: int = 3  # reads of a chunk whose checksum did not match
    fault_corrupt_chunks: int = 0  # fault injection for tests: damage this many chunks
    fault_drop_batches: int = 0  # fault injection for tests: lose each engine's next N batches
    # The node's KV pool (host memory its vLLM engines save blocks to and load them from,
    # through kvsched's KV connector, and transfers stage KV in): 0 bytes: none.
    kv_pool_bytes: int = 0
    kv_pool_socket: str = ""  # where the engines reach it (a Unix socket)
    kv_pool_dir: str = "/dev/shm"  # the shared-memory filesystem holding it
    tls: ClientTls | None = None  # towards the Conductors and the other Messengers
    server_tls: ServerTls | None = None  # its own gRPC server's (MessengerService)
    otlp_endpoint: str | None = None
    log: LogSettings = field(default_factory=LogSettings)

    def __post_init__(self) -> None:
        positive = {
            "--block-size": self.block_size,
            "--instance-ttl": self.instance_ttl_s,
            "--load-interval": self.load_interval_s,
            "--engine-dead-after": self.engine_dead_after_s,
            "--engine-hung-after": self.engine_hung_after_s,
            "--engine-timeout": self.engine_timeout_s,
            "--snapshot-timeout": self.snapshot_timeout_s,
            "--probe-interval": self.probe_interval_s,
            "--batch-max-events": self.batch_max_events,
            "--resend-batches": self.resend_batches,
            "--vllm-metrics-interval": self.vllm_metrics_interval_s,
        }
        for flag, value in positive.items():
            if value <= 0:
                raise ValueError(f"{flag} must be positive, got {value}")
        if self.batch_window_s < 0:
            raise ValueError("--batch-window must not be negative")
        if self.mirror_batches < 0:
            raise ValueError("--mirror-batches must not be negative")
        if not self.conductors:
            raise ValueError("--conductor needs at least one host:port")
        if self.transfer_backend not in TRANSFER_BACKENDS:
            raise ValueError(f"--transfer-backend must be one of {', '.join(TRANSFER_BACKENDS)}")
        missing = backend_missing(self.transfer_backend)
        if missing is not None:
            raise ValueError(missing)
        if self.mooncake_protocol not in ("tcp", "rdma"):
            raise ValueError("--mooncake-protocol must be tcp or rdma")
        if self.transfer_io_timeout_s <= 0 or self.max_transfers <= 0:
            raise ValueError("--transfer-io-timeout and --max-transfers must be positive")
        if self.kv_pool_bytes < 0:
            raise ValueError("--kv-pool-bytes must not be negative")
        if self.kv_pool_bytes and not self.kv_pool_socket:
            raise ValueError("a KV pool (--kv-pool-bytes) needs --kv-pool-socket")
        if min(self.transfer_rate, self.chunk_retries, self.fault_corrupt_chunks) < 0:
            raise ValueError(
                "--transfer-rate, --chunk-retries and --fault-corrupt-chunks must not be negative"
            )

    @property
    def url(self) -> str:
        """The gRPC address registered as each instance's `messenger_url`."""
        return self.advertise or self.listen

    @property
    def http_url(self) -> str:
        return f"http://{self.http_listen}"


def _split(values: Sequence[str]) -> tuple[str, ...]:
    """`a,b` and repeated flags alike, in order, without blanks or repeats."""
    items = (part.strip() for value in values for part in value.split(","))
    return tuple(dict.fromkeys(item for item in items if item))


def parse(argv: Sequence[str] | None = None) -> MessengerSettings:
    d = MessengerSettings(node="")
    p = argparse.ArgumentParser(
        prog="kvsched messenger",
        description="Run a Messenger: relay the KV events of this node's engines to the "
        "Conductor and keep the engines registered.",
    )
    _flag(p, "listen", d.listen, "gRPC listen address (port 0: any free one)")
    _flag(p, "http-listen", d.http_listen, "HTTP listen address for /metrics and /health")
    _flag(p, "advertise", d.advertise, "gRPC address the Conductor reaches (default: --listen)")
    _flag(p, "conductor", ",".join(d.conductors), "Conductor address(es), host:port[,host:port]")
    engine_env = ENV + "ENGINE"
    p.add_argument(
        "--engine",
        action="append",
        default=[],
        help="an engine of this node: URL[,kind=auto|sim|vllm][,id=ID][,role=R][,events=ZMQ]"
        f"[,replay=ZMQ][,topic=T]; repeat, or comma-separate URLs (env {engine_env})",
    )
    _flag(p, "node", "", "this node's name (default: the host name)")
    _flag(p, "instance-ttl", d.instance_ttl_s, "lease of each registered instance, seconds")
    _flag(p, "load-interval", d.load_interval_s, "seconds between reads of an engine's load")
    _flag(p, "engine-dead-after", d.engine_dead_after_s, "seconds refused or reset: gone")
    _flag(p, "engine-hung-after", d.engine_hung_after_s, "seconds timing out: hung, gone")
    _flag(p, "engine-timeout", d.engine_timeout_s, "timeout of one HTTP request to an engine")
    _flag(p, "snapshot-timeout", d.snapshot_timeout_s, "timeout of a KV snapshot request")
    _flag(p, "probe-interval", d.probe_interval_s, "seconds between probes of a gone engine")
    _flag(p, "batch-window", d.batch_window_s, "seconds events may wait to share a batch")
    _flag(p, "batch-max-events", d.batch_max_events, "events that cut a batch at once")
    _flag(p, "resend-batches", d.resend_batches, "batches kept per instance for resending")
    _flag(
        p,
        "mirror-batches",
        d.mirror_batches,
        "KV event batches queued per standby Conductor for its mirror (0: no mirror)",
    )
    add_block_hash_flags(_flag, p)
    _flag(p, "block-size", d.block_size, "tokens per KV block (the cluster's): others refused")
    _flag(p, "vllm-metrics-interval", d.vllm_metrics_interval_s, "seconds between /metrics reads")
    _flag(
        p, "transfer-backend", d.transfer_backend, f"how KV moves: {' or '.join(TRANSFER_BACKENDS)}"
    )
    _flag(p, "mooncake-protocol", d.mooncake_protocol, "Mooncake transport: tcp or rdma")
    _flag(p, "mooncake-device", d.mooncake_device, "Mooncake RDMA device(s), e.g. mlx5_0")
    _flag(p, "transfer-io-timeout", d.transfer_io_timeout_s, "a stalled read fails after, s")
    _flag(p, "max-transfers", d.max_transfers, "KV transfers running at once")
    _flag(p, "transfer-rate", d.transfer_rate, "bytes/s per transfer at most (0: no limit)")
    _flag(p, "chunk-retries", d.chunk_retries, "reads of a chunk that failed its checksum")
    _flag(p, "fault-corrupt-chunks", d.fault_corrupt_chunks, "tests: damage this many chunks")
    _flag(p, "fault-drop-batches", 0, "tests: lose each engine's next N KV-event messages")
    _flag(p, "kv-pool-bytes", d.kv_pool_bytes, "the node's KV pool in host memory (0: none)")
    _flag(p, "kv-pool-socket", d.kv_pool_socket, "Unix socket the engines reach the pool at")
    _flag(p, "kv-pool-dir", d.kv_pool_dir, "shared-memory filesystem holding the pool")
    CLIENT_TLS.add(_flag, p)
    SERVER_TLS.add(_flag, p)
    add_insecure(_flag, p)
    add_log_flags(_flag, p)
    a = p.parse_args(argv)
    tls = CLIENT_TLS.read(p, a)
    server_tls = SERVER_TLS.read(p, a)
    require_secure(p, a, (SERVER_TLS, server_tls), [(CLIENT_TLS, tls)])
    try:
        engines = parse_engines(a.engine or [os.environ.get(engine_env, "")])
        return MessengerSettings(
            listen=a.listen,
            http_listen=a.http_listen,
            advertise=a.advertise,
            conductors=_split([a.conductor]),
            engines=engines,
            node=a.node or socket.gethostname(),
            instance_ttl_s=a.instance_ttl,
            load_interval_s=a.load_interval,
            engine_dead_after_s=a.engine_dead_after,
            engine_hung_after_s=a.engine_hung_after,
            engine_timeout_s=a.engine_timeout,
            snapshot_timeout_s=a.snapshot_timeout,
            probe_interval_s=a.probe_interval,
            batch_window_s=a.batch_window,
            batch_max_events=a.batch_max_events,
            resend_batches=a.resend_batches,
            mirror_batches=a.mirror_batches,
            block_hashes=block_hashes_from_args(a),
            block_size=a.block_size,
            vllm_metrics_interval_s=a.vllm_metrics_interval,
            transfer_backend=a.transfer_backend,
            mooncake_protocol=a.mooncake_protocol,
            mooncake_device=a.mooncake_device,
            transfer_io_timeout_s=a.transfer_io_timeout,
            max_transfers=a.max_transfers,
            transfer_rate=a.transfer_rate,
            chunk_retries=a.chunk_retries,
            fault_corrupt_chunks=a.fault_corrupt_chunks,
            fault_drop_batches=a.fault_drop_batches,
            kv_pool_bytes=a.kv_pool_bytes,
            kv_pool_socket=a.kv_pool_socket,
            kv_pool_dir=a.kv_pool_dir,
            tls=tls,
            server_tls=server_tls,
            otlp_endpoint=otlp_endpoint(),
            log=read_log_settings(p, a),
        )
    except ValueError as exc:
        p.error(str(exc))
