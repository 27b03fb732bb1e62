"""The decisions a policy returns, built from the request's view and the terms it was scored
by: a placement on a slot, or a rejection for now."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import numpy.typing as npt

from kvsched.core.decision import Decision, TransferPlan
from kvsched.core.pickers import masked_min
from kvsched.core.request_view import RequestView

# Admission's say on a placement estimated at the given TTFT and scored by the given terms
# (with the terms of moving the session's host's part of the prompt, `cost.moving_terms`,
# when the caller computed them, else None): its rejection, or None when it stands. Asked
# before the placement (and its transfer orders) is built, so a refused request builds neither.
Refusal = Callable[
    [float, dict[str, npt.NDArray[np.float64]], "dict[str, npt.NDArray[np.float64]] | None"],
    "Decision | None",
]


def placement(
    view: RequestView,
    slot: int,
    rule: str,
    terms: dict[str, npt.NDArray[np.float64]],
    *,
    decode_slot: int | None = None,
    cached_tokens: float | None = None,
    fetched_tokens: int = 0,
    transfers: tuple[TransferPlan, ...] = (),
    keeps_binding: bool = False,
) -> Decision:
    """The decision placing `view.req` on `slot`, from the terms computed for it (its local
    hit unless `cached_tokens` says otherwise; decoding there unless `decode_slot`; its
    session stays bound where it is when `keeps_binding`)."""
    ttft = terms.get("ttft_s")
    return Decision(
        request_id=view.req.request_id,
        instance=slot,
        decode_instance=slot if decode_slot is None else decode_slot,
        cached_tokens=int(view.hit_tokens[slot] if cached_tokens is None else cached_tokens),
        fetched_tokens=fetched_tokens,
        estimated_ttft_s=float(ttft[slot]) if ttft is not None else float("nan"),
        rule=rule,
        transfers=transfers,
        terms=terms,
        candidates=view.eligible,
        keeps_binding=keeps_binding,
    )


def placement_unless_refused(
    view: RequestView,
    slot: int,
    rule: str,
    terms: dict[str, npt.NDArray[np.float64]],
    refuse: Refusal | None,
    *,
    moving: dict[str, npt.NDArray[np.float64]] | None = None,
    keeps_binding: bool = False,
) -> Decision:
    """`placement(view, slot, rule, terms, keeps_binding=...)`, or `refuse`'s rejection of it
    (then the placement is never built); `moving` goes to `refuse` as it is."""
    if refuse is not None:
        refused = refuse(float(terms["ttft_s"][slot]), terms, moving)
        if refused is not None:
            return refused
    return placement(view, slot, rule, terms, keeps_binding=keeps_binding)


def rejection(
    view: RequestView, rule: str, retry_after_s: float, terms: dict[str, npt.NDArray[np.float64]]
) -> Decision:
    """The decision refusing `view.req` for now (retry after `retry_after_s`)."""
    return Decision(
        request_id=view.req.request_id,
        instance=-1,
        decode_instance=-1,
        cached_tokens=0,
        fetched_tokens=0,
        estimated_ttft_s=masked_min(terms["ttft_s"], view.eligible, kernels=view.kernels)
        if "ttft_s" in terms
        else float("nan"),
        rule=rule,
        terms=terms,
        candidates=view.eligible,
        rejected=True,
        retry_after_s=retry_after_s,
    )
