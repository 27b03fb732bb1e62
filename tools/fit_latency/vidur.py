"""Vidur's profiles: per-op times of the linear layers (mlp.csv) with the model shapes they
imply, and the attention samples, fitted per token pair and per context token."""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tools.fit_latency.files import read_csv
from tools.fit_latency.numeric import MS, Array, Fit, fit_line, in_range

# Both Llama-2-7B and Llama-3-8B have 32 decoder layers (profiles README KV table; the header of
# attention_samples.csv says "multiply by 32 layers"). Vidur times are per layer, `emb` once.
N_LAYERS = 32
BLOCK_TOKENS = 16  # vLLM KV block size (attention_samples.csv header: block_size 16)
BF16_BYTES = 2
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
