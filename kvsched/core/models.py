"""Model configurations: how many bytes of KV cache one token takes, and of weights the model
takes. Built-in by name, or read from a JSON file a user writes for their own model."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Architecture facts that size the KV cache (bf16 unless `dtype_bytes` says otherwise)."""

    name: str
    layers: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int = 2
    max_model_len: int = 131_072
    params: int = 0  # parameter count (sizes the weights); 0: not known
    weight_dtype_bytes: int = 2  # bytes per parameter as served (bf16)

    def __post_init__(self) -> None:
        for name in ("layers", "kv_heads", "head_dim", "dtype_bytes", "max_model_len"):
            if getattr(self, name) <= 0:
                raise ValueError(f"model config {self.name!r}: {name} must be positive")
        if self.params < 0 or self.weight_dtype_bytes <= 0:
            raise ValueError(
                f"model config {self.name!r}: params must be >= 0, weight_dtype_bytes positive"
            )

    @property
    def weight_bytes(self) -> int:
        """Bytes of weights on the GPU (0 when the parameter count is not known)."""
        return self.params * self.weight_dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V for every layer: 2 × layers × kv_heads × head_dim × dtype bytes."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes

    def kv_bytes(self, tokens: int) -> int:
        return tokens * self.kv_bytes_per_token


DEFAULT_MODEL = "meta-llama/Llama-3.1-8B-Instruct"  # what the latency profiles measured
MINI_MODEL = "kvsched/llama-3.1-8b-mini-kv"

# Published architecture configs (each model's config.json on the Hugging Face hub) and
# parameter counts (the safetensors totals their model pages report).
MODELS: dict[str, ModelConfig] = {
    m.name: m
    for m in (
        ModelConfig(DEFAULT_MODEL, 32, 8, 128, max_model_len=131_072, params=8_030_261_248),
        ModelConfig(
            "meta-llama/Llama-2-7b-hf", 32, 32, 128, max_model_len=4_096, params=6_738_415_616
        ),
        ModelConfig(
            "Qwen/Qwen2.5-7B-Instruct", 28, 4, 128, max_model_len=32_768, params=7_615_616_512
        ),
        ModelConfig("Qwen/Qwen3-8B", 36, 8, 128, max_model_len=40_960, params=8_190_735_360),
        ModelConfig("Qwen/Qwen3-32B", 64, 8, 128, max_model_len=40_960, params=32_762_123_264),
        ModelConfig(
            "meta-llama/Llama-3.1-70B-Instruct",
            80,
            8,
            128,
            max_model_len=131_072,
            params=70_553_706_496,
        ),
        # Not a published model: Llama-3.1-8B's layers and context with one 16-wide KV head
        # (1/64 of its KV bytes per token), so simulated engines keep real KV bytes for their
        # whole cache in a small machine's memory and layer-wise transfers keep the 8B's shape.
        # Its weights are the 8B's (it stands in for that model on the GPU).
        ModelConfig(MINI_MODEL, 32, 1, 16, max_model_len=131_072, params=8_030_261_248),
    )
}

# The keys a model config file holds: those of ModelConfig (name, layers, kv_heads, head_dim
# required; the rest default as in the dataclass).
_FILE_REQUIRED = ("layers", "kv_heads", "head_dim")


def model_config(name: str) -> ModelConfig:
    """A built-in model by name, or the model config in the JSON file `name` (a path ending in
    `.json`; see `load_model_file`). Raises ValueError naming the known ones otherwise."""
    found = MODELS.get(name)
    if found is not None:
        return found
    if name.endswith(".json"):
        return load_model_file(Path(name))
    known = ", ".join(sorted(MODELS))
    raise ValueError(
        f"unknown model {name!r}; known models: {known} (or a model config .json file)"
    )


def load_model_file(path: Path) -> ModelConfig:
    """Read a model config JSON: {"name", "layers", "kv_heads", "head_dim"} and optionally
    "dtype_bytes", "max_model_len", "params", "weight_dtype_bytes" (the name defaults to the
    file's stem). Raises ValueError, naming the file, for a missing file or a bad field."""
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        known = ", ".join(sorted(MODELS))
        raise ValueError(f"no model config file {str(path)!r}; built-in models: {known}") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"model config {str(path)!r}: {exc}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"model config {str(path)!r}: expected a JSON object")
    known_keys = {f.name for f in fields(ModelConfig)}
    unknown = sorted(set(raw) - known_keys)
    missing = [k for k in _FILE_REQUIRED if k not in raw]
    if unknown or missing:
        problem = f"missing {', '.join(missing)}" if missing else f"unknown {', '.join(unknown)}"
        raise ValueError(
            f"model config {str(path)!r}: {problem} (keys: {', '.join(sorted(known_keys))})"
        )
    values: dict[str, Any] = {"name": str(raw.get("name") or path.stem)}
    for key in known_keys - {"name"}:
        if key in raw:
            value = raw[key]
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"model config {str(path)!r}: {key} must be an integer")
            values[key] = value
    try:
        return ModelConfig(**values)
    except ValueError as exc:
        raise ValueError(f"{exc} (in {str(path)!r})") from None
