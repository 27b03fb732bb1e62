"""Fit the engine step-time model of `kvsched.core.latency` from measured GPU profiles.

    python tools/fit_latency.py [--profiles PATH]

PATH defaults to `../shared/profiles` next to the repository root. The script reads the BLIS,
Vidur and Splitwise files described in that folder's README.md, fits

    step = step_s + prefill_token_s·p + attn_pair_s·pairs + decode_seq_s·B + decode_ctx_s·ctx

for Llama-3.1-8B on H100 (TP1, bf16) and Meta-Llama-3-8B on A100-80GB (TP1, bf16), prints the
constants with their fit statistics and cross-checks, and writes
`kvsched/data/latency/{llama-3.1-8b-h100,llama-3-8b-a100}.json`.
docs/latency-model.md explains every choice made here.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import statistics
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

Array = npt.NDArray[np.float64]

REPO = Path(__file__).resolve().parents[1]
DEFAULT_PROFILES = REPO.parent / "shared" / "profiles"
OUT_DIR = REPO / "kvsched" / "data" / "latency"

# Relative paths inside the profiles folder.
BLIS_COEFFS = "blis/blackbox_step_coeffs.csv"
BLIS_HARDWARE = "blis/hardware_config.json"
VIDUR_H100_MLP = "vidur/h100/meta-llama/Llama-2-7b-hf/mlp.csv"
VIDUR_A100_MLP = "vidur/a100/meta-llama/Meta-Llama-3-8B/mlp.csv"
VIDUR_A100_ATTN = "vidur/a100/meta-llama/Meta-Llama-3-8B/attention_samples.csv"
SPLITWISE = "splitwise/perf_model.csv"
DISTSERVE_CAPACITY = "distserve/max_num_tokens.csv"

BLIS_MODEL = "meta-llama/llama-3.1-8b-instruct"
BLIS_VLLM = "vllm/vllm-openai:v0.8.4"
BLIS_VLLM_NEWER = "vllm/vllm-openai:v0.11.0"

# Both Llama-2-7B and Llama-3-8B have 32 decoder layers (profiles README KV table; the header of
# attention_samples.csv says "multiply by 32 layers"). Vidur times are per layer, `emb` once.
N_LAYERS = 32
BLOCK_TOKENS = 16  # vLLM KV block size (attention_samples.csv header: block_size 16)
BF16_BYTES = 2
MS = 1e-3
US = 1e-6

PER_LAYER_OPS = (
    "input_layernorm",
    "attn_pre_proj",
    "attn_rope",
    "attn_post_proj",
    "post_attention_layernorm",
    "mlp_up_proj",
    "mlp_act",
    "mlp_down_proj",
    "add",
)
# Tokens per pass over which each slope is fitted (see docs/latency-model.md):
# prefill passes are compute-bound from ~1K tokens on (below that the weight-streaming floor
# in step_s overlaps the GEMMs); decode batches span the batch sizes Vidur's decode attention
# rows were profiled at (55..136), so 1..128.
PREFILL_RANGE = (1024, 1 << 30)
DECODE_RANGE = (1, 128)
SAME_SHAPE_RANGE = (1024, 4096)  # where the 4096x4096 O-projection GEMM is compute-bound


# ---- small numeric helpers ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Fit:
    """A straight line y = intercept + slope·x with its quality on the fitted points."""

    intercept: float
    slope: float
    r2: float
    rms: float  # root-mean-square residual, units of y
    max_rel_err: float  # max |fit − y| / y over the fitted points
    points: int

    def max_rel_err_on(self, x: Array, y: Array) -> float:
        """Max relative error of this line on other points (e.g. a subset)."""
        return float(np.max(np.abs(self.intercept + self.slope * x - y) / y))


def _stats(x: Array, y: Array, intercept: float, slope: float) -> Fit:
    pred = intercept + slope * x
    ss_res = float(((y - pred) ** 2).sum())
    ss_tot = float(((y - y.mean()) ** 2).sum())
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0
    rms = math.sqrt(ss_res / len(x))
    return Fit(intercept, slope, r2, rms, float(np.max(np.abs(pred - y) / y)), len(x))


def fit_line(x: Array, y: Array) -> Fit:
    """Ordinary least squares with a free intercept."""
    design = np.column_stack([np.ones_like(x), x])
    (intercept, slope), *_ = np.linalg.lstsq(design, y, rcond=None)
    return _stats(x, y, float(intercept), float(slope))


def fit_slope_pinned(x: Array, y: Array, intercept: float) -> Fit:
    """Slope minimising the squared *relative* error with the intercept held fixed."""
    w = 1.0 / y**2
    slope = float((w * x * (y - intercept)).sum() / (w * x * x).sum())
    return _stats(x, y, intercept, slope)


def in_range(x: Array, bounds: tuple[int, int]) -> npt.NDArray[np.bool_]:
    return (x >= bounds[0]) & (x <= bounds[1])


def sig(value: float, digits: int = 4) -> float:
    """Round to a few significant digits for the shipped JSON."""
    if value == 0:
        return 0.0
    return round(value, digits - 1 - math.floor(math.log10(abs(value))))


def read_csv(path: Path) -> list[dict[str, str]]:
    """CSV rows as dicts; lines starting with '#' are comments."""
    with path.open(encoding="utf-8") as f:
        return list(csv.DictReader(line for line in f if not line.startswith("#")))


# ---- BLIS -----------------------------------------------------------------------------------


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


def blis_row(rows: Iterable[dict[str, str]], gpu: str, vllm: str, tp: int = 1) -> BlisRow:
    for r in rows:
        if (r["model"], r["gpu"], r["tp"], r["vllm_version"]) == (BLIS_MODEL, gpu, str(tp), vllm):
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
    raise LookupError(f"no BLIS row for {BLIS_MODEL} {gpu} tp{tp} {vllm}")


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


# ---- Vidur linear ops -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Arch:
    """Shapes from Vidur's mlp.csv key columns (gated MLP, untied LM head, 32 layers)."""

    n_head: int
    n_kv_head: int
    n_embd: int
    n_ffn: int
    vocab: int

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def qkv_out(self) -> int:
        return (self.n_head + 2 * self.n_kv_head) * self.head_dim

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * N_LAYERS * self.n_kv_head * self.head_dim * BF16_BYTES

    @property
    def layer_linear_params(self) -> int:
        e = self.n_embd
        return e * self.qkv_out + e * e + 3 * e * self.n_ffn

    @property
    def params(self) -> int:
        norms = (2 * N_LAYERS + 1) * self.n_embd
        return N_LAYERS * self.layer_linear_params + 2 * self.vocab * self.n_embd + norms

    @property
    def linear_flops_per_token(self) -> float:
        """Matmul FLOPs of one token through the decoder layers (LM head excluded)."""
        return 2.0 * N_LAYERS * self.layer_linear_params

    @property
    def attn_flops_per_pair(self) -> float:
        """QKᵀ and PV FLOPs of one (query, key) pair over all layers."""
        return 4.0 * N_LAYERS * self.n_head * self.head_dim

    def op_size(self, op: str) -> float:
        """Work of one Vidur op per token, up to a constant (weight elements or activations)."""
        e = self.n_embd
        sizes = {
            "attn_pre_proj": e * self.qkv_out,
            "attn_post_proj": e * e,
            "mlp_up_proj": 2 * e * self.n_ffn,
            "mlp_act": self.n_ffn,
            "mlp_down_proj": self.n_ffn * e,
            "attn_rope": (self.n_head + self.n_kv_head) * self.head_dim,
        }
        return float(sizes.get(op, e))  # layer norms, residual add, embedding: hidden size


