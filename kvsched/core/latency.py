"""Step-time model of one engine instance, fitted from measured GPU profiles.

One forward pass that carries `p` new prompt tokens (attending to `pairs` token pairs of context)
and `B` running decodes with `ctx` tokens of context in total takes

    step = step_s + prefill_token_s·p + attn_pair_s·pairs + decode_seq_s·B + decode_ctx_s·ctx

where a prompt chunk of n new tokens on c cached ones contributes n·(c + n/2) pairs. A
profile measured on a running server may add two terms the GPU profiles fitted from pass
timings do not have (both 0 there): `prefill_ctx_s`, seconds per token of context a prompt
chunk reads before its own tokens, in each pass that carries it (vLLM's CPU build pays it
beside the pairs: a few new tokens on a long cached prefix cost far more than the pairs
say), and `request_overhead_s`, what the server spends on a request outside the forward
passes before its first one (HTTP, input processing), which delays its admission. The
constants come from `kvsched/data/latency/*.json`, written by `tools/fit_latency.py` from the
profiles it names (see docs/latency-model.md for the fit and its sources).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt

from kvsched.data_files import data_path

DEFAULT_LATENCY = "llama-3.1-8b-h100"

Num = TypeVar("Num", float, npt.NDArray[np.float64])


@dataclass(frozen=True, slots=True)
class LatencyModel:
    """Fitted constants (seconds) for one model on one GPU type."""

    name: str
    model: str
    gpu: str
    step_s: float
    prefill_token_s: float
    attn_pair_s: float
    decode_seq_s: float
    decode_ctx_s: float
    kv_capacity_tokens: int
    request_overhead_s: float = 0.0  # before a request's first pass, outside the passes
    prefill_ctx_s: float = 0.0  # per token of context a prompt chunk reads, per pass

    def step(
        self,
        prefill_tokens: int,
        attn_pairs: float,
        decode_seqs: int,
        decode_ctx: int,
        prefill_ctx: int = 0,
    ) -> float:
        """Duration of one forward pass with the given mix of work (`prefill_ctx`: the
        context, in tokens, that its prompt chunks read before their own tokens)."""
        return (
            self.step_s
            + self.prefill_token_s * prefill_tokens
            + self.attn_pair_s * attn_pairs
            + self.decode_seq_s * decode_seqs
            + self.decode_ctx_s * decode_ctx
            + self.prefill_ctx_s * prefill_ctx
        )

    def prefill(self, n_new: Num, n_cached: Num, chunk: int = 0) -> Num:
        """Isolated prefill of `n_new` tokens on `n_cached` cached ones (works on arrays).

        With `chunk` > 0 the prompt runs in chunks of that many tokens, one pass each; the
        attention pairs sum to the same total, only the fixed step cost repeats, and each
        chunk reads the context before it (`context_read`)."""
        passes: Any = 1.0 if chunk <= 0 else np.maximum(np.ceil(n_new / chunk), 1.0)
        return (  # type: ignore[no-any-return]
            self.step_s * passes
            + self.prefill_token_s * n_new
            + self.attn_pair_s * n_new * (n_cached + n_new * 0.5)
            + self.prefill_ctx_s * context_read(passes, n_cached, chunk)
        )

    def prefill_scalar(self, n_new: float, n_cached: float, chunk: int = 0) -> float:
        """`prefill` for plain numbers (no numpy dispatch on the engine's hot path)."""
        passes = 1.0 if chunk <= 0 else max(math.ceil(n_new / chunk), 1.0)
        return (
            self.step_s * passes
            + self.prefill_token_s * n_new
            + self.attn_pair_s * n_new * (n_cached + n_new * 0.5)
            + self.prefill_ctx_s * context_read(passes, n_cached, chunk)
        )

    def decode_step(self, batch: int, context: int) -> float:
        """One decode-only pass over `batch` sequences holding `context` tokens in total."""
        return self.step_s + self.decode_seq_s * batch + self.decode_ctx_s * context

    def decode_steps(self, batch: int, context: int, steps: int) -> float:
        """`steps` consecutive decode-only passes; every pass adds `batch` tokens of context."""
        per_step = self.step_s + self.decode_seq_s * batch + self.decode_ctx_s * context
        return steps * per_step + self.decode_ctx_s * batch * steps * (steps - 1) * 0.5

    def steps_within(self, batch: int, context: int, budget_s: float) -> int:
        """How many whole decode-only passes fit in `budget_s` (inverse of `decode_steps`)."""
        if budget_s <= 0:
            return 0
        base = self.step_s + self.decode_seq_s * batch + self.decode_ctx_s * context
        growth = self.decode_ctx_s * batch
        # Solve growth/2·k² + (base − growth/2)·k − budget = 0 for the largest whole k, in the
        # cancellation-free form (also valid for growth = 0, where it is budget / base). The
        # estimate is then corrected against decode_steps itself, so the result is the exact
        # inverse in floating point too.
        b = base - growth * 0.5
        k = int(2.0 * budget_s / (b + (b * b + 2.0 * growth * budget_s) ** 0.5))
        while k > 0 and self.decode_steps(batch, context, k) > budget_s:
            k -= 1
        while self.decode_steps(batch, context, k + 1) <= budget_s:
            k += 1
        return k


def context_read(passes: Num, n_cached: Num, chunk: int) -> Num:
    """Tokens of context a prompt's chunks read before their own, summed over its `passes`
    (chunk i starts after `n_cached` + i·`chunk` tokens; one pass without chunking)."""
    return passes * n_cached + chunk * passes * (passes - 1.0) * 0.5


def latency_profiles() -> tuple[str, ...]:
    """Names of the shipped profiles (`kvsched/data/latency/<name>.json`), sorted."""
    return tuple(sorted(p.stem for p in data_path("latency").glob("*.json")))


_CONSTANTS = ("step_s", "prefill_token_s", "attn_pair_s", "decode_seq_s", "decode_ctx_s")
_SERVER_TERMS = ("request_overhead_s", "prefill_ctx_s")  # optional: 0 when absent


def load_latency(name: str = DEFAULT_LATENCY) -> LatencyModel:
    """A shipped profile by name, or the profile in the JSON file `name` (a path ending in
    `.json`, written like the shipped ones: model, gpu, the five constants in seconds and
    kv_capacity_tokens). Raises ValueError naming the shipped profiles when neither exists,
    and naming the field when a file holds a bad one."""
    if name.endswith(".json"):
        return _read_profile(Path(name), Path(name).stem)
    path = data_path("latency", f"{name}.json")
    if not path.is_file():
        known = ", ".join(latency_profiles())
        raise ValueError(
            f"no latency profile named {name!r}; known profiles: {known} (or a profile .json file)"
        )
    return _read_profile(path, name)


def _read_profile(path: Path, default_name: str) -> LatencyModel:
    where = f"latency profile {str(path)!r}"
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        known = ", ".join(latency_profiles())
        raise ValueError(f"no {where}; known profiles: {known}") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{where}: {exc}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: expected a JSON object")
    missing = [k for k in ("model", "gpu", *_CONSTANTS, "kv_capacity_tokens") if k not in raw]
    if missing:
        raise ValueError(f"{where}: missing {', '.join(missing)}")
    constants: dict[str, float] = {}
    for key in _CONSTANTS:
        value = raw[key]
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"{where}: {key} must be a number")
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"{where}: {key} must be finite and >= 0, got {value}")
        constants[key] = float(value)
    if constants["step_s"] <= 0:
        raise ValueError(f"{where}: step_s must be positive")
    for key in _SERVER_TERMS:
        value = raw.get(key, 0.0)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"{where}: {key} must be a number")
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"{where}: {key} must be finite and >= 0, got {value}")
        constants[key] = float(value)
    capacity = raw["kv_capacity_tokens"]
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity <= 0:
        raise ValueError(f"{where}: kv_capacity_tokens must be a positive integer")
    return LatencyModel(
        name=str(raw.get("name") or default_name),
        model=str(raw["model"]),
        gpu=str(raw["gpu"]),
        kv_capacity_tokens=capacity,
        **constants,
    )
