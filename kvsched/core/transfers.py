"""Building KV transfer orders (the one place a `TransferPlan` is assembled)."""

from __future__ import annotations

from kvsched.core.cost import CostModel
from kvsched.core.decision import RequestId, TransferKind, TransferPlan


def plan_copy(
    cost: CostModel,
    kind: TransferKind,
    source: int,
    target: int,
    *,
    hashes: tuple[int, ...],
    have: int,
    upto: int,
    on_path: bool,
    session_id: str | None = None,
    request_id: RequestId | None = None,
) -> TransferPlan | None:
    """Order copying blocks `hashes[have:upto]` from `source` to `target`, which already holds
    the first `have`; None when there is nothing to copy."""
    if upto <= have:
        return None
    tokens = (upto - have) * cost.block_size
    return TransferPlan(
        kind=kind,
        source=source,
        target=target,
        block_hashes=hashes[:upto],
        skip_blocks=have,
        tokens=tokens,
        nbytes=tokens * cost.kv_bytes_per_token,
        est_seconds=cost.transfer_s(source, target, tokens),
        on_critical_path=on_path,
        session_id=session_id,
        request_id=request_id,
    )