@dataclass(frozen=True, slots=True)
class LinearOps:
    """Vidur TP1 rows of one mlp.csv, grouped by num_tokens."""

    arch: Arch
    rows: dict[int, list[dict[str, str]]]

    def tokens(self) -> Array:
        return np.array(sorted(self.rows), dtype=np.float64)

    def op_time(self, op: str) -> Array:
        """Per-layer median time (s) of one op, averaged over duplicate rows."""
        return np.array(
            [
                statistics.fmean(float(r[f"time_stats.{op}.median"]) for r in self.rows[n]) * MS
                for n in sorted(self.rows)
            ]
        )

    def forward_time(self, scale: dict[str, float] | None = None) -> Array:
        """Σ per-layer ops × layers + emb (s) per num_tokens; `scale` rescales single ops."""
        s = scale or {}
        total = self.op_time("emb") * s.get("emb", 1.0)
        for op in PER_LAYER_OPS:
            total = total + N_LAYERS * self.op_time(op) * s.get(op, 1.0)
        return total


def load_linear_ops(path: Path, tp: int = 1) -> LinearOps:
    grouped: dict[int, list[dict[str, str]]] = defaultdict(list)
    for r in read_csv(path):
        if r["num_tensor_parallel_workers"] == str(tp):
            grouped[int(r["num_tokens"])].append(r)
    first = next(iter(grouped.values()))[0]
    arch = Arch(
        n_head=int(first["n_head"]),
        n_kv_head=int(first["n_kv_head"]),
        n_embd=int(first["n_embd"]),
        n_ffn=int(first["n_expanded_embd"]),
        vocab=int(first["vocab_size"]),
    )
    return LinearOps(arch, dict(grouped))


