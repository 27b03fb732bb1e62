"""The KV capacity a GPU's memory gives (vLLM's rule)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvsched.core.latency import load_latency
from kvsched.core.memory import GIB, GpuMemory
from kvsched.core.models import DEFAULT_MODEL, model_config


def test_80_gib_at_vllms_default_share_gives_the_shipped_h100_capacity() -> None:
    # The shipped profile's capacity is BLIS's measured total_kv_blocks (29,205 blocks of 16):
    # the rule with no activation reserve reproduces it to the block.
    model = model_config(DEFAULT_MODEL)
    assert GpuMemory(80.0).kv_capacity_tokens(model) == 29_205 * 16
    assert load_latency().kv_capacity_tokens == 29_205 * 16


def test_capacity_falls_with_utilisation_activations_and_kv_size() -> None:
    model = model_config(DEFAULT_MODEL)
    full = GpuMemory(80.0).kv_capacity_tokens(model)
    assert GpuMemory(80.0, 0.8).kv_capacity_tokens(model) < full
    reserved = GpuMemory(80.0, activation_gib=2.0).kv_capacity_tokens(model)
    assert full - reserved == pytest.approx(2 * GIB / model.kv_bytes_per_token, abs=16)
    wide = model_config("meta-llama/Llama-2-7b-hf")  # 4x the KV bytes per token, fewer weights
    assert GpuMemory(80.0).kv_capacity_tokens(wide) < full // 3


@pytest.mark.parametrize(
    ("memory", "message"),
    [
        (lambda: GpuMemory(0.0), "must be positive"),
        (lambda: GpuMemory(80.0, 1.01), "in (0, 1]"),
        (lambda: GpuMemory(80.0, 0.0), "in (0, 1]"),
        (lambda: GpuMemory(80.0, activation_gib=-1.0), ">= 0"),
    ],
)
def test_bad_memory_figures_are_refused(memory: Callable[[], GpuMemory], message: str) -> None:
    with pytest.raises(ValueError) as refused:
        memory()
    assert message in str(refused.value)


def test_weights_that_fill_the_gpu_leave_no_kv_cache() -> None:
    with pytest.raises(ValueError, match="leaves no room for KV cache"):
        GpuMemory(16.0).kv_capacity_tokens(model_config(DEFAULT_MODEL))
