"""KV transfer benchmarks on live local clusters (`kvsched up`'s processes, started here):

1. throughput: one Messenger moves a session's KV (N blocks × every layer) from another
   node's pool into its own (once the source engine saved the blocks into its pool), the
   whole path timed from StartTransfer to verified and committed (export, checksums, reads,
   verification, commit), for each backend, against a raw TCP socket copy of the same number
   of bytes between two processes in the same run (goal: ≥ 0.9× the raw copy);
2. first layer: time until the first layer is verified (usable by a consumer) against the
   whole transfer, from the same transfers' progress streams;
3. migration downtime: a session whose host is made hot migrates with its next turn (`ear`,
   the copy on the turn's critical path): the time the turn waited for its KV, against the
   time to recompute that context on the target instead, measured right after under the
   same load (the hot host still busy).

Geometries: Llama-3.1-8B's real KV (64 KiB chunks at 16-token blocks, 2 MiB a block) and the
demo's mini-KV model at 64-token blocks (4 KiB chunks). Everything shares the machine's cores.

    .venv/bin/python -m bench.transfer [--quick] [--repeat 5] [--backends mooncake,tcp]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import grpc

from kvsched.api.common.v1 import common_pb2 as common
from kvsched.api.messenger.v1 import messenger_service_pb2 as mpb
from kvsched.api.messenger.v1 import messenger_service_pb2_grpc as mpb_grpc
from kvsched.core.models import DEFAULT_MODEL, MINI_MODEL
from kvsched.core.vllm_hashing import VllmBlockHasher
from services.launcher.__main__ import demo_keys
from services.launcher.cluster_options import ClusterOptions
from services.launcher.plan import plan_cluster, pool_socket
from services.launcher.supervisor import Supervisor
from services.vllm_connector.pool_client import PoolClient


@dataclass(frozen=True)
class Geometry:
    name: str
    model_config: str
    block_size: int
    blocks: int  # moved per transfer
    capacity_blocks: int


GEOMETRIES = (
    Geometry("llama-3.1-8b (64 KiB chunks)", DEFAULT_MODEL, 16, 128, 160),
    Geometry("mini-kv, 64-token blocks (4 KiB chunks)", MINI_MODEL, 64, 1024, 1200),
)


@asynccontextmanager
async def cluster(opts: ClusterOptions) -> Any:
    with tempfile.TemporaryDirectory(prefix="kvsched-bench-") as tmp:
        run_dir = Path(tmp)
        key = demo_keys(run_dir / "api-keys.json")
        plan = plan_cluster(opts, run_dir, run_dir / "api-keys.json", key)
        sup = Supervisor(plan, run_dir / "logs")
        try:
            await sup.start()
            yield plan.endpoints(sup.pids()), key, run_dir
        finally:
            sup.stop()


def tokens(n: int, seed: int) -> list[int]:
    return [100 + (seed * 797 + i) % 3900 for i in range(n)]


# ---- 1 and 2: throughput and first layer -------------------------------------------------------


async def saved(socket_path: str, hashes: list[int], timeout_s: float = 60.0) -> None:
    """Wait until the node pool at `socket_path` holds the chain `hashes` (the engine saves a
    prompt's blocks once it computed them), so a transfer times the move alone."""
    client = PoolClient(socket_path)
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            answer = await asyncio.to_thread(
                client.call, "load", block_hashes=hashes, start=0, end=len(hashes), hold_s=5.0
            )
            if answer["export_id"] is not None:
                await asyncio.to_thread(client.call, "release", export_id=answer["export_id"])
            if answer["blocks"] == len(hashes):
                return
            if time.monotonic() > deadline:
                raise RuntimeError("the source engine did not save its prompt into its pool")
            await asyncio.sleep(0.01)
    finally:
        client.close()


async def transfer_once(
    stub: Any, ep: dict[str, Any], hashes: list[int]
) -> tuple[float, float, int]:
    """One transfer of `hashes` from node-0's engine into node-1's; (first layer s, whole s,
    bytes)."""
    tid = f"bench-{uuid.uuid4().hex[:8]}"
    source = next(m["url"] for m in ep["messengers"] if m["node"] == "node-0")
    plan = common.TransferPlan(
        transfer_id=tid,
        kind=common.TRANSFER_KIND_MIGRATE_SESSION,
        source_instance_id="node-0-e0",
        target_instance_id="node-1-e0",
        block_hashes=hashes,
    )
    request = mpb.StartTransferRequest(plan=plan, source_messenger_url=source)
    request.timeout.FromSeconds(120)
    started = time.perf_counter()
    await stub.StartTransfer(request, timeout=10)
    first = 0.0
    last = None
    async for progress in stub.WatchTransfer(mpb.WatchTransferRequest(transfer_id=tid)):
        if not first and progress.layers_done >= 1:
            first = time.perf_counter() - started
        last = progress
    whole = time.perf_counter() - started
    if last is None or last.state != mpb.TRANSFER_STATE_DONE:
        raise RuntimeError(f"transfer failed: {last}")
    return first, whole, int(last.bytes_done)


async def throughput(backend: str, geometry: Geometry, repeat: int) -> dict[str, Any]:
    opts = ClusterOptions(
        routers=1,
        nodes=2,
        engines_per_node=1,
        policy="cache_aware",
        block_size=geometry.block_size,
        time_scale=0.01,
        model_config=geometry.model_config,
        transfer_backend=backend,
        engine_flags=("--capacity-blocks", str(geometry.capacity_blocks)),
        insecure=True,  # the bench orders transfers itself, as the Conductor: plaintext
    )
    async with cluster(opts) as (ep, _, run_dir):
        engines = {e["id"]: e["url"] for e in ep["engines"]}
        target = next(m["url"] for m in ep["messengers"] if m["node"] == "node-1")
        timeout = aiohttp.ClientTimeout(total=600)
        firsts, wholes, nbytes = [], [], 0
        async with (
            aiohttp.ClientSession(timeout=timeout) as http,
            grpc.aio.insecure_channel(target) as channel,
        ):
            stub = mpb_grpc.MessengerServiceStub(channel)
            for r in range(repeat + 1):  # the first run warms up (connections, page faults)
                prompt = tokens(geometry.blocks * geometry.block_size + 1, 10 + r)
                async with http.post(
                    f"{engines['node-0-e0']}/v1/completions",
                    json={"prompt": prompt, "max_tokens": 1},
                ) as resp:
                    assert resp.status == 200, await resp.text()
                hashes = VllmBlockHasher(geometry.block_size).hash_prompt(prompt)
                await saved(pool_socket(run_dir, "node-0"), hashes)
                first, whole, nbytes = await transfer_once(stub, ep, hashes)
                if r:
                    firsts.append(first)
                    wholes.append(whole)
    raw = raw_copy_seconds(nbytes, repeat)
    return {
        "backend": backend,
        "geometry": geometry.name,
        "bytes": nbytes,
        "transfer_s_median": statistics.median(wholes),
        "first_layer_s_median": statistics.median(firsts),
        "raw_copy_s_median": statistics.median(raw),
        "transfer_mb_per_s": nbytes / statistics.median(wholes) / 1e6,
        "raw_mb_per_s": nbytes / statistics.median(raw) / 1e6,
        "ratio_to_raw": statistics.median(raw) / statistics.median(wholes),
        "first_layer_share": statistics.median(firsts) / statistics.median(wholes),
    }


_SENDER = """
import socket, sys
n, port = int(sys.argv[1]), int(sys.argv[2])
buf = bytearray(n)
s = socket.create_connection(("127.0.0.1", port))
s.sendall(buf)
s.close()
"""


def raw_copy_seconds(nbytes: int, repeat: int) -> list[float]:
    """A raw TCP copy of `nbytes` from another process into one buffer here (`sendall` of one
    buffer, answered by `recv_into` loops), timed from connect to the last byte."""
    out = []
    for _ in range(repeat):
        sink = bytearray(nbytes)
        view = memoryview(sink)
        server = socket.create_server(("127.0.0.1", 0))
        port = server.getsockname()[1]
        sender = subprocess.Popen([sys.executable, "-c", _SENDER, str(nbytes), str(port)])
        conn, _ = server.accept()
        started = time.perf_counter()
        got = 0
        while got < nbytes:
            n = conn.recv_into(view[got:], nbytes - got)
            if not n:
                break
            got += n
        out.append(time.perf_counter() - started)
        conn.close()
        server.close()
        sender.wait()
        if got != nbytes:
            raise RuntimeError("the raw copy broke off")
    return out


# ---- 3: migration downtime ------------------------------------------------------------------


async def downtime(migrations: int) -> dict[str, Any]:
    t_hot = 20_000
    opts = ClusterOptions(
        routers=1,
        nodes=2,
        engines_per_node=1,
        policy=f"ear:t_hot_tokens={t_hot},t_cool_s=0.001",
        block_size=64,
        time_scale=0.1,
        insecure=True,  # it reads the Conductor's admin HTTP API without a token
    )
    async with cluster(opts) as (ep, key, _):
        router = ep["routers"][0]["url"]
        engines = {e["id"]: e["url"] for e in ep["engines"]}
        auth = {"Authorization": f"Bearer {key}"}
        waits, recompute, contexts = [], [], []
        timeout = aiohttp.ClientTimeout(total=600)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            for m in range(migrations):
                sid = f"bench-{m}"
                context = tokens(8000, 500 + m)
                host, _ = await _turn(http, router, auth, sid, context)
                busy = await _flood(http, ep, host, 4 * t_hot, 900 + m)
                before = await _router_wait(http, router)
                ran_on, cached = await _turn(http, router, auth, sid, [*context, *tokens(64, m)])
                after = await _router_wait(http, router)
                if ran_on != host and after[1] > before[1]:  # it migrated
                    waits.append((after[0] - before[0]) / (after[1] - before[1]))
                    contexts.append(cached)
                    # The alternative: recompute that context on the target (a new prompt of
                    # the same length straight to it), with the machine as loaded as it was.
                    fresh = tokens(cached + 1, 70 + m)
                    recompute.append(await _ttft(http, engines[ran_on], fresh))
                await asyncio.gather(*busy)
    scale = opts.time_scale
    return {
        "migrations": len(waits),
        "context_tokens_median": statistics.median(contexts) if contexts else 0,
        "downtime_s_median": statistics.median(waits) if waits else float("nan"),
        "recompute_s_median": statistics.median(recompute) if recompute else float("nan"),
        "ratio_to_recompute": statistics.median(waits) / statistics.median(recompute)
        if waits
        else float("nan"),
        "time_scale": scale,
    }


async def _turn(
    http: aiohttp.ClientSession, router: str, auth: dict[str, str], sid: str, prompt: list[int]
) -> tuple[str, int]:
    async with http.post(
        f"{router}/v1/completions",
        json={"prompt": prompt, "max_tokens": 2},
        headers={**auth, "x-session-id": sid},
    ) as resp:
        answer = await resp.json()
        if resp.status != 200:
            raise RuntimeError(f"turn failed: {answer}")
        return resp.headers["x-kvsched-instance"], answer["usage"]["prompt_tokens_details"][
            "cached_tokens"
        ]


async def _flood(
    http: aiohttp.ClientSession, ep: dict[str, Any], instance: str, hot: int, seed: int
) -> list[asyncio.Task[None]]:
    """Queue prompts on an engine directly until the Conductor sees it hot."""
    engine = next(e["url"] for e in ep["engines"] if e["id"] == instance)
    conductor = ep["conductors"][0]["http_url"]

    async def one(k: int) -> None:
        body = {"prompt": tokens(30_000, seed * 100 + k), "max_tokens": 1}
        async with http.post(f"{engine}/v1/completions", json=body) as resp:
            await resp.read()

    tasks = [asyncio.create_task(one(k)) for k in range(16)]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        async with http.get(f"{conductor}/api/nodes/stats") as resp:
            rows = {r["instance_id"]: r for r in (await resp.json())["instances"]}
        if rows[instance]["pending_prefill_tokens"] > hot:
            return tasks
        await asyncio.sleep(0.02)  # polling interval
    raise RuntimeError(f"{instance} never turned hot")


async def _router_wait(http: aiohttp.ClientSession, router: str) -> tuple[float, float]:
    """(sum, count) of the Router's waits for migrations."""
    async with http.get(f"{router}/metrics") as resp:
        text = await resp.text()
    total = count = 0.0
    for line in text.splitlines():
        if 'kind="migrate_session"' not in line:
            continue
        if line.startswith("kvsched_router_transfer_wait_seconds_sum"):
            total = float(line.rsplit(" ", 1)[1])
        elif line.startswith("kvsched_router_transfer_wait_seconds_count"):
            count = float(line.rsplit(" ", 1)[1])
    return total, count


async def _ttft(http: aiohttp.ClientSession, engine: str, prompt: list[int]) -> float:
    started = time.perf_counter()
    body = {"prompt": prompt, "max_tokens": 1, "stream": True}
    async with http.post(f"{engine}/v1/completions", json=body) as resp:
        async for line in resp.content:
            if line.startswith(b"data: "):
                return time.perf_counter() - started
    raise RuntimeError("no token")


# ---- main ------------------------------------------------------------------------------------


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="one repeat, two migrations (smoke)")
    p.add_argument("--repeat", type=int, default=5, help="transfers timed per backend")
    p.add_argument("--migrations", type=int, default=5, help="migrations timed")
    p.add_argument("--backends", default="mooncake,tcp")
    args = p.parse_args()
    if args.quick:
        args.repeat, args.migrations = 1, 2
    results: dict[str, Any] = {"throughput": []}
    for geometry in GEOMETRIES:
        for backend in args.backends.split(","):
            row = asyncio.run(throughput(backend, geometry, args.repeat))
            results["throughput"].append(row)
            print(
                f"{geometry.name}, {backend}: {row['bytes'] / 1e6:.0f} MB in "
                f"{row['transfer_s_median'] * 1e3:.1f} ms = {row['transfer_mb_per_s']:.0f} MB/s; "
                f"raw TCP copy {row['raw_mb_per_s']:.0f} MB/s; "
                f"{row['ratio_to_raw']:.2f}x raw (goal >= 0.9); first layer usable after "
                f"{row['first_layer_s_median'] * 1e3:.1f} ms "
                f"({row['first_layer_share']:.2f} of the transfer)",
                flush=True,
            )
    d = results["downtime"] = asyncio.run(downtime(args.migrations))
    print(
        f"migration downtime ({d['migrations']} ear migrations of ~{d['context_tokens_median']:.0f}"
        f"-token contexts, mini-KV model, engines at time scale {d['time_scale']}): "
        f"{d['downtime_s_median'] * 1e3:.1f} ms waited for the KV; recomputing it on the target "
        f"instead {d['recompute_s_median'] * 1e3:.1f} ms ({d['ratio_to_recompute']:.2f}x)"
    )
    print(json.dumps(results))


if __name__ == "__main__":
    main()