def rescale_factors(source: Arch, target: Arch) -> dict[str, float]:
    """Per-op time multipliers that move measured ops to another model's shapes."""
    ops = ("emb", *PER_LAYER_OPS)
    return {op: target.op_size(op) / source.op_size(op) for op in ops}


def value_at(x: Array, y: Array, at: float) -> float:
    return float(y[int(np.argmin(np.abs(x - at)))])


GEMM_OPS = ("attn_pre_proj", "attn_post_proj", "mlp_up_proj", "mlp_down_proj")


def gemm_shape_scaling(path: Path) -> float:
    """Median TP2/TP1 ratio of summed GEMM time over compute-bound token counts: TP2 halves
    every GEMM's shape, so 0.5 means time is proportional to shape (the rescaling premise)."""
    tp1, tp2 = load_linear_ops(path, 1), load_linear_ops(path, 2)
    n = tp1.tokens()
    if not np.array_equal(n, tp2.tokens()):
        raise ValueError("TP1 and TP2 rows cover different num_tokens")
    gemm1 = sum((tp1.op_time(op) for op in GEMM_OPS), np.zeros_like(n))
    gemm2 = sum((tp2.op_time(op) for op in GEMM_OPS), np.zeros_like(n))
    m = in_range(n, SAME_SHAPE_RANGE)
    return float(np.median(gemm2[m] / gemm1[m]))


# ---- Vidur attention ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class AttentionFits:
    prefill: Fit  # whole-model seconds vs token pairs n·(c + n/2)
    prefill_max_rel_err_large: float  # on the rows with chunks of >= 512 tokens
    decode: Fit  # whole-model seconds vs batch·kv_cache_size
    kv_save_prefill_s_per_token: float  # attn_kv_cache_save, whole model
    kv_save_decode_s_per_token: float


def fit_attention(path: Path) -> AttentionFits:
    rows = read_csv(path)
    pre = [r for r in rows if r["phase"] == "prefill"]
    dec = [r for r in rows if r["phase"] == "decode"]

    def col(rs: Sequence[dict[str, str]], name: str) -> Array:
        return np.array([float(r[name]) for r in rs])

    n, c = col(pre, "prefill_chunk_size"), col(pre, "kv_cache_size")
    t_pre = col(pre, "attn_prefill_or_decode_median_ms") * MS * N_LAYERS
    batch, kv = col(dec, "batch_size"), col(dec, "kv_cache_size")
    t_dec = col(dec, "attn_prefill_or_decode_median_ms") * MS * N_LAYERS
    save_pre = col(pre, "attn_kv_cache_save_median_ms") * MS * N_LAYERS / n
    save_dec = col(dec, "attn_kv_cache_save_median_ms") * MS * N_LAYERS / batch
    pairs = n * (c + n / 2)
    prefill = fit_line(pairs, t_pre)
    large = n >= 512
    return AttentionFits(
        prefill=prefill,
        prefill_max_rel_err_large=prefill.max_rel_err_on(pairs[large], t_pre[large]),
        decode=fit_line(batch * kv, t_dec),
        kv_save_prefill_s_per_token=float(np.median(save_pre[n >= 512])),
        kv_save_decode_s_per_token=float(np.median(save_dec)),
    )


# ---- A100 → H100 ratios ---------------------------------------------------------------------


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


# ---- capacity -------------------------------------------------------------------------------


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


