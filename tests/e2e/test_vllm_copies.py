"""The connector's copies between vLLM's paged KV and the pool, byte for byte against a plain
per-block copy, for stretches and scattered blocks, both ways: run in vLLM's environment
(torch lives there only). Marked `vllm` (run by the test command)."""

from __future__ import annotations

import subprocess

import pytest

from services.launcher.vllm import DEFAULT_PYTHON, REPO

pytestmark = pytest.mark.vllm

CHECK = """
import random
import torch
from services.vllm_connector.worker_side import copy_blocks, layer_bytes, runs

assert runs([4, 5, 6, 9], [10, 11, 3, 4]) == [(4, 10, 2), (6, 3, 1), (9, 4, 1)]
rng = random.Random(7)
for split in ("packed", "k,v"):
    shape = (40, 2, 32, 16) if split == "packed" else (2, 40, 2, 32, 16)
    kv = torch.randn(shape)
    layer, kind = layer_bytes(kv, 40)
    assert kind.startswith(split), kind
    chunk = layer.chunk_bytes
    for n, scattered in ((12, False), (12, True)):
        blocks = list(range(5, 5 + n)) if not scattered else rng.sample(range(40), n)
        pages = list(range(100, 100 + n)) if not scattered else rng.sample(range(200), n)
        pool = torch.zeros(200, chunk, dtype=torch.uint8)
        copy_blocks(pool, pages, layer.parts, blocks, into_pool=True)
        for page, block in zip(pages, blocks):
            want = torch.cat([p[block] for p in layer.parts])
            assert torch.equal(pool[page], want), (split, scattered)
        before = [torch.cat([p[b] for p in layer.parts]).clone() for b in blocks]
        for part in layer.parts:
            part.zero_()
        copy_blocks(pool, pages, layer.parts, blocks, into_pool=False)
        for block, want in zip(blocks, before):
            assert torch.equal(torch.cat([p[block] for p in layer.parts]), want)
print("ok")
"""


def test_copies_move_each_block_whole_and_to_its_place() -> None:
    if not DEFAULT_PYTHON.exists():
        pytest.skip("vLLM is not set up here: run scripts/setup --vllm")
    done = subprocess.run(
        [str(DEFAULT_PYTHON), "-c", CHECK],
        cwd=REPO,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
