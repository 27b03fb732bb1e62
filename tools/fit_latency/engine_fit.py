"""The step-time model fitted to timings measured on a running engine (pure: no I/O).

Two kinds of probe, each a median over repeats (`tools.fit_latency.engine_probes` sends them):

- a *prefill* probe: one request alone, `n` fresh prompt tokens (after `c` cached ones,
  the shape of an agent's next turn, or none) and one output token; its latency is
  `overhead + passes(n)·step_s + prefill_token_s·n + attn_pair_s·n·(c + n/2) +
  prefill_ctx_s·read`, where `read` is the context the chunks read before their own tokens
  (`kvsched.core.latency.context_read`: `c` in one pass) and `overhead` what the server adds
  to a request outside the forward passes (HTTP, input processing, detokenizing): the
  profile's `request_overhead_s`;
- a *decode* probe: `batch` requests at once, each `context` prompt tokens, run twice with
  `short` and `long` output tokens; the difference of their mean latencies over `long − short`
  is one decode pass of `batch` sequences holding `batch·(context + (short + long)/2)` tokens:
  `step_s + decode_seq_s·batch + decode_ctx_s·ctx`. Prefill and overhead cancel.

The decode probes fit `step_s`, `decode_seq_s` and `decode_ctx_s`; with `step_s` held, the
prefill probes fit `prefill_token_s`, `attn_pair_s`, `prefill_ctx_s` (only with probes on a
cached prefix: without them it is held at 0) and the overhead. Every constant is
non-negative (a negative least-squares coefficient is held at 0 and the rest refitted), and
each fit minimises the relative error over its probes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvsched.core.latency import context_read
from tools.fit_latency.numeric import Array
from tools.fit_latency.profiles import Constants


@dataclass(frozen=True, slots=True)
class PrefillProbe:
    """One request alone: `tokens` fresh prompt tokens, one output token, `latency_s`."""

    tokens: int
    latency_s: float


@dataclass(frozen=True, slots=True)
class CachedProbe:
    """One request alone: `new` fresh prompt tokens after `cached` ones in the cache, one
    output token, `latency_s`."""

    cached: int
    new: int
    latency_s: float


@dataclass(frozen=True, slots=True)
class DecodeProbe:
    """`batch` requests at once of `context` prompt tokens each; `step_s` is one decode pass,
    measured as (mean latency with `long` − with `short` output tokens) / (long − short)."""

    batch: int
    context: int
    short: int
    long: int
    step_s: float

    @property
    def context_tokens(self) -> float:
        """Tokens the batch holds, on average over the passes measured."""
        return self.batch * (self.context + (self.short + self.long) / 2)


@dataclass(frozen=True, slots=True)
class EngineFit:
    """The fitted constants, the per-request overhead outside the model, and how well the
    fit reproduces its own probes."""

    constants: Constants
    overhead_s: float
    prefill_ctx_s: float
    prefill_max_rel_err: float
    decode_max_rel_err: float


def passes(tokens: int, chunk_tokens: int) -> int:
    """Forward passes a prompt of `tokens` takes with chunks of `chunk_tokens` (0: one)."""
    return 1 if chunk_tokens <= 0 else max(math.ceil(tokens / chunk_tokens), 1)


def nonnegative_lstsq(design: Array, y: Array) -> Array:
    """Least squares of the *relative* error (each row weighted by 1/y: the probes span
    milliseconds to seconds, and each should be reproduced as closely) with every
    coefficient >= 0: a column whose coefficient comes out negative is dropped (held at 0)
    and the rest refitted, until none is."""
    keep = np.ones(design.shape[1], dtype=bool)
    coef = np.zeros(design.shape[1])
    weighted, ones = design / y[:, None], np.ones_like(y)
    while keep.any():
        sub, *_ = np.linalg.lstsq(weighted[:, keep], ones, rcond=None)
        if (sub >= 0).all():
            coef[keep] = sub
            return coef
        worst = np.flatnonzero(keep)[int(np.argmin(sub))]
        keep[worst] = False
    return coef


def fit_engine(
    prefill: list[PrefillProbe],
    decode: list[DecodeProbe],
    *,
    chunk_tokens: int,
    kv_capacity_tokens: int,
    cached: Sequence[CachedProbe] = (),
) -> EngineFit:
    """The constants from the probes (see the module docstring). Raises ValueError when the
    probes cannot determine them (fewer than three of a kind, or every decode at one batch
    size)."""
    if len(decode) < 3 or len({d.batch for d in decode}) < 2:
        raise ValueError("the decode probes need at least three runs over two batch sizes")
    if len(prefill) < 3 or len({p.tokens for p in prefill}) < 3:
        raise ValueError("the prefill probes need at least three prompt lengths")
    steps = np.array([d.step_s for d in decode])
    d_design = np.array([[1.0, d.batch, d.context_tokens] for d in decode])
    step_s, decode_seq_s, decode_ctx_s = nonnegative_lstsq(d_design, steps)
    if step_s <= 0:
        raise ValueError("the decode probes give no fixed cost per pass: probe smaller batches")

    shapes = [(p.tokens, 0, p.latency_s) for p in prefill]
    shapes += [(p.new, p.cached, p.latency_s) for p in cached]
    n, c, latency = (np.array(column, dtype=float) for column in zip(*shapes, strict=True))
    k = np.array([passes(int(x), chunk_tokens) for x in n], dtype=float)
    columns = [np.ones_like(n), n, n * (c + n / 2)]
    if cached:
        columns.append(context_read(k, c, chunk_tokens))
    p_design = np.column_stack(columns)
    fixed = step_s * k
    overhead_s, prefill_token_s, attn_pair_s, *read = nonnegative_lstsq(p_design, latency - fixed)
    prefill_ctx_s = float(read[0]) if read else 0.0

    constants = Constants(
        float(step_s),
        float(prefill_token_s),
        float(attn_pair_s),
        float(decode_seq_s),
        float(decode_ctx_s),
        kv_capacity_tokens,
    )
    p_pred = fixed + p_design @ np.array([overhead_s, prefill_token_s, attn_pair_s, *read])
    d_pred = d_design @ np.array([step_s, decode_seq_s, decode_ctx_s])
    return EngineFit(
        constants=constants,
        overhead_s=float(overhead_s),
        prefill_ctx_s=prefill_ctx_s,
        prefill_max_rel_err=float(np.max(np.abs(p_pred - latency) / latency)),
        decode_max_rel_err=float(np.max(np.abs(d_pred - steps) / steps)),
    )


def predicted_s(fit: EngineFit, new: int, cached: int, chunk_tokens: int) -> float:
    """The fitted latency of one request alone: overhead plus its prefill."""
    k = fit.constants
    n = passes(new, chunk_tokens)
    prefill = k.step_s * n + k.prefill_token_s * new + k.attn_pair_s * new * (cached + new / 2)
    return fit.overhead_s + prefill + fit.prefill_ctx_s * context_read(n, cached, chunk_tokens)