# ---- profiles -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Constants:
    step_s: float
    prefill_token_s: float
    attn_pair_s: float
    decode_seq_s: float
    decode_ctx_s: float
    kv_capacity_tokens: int

    def step(self, p: float, pairs: float, batch: float, ctx: float) -> float:
        return (
            self.step_s
            + self.prefill_token_s * p
            + self.attn_pair_s * pairs
            + self.decode_seq_s * batch
            + self.decode_ctx_s * ctx
        )

    def rounded(self) -> Constants:
        return Constants(
            sig(self.step_s),
            sig(self.prefill_token_s),
            sig(self.attn_pair_s),
            sig(self.decode_seq_s),
            sig(self.decode_ctx_s),
            self.kv_capacity_tokens,
        )


def examples(k: Constants) -> dict[str, float]:
    """The README's worked examples (seconds)."""
    return {
        "example_2000_cold_s": k.step(2000, 2000 * 1000, 0, 0),
        "example_1000_on_100k_cached_s": k.step(1000, 1000 * (100_000 + 500), 0, 0),
        "example_101k_cold_s": k.step(101_000, 101_000 * 50_500, 0, 0),
        "example_decode_b32_4k_s": k.step(0, 0, 32, 32 * 4096),
    }


@dataclass(frozen=True, slots=True)
class Inputs:
    profiles: Path
    blis_rows: list[dict[str, str]]
    gpus: dict[str, Gpu]
    h100_ops: LinearOps  # Llama-2-7B
    a100_ops: LinearOps  # Llama-3-8B
    attention: AttentionFits


def load_inputs(profiles: Path) -> Inputs:
    return Inputs(
        profiles=profiles,
        blis_rows=read_csv(profiles / BLIS_COEFFS),
        gpus=load_gpus(profiles / BLIS_HARDWARE),
        h100_ops=load_linear_ops(profiles / VIDUR_H100_MLP),
        a100_ops=load_linear_ops(profiles / VIDUR_A100_MLP),
        attention=fit_attention(profiles / VIDUR_A100_ATTN),
    )


@dataclass(frozen=True, slots=True)
class ProfileFit:
    constants: Constants
    checks: dict[str, float]  # cross-checks and fit statistics, seconds unless named otherwise


def fit_a100(inp: Inputs, capacity: Capacity) -> ProfileFit:
    """Meta-Llama-3-8B on A100-80GB straight from Vidur's A100 files."""
    ops, att = inp.a100_ops, inp.attention
    n, t = ops.tokens(), ops.forward_time()
    dec = in_range(n, DECODE_RANGE)
    linear_decode = fit_line(n[dec], t[dec])
    # Vidur composes a pass as the sum of its ops: the fixed cost is linear + attention intercept.
    step_s = linear_decode.intercept + att.decode.intercept
    pre = in_range(n, PREFILL_RANGE)
    linear_prefill = fit_slope_pinned(n[pre], t[pre], linear_decode.intercept)
    k = Constants(
        step_s=step_s,
        prefill_token_s=linear_prefill.slope,
        attn_pair_s=att.prefill.slope,
        decode_seq_s=linear_decode.slope,
        decode_ctx_s=att.decode.slope,
        kv_capacity_tokens=capacity.tokens,
    )
    gpu = inp.gpus["A100-80"]
    blis = blis_row(inp.blis_rows, "A100-80", BLIS_VLLM)
    free = fit_line(n[pre], t[pre])
    checks = {
        "vidur_linear_one_token_s": value_at(n, t, 1),
        "vidur_linear_decode_fit_r2": linear_decode.r2,
        "vidur_linear_prefill_max_rel_err": linear_prefill.max_rel_err,
        "vidur_linear_prefill_free_slope_s": free.slope,
        "vidur_attn_prefill_intercept_s": att.prefill.intercept,
        "vidur_attn_prefill_r2": att.prefill.r2,
        "vidur_attn_prefill_rms_s": att.prefill.rms,
        "vidur_attn_prefill_max_rel_err_chunks_ge_512": att.prefill_max_rel_err_large,
        "vidur_attn_prefill_max_rel_err_all": att.prefill.max_rel_err,
        "vidur_attn_decode_intercept_s": att.decode.intercept,
        "vidur_attn_decode_r2": att.decode.r2,
        "vidur_attn_decode_max_rel_err": att.decode.max_rel_err,
        "kv_read_efficiency_vs_peak_bw": (
            ops.arch.kv_bytes_per_token / gpu.bw_bytes_s / att.decode.slope
        ),
        "vidur_kv_cache_save_prefill_s_per_token_not_used": att.kv_save_prefill_s_per_token,
        "vidur_kv_cache_save_decode_s_per_token_not_used": att.kv_save_decode_s_per_token,
        "weight_stream_floor_s": capacity.weights_bytes / gpu.bw_bytes_s,
        "kv_read_at_peak_bw_s_per_token": ops.arch.kv_bytes_per_token / gpu.bw_bytes_s,
        "linear_flops_at_peak_s_per_token": ops.arch.linear_flops_per_token / gpu.peak_flops,
        "implied_linear_mfu": mfu(ops.arch.linear_flops_per_token, k.prefill_token_s, gpu),
        "implied_linear_mfu_blis_beta1": mfu(ops.arch.linear_flops_per_token, blis.beta1_s, gpu),
        "attn_flops_at_peak_s_per_pair": ops.arch.attn_flops_per_pair / gpu.peak_flops,
        "implied_attn_mfu": mfu(ops.arch.attn_flops_per_pair, k.attn_pair_s, gpu),
        "blis_a100_beta0_s": blis.beta0_s,
        "blis_a100_beta1_s_per_token": blis.beta1_s,
        "blis_a100_beta2_s_per_decode_token": blis.beta2_s,
        "blis_a100_pass_2048_tokens_s": blis.beta0_s + 2048 * blis.beta1_s,
        "model_pass_2048_tokens_s": k.step(2048, 2048 * 1024, 0, 0),
        "blis_a100_decode_b32_s": blis.beta0_s + 32 * blis.beta2_s,
        "model_decode_b32_1k_ctx_s": k.step(0, 0, 32, 32 * 1024),
        "kv_capacity_mem_fraction": capacity.mem_fraction,
    }
    return ProfileFit(k, checks)


