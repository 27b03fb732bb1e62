"""Which per-instance scoring runs: the compiled kernels (`_scoring.c`) or the numpy reference.

A placement decision scores every instance slot with vector arithmetic (`kvsched.core.cost`'s
TTFT terms, pool loads and prefix fetches, the pickers' masked minima, the request view's hit
vectors). Each of those functions keeps its numpy code as the reference and, when compiled
kernels are active, hands the same inputs to one C loop instead (a dozen numpy calls of about
a microsecond each become one). The kernels compute bit-identical floats (see `_scoring.c` for
why), so a decision never depends on which runs; the property tests hold them to it.

Which runs is the cluster's choice, made when it is built (`build_cluster(pure=...)`, which
puts `load_kernels`' answer in its `CostModel.kernels`): the scoring functions take it from
the cost model or the request view they are given, and nothing here reads the environment
or keeps a process-wide switch, so two clusters in one process (the benches compare both)
can score each its own way.
"""

from __future__ import annotations

from types import NotImplementedType
from typing import Protocol

import numpy as np
import numpy.typing as npt

FloatVec = npt.NDArray[np.float64]
BoolVec = npt.NDArray[np.bool_]
# step_s, decode_seq_s, decode_ctx_s, prefill_token_s, attn_pair_s, chunk_tokens,
# kv_bytes_per_token, prefill_ctx_s (`CostModel.kernel_constants`)
Constants = tuple[float, float, float, float, float, float, float, float]
# The pool link's setup_s and seconds per byte, kv_bytes_per_token, layers
# (`CostModel.pool_constants`)
PoolConstants = tuple[float, float, float, float]


class Kernels(Protocol):
    """The compiled kernels (`kvsched.core._scoring`). Each returns NotImplemented, changing
    nothing, when a vector is not a 1-D C-contiguous float64 (or bool) array; the caller then
    computes the reference. None of them changes its inputs."""

    def ttft(  # noqa: PLR0917 (positional, as the C function takes them)
        self,
        prompt_tokens: float,
        cached: FloatVec,
        running: FloatVec,
        decode_tokens: FloatVec,
        queue: FloatVec,
        transfer: FloatVec | None,
        constants: Constants,
        /,
    ) -> tuple[FloatVec, FloatVec, FloatVec] | NotImplementedType:
        """(prefill, transfer, ttft) of `cost.ttft_terms` (`transfer` itself, or zeros)."""

    def moving(
        self, host: int, hits: FloatVec, setup: FloatVec, per_byte: FloatVec, kv: float, /
    ) -> tuple[FloatVec, FloatVec] | NotImplementedType:
        """(cached, transfer) of `cost.moving_terms` before its TTFT."""

    def fetch_when_cheaper(  # noqa: PLR0917 (positional, as the C function takes them)
        self,
        holder: int,
        prompt_tokens: float,
        hits: FloatVec,
        eligible: BoolVec,
        setup: FloatVec,
        per_byte: FloatVec,
        constants: Constants,
        holder_prefill_s: float,
        /,
    ) -> tuple[BoolVec, FloatVec, FloatVec] | NotImplementedType:
        """(fetch, cached, transfer) of `cost.fetch_when_cheaper`."""

    def fetch_from(  # noqa: PLR0917 (positional, as the C function takes them)
        self,
        holder: int,
        hits: FloatVec,
        fetch: BoolVec,
        setup: FloatVec,
        per_byte: FloatVec,
        kv: float,
        /,
    ) -> tuple[FloatVec, FloatVec] | NotImplementedType:
        """(cached, transfer) of `cost.fetch_from`."""

    def candidates(  # noqa: PLR0917 (positional, as the C function takes them)
        self,
        eligible: BoolVec,
        free_blocks: FloatVec,
        block_size: int,
        context_tokens: float,
        pending: FloatVec,
        host: int,
        /,
    ) -> BoolVec | NotImplementedType:
        """`migration.MigrationPlanner.candidates`."""

    def cold_score(  # noqa: PLR0917 (positional, as the C function takes them)
        self,
        ttft: FloatVec,
        prefill: FloatVec,
        pending_s: FloatVec,
        eligible: BoolVec,
        resident: FloatVec,
        context_tokens: float,
        capacity_tokens: float,
        /,
    ) -> tuple[FloatVec, BoolVec] | NotImplementedType:
        """(score, pool) of `policies.elastic_cold_score.cold_score` (NotImplemented with no slot
        eligible)."""

    def best_slot(self, hit_blocks: FloatVec, eligible: BoolVec, /) -> int | NotImplementedType:
        """`RequestView.best_slot`."""

    def masked_min(self, values: FloatVec, mask: BoolVec, /) -> float | NotImplementedType:
        """`np.min(values[mask])` (ValueError when `mask` is empty)."""

    def argmin(
        self, values: FloatVec, eligible: BoolVec, tiebreaks: tuple[FloatVec, ...], /
    ) -> int | NotImplementedType:
        """`pickers.argmin_eligible`."""

    def hit_vectors(
        self, n: int, matches: tuple[dict[int, int], ...], block_size: int, cap_tokens: int, /
    ) -> tuple[FloatVec, FloatVec, FloatVec | None]:
        """`request_view.hit_vectors`: (blocks, tokens, pool_tokens or None)."""

    def pool_load(
        self, pool_tokens: FloatVec, prefill: FloatVec, constants: PoolConstants, /
    ) -> tuple[FloatVec, FloatVec] | NotImplementedType:
        """(load, load_wait) of `cost.pool_load`."""


def load_kernels(pure: bool = False) -> Kernels | None:
    """The compiled kernels, or None for the numpy reference when `pure`. Changes nothing."""
    if pure:
        return None
    try:
        from kvsched.core import _scoring  # noqa: PLC0415  (built by pip)
    except ImportError as exc:
        raise ImportError(
            "kvsched's compiled scoring (kvsched.core._scoring) is not built: reinstall kvsched "
            "with pip (scripts/setup, or pip install -e .), which compiles it with the machine's "
            "C compiler, or run the numpy reference (a cluster built with pure=True: the "
            "Conductor's --pure-kernels)"
        ) from exc
    return _scoring
