# Types of the compiled scoring kernels (_scoring.c); behaviour as kvsched.core.scoring.Kernels.
from types import NotImplementedType

from kvsched.core.scoring import BoolVec, Constants, FloatVec, PoolConstants

def ttft(
    prompt_tokens: float,
    cached: FloatVec,
    running: FloatVec,
    decode_tokens: FloatVec,
    queue: FloatVec,
    transfer: FloatVec | None,
    constants: Constants,
    /,
) -> tuple[FloatVec, FloatVec, FloatVec] | NotImplementedType: ...
def moving(
    host: int, hits: FloatVec, setup: FloatVec, per_byte: FloatVec, kv: float, /
) -> tuple[FloatVec, FloatVec] | NotImplementedType: ...
def fetch_when_cheaper(
    holder: int,
    prompt_tokens: float,
    hits: FloatVec,
    eligible: BoolVec,
    setup: FloatVec,
    per_byte: FloatVec,
    constants: Constants,
    holder_prefill_s: float,
    /,
) -> tuple[BoolVec, FloatVec, FloatVec] | NotImplementedType: ...
def fetch_from(
    holder: int, hits: FloatVec, fetch: BoolVec, setup: FloatVec, per_byte: FloatVec, kv: float, /
) -> tuple[FloatVec, FloatVec] | NotImplementedType: ...
def candidates(
    eligible: BoolVec,
    free_blocks: FloatVec,
    block_size: int,
    context_tokens: float,
    pending: FloatVec,
    host: int,
    /,
) -> BoolVec | NotImplementedType: ...
def cold_score(
    ttft: FloatVec,
    prefill: FloatVec,
    pending_s: FloatVec,
    eligible: BoolVec,
    resident: FloatVec,
    context_tokens: float,
    capacity_tokens: float,
    /,
) -> tuple[FloatVec, BoolVec] | NotImplementedType: ...
def best_slot(hit_blocks: FloatVec, eligible: BoolVec, /) -> int | NotImplementedType: ...
def masked_min(values: FloatVec, mask: BoolVec, /) -> float | NotImplementedType: ...
def argmin(
    values: FloatVec, eligible: BoolVec, tiebreaks: tuple[FloatVec, ...], /
) -> int | NotImplementedType: ...
def hit_vectors(
    n: int, matches: tuple[dict[int, int], ...], block_size: int, cap_tokens: int, /
) -> tuple[FloatVec, FloatVec, FloatVec | None]: ...
def pool_load(
    pool_tokens: FloatVec, prefill: FloatVec, constants: PoolConstants, /
) -> tuple[FloatVec, FloatVec] | NotImplementedType: ...