def fit_h100(inp: Inputs, capacity: Capacity) -> ProfileFit:
    """Llama-3.1-8B on H100: BLIS step/decode, Vidur H100 GEMMs, A100 attention converted."""
    blis = blis_row(inp.blis_rows, "H100", BLIS_VLLM)
    blis_a100 = blis_row(inp.blis_rows, "A100-80", BLIS_VLLM)
    blis_newer = blis_row(inp.blis_rows, "H100", BLIS_VLLM_NEWER)
    h100, a100 = inp.gpus["H100"], inp.gpus["A100-80"]
    att, target = inp.attention, inp.a100_ops.arch
    # Vidur has Llama-2-7B on H100 only: move each op to Llama-3-8B's shapes.
    ops = inp.h100_ops
    n, t = ops.tokens(), ops.forward_time(rescale_factors(ops.arch, target))
    pre = in_range(n, PREFILL_RANGE)
    linear_prefill = fit_slope_pinned(n[pre], t[pre], blis.beta0_s)
    dec = in_range(n, DECODE_RANGE)
    linear_decode = fit_line(n[dec], t[dec])
    sw_min, sw_max = splitwise_ratios(inp.profiles / SPLITWISE)
    ratios = Ratios(
        blis_beta1=blis_a100.beta1_s / blis.beta1_s,
        same_gemm=same_gemm_ratio(inp.a100_ops, ops),
        splitwise_min=sw_min,
        splitwise_max=sw_max,
        bandwidth=h100.bw_bytes_s / a100.bw_bytes_s,
        peak_flops=h100.peak_flops / a100.peak_flops,
    )
    k = Constants(
        step_s=blis.beta0_s,
        prefill_token_s=linear_prefill.slope,
        attn_pair_s=att.prefill.slope / ratios.blis_beta1,
        decode_seq_s=blis.beta2_s,
        decode_ctx_s=att.decode.slope / ratios.bandwidth,
        kv_capacity_tokens=capacity.tokens,
    )
    a100_one = value_at(inp.a100_ops.tokens(), inp.a100_ops.forward_time(), 1)
    checks = {
        "blis_beta0_s": blis.beta0_s,
        "blis_beta1_s_per_token": blis.beta1_s,
        "blis_beta2_s_per_decode_token": blis.beta2_s,
        "blis_alpha0_s_not_folded": blis.alpha0_s,
        "blis_alpha1_s_per_input_token_not_folded": blis.alpha1_s,
        "blis_alpha2_s_per_output_token_not_folded": blis.alpha2_s,
        "blis_vllm_0_11_beta0_s": blis_newer.beta0_s,
        "blis_vllm_0_11_beta1_s_per_token": blis_newer.beta1_s,
        "vidur_h100_rescaled_one_token_s": value_at(n, t, 1),
        "vidur_h100_rescaled_decode_intercept_s": linear_decode.intercept,
        "vidur_h100_gemm_tp2_over_tp1": gemm_shape_scaling(inp.profiles / VIDUR_H100_MLP),
        "vidur_a100_one_token_times_bw_ratio_s": a100_one / ratios.bandwidth,
        "weight_stream_floor_s": capacity.weights_bytes / h100.bw_bytes_s,
        "vidur_h100_rescaled_prefill_max_rel_err": linear_prefill.max_rel_err,
        "vidur_h100_rescaled_free_slope_s": fit_line(n[pre], t[pre]).slope,
        "vidur_h100_rescaled_decode_slope_s": linear_decode.slope,
        "vidur_a100_prefill_slope_over_same_gemm_ratio_s": (
            fit_line(*_prefill_points(inp.a100_ops)).slope / ratios.same_gemm
        ),
        "a100_attn_pair_s": att.prefill.slope,
        "a100_attn_prefill_r2": att.prefill.r2,
        "ratio_a100_h100_blis_beta1": ratios.blis_beta1,
        "ratio_a100_h100_same_gemm": ratios.same_gemm,
        "ratio_a100_h100_splitwise_prompt_min": ratios.splitwise_min,
        "ratio_a100_h100_splitwise_prompt_max": ratios.splitwise_max,
        "ratio_h100_a100_bandwidth": ratios.bandwidth,
        "ratio_h100_a100_peak_flops": ratios.peak_flops,
        "a100_decode_ctx_s_per_token": att.decode.slope,
        "a100_decode_ctx_r2": att.decode.r2,
        "kv_read_at_peak_bw_s_per_token": target.kv_bytes_per_token / h100.bw_bytes_s,
        "linear_flops_at_peak_s_per_token": target.linear_flops_per_token / h100.peak_flops,
        "implied_linear_mfu": mfu(target.linear_flops_per_token, k.prefill_token_s, h100),
        "implied_linear_mfu_blis_beta1": mfu(target.linear_flops_per_token, blis.beta1_s, h100),
        "attn_flops_at_peak_s_per_pair": target.attn_flops_per_pair / h100.peak_flops,
        "implied_attn_mfu": mfu(target.attn_flops_per_pair, k.attn_pair_s, h100),
        "attn_pair_s_if_ratio_splitwise_min": att.prefill.slope / ratios.splitwise_min,
        "attn_pair_s_if_ratio_same_gemm": att.prefill.slope / ratios.same_gemm,
        "blis_total_kv_blocks": float(capacity.blocks),
        "kv_capacity_mem_fraction": capacity.mem_fraction,
        "blis_pass_2048_tokens_s": blis.beta0_s + 2048 * blis.beta1_s,
        "model_pass_2048_tokens_s": k.step(2048, 2048 * 1024, 0, 0),
    }
    return ProfileFit(k, checks)


