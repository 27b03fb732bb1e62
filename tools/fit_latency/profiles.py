"""The two fitted profiles: Meta-Llama-3-8B on A100-80GB straight from Vidur, Llama-3.1-8B on
H100 from BLIS, Vidur's H100 GEMMs and the A100 attention converted; each with its checks."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tools.fit_latency.blis import BLIS_VLLM, BLIS_VLLM_NEWER, Gpu, blis_row, load_gpus, mfu
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
