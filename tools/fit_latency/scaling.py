"""From one GPU to another: A100/H100 time ratios measured several ways, and the KV capacity
BLIS's memory rule gives each GPU."""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from tools.fit_latency.blis import Gpu
from tools.fit_latency.files import read_csv
from tools.fit_latency.numeric import value_at
from tools.fit_latency.vidur import BF16_BYTES, BLOCK_TOKENS, SAME_SHAPE_RANGE, Arch, LinearOps


@dataclass(frozen=True, slots=True)
class Ratios:
    """A100 time / H100 time for the same work, measured several ways."""

    blis_beta1: float  # llama-3.1-8b tp1 vLLM v0.8.4: what attention conversion uses
    same_gemm: float  # Vidur 4096x4096 O-projection (identical shape in both files)
    splitwise_min: float  # Llama2-70B whole prompt at the longest prompt, over TP degrees
    splitwise_max: float
    bandwidth: float  # HBM peak, hardware_config.json
    peak_flops: float


def same_gemm_ratio(a100: LinearOps, h100: LinearOps) -> float:
    if a100.arch.n_embd != h100.arch.n_embd:
        raise ValueError("O-projection shapes differ; the same-shape ratio needs equal n_embd")
    na, nh = a100.tokens(), h100.tokens()
    ta, th = a100.op_time("attn_post_proj"), h100.op_time("attn_post_proj")
    common = [n for n in nh if n in set(na) and SAME_SHAPE_RANGE[0] <= n <= SAME_SHAPE_RANGE[1]]
    return statistics.median(value_at(na, ta, n) / value_at(nh, th, n) for n in common)


def splitwise_ratios(path: Path) -> tuple[float, float]:
    times: dict[tuple[str, int], list[float]] = defaultdict(list)
    rows = [r for r in read_csv(path) if r["model"] == "llama2-70b" and r["batch_size"] == "1"]
    longest = max(int(r["prompt_size"]) for r in rows)
    for r in rows:
        if int(r["prompt_size"]) == longest:
            times[(r["hardware"], int(r["tensor_parallel"]))].append(float(r["prompt_time"]))
    a100 = {tp for hw, tp in times if hw == "a100-80gb"}
    tps = a100 & {tp for hw, tp in times if hw == "h100-80gb"}
    ratios = [
        statistics.median(times[("a100-80gb", tp)]) / statistics.median(times[("h100-80gb", tp)])
        for tp in sorted(tps)
    ]
    return min(ratios), max(ratios)


@dataclass(frozen=True, slots=True)
class Capacity:
    tokens: int
    blocks: int
    mem_fraction: float  # (KV pool + weights) / GPU memory implied by BLIS's H100 row
    weights_bytes: int


def capacity_from_blis(blocks: int, arch: Arch, gpu: Gpu, target: Gpu) -> Capacity:
    """BLIS's H100 block count, and the same memory rule applied to `target`."""
    weights = arch.params * BF16_BYTES
    block_bytes = BLOCK_TOKENS * arch.kv_bytes_per_token
    budget = blocks * block_bytes + weights  # bytes BLIS gives KV pool + weights on `gpu`
    scaled = round(budget * target.mem_bytes / gpu.mem_bytes)
    target_blocks = (scaled - weights) // block_bytes
    return Capacity(target_blocks * BLOCK_TOKENS, target_blocks, budget / gpu.mem_bytes, weights)


def distserve_models(path: Path) -> list[str]:
    return sorted({r["model"] for r in read_csv(path)})
