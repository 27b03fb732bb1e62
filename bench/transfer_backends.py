"""Throughput of the transfer backends against a raw socket copy of the same bytes, between
two processes on loopback:

    .venv/bin/python -m bench.transfer_backends [--repeat 15] [--depth 2] \
        [--backends tcp,mooncake] [--cpus READER,SOURCE]

For each geometry (128 MiB of 64 KiB chunks, 40 MiB of 4 KiB chunks) a source process maps
a KV file and serves it; this process reads every layer into another file, `depth` layers in
flight (the transfer runner keeps two), with the pages in one run per layer ("consecutive")
and with every page its own run ("scattered": destination pages reversed). "raw" is one
`sendall` of the whole file answered into one `recv_into` loop. The cases take turns, pass
after pass, so drift in the machine's load hits all alike. Prints MB/s (10^6 bytes per
second): the median and best of the passes, and each case's median as a share of raw's.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import uvloop

from bench.common import REPO
from services.dataplane.kv_layout import KvLayout
from services.dataplane.transfer.backend import Backend, Reader, SourceExport
from services.dataplane.transfer.factory import open_backend
from services.dataplane.transfer.region import KvRegion
from services.dataplane.transfer.runs import Run, Runs, coalesce
from tests.dataplane.transfer.kvfiles import create_kv_file, fill_pages, mismatches, new_kv_path

GEOMETRIES = {
    "64KiB": KvLayout(layers=32, pages=64, chunk_bytes=64 << 10, block_size=16),
    "4KiB": KvLayout(layers=32, pages=320, chunk_bytes=4 << 10, block_size=16),
}


@contextlib.contextmanager
def source(
    backend: str, path: Path, layout: KvLayout, cpu: int | None = None
) -> Iterator[dict[str, object]]:
    argv = [
        sys.executable, "-m", "tests.dataplane.transfer.source_proc", "--backend", backend,
        "--path", str(path), "--layers", str(layout.layers), "--pages", str(layout.pages),
        "--chunk-bytes", str(layout.chunk_bytes), "--block-size", str(layout.block_size),
    ]  # fmt: skip
    if cpu is not None:
        argv += ["--cpu", str(cpu)]
    proc = subprocess.Popen(argv, cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the {backend} source exited with {proc.wait()}")
        yield json.loads(line)
    finally:
        proc.kill()
        proc.wait()


class RawCopy:
    """The baseline: one connection to the raw source; each pass asks for the whole file and
    receives it with `recv_into`."""

    def __init__(self, endpoint: str, dst: KvRegion) -> None:
        host, port = endpoint.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)))
        self.whole = dst.whole()

    def run(self) -> None:
        self.sock.sendall(b"x")
        got, size = 0, self.whole.nbytes
        while got < size:
            n = self.sock.recv_into(self.whole[got:])
            if not n:
                raise RuntimeError("the raw source closed")
            got += n

    def close(self) -> None:
        self.sock.close()
        self.whole.release()


async def read_all(reader: Reader, runs: Sequence[Run], dst: KvRegion, depth: int = 2) -> None:
    """Every layer, `depth` reads in flight (as the runner pipelines them)."""
    in_flight: list[asyncio.Future[Sequence[int] | None]] = []
    for layer in range(dst.layout.layers):
        in_flight.append(asyncio.ensure_future(reader.read(layer, runs, dst)))
        if len(in_flight) >= depth:
            await in_flight.pop(0)
    await asyncio.gather(*in_flight)


async def bench_geometry(layout: KvLayout, args: argparse.Namespace) -> None:
    src_path, dst_path = new_kv_path(), new_kv_path()
    try:
        create_kv_file(src_path, layout)
        create_kv_file(dst_path, layout)
        with KvRegion(src_path, layout) as src:
            fill_pages(src, range(layout.pages), range(1, layout.pages + 1))
        with KvRegion(dst_path, layout) as dst, contextlib.ExitStack() as stack:
            await run_cases(stack, layout, src_path, dst, args)
    finally:
        src_path.unlink(missing_ok=True)
        dst_path.unlink(missing_ok=True)


async def run_cases(
    stack: contextlib.ExitStack,
    layout: KvLayout,
    src_path: Path,
    dst: KvRegion,
    args: argparse.Namespace,
) -> None:
    repeat, depth = args.repeat, args.depth
    pages = list(range(layout.pages))
    shapes = {
        "consecutive": Runs(coalesce(pages, pages)),
        "scattered": Runs(coalesce(pages, pages[::-1])),  # every page a run of its own
    }
    raw = RawCopy(
        str(stack.enter_context(source("raw", src_path, layout, args.source_cpu))["endpoint"]), dst
    )
    stack.callback(raw.close)
    readers: dict[str, Reader] = {}
    locals_: list[Backend] = []
    for name in args.backends.split(","):
        info = stack.enter_context(source(name, src_path, layout, args.source_cpu))
        backend = open_backend(name, "127.0.0.1")
        await backend.start()
        locals_.append(backend)
        backend.register(dst)
        export = SourceExport(
            str(info["endpoint"]), int(str(info["base_address"])), layout, "export-0"
        )
        readers[name] = await backend.open_reader(export)
    seconds: dict[str, list[float]] = {"raw": []}
    try:
        for i in range(repeat + 1):  # interleaved, so drift hits every case alike
            start = time.perf_counter()
            raw.run()
            seconds["raw"].append(time.perf_counter() - start)
            for name, reader in readers.items():
                for shape, runs in shapes.items():
                    start = time.perf_counter()
                    await read_all(reader, runs, dst, depth)
                    seconds.setdefault(f"{name} {shape}", []).append(time.perf_counter() - start)
                    if i == 0:  # the first pass warms up; check its bytes
                        first = [r.dst_page for r in runs[:4]]
                        bad = mismatches(
                            dst, [0, layout.layers - 1], first, [r.src_page + 1 for r in runs[:4]]
                        )
                        assert not bad, f"{name} {shape}: wrong bytes at {bad[:3]}"
    finally:
        for backend in locals_:
            await backend.stop()
    raw_med = statistics.median(seconds["raw"][1:])
    print(
        f"{layout.chunk_bytes >> 10} KiB chunks: {layout.size / 2**20:.0f} MiB, {layout}, "
        f"{depth} reads in flight"
    )
    for case, times in seconds.items():
        med, best = statistics.median(times[1:]), min(times[1:])
        rate, top = layout.size / med / 1e6, layout.size / best / 1e6
        print(f"  {case:22} {rate:7.0f} MB/s median {top:7.0f} best  {raw_med / med:5.2f}× raw")


async def main_async(args: argparse.Namespace) -> None:
    for layout in GEOMETRIES.values():
        await bench_geometry(layout, args)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--repeat", type=int, default=15)
    p.add_argument("--backends", default="tcp,mooncake")
    p.add_argument("--depth", type=int, default=2, help="reads in flight (the runner keeps 2)")
    p.add_argument(
        "--cpus", help="READER,SOURCE: pin this process and the sources (e.g. 1,0 or 0,0)"
    )
    args = p.parse_args(argv)
    if args.cpus:
        reader_cpu, args.source_cpu = map(int, args.cpus.split(","))
        os.sched_setaffinity(0, {reader_cpu})
    else:
        args.source_cpu = None
    uvloop.run(main_async(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
