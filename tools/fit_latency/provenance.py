"""Where each shipped constant comes from: the sources (file, upstream, licence, use) and the
method paragraph of each profile's JSON."""

from __future__ import annotations

from tools.fit_latency.files import (
    BLIS_COEFFS,
    BLIS_HARDWARE,
    DISTSERVE_CAPACITY,
    SPLITWISE,
    VIDUR_A100_ATTN,
    VIDUR_A100_MLP,
    VIDUR_H100_MLP,
)

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

H100_70B_SOURCES = [
    source(
        BLIS_COEFFS,
        BLIS,
        "step_s = beta0, prefill_token_s = beta1, decode_seq_s = beta2 of "
        "llama-3.3-70b-instruct/H100/tp4/vLLM v0.8.4 (Llama-3.1-70B's architecture)",
    ),
    source(BLIS_HARDWARE, BLIS_HW_UPSTREAM, "H100 memory and bandwidth (capacity, checks)"),
    source(
        SPLITWISE,
        ("Mutinifni/splitwise-sim @8f99e7d", "MIT"),
        "check only: measured Llama2-70B H100 TP4 prompt times at batch 1, 1,024-8,192 tokens",
    ),
]
H100_70B_METHOD = (
    "step_s, prefill_token_s and decode_seq_s are BLIS's beta0, beta1 and beta2 for "
    "llama-3.3-70b-instruct on H100, TP4, vLLM v0.8.4 (the same architecture as Llama-3.1-70B; "
    "BLIS has no 3.1 row; beta1 is end to end, so it also carries the prompt attention BLIS "
    "does not separate). attn_pair_s is the llama-3.1-8b-h100 profile's, times the attention "
    "work per query/key pair per GPU: layers x hidden size over TP, 80 x 8192 / 4 against "
    "32 x 4096 (1.25x; assumes the same attention kernel efficiency). decode_ctx_s is the 8B "
    "profile's times the KV bytes per token each GPU reads, 327,680 / 4 against 131,072 "
    "(0.625x). kv_capacity_tokens applies the memory rule implied by BLIS's 8B H100 row (KV "
    "pool + weights = 0.90 x GPU memory, 16-token blocks) to four 80 GiB GPUs holding 141 GB "
    "of bf16 weights. Splitwise's Llama2-70B prompt times on H100 TP4 (an older serving stack) "
    "are reported beside the model's as a check, not fitted."
)
