"""Properties of the shipped step-time profiles (kvsched/data/latency/*.json).

Only the shipped JSON is read. Reference numbers in this file are quoted from the profile data
(../shared/profiles, see docs/latency-model.md) and the model architecture, never from the
fitted output: they bound what the constants may be, so a bad refit fails here.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvsched.core.latency import DEFAULT_LATENCY, LatencyModel, load_latency

H100 = "llama-3.1-8b-h100"
A100 = "llama-3-8b-a100"
NAMES = (H100, A100)
MODELS = {name: load_latency(name) for name in NAMES}

# Llama-3(.1)-8B architecture: 32 layers, 32 query heads, 8 KV heads, head dim 128, hidden 4096,
# gated MLP 14336, vocab 128256 (untied LM head) -> 8,030,261,248 parameters.
KV_BYTES_PER_TOKEN = 2 * 32 * 8 * 128 * 2  # 131,072
WEIGHT_BYTES = 8_030_261_248 * 2
LINEAR_FLOPS_PER_TOKEN = 2 * 32 * (4096 * 6144 + 4096 * 4096 + 3 * 4096 * 14336)
ATTN_FLOPS_PER_PAIR = 4 * 32 * 32 * 128  # QK^T and PV over all layers
GIB = 2**30


class Gpu:
    """blis/hardware_config.json: peak bf16 rate, HBM bandwidth, memory, calibrated prefill MFU."""

    def __init__(self, flops: float, bw: float, mem_gib: float, mfu_prefill: float) -> None:
        self.flops, self.bw, self.mem, self.mfu_prefill = flops, bw, mem_gib * GIB, mfu_prefill


GPUS = {H100: Gpu(989.5e12, 3.35e12, 80, 0.45), A100: Gpu(312e12, 2.039e12, 80, 0.38)}

# Measured on A100 for Meta-Llama-3-8B (Vidur attention_samples.csv, x 32 layers): prefill
# attention slope 3.1-3.3 ns per pair (with / without intercept), decode 74.7 ns per context
# token. An H100 cannot be slower than the A100 at the same kernel.
A100_ATTN_PAIR_S = (3.1e-9, 3.3e-9)
A100_DECODE_CTX_S = 74.7e-9

models = pytest.mark.parametrize("name", NAMES)


def test_default_and_unknown_profiles() -> None:
    assert load_latency().name == DEFAULT_LATENCY == H100
    assert MODELS[H100].gpu.startswith("H100") and MODELS[A100].gpu.startswith("A100")
    with pytest.raises(ValueError, match="no latency profile"):
        load_latency("no-such-profile")


@models
def test_constants_positive(name: str) -> None:
    m = MODELS[name]
    for value in (m.step_s, m.prefill_token_s, m.attn_pair_s, m.decode_seq_s, m.decode_ctx_s):
        assert math.isfinite(value) and value > 0
    assert m.kv_capacity_tokens > 0


# ---- physical bounds --------------------------------------------------------------------------


@models
def test_no_constant_beats_the_hardware(name: str) -> None:
    """Every cost is at least the work divided by the GPU's peak rate."""
    m, gpu = MODELS[name], GPUS[name]
    assert m.step_s >= WEIGHT_BYTES / gpu.bw  # a pass streams all weights once
    assert m.decode_ctx_s >= KV_BYTES_PER_TOKEN / gpu.bw
    assert m.attn_pair_s >= ATTN_FLOPS_PER_PAIR / gpu.flops
    mfu = LINEAR_FLOPS_PER_TOKEN / m.prefill_token_s / gpu.flops
    # Not faster than peak; not slower than BLIS's calibrated roofline prefill efficiency.
    assert gpu.mfu_prefill <= mfu < 1.0


def test_h100_not_slower_than_measured_a100() -> None:
    h = MODELS[H100]
    assert h.attn_pair_s < A100_ATTN_PAIR_S[0]
    assert h.decode_ctx_s < A100_DECODE_CTX_S
    a = MODELS[A100]
    for field in ("step_s", "prefill_token_s", "attn_pair_s", "decode_seq_s", "decode_ctx_s"):
        assert getattr(h, field) < getattr(a, field), field


def test_a100_attention_matches_its_measurement() -> None:
    a = MODELS[A100]
    assert A100_ATTN_PAIR_S[0] <= a.attn_pair_s <= A100_ATTN_PAIR_S[1]
    assert a.decode_ctx_s == pytest.approx(A100_DECODE_CTX_S, rel=0.02)


