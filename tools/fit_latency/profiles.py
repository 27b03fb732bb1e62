"""The three fitted profiles: Meta-Llama-3-8B on A100-80GB straight from Vidur, Llama-3.1-8B on
H100 from BLIS, Vidur's H100 GEMMs and the A100 attention converted, and Llama-3.1-70B on four
H100s from BLIS's TP4 row with the 8B's attention scaled; each with its checks."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tools.fit_latency.blis import (
    BLIS_MODEL_70B,
    BLIS_VLLM,
    BLIS_VLLM_NEWER,
    Gpu,
    blis_row,
    load_gpus,
    mfu,
)
from tools.fit_latency.files import (
    BLIS_COEFFS,
    BLIS_HARDWARE,
    SPLITWISE,
    VIDUR_A100_ATTN,
    VIDUR_A100_MLP,
    VIDUR_H100_MLP,
    read_csv,
)
from tools.fit_latency.numeric import Array, fit_line, fit_slope_pinned, in_range, sig, value_at
from tools.fit_latency.scaling import Capacity, Ratios, same_gemm_ratio, splitwise_ratios
from tools.fit_latency.vidur import (
    DECODE_RANGE,
    PREFILL_RANGE,
    AttentionFits,
    LinearOps,
    fit_attention,
    gemm_shape_scaling,
    load_linear_ops,
    rescale_factors,
)


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


def examples(k: Constants, prefill_ctx_s: float = 0.0) -> dict[str, float]:
    """The README's worked examples (seconds), one pass each; `prefill_ctx_s`: a running
    server's cost per token of cached context the pass reads (`LatencyModel.prefill_ctx_s`)."""
    warm = k.step(1000, 1000 * (100_000 + 500), 0, 0) + prefill_ctx_s * 100_000
    return {
        "example_2000_cold_s": k.step(2000, 2000 * 1000, 0, 0),
        "example_1000_on_100k_cached_s": warm,
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


# Llama-3.1-70B against Llama-3.1-8B (their config.json files): per-layer attention work per
# query/key pair scales with the hidden size (query heads × head dim), KV bytes per token with
# layers × KV heads × head dim.
LAYERS_70B, HIDDEN_70B, KV_BYTES_70B, PARAMS_70B = 80, 8192, 327_680, 70_553_706_496
LAYERS_8B, HIDDEN_8B, KV_BYTES_8B = 32, 4096, 131_072
TP_70B = 4
BLOCK_TOKENS = 16


def fit_h100_70b(inp: Inputs, eight: ProfileFit, mem_fraction: float) -> ProfileFit:
    """Llama-3.1-70B on four H100s (TP4): BLIS's step, prefill and decode coefficients of the
    same architecture on H100 TP4; attention from the 8B profile's, per GPU; KV capacity by
    the 8B's BLIS memory rule on four GPUs. Splitwise's measured Llama2-70B H100 TP4 prompt
    times (an older serving stack) are reported beside the model's as a check."""
    blis = blis_row(inp.blis_rows, "H100", BLIS_VLLM, tp=TP_70B, model=BLIS_MODEL_70B)
    h100 = inp.gpus["H100"]
    k8 = eight.constants
    attn_scale = (LAYERS_70B * HIDDEN_70B / TP_70B) / (LAYERS_8B * HIDDEN_8B)
    ctx_scale = (KV_BYTES_70B / TP_70B) / KV_BYTES_8B
    weights = PARAMS_70B * 2
    kv_bytes = mem_fraction * TP_70B * h100.mem_bytes - weights
    blocks = int(kv_bytes // (BLOCK_TOKENS * KV_BYTES_70B))
    k = Constants(
        step_s=blis.beta0_s,
        prefill_token_s=blis.beta1_s,
        attn_pair_s=k8.attn_pair_s * attn_scale,
        decode_seq_s=blis.beta2_s,
        decode_ctx_s=k8.decode_ctx_s * ctx_scale,
        kv_capacity_tokens=blocks * BLOCK_TOKENS,
    )
    checks: dict[str, float] = {
        "blis_beta0_s": blis.beta0_s,
        "blis_beta1_s_per_token": blis.beta1_s,
        "blis_beta2_s_per_decode_token": blis.beta2_s,
        "blis_alpha0_s_not_folded": blis.alpha0_s,
        "attn_scale_from_8b": attn_scale,
        "decode_ctx_scale_from_8b": ctx_scale,
        "kv_capacity_mem_fraction": mem_fraction,
        "weights_bytes": float(weights),
        "weight_stream_floor_s": weights / TP_70B / h100.bw_bytes_s,
        "implied_linear_mfu": mfu(2 * PARAMS_70B / TP_70B, k.prefill_token_s, h100),
    }
    for tokens, measured in splitwise_prompts(inp.profiles / SPLITWISE).items():
        model = k.step(tokens, tokens * tokens / 2, 0, 0)
        checks[f"splitwise_llama2_70b_tp4_prompt_{tokens}_s"] = measured
        checks[f"model_prompt_{tokens}_s"] = model
    return ProfileFit(k, checks)


def splitwise_prompts(path: Path) -> dict[int, float]:
    """Splitwise's Llama2-70B H100 TP4 prompt time (s) at batch 1, median over its repeats,
    for prompts of 1,024 tokens and more."""
    times: dict[int, list[float]] = {}
    for r in read_csv(path):
        if (r["model"], r["hardware"], r["tensor_parallel"], r["batch_size"]) == (
            "llama2-70b", "h100-80gb", str(TP_70B), "1"
        ) and int(r["prompt_size"]) >= 1024:  # fmt: skip
            times.setdefault(int(r["prompt_size"]), []).append(float(r["prompt_time"]) / 1e3)
    return {n: sorted(v)[len(v) // 2] for n, v in sorted(times.items())}


def _prefill_points(ops: LinearOps) -> tuple[Array, Array]:
    n, t = ops.tokens(), ops.forward_time()
    m = in_range(n, PREFILL_RANGE)
    return n[m], t[m]
