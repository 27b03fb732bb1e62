"""Step-time model of one engine instance, fitted from measured GPU profiles.

One forward pass that carries `p` new prompt tokens (attending to `pairs` token pairs of context)
and `B` running decodes with `ctx` tokens of context in total takes

    step = step_s + prefill_token_s·p + attn_pair_s·pairs + decode_seq_s·B + decode_ctx_s·ctx

where a prompt chunk of n new tokens on c cached ones contributes n·(c + n/2) pairs. The
constants come from `kvsched/data/latency/*.json`, written by `tools/fit_latency.py` from the
profiles it names (see docs/latency-model.md for the fit and its sources).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
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

    def step(
        self, prefill_tokens: int, attn_pairs: float, decode_seqs: int, decode_ctx: int
    ) -> float:
        """Duration of one forward pass with the given mix of work."""
        return (
            self.step_s
            + self.prefill_token_s * prefill_tokens
            + self.attn_pair_s * attn_pairs
            + self.decode_seq_s * decode_seqs
            + self.decode_ctx_s * decode_ctx
        )

    def prefill(self, n_new: Num, n_cached: Num, chunk: int = 0) -> Num:
        """Isolated prefill of `n_new` tokens on `n_cached` cached ones (works on arrays).

        With `chunk` > 0 the prompt runs in chunks of that many tokens, one pass each; the
        attention pairs sum to the same total, only the fixed step cost repeats."""
        passes: Any = 1.0 if chunk <= 0 else np.maximum(np.ceil(n_new / chunk), 1.0)
        return (  # type: ignore[no-any-return]
            self.step_s * passes
            + self.prefill_token_s * n_new
            + self.attn_pair_s * n_new * (n_cached + n_new * 0.5)
        )

    def prefill_scalar(self, n_new: float, n_cached: float, chunk: int = 0) -> float:
        """`prefill` for plain numbers (no numpy dispatch on the engine's hot path)."""
        passes = 1.0 if chunk <= 0 else max(math.ceil(n_new / chunk), 1.0)
        return (
            self.step_s * passes
            + self.prefill_token_s * n_new
            + self.attn_pair_s * n_new * (n_cached + n_new * 0.5)
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


def load_latency(name: str = DEFAULT_LATENCY) -> LatencyModel:
    """Load fitted constants shipped in `kvsched/data/latency/<name>.json`."""
    path = data_path("latency", f"{name}.json")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"no latency profile named {name!r}") from None
    return LatencyModel(
        name=name,
        model=raw["model"],
        gpu=raw["gpu"],
        step_s=float(raw["step_s"]),
        prefill_token_s=float(raw["prefill_token_s"]),
        attn_pair_s=float(raw["attn_pair_s"]),
        decode_seq_s=float(raw["decode_seq_s"]),
        decode_ctx_s=float(raw["decode_ctx_s"]),
        kv_capacity_tokens=int(raw["kv_capacity_tokens"]),
    )