def _prefill_points(ops: LinearOps) -> tuple[Array, Array]:
    n, t = ops.tokens(), ops.forward_time()
    m = in_range(n, PREFILL_RANGE)
    return n[m], t[m]


# ---- output ---------------------------------------------------------------------------------

VIDUR = ("microsoft/vidur @7d47513", "MIT")
BLIS_HW_UPSTREAM = ("inference-sim/inference-sim (hardware_config.json)", "Apache-2.0")
BLIS = (
    "inference-sim/inference-sim defaults.yaml@e1a880a4, coefficients.yaml@01cddc32",
    "Apache-2.0",
)


def source(file: str, upstream: tuple[str, str], used_for: str) -> dict[str, str]:
    return {"file": file, "upstream": upstream[0], "license": upstream[1], "used_for": used_for}


H100_SOURCES = [
    source(
        BLIS_COEFFS,
        BLIS,
        "step_s = beta0 and decode_seq_s = beta2 of llama-3.1-8b-instruct/H100/tp1/vLLM v0.8.4; "
        "kv_capacity_tokens = its total_kv_blocks x 16; A100/H100 beta1 ratio converts "
        "attention; v0.11.0 and alpha terms reported as checks",
    ),
    source(
        BLIS_HARDWARE,
        BLIS_HW_UPSTREAM,
        "H100/A100 HBM bandwidth ratio (decode_ctx_s), peak-rate bounds",
    ),
    source(
        VIDUR_H100_MLP,
        VIDUR,
        "prefill_token_s: Llama-2-7B linear ops rescaled per op to Llama-3-8B shapes, slope over "
        "1024..4096 tokens with intercept pinned at step_s; step_s/decode cross-checks",
    ),
    source(
        VIDUR_A100_MLP,
        VIDUR,
        "Llama-3-8B shapes and parameter count; one-token forward cross-check; same-shape GEMM "
        "A100/H100 ratio",
    ),
    source(
        VIDUR_A100_ATTN,
        (
            "microsoft/vidur @7d47513 attention.csv (rows hand-transcribed via the "
            "sw5sh/cs378-assignment3 fork)",
            "MIT",
        ),
        "attn_pair_s (prefill rows, A100, / BLIS beta1 ratio); decode_ctx_s (decode rows, A100, "
        "x HBM bandwidth ratio)",
    ),
    source(
        SPLITWISE,
        ("Mutinifni/splitwise-sim @8f99e7d", "MIT"),
        "bracket for the A100/H100 prefill ratio only (Llama2-70B)",
    ),
]

