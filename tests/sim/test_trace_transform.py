"""scale_tokens and cap_requests on hand-made traces."""

from __future__ import annotations

from fractions import Fraction

import pytest

from kvsched.sim.traces import Trace, TraceCall, cap_requests, ideal_apc, scale_tokens


def make_trace(
    calls: list[tuple[int, tuple[int, ...]]], block_tokens: int = 64, session: str = "s"
) -> Trace:
    return Trace(
        name="t",
        format="mooncake",
        block_tokens=block_tokens,
        calls=tuple(
            TraceCall(
                index=i,
                session=session,
                group=session,
                timestamp_s=float(i),
                input_tokens=inp,
                output_tokens=5,
                block_ids=ids,
                after=i - 1,
                gap_s=0.5,
            )
            for i, (inp, ids) in enumerate(calls)
        ),
        closed_loop=True,
        notes={"source": "hand"},
    )


BASE = make_trace([(1000, tuple(range(10, 25))), (1023, tuple(range(10, 25))), (130, (10, 11))])


def test_factor_one_same_blocks_is_the_identity() -> None:
    scaled = scale_tokens(BASE, 1.0)
    assert scaled.calls == BASE.calls
    assert scaled.block_tokens == BASE.block_tokens
    assert scaled.notes["scale_tokens"] == [
        {"factor": "1", "block_tokens": [64, 64], "ids_renumbered": False}
    ]
    assert scaled.notes["source"] == "hand"


def test_quarter_scale_hand_computed() -> None:
    scaled = scale_tokens(BASE, 0.25)
    # 1000 → 250 tokens: 3 full 64-token blocks; new block j ends at original token 256(j+1),
    # i.e. original block 4j+3
    first, second, third = scaled.calls
    assert (first.input_tokens, first.block_ids) == (250, (13, 17, 21))
    # 1023 → 255.75 → 256 tokens: 4 new full blocks, but the 4th would end original token
    # 1024, inside the partial 16th original block, so only 3 are kept
    assert (second.input_tokens, second.block_ids) == (256, (13, 17, 21))
    # 130 → 32.5 → 33 (halves round up): no full block
    assert (third.input_tokens, third.block_ids) == (33, ())
    assert [c.output_tokens for c in scaled.calls] == [5, 5, 5]
    assert [(c.after, c.gap_s, c.timestamp_s) for c in scaled.calls] == [
        (c.after, c.gap_s, c.timestamp_s) for c in BASE.calls
    ]
    assert scaled.notes["scale_tokens"][0]["factor"] == "1/4"


def test_quarter_scale_with_quarter_blocks_keeps_ids() -> None:
    scaled = scale_tokens(BASE, Fraction(1, 4), block_tokens=16)
    assert scaled.block_tokens == 16
    assert scaled.calls[0].block_ids == tuple(range(10, 25))  # 250 // 16 = 15 blocks
    assert scaled.calls[2].block_ids == (10, 11)  # 33 // 16 = 2
    assert scaled.calls[1].block_ids == tuple(range(10, 25))  # 16 new blocks, 15 backed
    # hits: 0, min(15·16, 255) = 240, min(2·16, 32) = 32
    assert ideal_apc(scaled) == pytest.approx((240 + 32) / (250 + 256 + 33))


def test_minimum_one_token() -> None:
    tiny = make_trace([(1, ()), (2, ()), (6, ())])
    assert [c.input_tokens for c in scale_tokens(tiny, 0.25).calls] == [1, 1, 2]


def test_upscaling_renumbers_so_no_id_repeats_in_a_prompt() -> None:
    trace = make_trace([(128, (1, 2)), (128, (1, 5))])
    scaled = scale_tokens(trace, 2)
    a, b = (c.block_ids for c in scaled.calls)
    assert len(a) == len(b) == 4
    assert len(set(a)) == 4
    assert a[:2] == b[:2]  # the shared first original block → two shared new blocks
    assert set(a[2:]).isdisjoint(b[2:])
    assert scaled.notes["scale_tokens"][0]["ids_renumbered"] is True
    assert ideal_apc(scaled) == pytest.approx(ideal_apc(trace))


def test_scalings_accumulate_in_notes() -> None:
    twice = scale_tokens(scale_tokens(BASE, 0.5), 0.5)
    assert [s["factor"] for s in twice.notes["scale_tokens"]] == ["1/2", "1/2"]


@pytest.mark.parametrize(("factor", "blocks"), [(0.0, None), (-1.0, None), (1.0, 0)])
def test_scale_rejects_bad_arguments(factor: float, blocks: int | None) -> None:
    with pytest.raises(ValueError):
        scale_tokens(BASE, factor, blocks)


def test_cap_requests() -> None:
    capped = cap_requests(BASE, 2)
    assert capped.calls == BASE.calls[:2]
    assert capped.notes["capped_to"] == 2
    assert cap_requests(BASE, 10) is BASE
    assert cap_requests(BASE, 0).calls == ()
    with pytest.raises(ValueError):
        cap_requests(BASE, -1)
