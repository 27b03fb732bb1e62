"""KV moved between real vLLM engines (the CPU build serving the tiny model in float32, two
nodes of `kvsched up --engine vllm` started here, each with its Messenger and KV pool), every
figure against a baseline measured in the same run on the same machine:

1. pool to pool: a session's KV (its first turn's blocks) moved from node-0's pool to node-1's
   by the Messengers, timed from StartTransfer to verified and committed, against a raw TCP
   copy of the same bytes between two processes; and the time until its first layer was
   usable, against the whole move;
2. into vLLM: the session's next turn on the target, its context loaded from the pool by
   kvsched's KV connector: its time to first token against recomputing the context on the
   target (a prompt of the same length it holds nothing of) and against the same turn on the
   source, which has the context in vLLM's own prefix cache; and the connector's copy rate
   from the pool into vLLM's paged cache (as the engines report it to their Messenger,
   `kvsched_messenger_pool_copied_bytes` / `_copy_seconds`) against a raw in-memory copy of
   the same bytes;
3. out of vLLM: the connector's copy rate from vLLM's paged cache into the pool against the
   same raw copy; and, after the cluster, a first turn's time to first token on a vLLM
   engine saving its blocks into a pool against one without a connector (two engines
   started alike, their requests alternating).

    .venv/bin/python -m bench.transfer_vllm [--context 8000] [--repeat 5]

Needs `scripts/setup --vllm` (`.venv-vllm/`, `out/models/tiny-llama/`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import numpy as np

from bench.transfer import cluster, raw_copy_seconds, saved, transfer_once
from kvsched.api.messenger.v1 import messenger_service_pb2_grpc as mpb_grpc
from kvsched.core.vllm_hashing import VllmBlockHasher
from services.launcher.cluster_options import ClusterOptions
from services.launcher.plan import pool_socket
from services.launcher.ports import Ports
from services.launcher.vllm import DEFAULT_PYTHON, VllmServer

REPO = Path(__file__).resolve().parent.parent
MODEL_DIR = REPO / "out" / "models" / "tiny-llama"
MODEL = "tiny-llama"
BLOCK = 32
HASHER = VllmBlockHasher(BLOCK)
OPTIONS = ClusterOptions(
    routers=1,
    nodes=2,
    engines_per_node=1,
    block_size=BLOCK,
    engine="vllm",
    model_dir=MODEL_DIR,
    model=MODEL,
    dtype="float32",
    insecure=True,  # the bench orders transfers itself, as the Conductor: plaintext
)


def ids(n: int, seed: int) -> list[int]:
    """`n` token ids of their own (the tiny model's vocabulary has 4,096)."""
    return [10 + (seed * 7919 + i * 104729) % 4000 for i in range(n)]


async def ttft(http: aiohttp.ClientSession, engine: str, prompt: list[int]) -> tuple[float, int]:
    """Time to the first token of a greedy completion straight on `engine`, and the prompt
    tokens it reported cached."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    started = time.perf_counter()
    first, cached = 0.0, -1
    async with http.post(f"{engine}/v1/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{engine}: {resp.status} {await resp.text()}")
        async for line in resp.content:
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            if not first and chunk.get("choices"):
                first = time.perf_counter() - started
            usage = chunk.get("usage")
            if usage:
                cached = usage["prompt_tokens_details"]["cached_tokens"]
    return first, cached


async def reply_of(http: aiohttp.ClientSession, engine: str, prompt: list[int]) -> list[int]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 16, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}  # fmt: skip
    async with http.post(f"{engine}/v1/completions", json=body) as resp:
        answer = await resp.json()
    return list(answer["choices"][0]["token_ids"])


DIRECTION = {"node-0": "save", "node-1": "load"}  # what each node's engine copies, timed


async def copied(
    http: aiohttp.ClientSession, messenger: str, direction: str
) -> tuple[float, float]:
    """The bytes and seconds a Messenger's engines reported copying in `direction`."""
    async with http.get(f"{messenger}/metrics") as resp:
        text = await resp.text()
    label = f'_total{{direction="{direction}"}} '
    values = {
        line.split("_total{")[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("kvsched_messenger_pool_cop") and label in line
    }
    return (
        values["kvsched_messenger_pool_copied_bytes"],
        values["kvsched_messenger_pool_copy_seconds"],
    )


def raw_memcpy_seconds(nbytes: int, repeat: int) -> list[float]:
    """One in-memory copy of `nbytes` (numpy, one buffer into another), timed."""
    src, dst = np.ones(nbytes, dtype=np.uint8), np.empty(nbytes, dtype=np.uint8)
    out = []
    for _ in range(repeat):
        started = time.perf_counter()
        np.copyto(dst, src)
        out.append(time.perf_counter() - started)
    return out


async def with_pools(context: int, repeat: int) -> dict[str, list[float]]:
    """Sections 1 and 2, and section 3's turns with saving."""
    rows: dict[str, list[float]] = {k: [] for k in (
        "move_s", "first_layer_s", "bytes", "loaded_ttft", "local_ttft",
        "recompute_ttft", "loaded_tokens", "raw_tcp_s", "raw_memcpy_s", "load_mb_per_s",
        "save_mb_per_s")}  # fmt: skip
    async with cluster(OPTIONS) as (ep, _, run_dir):
        engines = {e["node"]: e["url"] for e in ep["engines"]}
        messengers = {m["node"]: m["url"] for m in ep["messengers"]}
        metrics = {m["node"]: m["http_url"] for m in ep["messengers"]}
        source, target = engines["node-0"], engines["node-1"]
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http,
            grpc.aio.insecure_channel(messengers["node-1"]) as channel,
        ):
            stub = mpb_grpc.MessengerServiceStub(channel)
            copies: dict[str, tuple[float, float]] = {}
            for r in range(repeat + 1):  # the first round warms up (connections, page faults)
                if r == 1:
                    copies = {n: await copied(http, m, DIRECTION[n]) for n, m in metrics.items()}
                first = ids(context, 100 + r)
                await ttft(http, source, first)
                second = [*first, *await reply_of(http, source, first), *ids(64, 900 + r)]
                computed = (len(first) + 16 - 1) // BLOCK
                hashes = HASHER.hash_prompt(second)[:computed]
                await saved(pool_socket(run_dir, "node-0"), hashes)
                first_layer, whole, nbytes = await transfer_once(stub, ep, hashes)
                loaded, cached = await ttft(http, target, second)
                if cached != computed * BLOCK:
                    raise RuntimeError(f"the target loaded {cached} tokens, not {computed * BLOCK}")
                local, _ = await ttft(http, source, second)
                recompute, _ = await ttft(http, target, ids(len(second), 500 + r))
                if r:
                    for key, value in (
                        ("move_s", whole), ("first_layer_s", first_layer),
                        ("bytes", nbytes), ("loaded_ttft", loaded), ("local_ttft", local),
                        ("recompute_ttft", recompute), ("loaded_tokens", cached),
                    ):  # fmt: skip
                        rows[key].append(value)
            for node, url in metrics.items():
                moved_bytes, seconds = await copied(http, url, DIRECTION[node])
                rate = (moved_bytes - copies[node][0]) / (seconds - copies[node][1]) / 1e6
                rows[f"{DIRECTION[node]}_mb_per_s"].append(rate)
            # The baselines, with the cluster up (its engines share the cores the same way).
            nbytes = int(statistics.median(rows["bytes"]))
            rows["raw_tcp_s"] = raw_copy_seconds(nbytes, repeat)
            rows["raw_memcpy_s"] = raw_memcpy_seconds(nbytes, max(repeat, 5))
    return rows


_POOL = """
import asyncio, sys
from kvsched.core.vllm_hashing import VllmBlockHasher
from services.dataplane.kv_pool import NodePool
from services.dataplane.pool_server import PoolServer

async def serve():
    pool = NodePool(512 << 20, node="bench", hasher_for=VllmBlockHasher, on_events=lambda e: None)
    await PoolServer(pool, sys.argv[1]).start()
    await asyncio.Event().wait()

asyncio.run(serve())
"""


async def saving_or_not(context: int, repeat: int) -> tuple[list[float], list[float]]:
    """Section 3: first turns' time to first token on two vLLM engines started alike, one
    saving into a KV pool (served by its own process, as a Messenger's), one without a
    connector; their requests alternate, so both see the machine as loaded."""
    with tempfile.TemporaryDirectory(prefix="kvsched-bench-") as tmp:
        socket = str(Path(tmp) / "pool.sock")
        pool = subprocess.Popen([sys.executable, "-c", _POOL, socket], cwd=REPO)
        ports = Ports()
        servers = [
            VllmServer(DEFAULT_PYTHON, MODEL_DIR, MODEL, ports(), ports(), ports(), BLOCK,
                       "sha256", dtype="float32", cpu_cores=str(i), pool_socket=sock)
            for i, sock in enumerate((socket, ""))
        ]  # fmt: skip
        engines = [
            subprocess.Popen(
                server.argv(),
                env={**os.environ, **server.env()},
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
            for server in servers
        ]
        saving: list[float] = []
        bare: list[float] = []
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http:
                urls = [f"http://127.0.0.1:{server.port}" for server in servers]
                for url in urls:
                    await until_healthy(http, url)
                for r in range(repeat + 1):
                    for url, out in zip(urls, (saving, bare), strict=True):
                        value, _ = await ttft(http, url, ids(context, 100 + 2 * r + len(out)))
                        if r:
                            out.append(value)
        finally:
            for process in engines:
                os.killpg(process.pid, signal.SIGTERM)
            pool.terminate()
            for process in (*engines, pool):
                process.wait(60)
    return saving, bare


async def until_healthy(http: aiohttp.ClientSession, url: str, timeout_s: float = 600.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            async with http.get(f"{url}/health") as resp:
                if resp.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(1.0)  # polling interval
    raise RuntimeError(f"{url} did not start")


def summary(rows: dict[str, list[float]], saving: list[float], bare: list[float]) -> dict[str, Any]:
    med = {k: statistics.median(v) for k, v in rows.items()}
    nbytes = int(med["bytes"])
    raw_tcp, raw_mem = med["raw_tcp_s"], med["raw_memcpy_s"]
    raw_mem_rate = nbytes / raw_mem / 1e6
    return {
        "context_tokens": int(med["loaded_tokens"]),
        "bytes": nbytes,
        "move_s": med["move_s"],
        "move_mb_per_s": nbytes / med["move_s"] / 1e6,
        "raw_tcp_mb_per_s": nbytes / raw_tcp / 1e6,
        "move_ratio_to_raw_tcp": raw_tcp / med["move_s"],
        "first_layer_s": med["first_layer_s"],
        "first_layer_share": med["first_layer_s"] / med["move_s"],
        "loaded_ttft_s": med["loaded_ttft"],
        "local_hit_ttft_s": med["local_ttft"],
        "recompute_ttft_s": med["recompute_ttft"],
        "loaded_to_recompute": med["loaded_ttft"] / med["recompute_ttft"],
        "load_mb_per_s": med["load_mb_per_s"],
        "save_mb_per_s": med["save_mb_per_s"],
        "raw_memcpy_mb_per_s": raw_mem_rate,
        "load_ratio_to_memcpy": med["load_mb_per_s"] / raw_mem_rate,
        "save_ratio_to_memcpy": med["save_mb_per_s"] / raw_mem_rate,
        "save_ttft_s": statistics.median(saving),
        "no_save_ttft_s": statistics.median(bare),
        "save_to_no_save": statistics.median(saving) / statistics.median(bare),
    }


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--context", type=int, default=8000, help="tokens of each first turn")
    p.add_argument("--repeat", type=int, default=10, help="rounds timed (after one warm-up)")
    args = p.parse_args()
    rows = asyncio.run(with_pools(args.context, args.repeat))
    saving, bare = asyncio.run(saving_or_not(args.context, args.repeat))
    s = summary(rows, saving, bare)
    kib = s["bytes"] / 1024
    print(
        f"pool to pool: {s['context_tokens']} tokens ({kib:.0f} KiB) in "
        f"{s['move_s'] * 1e3:.1f} ms = {s['move_mb_per_s']:.0f} MB/s; raw TCP copy "
        f"{s['raw_tcp_mb_per_s']:.0f} MB/s ({s['move_ratio_to_raw_tcp']:.2f}x raw); first layer "
        f"usable after {s['first_layer_s'] * 1e3:.1f} ms ({s['first_layer_share']:.2f} of it)\n"
        f"into vLLM: next turn's TTFT with the context loaded {s['loaded_ttft_s'] * 1e3:.1f} ms; "
        f"recomputing it on the target {s['recompute_ttft_s'] * 1e3:.1f} ms "
        f"({s['loaded_to_recompute']:.2f}x); on the source from its own cache "
        f"{s['local_hit_ttft_s'] * 1e3:.1f} ms; pool to vLLM copies {s['load_mb_per_s']:.0f} MB/s "
        f"against a raw memcpy's {s['raw_memcpy_mb_per_s']:.0f} MB/s "
        f"({s['load_ratio_to_memcpy']:.2f}x)\n"
        f"out of vLLM: vLLM to pool copies {s['save_mb_per_s']:.0f} MB/s "
        f"({s['save_ratio_to_memcpy']:.2f}x the raw memcpy); a first turn's TTFT on an engine "
        f"saving its blocks {s['save_ttft_s'] * 1e3:.1f} ms, on one without a connector "
        f"{s['no_save_ttft_s'] * 1e3:.1f} ms ({s['save_to_no_save']:.2f}x)",
        flush=True,
    )
    print(json.dumps(s))


if __name__ == "__main__":
    main()