A100_SOURCES = [
    source(
        VIDUR_A100_MLP,
        VIDUR,
        "step_s (decode-range intercept plus attention intercept), decode_seq_s (slope over "
        "1..128 tokens), prefill_token_s (slope over >=1024 tokens, intercept pinned)",
    ),
    source(
        VIDUR_A100_ATTN,
        (
            "microsoft/vidur @7d47513 attention.csv (rows hand-transcribed via the "
            "sw5sh/cs378-assignment3 fork)",
            "MIT",
        ),
        "attn_pair_s (prefill rows), decode_ctx_s (decode rows), attention part of step_s",
    ),
    source(
        BLIS_COEFFS,
        BLIS,
        "cross-check against the llama-3.1-8b-instruct/A100-80/tp1/v0.8.4 row; the H100 row's "
        "total_kv_blocks fixes the memory rule used for kv_capacity_tokens",
    ),
    source(
        BLIS_HARDWARE, BLIS_HW_UPSTREAM, "A100-80 memory (80 GiB) for capacity; peak-rate bounds"
    ),
    source(
        DISTSERVE_CAPACITY,
        ("LLMServe/DistServe @82831f1", "Apache-2.0"),
        "checked for capacity: OPT models only, not used",
    ),
]

H100_METHOD = (
    "step_s and decode_seq_s are BLIS's beta0 and beta2 for llama-3.1-8b-instruct on H100, TP1, "
    "vLLM v0.8.4 (alpha CPU/API overheads are per request, outside the engine step, and are not "
    "folded in). prefill_token_s is the GEMM-bound slope of Vidur's H100 Llama-2-7B non-attention "
    "ops (sum of per-layer medians x 32 layers + emb), each op rescaled to Llama-3-8B shapes, "
    "least-squares in relative error over 1024..4096 tokens with the intercept pinned at step_s; "
    "BLIS beta1 is lower because it is an end-to-end Bayesian-optimisation fit that trades off "
    "against beta0. attn_pair_s is the slope of Vidur's A100 Llama-3-8B prefill attention "
    "(x 32 layers) against n(c + n/2) pairs, divided by the A100/H100 ratio of BLIS beta1 for the "
    "same model and vLLM version (assumes attention speeds up like the whole prefill; bracketed "
    "by Splitwise's Llama2-70B prompt ratio and a same-shape GEMM ratio). decode_ctx_s is the "
    "slope of Vidur's A100 decode attention against batch x kv_cache_size, scaled by the "
    "hardware_config.json HBM bandwidth ratio; kv_capacity_tokens is BLIS total_kv_blocks x 16."
)

