"""`kvsched health`, the probe of a gRPC server's health over mutual TLS: 0 for SERVING, 1 for
anything else or no answer, with the caller's certificate and a server name of its choosing."""

from __future__ import annotations

import asyncio
import datetime
from pathlib import Path

import pytest
from opentelemetry.sdk.trace import TracerProvider

from services.common.security.identity import Identity, Role
from services.common.security.pki import cert_files, make_cluster_pki
from services.common.serving.grpc_server import GrpcApi, health_servicer, start_grpc_server
from services.common.serving.health_probe import main, parse

API = GrpcApi("kvsched.test.v1.Nothing", lambda server: None)
TRACER = TracerProvider().get_tracer("test")
SERVER = Identity(Role.CONDUCTOR, "conductor-0")


def _tls_flags(folder: Path, identity: Identity) -> list[str]:
    f = cert_files(folder, identity)
    return ["--ca", str(f.ca), "--cert", str(f.cert), "--key", str(f.key)]


async def test_the_probe_passes_a_serving_server_and_fails_one_that_is_not(
    tmp_path: Path,
) -> None:
    make_cluster_pki(tmp_path, (SERVER,), datetime.datetime.now(datetime.UTC))
    server, port = await start_grpc_server(
        "127.0.0.1:0",
        API,
        health_servicer(),
        tracer=TRACER,
        tls=cert_files(tmp_path, SERVER).server(),
        serving=False,
    )
    probe = ["--address", f"127.0.0.1:{port}", *_tls_flags(tmp_path, SERVER)]
    try:
        assert await asyncio.to_thread(main, probe) == 0
        named = [*probe, "--server-name", "localhost"]
        assert await asyncio.to_thread(main, named) == 0
        assert await asyncio.to_thread(main, [*probe, "--service", API.name]) == 1
        # The certificate names localhost, 127.0.0.1 and ::1: any other name is refused.
        assert await asyncio.to_thread(main, [*probe, "--server-name", "elsewhere.example"]) == 1
    finally:
        await server.stop(None)
    assert await asyncio.to_thread(main, [*probe, "--timeout", "0.5"]) == 1


def test_a_certificate_without_its_key_is_a_usage_error(tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as usage:
        main(["--ca", str(tmp_path / "ca.pem"), "--cert", str(tmp_path / "c.pem")])
    assert usage.value.code == 2


def test_the_files_can_come_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVSCHED_HEALTH_CA", "/tls/ca.crt")
    monkeypatch.setenv("KVSCHED_HEALTH_CERT", "/tls/pod.crt")
    monkeypatch.setenv("KVSCHED_HEALTH_KEY", "/tls/pod.key")
    args, tls = parse(["--address", "127.0.0.1:50071"])
    assert tls is not None and (tls.ca_file, tls.cert_file) == ("/tls/ca.crt", "/tls/pod.crt")
    assert args.address == "127.0.0.1:50071"
