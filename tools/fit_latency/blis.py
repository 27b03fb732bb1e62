"""BLIS (inference-sim): the step-time coefficients of one model, GPU and vLLM version, and
the GPUs' peak rates and memory."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from tools.fit_latency.numeric import US

BLIS_MODEL = "meta-llama/llama-3.1-8b-instruct"
# BLIS has no Llama-3.1-70B row; Llama-3.3-70B has the same architecture (80 layers, hidden
# 8192, 64 query and 8 KV heads), only newer weights.
BLIS_MODEL_70B = "meta-llama/llama-3.3-70b-instruct"
BLIS_VLLM = "vllm/vllm-openai:v0.8.4"
BLIS_VLLM_NEWER = "vllm/vllm-openai:v0.11.0"


@dataclass(frozen=True, slots=True)
class BlisRow:
    """One row of blackbox_step_coeffs.csv converted to seconds."""

    gpu: str
    vllm: str
    beta0_s: float
    beta1_s: float  # per uncached prefill token
    beta2_s: float  # per decode token
    alpha0_s: float
    alpha1_s: float  # per input token
    alpha2_s: float  # per output token
    total_kv_blocks: int | None
    source: str


def blis_row(
    rows: Iterable[dict[str, str]], gpu: str, vllm: str, tp: int = 1, model: str = BLIS_MODEL
) -> BlisRow:
    for r in rows:
        if (r["model"], r["gpu"], r["tp"], r["vllm_version"]) == (model, gpu, str(tp), vllm):
            blocks = r["total_kv_blocks"].strip()
            return BlisRow(
                gpu=gpu,
                vllm=vllm,
                beta0_s=float(r["beta0_us"]) * US,
                beta1_s=float(r["beta1_us_per_uncached_prefill_token"]) * US,
                beta2_s=float(r["beta2_us_per_decode_token"]) * US,
                alpha0_s=float(r["alpha0_us"]) * US,
                alpha1_s=float(r["alpha1_us_per_input_token"]) * US,
                alpha2_s=float(r["alpha2_us_per_output_token"]) * US,
                total_kv_blocks=int(blocks) if blocks else None,
                source=r["source"],
            )
    raise LookupError(f"no BLIS row for {model} {gpu} tp{tp} {vllm}")


@dataclass(frozen=True, slots=True)
class Gpu:
    name: str
    bw_bytes_s: float
    peak_flops: float
    mem_bytes: float


def mfu(flops: float, seconds: float, gpu: Gpu) -> float:
    """Fraction of the GPU's peak rate that `flops` in `seconds` means."""
    return flops / seconds / gpu.peak_flops


def load_gpus(path: Path) -> dict[str, Gpu]:
    raw = json.loads(path.read_text(encoding="utf-8"))
    return {
        name: Gpu(name, v["BwPeakTBs"] * 1e12, v["TFlopsPeak"] * 1e12, v["MemoryGiB"] * 2**30)
        for name, v in raw.items()
    }
