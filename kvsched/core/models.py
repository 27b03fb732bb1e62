"""Model configurations: how many bytes of KV cache one token takes."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Architecture facts that size the KV cache (bf16 unless `dtype_bytes` says otherwise)."""

    name: str
    layers: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int = 2
    max_model_len: int = 131_072

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V for every layer: 2 × layers × kv_heads × head_dim × dtype bytes."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes

    def kv_bytes(self, tokens: int) -> int:
        return tokens * self.kv_bytes_per_token


DEFAULT_MODEL = "meta-llama/Llama-3.1-8B-Instruct"  # what the latency profiles measured
MINI_MODEL = "kvsched/llama-3.1-8b-mini-kv"

# Published architecture configs (each model's config.json on the Hugging Face hub).
MODELS: dict[str, ModelConfig] = {
    m.name: m
    for m in (
        ModelConfig(DEFAULT_MODEL, 32, 8, 128, max_model_len=131_072),
        ModelConfig("meta-llama/Llama-2-7b-hf", 32, 32, 128, max_model_len=4_096),
        ModelConfig("Qwen/Qwen2.5-7B-Instruct", 28, 4, 128, max_model_len=32_768),
        ModelConfig("Qwen/Qwen3-8B", 36, 8, 128, max_model_len=40_960),
        ModelConfig("Qwen/Qwen3-32B", 64, 8, 128, max_model_len=40_960),
        ModelConfig("meta-llama/Llama-3.1-70B-Instruct", 80, 8, 128, max_model_len=131_072),
        # Not a published model: Llama-3.1-8B's layers and context with one 16-wide KV head
        # (1/64 of its KV bytes per token), so simulated engines keep real KV bytes for their
        # whole cache in a small machine's memory and layer-wise transfers keep the 8B's shape.
        ModelConfig(MINI_MODEL, 32, 1, 16, max_model_len=131_072),
    )
}


def model_config(name: str) -> ModelConfig:
    try:
        return MODELS[name]
    except KeyError:
        known = ", ".join(sorted(MODELS))
        raise ValueError(f"unknown model {name!r}; known models: {known}") from None
