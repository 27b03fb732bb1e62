"""What the checks of a load cost: a load copies a prompt's blocks from the node's pool into
the engine's KV memory (`pool_link._copy`, the baseline, measured in the same run). Before
answering, the pool checks every block it hands out against the checksum it kept at the
block's save (`pool_check`: `kv_layout.block_checksums`, XXH3-64 over the block's chunks,
which is also what computing the checksums at a save costs); a simulated engine then
checks that every block holds the content its hash and layer imply
(`kv_layout.intact_prefix`, `check`). Both memories are KV memory files on the shared-memory
filesystem, faulted in first, as in a running engine and pool; the pool's blocks lie on
scattered pages (every other one), as a pool that has evicted holds them.

Geometries: the demo's mini-KV model and Llama-3.1-8B's real KV (2 MiB a 16-token block).
Medians of `--repeat` runs; the machine's cores are shared, so the ratio is the figure to
read, the absolute rates only its scale.

    .venv/bin/python -m bench.load_check [--repeat 15] [--blocks 64]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

from kvsched.core.models import DEFAULT_MODEL, MINI_MODEL, model_config
from services.dataplane.kv_layout import KvLayout, block_checksums, intact_prefix
from services.dataplane.kv_memory import DEFAULT_DIR, KvMemory
from services.dataplane.pool_link import _copy

BLOCK_SIZE = 16


def measure(model: str, blocks: int, repeat: int) -> dict[str, object]:
    """Copy-then-check `blocks` blocks of `model`'s KV `repeat` times; medians."""
    layout = KvLayout.for_model(model_config(model), BLOCK_SIZE, 2 * blocks)
    with tempfile.TemporaryDirectory(dir=DEFAULT_DIR, prefix="kvsched-bench-") as folder:
        pool = KvMemory(layout, "bench-pool", folder)
        engine = KvMemory(layout, "bench-engine", folder)
        try:
            for memory in (pool, engine):
                memory.populate()
            hashes = list(range(1_000_003, 1_000_003 + 2 * blocks))
            pool.store(hashes)
            pool.remove(hashes[1::2])  # the chain's blocks on every other page
            chain = hashes[::2]
            pool_pages = [pool.page_of[h] for h in chain]
            engine_pages = list(range(blocks))
            view = pool.chunks.data.cast("B")
            saved = list(block_checksums(view, layout, pool_pages))
            copy_s, check_s, pool_check_s = [], [], []
            for _ in range(repeat):
                started = time.perf_counter()
                sums = block_checksums(view, layout, pool_pages)
                assert all(got == want for got, want in zip(sums, saved, strict=True))
                pool_checked = time.perf_counter()
                _copy(pool.chunks, pool_pages, engine.chunks, engine_pages)
                copied = time.perf_counter()
                intact = intact_prefix(engine.chunks, engine_pages, chain)
                checked = time.perf_counter()
                assert intact == blocks, intact
                pool_check_s.append(pool_checked - started)
                copy_s.append(copied - pool_checked)
                check_s.append(checked - copied)
            view.release()
        finally:
            pool.close()
            engine.close()
    nbytes = blocks * layout.block_bytes
    copy, check = statistics.median(copy_s), statistics.median(check_s)
    pool_check = statistics.median(pool_check_s)
    return {
        "model": model,
        "blocks": blocks,
        "block_bytes": layout.block_bytes,
        "copy_ms": round(copy * 1e3, 3),
        "check_ms": round(check * 1e3, 3),
        "pool_check_ms": round(pool_check * 1e3, 3),
        "check_over_copy": round(check / copy, 2),
        "pool_check_over_copy": round(pool_check / copy, 2),
        "copy_gb_per_s": round(nbytes / copy / 1e9, 2),
        "check_gb_per_s": round(nbytes / check / 1e9, 2),
        "pool_check_gb_per_s": round(nbytes / pool_check / 1e9, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--blocks", type=int, default=64, help="blocks a load moves")
    args = parser.parse_args()
    for model in (MINI_MODEL, DEFAULT_MODEL):
        print(json.dumps(measure(model, args.blocks, args.repeat)))


if __name__ == "__main__":
    main()