@models
def test_kv_capacity_fits_in_memory(name: str) -> None:
    m, gpu = MODELS[name], GPUS[name]
    assert m.kv_capacity_tokens % 16 == 0  # whole vLLM blocks
    assert m.kv_capacity_tokens * KV_BYTES_PER_TOKEN + WEIGHT_BYTES <= gpu.mem
    # ... and uses most of what is left (BLIS's H100 row: 29,205 blocks = 0.90 of 80 GiB).
    assert m.kv_capacity_tokens * KV_BYTES_PER_TOKEN + WEIGHT_BYTES >= 0.85 * gpu.mem


# ---- the README's worked examples -------------------------------------------------------------
# Bands (seconds), derived from the profile data independently of the fit:
#  H100 2,000 cold: BLIS v0.8.4 beta-only 40 ms, BLIS v0.11 46 ms, Vidur H100 linear ops at 2,048
#    tokens 40 ms (Llama-2-7B, no attention) -> 35..70 ms.
#  H100 1,000 on 100K: A100 attention 1.005e8 pairs x 3.16 ns = 318 ms divided by the A100/H100
#    speed-ups in the data (1.83 Splitwise .. 3.17 peak FLOPs) = 100..174 ms, plus 1,000 tokens of
#    GEMMs (17..22 us each) and a step -> 100..220 ms.
#  H100 101K cold: GEMMs 101K x 17..22 us = 1.7..2.3 s; attention 5.1e9 pairs x 3.16 ns
#    / (3.17..1.83) = 5.1..8.8 s -> 6..12 s.
#  H100 decode 32 x 4K: weights + 131,072 tokens of KV at peak bandwidth = 9.9 ms (hard floor);
#    BLIS beta0 + 32 beta2 + KV at the A100-measured 74.7 ns/token = 15.7 ms -> 9.9..20 ms.
#  A100 2,000 cold: Vidur A100 linear ops at 2,048 tokens 142..146 ms, BLIS A100 beta-only 112 ms
#    -> 100..200 ms.
#  A100 1,000 on 100K: 1.005e8 pairs x 3.1..3.3 ns = 312..332 ms plus 1,000 x 48..66 us
#    -> 250..550 ms.
#  A100 101K cold: GEMMs 101K x 48..66 us = 4.8..6.7 s; attention 5.1e9 x 3.1..3.3 ns = 15.8..16.8 s
#    -> 18..27 s.
#  A100 decode 32 x 4K: weights + KV at peak bandwidth = 16.3 ms (floor); BLIS A100 beta0 + 32 beta2
#    plus KV at 74.7 ns/token = 26.8 ms -> 16.3..30 ms.
BANDS = {
    H100: {
        "cold_2000": (0.035, 0.070),
        "warm_1000_on_100k": (0.100, 0.220),
        "cold_101k": (6.0, 12.0),
        "decode_32x4k": (0.0099, 0.020),
    },
    A100: {
        "cold_2000": (0.100, 0.200),
        "warm_1000_on_100k": (0.250, 0.550),
        "cold_101k": (18.0, 27.0),
        "decode_32x4k": (0.0163, 0.030),
    },
}


def readme_examples(m: LatencyModel) -> dict[str, float]:
    return {
        "cold_2000": float(m.prefill(2000.0, 0.0)),
        "warm_1000_on_100k": float(m.prefill(1000.0, 100_000.0)),
        "cold_101k": float(m.prefill(101_000.0, 0.0)),
        "decode_32x4k": m.decode_step(32, 32 * 4096),
    }


@models
def test_readme_examples_within_data_bands(name: str) -> None:
    got = readme_examples(MODELS[name])
    for key, (lo, hi) in BANDS[name].items():
        assert lo <= got[key] <= hi, (key, got[key])


@models
def test_cached_prefix_is_most_of_a_warm_turn(name: str) -> None:
    """1,000 new tokens on 100K cached cost far more than 1,000 cold ones and far less than
    recomputing all 101K: a TTFT estimate needs both new and cached tokens."""
    m = MODELS[name]
    warm, cold_small, cold_all = (
        float(m.prefill(1000.0, 100_000.0)),
        float(m.prefill(1000.0, 0.0)),
        float(m.prefill(101_000.0, 0.0)),
    )
    assert 3 * cold_small < warm < cold_all / 20


# ---- algebra of the model ---------------------------------------------------------------------

tokens = st.integers(min_value=1, max_value=200_000)
cached = st.integers(min_value=0, max_value=500_000)
chunks = st.integers(min_value=1, max_value=16_384)


@models
@given(n=tokens, c=cached, extra=st.integers(min_value=1, max_value=10_000))
def test_prefill_monotone(name: str, n: int, c: int, extra: int) -> None:
    m = MODELS[name]
    base = float(m.prefill(float(n), float(c)))
    assert float(m.prefill(float(n + extra), float(c))) > base
    assert float(m.prefill(float(n), float(c + extra))) > base


