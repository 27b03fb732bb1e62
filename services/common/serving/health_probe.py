"""`kvsched health`: ask a gRPC server's standard health service (`grpc.health.v1`) whether it
serves, over mutual TLS with the caller's own certificate, as a Kubernetes exec probe does
(the kubelet's own gRPC probe speaks plaintext only, which an mTLS server refuses).

    kvsched health [--address HOST:PORT] [--service NAME] [--ca F --cert F --key F]
                   [--server-name NAME] [--timeout S]

Each flag also reads `KVSCHED_HEALTH_<FLAG>` (a probe's files can come from the container's
environment, where the kubelet expands `$(POD_NAME)`, which it does not in a probe's command).
Exit status 0 when the service is SERVING, 1 when it answers anything else or not at all
(the reason on stderr), 2 for a usage error. Nothing on the server changes."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.security.tls import ClientTls, channel_credentials
from services.common.security.tls_flags import ClientTlsFlags
from services.common.serving.flags import env_flags

ENV = "KVSCHED_HEALTH_"
_flag = env_flags(ENV)
TLS = ClientTlsFlags("", "the server")


def parse(argv: Sequence[str] | None = None) -> tuple[argparse.Namespace, ClientTls | None]:
    p = argparse.ArgumentParser(
        prog="kvsched health",
        description="Exit 0 when a gRPC server's health service says SERVING.",
    )
    _flag(p, "address", "127.0.0.1:50051", "the server's host:port")
    _flag(p, "service", "", "the service asked about ('': the whole server)")
    _flag(p, "server-name", "", "the name its certificate must hold (default: the host)")
    _flag(p, "timeout", 3.0, "seconds to wait for the answer")
    TLS.add(_flag, p)
    args = p.parse_args(argv)
    if args.timeout <= 0:
        p.error("--timeout must be positive")
    return args, TLS.read(p, args)


def check(
    address: str, service: str, tls: ClientTls | None, server_name: str, timeout: float
) -> str:
    """The status the server reports for `service` (e.g. "SERVING"); raises grpc.RpcError when
    it does not answer in `timeout` seconds."""
    credentials = channel_credentials(tls)
    if credentials is None:
        channel = grpc.insecure_channel(address)
    else:
        options = [("grpc.ssl_target_name_override", server_name)] if server_name else []
        channel = grpc.secure_channel(address, credentials, options=options)
    with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        answer = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(answer.status))


def main(argv: Sequence[str] | None = None) -> int:
    args, tls = parse(argv)
    try:
        status = check(args.address, args.service, tls, args.server_name, args.timeout)
    except grpc.RpcError as exc:
        print(
            f"kvsched health: {args.address}: {exc.code().name}: {exc.details()}", file=sys.stderr
        )
        return 1
    except OSError as exc:  # a TLS file that cannot be read
        print(f"kvsched health: {exc}", file=sys.stderr)
        return 1
    if status != "SERVING":
        print(
            f"kvsched health: {args.address} {args.service or '(server)'}: {status}",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
