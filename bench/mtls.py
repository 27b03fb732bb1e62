"""What mutual TLS costs: minting `kvsched up`'s certificates at each start, and a unary RPC
over mTLS with the per-call authorisation (`services.common.security.authz`) against the same RPC
over plaintext, measured in the same run on one warm channel each (a gRPC server of the
project's own skeleton, `start_grpc_server`, answering health checks in process).

    .venv/bin/python -m bench.mtls [--calls 2000] [--repeats 5]

Prints the median minting time and the per-call medians and p99s, and their ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import statistics
import tempfile
import time
from pathlib import Path

from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry.trace import NoOpTracer

from services.common.security.identity import Identity, Role
from services.common.security.pki import make_cluster_pki
from services.common.security.tls import ClientTls, ServerTls, aio_channel
from services.common.serving.grpc_server import GrpcApi, health_servicer, start_grpc_server
from services.launcher.cluster_options import ClusterOptions
from services.launcher.credentials import ADMIN, ClusterCredentials
from services.launcher.plan import identities

API = GrpcApi("bench.Nothing", lambda server: None)


def mint_s(repeats: int) -> tuple[float, int]:
    """Median seconds to mint a default `kvsched up` cluster's CA and certificates."""
    ids = ClusterCredentials.for_run(Path("."), identities(ClusterOptions())).identities
    times = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(repeats):
            started = time.perf_counter()
            make_cluster_pki(Path(tmp) / str(i), ids, datetime.datetime.now(datetime.UTC))
            times.append(time.perf_counter() - started)
    return statistics.median(times), len(ids)


async def call_times(
    server_tls: ServerTls | None, client: ClientTls | None, calls: int
) -> list[float]:
    """Seconds of each of `calls` sequential health checks on one warm channel."""
    server, port = await start_grpc_server(
        "127.0.0.1:0", API, health_servicer(), tracer=NoOpTracer(), tls=server_tls
    )
    try:
        async with aio_channel(f"127.0.0.1:{port}", client) as channel:
            check = health_pb2_grpc.HealthStub(channel).Check
            request = health_pb2.HealthCheckRequest()
            for _ in range(50):  # warm: the handshake and the interceptor's cache
                await check(request, timeout=5)
            times = []
            for _ in range(calls):
                started = time.perf_counter()
                await check(request, timeout=5)
                times.append(time.perf_counter() - started)
            return times
    finally:
        await server.stop(None)


def _p(times: list[float], q: float) -> float:
    return sorted(times)[min(len(times) - 1, int(q * len(times)))]


async def rpc_overhead(calls: int, repeats: int) -> None:
    conductor = Identity(Role.CONDUCTOR, "conductor-0")
    with tempfile.TemporaryDirectory() as tmp:
        now = datetime.datetime.now(datetime.UTC)
        files = make_cluster_pki(Path(tmp), (conductor, ADMIN), now)
        server_files, admin = files[conductor], files[ADMIN]
        plain: list[float] = []
        mutual: list[float] = []
        for _ in range(repeats):  # alternate, so drift hits both alike
            plain += await call_times(None, None, calls)
            mutual += await call_times(server_files.server(), admin.client(), calls)
    p50_plain, p50_mutual = statistics.median(plain), statistics.median(mutual)
    print(f"unary RPC, plaintext: p50 {p50_plain * 1e6:.0f} us, p99 {_p(plain, 0.99) * 1e6:.0f} us")
    print(
        f"unary RPC, mTLS + authz: p50 {p50_mutual * 1e6:.0f} us, "
        f"p99 {_p(mutual, 0.99) * 1e6:.0f} us ({p50_mutual / p50_plain:.2f}x plaintext's p50)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    seconds, count = mint_s(args.repeats)
    print(f"minting kvsched up's CA and {count} certificates: {seconds * 1e3:.1f} ms (median)")
    asyncio.run(rpc_overhead(args.calls, args.repeats))


if __name__ == "__main__":
    main()
