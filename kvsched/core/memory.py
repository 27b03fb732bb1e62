"""How many tokens of KV cache one GPU holds, by vLLM's memory rule.

vLLM (v1 `gpu_worker.determine_available_memory`) gives the KV cache what is left of the share
of GPU memory it may use once the weights and the peak of a profiling forward pass are in it:

    kv_bytes = memory × gpu_memory_utilization − weights − activations

and cuts that into whole blocks of `block_size × kv_bytes_per_token` bytes. The activation peak
(and the non-torch memory vLLM adds to it) is measured at start-up, not known here: it is a
parameter, 0 by default, which is what the shipped H100 profile's capacity implies (BLIS's
total_kv_blocks for Llama-3.1-8B = (80 GiB × 0.9 − 16.06 GB of weights) / 128 KiB per token, to
the block).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvsched.core.models import ModelConfig

GIB = 2**30
DEFAULT_UTILIZATION = 0.9  # vLLM's default --gpu-memory-utilization
VLLM_BLOCK_SIZE = 16  # vLLM's default KV block (tokens) on CUDA: the unit it counts capacity in


@dataclass(frozen=True, slots=True)
class GpuMemory:
    """One instance's GPU memory as vLLM budgets it (GiB, as vLLM logs it)."""

    memory_gib: float
    utilization: float = DEFAULT_UTILIZATION
    activation_gib: float = 0.0

    def __post_init__(self) -> None:
        if not self.memory_gib > 0:
            raise ValueError(f"GPU memory must be positive, got {self.memory_gib:g} GiB")
        if not 0 < self.utilization <= 1:
            raise ValueError(f"GPU memory utilization must be in (0, 1], got {self.utilization:g}")
        if not self.activation_gib >= 0:
            raise ValueError(f"activation memory must be >= 0, got {self.activation_gib:g} GiB")

    def kv_bytes(self, model: ModelConfig) -> int:
        """Bytes left for the KV cache once `model`'s weights and the activations are in."""
        usable = self.memory_gib * self.utilization * GIB
        return int(usable - model.weight_bytes - self.activation_gib * GIB)

    def kv_capacity_tokens(self, model: ModelConfig, block_size: int = VLLM_BLOCK_SIZE) -> int:
        """Tokens of KV cache, in whole blocks of `block_size`. Raises ValueError when the model's
        weights are not known or leave no room for one block."""
        if model.weight_bytes <= 0:
            raise ValueError(
                f"model {model.name!r} does not say its parameter count (params): "
                "its weights, and so the KV capacity, cannot follow from GPU memory"
            )
        kv_bytes = self.kv_bytes(model)
        blocks = max(kv_bytes, 0) // (block_size * model.kv_bytes_per_token)
        if blocks <= 0:
            raise ValueError(
                f"{self.memory_gib:g} GiB × {self.utilization:g} leaves no room for KV cache "
                f"after {model.name}'s {model.weight_bytes / GIB:.2f} GiB of weights and "
                f"{self.activation_gib:g} GiB of activations"
            )
        return blocks * block_size
