"""`tools.fit_latency.engine_fit`: the step-time model fitted to an engine's own timings."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvsched.core.latency import context_read, load_latency
from tools.fit_latency.engine_fit import (
    CachedProbe,
    DecodeProbe,
    PrefillProbe,
    fit_engine,
    nonnegative_lstsq,
    passes,
    predicted_s,
)
from tools.fit_latency.output import profile_json, write_json
from tools.fit_latency.profiles import Constants

TRUE = Constants(4e-3, 30e-6, 2e-9, 50e-6, 20e-9, 65_536)
OVERHEAD_S = 2e-3
CHUNK = 2048
PREFILL_CTX_S = 1.4e-6  # what vLLM's CPU build pays per cached token a chunk reads


def prefill_probe(n: int) -> PrefillProbe:
    latency = OVERHEAD_S + TRUE.step_s * passes(n, CHUNK) + TRUE.step(n, n * n / 2, 0, 0)
    return PrefillProbe(n, latency - TRUE.step_s)


def decode_probe(batch: int, context: int) -> DecodeProbe:
    probe = DecodeProbe(batch, context, 8, 72, 0.0)
    step = TRUE.step(0, 0, batch, probe.context_tokens)
    return DecodeProbe(batch, context, 8, 72, step)


def test_exact_timings_give_back_the_constants_and_the_overhead() -> None:
    prefill = [prefill_probe(n) for n in (32, 1024, 4096, 16384)]
    decode = [decode_probe(b, c) for b in (1, 4, 16) for c in (256, 4096)]
    fit = fit_engine(prefill, decode, chunk_tokens=CHUNK, kv_capacity_tokens=65_536)
    k = fit.constants
    got = (k.step_s, k.prefill_token_s, k.attn_pair_s, k.decode_seq_s, k.decode_ctx_s)
    want = (TRUE.step_s, TRUE.prefill_token_s, TRUE.attn_pair_s, TRUE.decode_seq_s, 20e-9)
    assert got == pytest.approx(want, rel=1e-6)
    assert fit.overhead_s == pytest.approx(OVERHEAD_S, rel=1e-6)
    assert k.kv_capacity_tokens == 65_536
    assert fit.prefill_max_rel_err < 1e-9 and fit.decode_max_rel_err < 1e-9
    # The fit's prediction of a cold prompt is its probe; on a cached prefix, the pairs grow.
    assert predicted_s(fit, 4096, 0, CHUNK) == pytest.approx(prefill_probe(4096).latency_s)
    on_cache = predicted_s(fit, 1024, 16384, CHUNK) - predicted_s(fit, 1024, 0, CHUNK)
    assert on_cache == pytest.approx(TRUE.attn_pair_s * 1024 * 16384)


def cached_probe(cached: int, new: int) -> CachedProbe:
    k = passes(new, CHUNK)
    pairs = new * (cached + new / 2)
    read = PREFILL_CTX_S * context_read(k, cached, CHUNK)
    latency = OVERHEAD_S + TRUE.step_s * k + TRUE.step(new, pairs, 0, 0) - TRUE.step_s + read
    return CachedProbe(cached, new, latency)


def test_turns_on_a_cached_prefix_fit_what_reading_it_costs() -> None:
    # The fresh prompts' chunks read context too: the term prices every probe alike.
    prefill = [PrefillProbe(n, cached_probe(0, n).latency_s) for n in (32, 1024, 4096, 16384)]
    cached = [cached_probe(c, n) for c in (2048, 16384) for n in (32, 1024, 4096)]
    decode = [decode_probe(b, c) for b in (1, 4, 16) for c in (256, 4096)]
    fit = fit_engine(prefill, decode, chunk_tokens=CHUNK, kv_capacity_tokens=1, cached=cached)
    assert fit.prefill_ctx_s == pytest.approx(PREFILL_CTX_S, rel=1e-6)
    assert fit.constants.attn_pair_s == pytest.approx(TRUE.attn_pair_s, rel=1e-6)
    assert fit.overhead_s == pytest.approx(OVERHEAD_S, rel=1e-6)
    assert fit.prefill_max_rel_err < 1e-9
    turn = cached_probe(16384, 256)  # a shape it was not fitted on
    assert predicted_s(fit, 256, 16384, CHUNK) == pytest.approx(turn.latency_s, rel=1e-9)
    # Fitted on fresh prompts alone, the same engine's turns come out too cheap.
    fresh = fit_engine(prefill, decode, chunk_tokens=CHUNK, kv_capacity_tokens=1)
    assert fresh.prefill_ctx_s == 0.0
    assert predicted_s(fresh, 256, 16384, CHUNK) < 0.9 * turn.latency_s


def test_a_prompt_over_the_chunk_pays_the_fixed_cost_of_each_pass() -> None:
    assert [passes(n, 2048) for n in (1, 2048, 2049, 8192)] == [1, 1, 2, 4]
    assert passes(100_000, 0) == 1


def test_no_constant_comes_out_negative() -> None:
    design = np.array([[1.0, 0.0], [1.0, 1.0], [1.0, 2.0]])
    y = np.array([3.0, 2.0, 1.0])
    coef = nonnegative_lstsq(design, y)  # falling: the slope is held at 0
    # The constant closest in relative error: the minimum of sum((c / y - 1)^2).
    assert coef[1] == 0.0 and coef[0] == pytest.approx((1 / y).sum() / (1 / y**2).sum())


def test_too_few_probes_are_refused_saying_what_is_missing() -> None:
    prefill = [prefill_probe(n) for n in (32, 1024, 4096)]
    one_batch = [decode_probe(4, c) for c in (256, 1024, 4096)]
    with pytest.raises(ValueError, match="two batch sizes"):
        fit_engine(prefill, one_batch, chunk_tokens=CHUNK, kv_capacity_tokens=1)
    decode = [decode_probe(b, 256) for b in (1, 2, 4)]
    with pytest.raises(ValueError, match="three prompt lengths"):
        fit_engine(prefill[:2], decode, chunk_tokens=CHUNK, kv_capacity_tokens=1)


def test_a_profiles_warm_example_pays_the_cached_context_it_reads(tmp_path: Path) -> None:
    """The profile's worked example of 1,000 new tokens on 100K cached is what the loaded
    profile prices it at, `prefill_ctx_s` included (it is most of such a turn on a CPU)."""
    k = Constants(6.3e-3, 1.5e-5, 4.7e-9, 5.5e-5, 1.0e-7, 4_194_304)
    doc = profile_json(
        name="cpu",
        model="m",
        gpu="g",
        k=k,
        sources=[],
        method="",
        checks={},
        dtype="",
        prefill_ctx_s=2.5e-6,
    )
    warm = doc["checks"]["example_1000_on_100k_cached_s"]
    priced = load_latency(str(write_json(doc, tmp_path))).prefill_scalar(1000, 100_000)
    assert warm == pytest.approx(priced, rel=1e-3)
    assert warm > k.step(1000, 1000 * 100_500, 0, 0) + 0.2  # the read: 0.25 s of it