@models
@given(n=tokens, c=cached, chunk=chunks)
def test_chunked_prefill_adds_only_step_costs(name: str, n: int, c: int, chunk: int) -> None:
    m = MODELS[name]
    passes = max(math.ceil(n / chunk), 1)
    whole = float(m.prefill(float(n), float(c)))
    assert float(m.prefill(float(n), float(c), chunk)) == pytest.approx(
        whole + (passes - 1) * m.step_s, rel=1e-12
    )


@models
@given(n=st.integers(min_value=1, max_value=50_000), c=cached, chunk=chunks)
def test_chunked_prefill_equals_sum_of_chunk_steps(name: str, n: int, c: int, chunk: int) -> None:
    """Running the chunks as separate passes (as the engine does) costs what prefill() says."""
    m = MODELS[name]
    total, done = 0.0, 0
    while done < n:
        take = min(chunk, n - done)
        total += m.step(take, take * (c + done + take * 0.5), 0, 0)
        done += take
    assert total == pytest.approx(float(m.prefill(float(n), float(c), chunk)), rel=1e-9)


@given(n=st.integers(min_value=1, max_value=50_000), c=cached, chunk=st.integers(64, 16_384))
def test_a_server_profiles_context_reads_are_paid_by_each_chunk(n: int, c: int, chunk: int) -> None:
    """With `prefill_ctx_s`, every chunk also pays for the context before it: prefill() is
    still the sum of the engine's chunk passes, and the term adds exactly that reading."""
    m = replace(MODELS[DEFAULT_LATENCY], prefill_ctx_s=1.36e-6)
    total, read, done = 0.0, 0, 0
    while done < n:
        take = min(chunk, n - done)
        total += m.step(take, take * (c + done + take * 0.5), 0, 0, c + done)
        read += c + done
        done += take
    prefill = m.prefill_scalar(float(n), float(c), chunk)
    assert total == pytest.approx(prefill, rel=1e-9)
    assert float(m.prefill(float(n), float(c), chunk)) == pytest.approx(prefill, rel=1e-12)
    without = MODELS[DEFAULT_LATENCY].prefill_scalar(float(n), float(c), chunk)
    assert prefill - without == pytest.approx(1.36e-6 * read, rel=1e-6, abs=1e-12)


@models
def test_prefill_accepts_arrays(name: str) -> None:
    m = MODELS[name]
    n = np.array([1.0, 512.0, 3000.0, 70_000.0])
    c = np.array([0.0, 4096.0, 100_000.0, 0.0])
    got = m.prefill(n, c, 2048)
    want = [float(m.prefill(float(a), float(b), 2048)) for a, b in zip(n, c, strict=True)]
    np.testing.assert_allclose(got, want, rtol=1e-12)


@models
@given(batch=st.integers(min_value=0, max_value=512), ctx=st.integers(min_value=0, max_value=10**6))
def test_step_reduces_to_decode_step(name: str, batch: int, ctx: int) -> None:
    m = MODELS[name]
    assert m.step(0, 0.0, batch, ctx) == pytest.approx(m.decode_step(batch, ctx), rel=1e-12)


@models
@given(
    batch=st.integers(min_value=0, max_value=512),
    ctx=st.integers(min_value=0, max_value=2_000_000),
    k=st.integers(min_value=0, max_value=600),
)
def test_decode_steps_is_sum_of_single_steps(name: str, batch: int, ctx: int, k: int) -> None:
    m = MODELS[name]
    looped = sum(m.decode_step(batch, ctx + i * batch) for i in range(k))
    assert m.decode_steps(batch, ctx, k) == pytest.approx(looped, rel=1e-9, abs=1e-15)


@models
@given(
    batch=st.integers(min_value=0, max_value=1024),
    ctx=st.integers(min_value=0, max_value=4_000_000),
    budget=st.floats(min_value=-1.0, max_value=600.0, allow_nan=False),
)
def test_steps_within_is_exact_inverse(name: str, batch: int, ctx: int, budget: float) -> None:
    m = MODELS[name]
    k = m.steps_within(batch, ctx, budget)
    assert k >= 0
    assert k == 0 or m.decode_steps(batch, ctx, k) <= budget
    assert m.decode_steps(batch, ctx, k + 1) > budget


@models
@given(
    batch=st.integers(min_value=0, max_value=1024),
    ctx=st.integers(min_value=0, max_value=4_000_000),
    k=st.integers(min_value=0, max_value=20_000),
)
def test_steps_within_recovers_step_count(name: str, batch: int, ctx: int, k: int) -> None:
    m = MODELS[name]
    assert m.steps_within(batch, ctx, m.decode_steps(batch, ctx, k)) == k
