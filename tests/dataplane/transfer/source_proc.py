"""A source Messenger's transfer side in a process of its own (the production shape): maps
an existing KV file, starts a backend, registers the region, allows an export of some pages,
prints the export as one JSON line, and serves until its stdin closes or it is killed.

    python -m tests.dataplane.transfer.source_proc --backend tcp|mooncake|raw --path FILE \\
        --layers L --pages P --chunk-bytes C [--export-id ID] [--allow 0,1,2 | --allow all] \\
        [--cpu N]

`raw` is the benchmark's baseline: for each byte a client sends, the whole file is sent back
with one `sendall`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import sys
from collections.abc import Sequence

import uvloop

from services.dataplane.kv_layout import KvLayout
from services.dataplane.transfer.factory import open_backend
from services.dataplane.transfer.region import KvRegion


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--backend", choices=["tcp", "mooncake", "raw"], required=True)
    p.add_argument("--path", required=True)
    p.add_argument("--layers", type=int, required=True)
    p.add_argument("--pages", type=int, required=True)
    p.add_argument("--chunk-bytes", type=int, required=True)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--export-id", default="export-0")
    p.add_argument("--allow", default="all", help="pages to export: all, or comma-separated")
    p.add_argument("--cpu", type=int, help="run on this CPU only (benchmarks)")
    return p.parse_args(argv)


async def _stdin_closed() -> None:
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, sys.stdin.buffer.read)


async def serve_raw(region: KvRegion) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    print(json.dumps({"endpoint": f"127.0.0.1:{listener.getsockname()[1]}"}), flush=True)

    def send_all() -> None:
        conn, _ = listener.accept()
        with conn:
            whole = region.whole()
            while conn.recv(1):
                conn.sendall(whole)

    await asyncio.get_running_loop().run_in_executor(None, send_all)


async def serve(args: argparse.Namespace) -> None:
    layout = KvLayout(args.layers, args.pages, args.chunk_bytes, args.block_size)
    region = KvRegion(args.path, layout)
    if args.backend == "raw":
        await asyncio.wait(
            [asyncio.ensure_future(serve_raw(region)), asyncio.ensure_future(_stdin_closed())],
            return_when=asyncio.FIRST_COMPLETED,
        )
        return
    backend = open_backend(args.backend, "127.0.0.1")
    await backend.start()
    backend.register(region)
    pages = range(layout.pages) if args.allow == "all" else map(int, args.allow.split(","))
    backend.allow(args.export_id, region, pages)
    export = backend.source_export(region, args.export_id)
    print(
        json.dumps(
            {
                "endpoint": export.endpoint,
                "base_address": export.base_address,
                "export_id": export.export_id,
            }
        ),
        flush=True,
    )
    await _stdin_closed()
    await backend.stop()


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    if args.cpu is not None:
        os.sched_setaffinity(0, {args.cpu})
    uvloop.run(serve(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