A100_METHOD = (
    "All constants come from Vidur's A100 Meta-Llama-3-8B profiles. Non-attention ops (sum of "
    "per-layer medians x 32 layers + emb) are fitted as a line over 1..128 tokens (decode "
    "batches): its slope is decode_seq_s and its intercept plus the decode-attention intercept "
    "is step_s. prefill_token_s is the slope over >=1024 tokens with the intercept pinned at the "
    "linear-op intercept, least squares in relative error. attn_pair_s and decode_ctx_s are the "
    "slopes of the sampled attention rows (x 32 layers) against n(c + n/2) pairs and against "
    "batch x kv_cache_size. Vidur's attn_kv_cache_save is left out (its per-token cost differs "
    "17x between prefill and decode rows). kv_capacity_tokens applies the memory rule implied by "
    "BLIS's H100 row (KV pool + weights = 0.90 x GPU memory, 16-token blocks) to the 80 GiB A100; "
    "DistServe's capacity table covers OPT models only. BLIS's A100 row is a cross-check."
)


def profile_json(
    *,
    name: str,
    model: str,
    gpu: str,
    k: Constants,
    sources: list[dict[str, str]],
    method: str,
    checks: dict[str, float],
) -> dict[str, Any]:
    r = k.rounded()
    all_checks = {**checks, **examples(r)}
    return {
        "name": name,
        "model": model,
        "gpu": gpu,
        "tp": 1,
        "dtype": "bf16",
        "step_s": r.step_s,
        "prefill_token_s": r.prefill_token_s,
        "attn_pair_s": r.attn_pair_s,
        "decode_seq_s": r.decode_seq_s,
        "decode_ctx_s": r.decode_ctx_s,
        "kv_capacity_tokens": r.kv_capacity_tokens,
        "sources": sources,
        "method": method,
        "checks": {key: v if v.is_integer() else sig(v) for key, v in all_checks.items()},
    }


def write_json(doc: dict[str, Any], out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{doc['name']}.json"
    path.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    return path


def print_profile(doc: dict[str, Any]) -> None:
    print(f"\n== {doc['name']}  ({doc['model']}, {doc['gpu']}, TP{doc['tp']}, {doc['dtype']})")
    units = {
        "step_s": (1e3, "ms"),
        "prefill_token_s": (1e6, "us/token"),
        "attn_pair_s": (1e9, "ns/pair"),
        "decode_seq_s": (1e6, "us/seq"),
        "decode_ctx_s": (1e9, "ns/ctx token"),
    }
    for key, (mult, unit) in units.items():
        print(f"  {key:<18} {doc[key] * mult:>10.4g} {unit}")
    print(f"  {'kv_capacity_tokens':<18} {doc['kv_capacity_tokens']:>10,d}")
    print("  checks:")
    for key, value in doc["checks"].items():
        print(f"    {key:<52} {value:.6g}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--profiles", type=Path, default=DEFAULT_PROFILES)
    parser.add_argument("--out", type=Path, default=OUT_DIR, help="output folder for the JSON")
    args = parser.parse_args(argv)

    inp = load_inputs(args.profiles)
    blis_h100 = blis_row(inp.blis_rows, "H100", BLIS_VLLM)
    if blis_h100.total_kv_blocks is None:
        raise LookupError("BLIS H100 row has no total_kv_blocks")
    arch, h100, a100 = inp.a100_ops.arch, inp.gpus["H100"], inp.gpus["A100-80"]
    cap_h100 = capacity_from_blis(blis_h100.total_kv_blocks, arch, h100, h100)
    cap_a100 = capacity_from_blis(blis_h100.total_kv_blocks, arch, h100, a100)
    models = ", ".join(distserve_models(inp.profiles / DISTSERVE_CAPACITY))
    print(f"DistServe capacity table covers {models}: no Llama rows, not used")

    hf = fit_h100(inp, cap_h100)
    af = fit_a100(inp, cap_a100)
    docs = [
        profile_json(
            name="llama-3.1-8b-h100",
            model="meta-llama/Llama-3.1-8B-Instruct",
            gpu="H100-80GB-SXM",
            k=hf.constants,
            sources=H100_SOURCES,
            method=H100_METHOD,
            checks=hf.checks,
        ),
        profile_json(
            name="llama-3-8b-a100",
            model="meta-llama/Meta-Llama-3-8B",
            gpu="A100-80GB-SXM",
            k=af.constants,
            sources=A100_SOURCES,
            method=A100_METHOD,
            checks=af.checks,
        ),
    ]
    for doc in docs:
        print_profile(doc)
        print(f"  wrote {write_json(doc, args.out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
