"""The generated Go client (clients/go) against live Conductors on a real etcd: its own
`go test` (unit tests on fake servers, then the live ones), run here with the Conductors'
addresses. Two Conductors share an etcd; the Go test stops the leader through a loopback
hook served here and its next call must reach the new one. Where Debian's Go toolchain is
missing the tests skip, naming the packages to install."""

from __future__ import annotations

import asyncio
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from services.common.security.tls import ServerTls
from services.conductor.app import Conductor
from tests.conductor.conftest import REPO
from tests.fixtures.etcd import make_tls
from tests.fixtures.process import run_to_end

GO_CLIENT = REPO / "clients" / "go"
GOTOOL = GO_CLIENT / "gotool"
DEBIAN_PACKAGES = (
    "golang-go golang-google-grpc-dev golang-google-protobuf-dev "
    "golang-github-golang-protobuf-1-5-dev"
)
# Debian installs Go library sources here (clients/go/gotool reads the same variable).
GOCODE = Path(os.environ.get("KVSCHED_DEBIAN_GOCODE", "/usr/share/gocode")) / "src"
BIG_HASH = 2**64 - 2**20 + 7  # above 2^63: a signed 64-bit integer cannot hold it
GO_TIMEOUT_S = 300  # the first run compiles grpc-go (about 30 s on two busy cores)


def go_test_flags() -> list[str]:
    """`go test` flags: fresh runs, verbose (the live tests' PASS lines are checked), and the
    race detector where cgo has a C compiler (the client is used from many goroutines)."""
    return ["-count=1", "-v", *(["-race"] if shutil.which("gcc") else [])]


def skip_without_go() -> None:
    """Skip, naming the Debian packages, where the Go toolchain or libraries are missing."""
    missing = []
    if shutil.which("go") is None:
        missing.append("the go command")
    for package in ("google.golang.org/grpc", "google.golang.org/protobuf/proto"):
        if not (GOCODE / package).is_dir():
            missing.append(package)
    # grpc-go 1.33's codec goes through github.com/golang/protobuf; only its 1.4+ API
    # (Debian's 1-5 package: registry.go) marshals the protobuf-go messages we generate.
    if not (GOCODE / "github.com/golang/protobuf/proto/registry.go").is_file():
        missing.append("github.com/golang/protobuf 1.5 (not 1.3)")
    if missing:
        pytest.skip(f"Go client test needs {', '.join(missing)}: apt-get install {DEBIAN_PACKAGES}")


async def gotool(*args: str, env: dict[str, str] | None = None) -> str:
    """Run `clients/go/gotool ARGS` (the go command, offline, on Debian's packages); its
    output, after asserting it succeeded."""
    environ = dict(os.environ, **(env or {}))
    return await run_to_end([str(GOTOOL), *args], cwd=REPO, env=environ, timeout_s=GO_TIMEOUT_S)


async def serve_stop_leader(conductors: list[Conductor]) -> tuple[str, web.AppRunner]:
    """A loopback hook: POST /stop-leader stops the Conductor that serves as the leader and
    answers its address."""

    async def stop_leader(_: web.Request) -> web.Response:
        leaders = [c for c in conductors if c.serving]
        if len(leaders) != 1:
            return web.Response(status=409, text=f"{len(leaders)} Conductors lead")
        await leaders[0].stop(0.5)
        return web.Response(text=leaders[0].url)

    app = web.Application()
    app.router.add_post("/stop-leader", stop_leader)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    return f"http://127.0.0.1:{port}/stop-leader", runner


async def test_go_client_registers_schedules_follows_the_leader_and_reads_rejections(
    start_conductor: Callable[..., Any], tmp_path: Path
) -> None:
    skip_without_go()
    # The elastic policy refuses what no instance can start within the TTFT objective.
    c1 = await start_conductor(conductor_id="c1", policy="elastic")
    c2 = await start_conductor(conductor_id="c2", policy="elastic", lead=False)
    hook, runner = await serve_stop_leader([c1, c2])
    try:
        env = {
            "KVSCHED_LIVE_CONDUCTORS": f"{c1.url},{c2.url}",
            "KVSCHED_LIVE_STOP_LEADER": hook,
            "KVSCHED_LIVE_BLOCK_HASH": str(BIG_HASH),
        }
        await gotool("vet", "./kvsched", "./cmd/example")
        out = await gotool("test", *go_test_flags(), "./kvsched", env=env)
    finally:
        await runner.cleanup()
    print(out)  # shown with -s: the Go test logs how long following the leader took
    live = "TestLiveConductorsRegisterScheduleFollowTheLeaderAndReject"
    assert f"--- PASS: {live}" in out, out
    assert "--- FAIL" not in out and "--- SKIP: TestLiveConductors" not in out, out
    # The Go test stopped c1 (it led); c2 leads now and holds the hash exactly as sent.
    assert not c1.serving and c2.serving
    slot = c2.state.instances["go-node/engine-0"].slot
    assert c2.state.cluster.index.holders(BIG_HASH) == 1 << slot
    assert c2.state.cluster.index.holders(BIG_HASH ^ 0xFF) == 1 << slot

    example = tmp_path / "example"
    await gotool("build", "-o", str(example), "./cmd/example")
    proc = await asyncio.create_subprocess_exec(
        str(example),
        "-conductor",
        f"grpc://{c1.url},{c2.url}",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    shown = (await asyncio.wait_for(proc.communicate(), 30))[0].decode(errors="replace")
    assert proc.returncode == 0, shown
    assert f"leader: {c2.url}" in shown and "registered: example/engine-" in shown, shown
    # Its own instance is the only idle one: the request goes there; then it cleans up.
    assert "-> example/engine-" in shown and "finished: " in shown, shown
    assert "deregistered example/engine-" in shown, shown

    gofmt = shutil.which("gofmt")
    if gofmt is not None:
        listed = await asyncio.create_subprocess_exec(
            gofmt, "-l", str(GO_CLIENT), stdout=asyncio.subprocess.PIPE
        )
        unformatted = (await listed.communicate())[0].decode()
        assert unformatted == "", f"gofmt would change:\n{unformatted}"


async def test_go_client_speaks_mutual_tls(
    start_conductor: Callable[..., Any], tmp_path: Path
) -> None:
    skip_without_go()
    tls = make_tls(tmp_path)  # the client's certificate names an operator (admin role)
    c = await start_conductor(
        tls=ServerTls(str(tls.server_cert), str(tls.server_key), str(tls.ca_file))
    )
    env = {
        "KVSCHED_LIVE_TLS_CONDUCTOR": c.url,
        "KVSCHED_LIVE_TLS_CA": str(tls.ca_file),
        "KVSCHED_LIVE_TLS_CERT": str(tls.client_cert),
        "KVSCHED_LIVE_TLS_KEY": str(tls.client_key),
    }
    out = await gotool("test", *go_test_flags(), "-run", "TestLiveMutualTLS", "./kvsched", env=env)
    assert "--- PASS: TestLiveMutualTLS" in out, out
