"""ideal_apc on hand-made traces with known answers, and properties on generated traces."""

from __future__ import annotations

import gc
import weakref

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsched.core.latency import load_latency
from kvsched.sim.traces import Trace, TraceCall, ceiling, ideal_apc, matched_blocks
from kvsched.sim.traces.ceiling import ideal_hits, ttft_floor

BT = 16


def make_trace(calls: list[tuple[str, int, tuple[int, ...]]], block_tokens: int = BT) -> Trace:
    return Trace(
        name="t",
        format="mooncake",
        block_tokens=block_tokens,
        calls=tuple(
            TraceCall(
                index=i,
                session=s,
                group=s,
                timestamp_s=float(i),
                input_tokens=inp,
                output_tokens=1,
                block_ids=ids,
            )
            for i, (s, inp, ids) in enumerate(calls)
        ),
        closed_loop=False,
    )


TINY = make_trace(
    [
        ("a", 53, (1, 2, 3)),  # cold: 0
        ("b", 50, (1, 2, 4)),  # global: 2 blocks = 32; session: 0
        ("a", 64, (1, 2, 3, 5)),  # 3 blocks = 48
        ("a", 64, (1, 2, 3, 5)),  # 4 blocks = 64, capped at 63
    ]
)
P = 53 + 50 + 64 + 64


def test_hits_are_remembered_per_trace_and_scope() -> None:
    assert ideal_hits(TINY) == (0, 32, 48, 63)
    assert ideal_hits(TINY) is ideal_hits(TINY)
    assert ideal_hits(TINY, scope="session") == (0, 0, 48, 63)
    # Another trace object has hits of its own.
    assert ideal_hits(make_trace([("a", 53, (1, 2, 3))] * 2)) == (0, 48)


def test_remembered_hits_do_not_keep_their_trace_alive() -> None:
    trace = make_trace([("a", 53, (1, 2, 3))] * 2)
    assert ideal_hits(trace) == ideal_hits(trace, scope="session") == (0, 48)
    alive = weakref.ref(trace)
    del trace
    gc.collect()
    assert alive() is None
    assert all(held() is not None for held, _ in ceiling._HITS.values())  # its entries went


def test_known_answers() -> None:
    assert ideal_apc(TINY) == pytest.approx((32 + 48 + 63) / P)
    assert ideal_apc(TINY, scope="session") == pytest.approx((48 + 63) / P)
    assert ideal_apc(TINY, window=range(2, 4)) == pytest.approx((48 + 63) / 128)
    assert ideal_apc(TINY, window=range(1, 2)) == pytest.approx(32 / 50)
    assert ideal_apc(TINY, scope="session", window=range(1, 2)) == 0.0


def test_partial_blocks_count_when_listed() -> None:
    # a trace built with every hash id (partial last block included) gets it counted, capped
    trace = make_trace([("a", 40, (1, 2, 3)), ("a", 40, (1, 2, 3))])
    assert ideal_apc(trace) == pytest.approx(39 / 80)


def test_no_session_never_hits_in_session_scope() -> None:
    trace = make_trace([("", 32, (1, 2)), ("", 32, (1, 2))])
    assert ideal_apc(trace) == pytest.approx(31 / 64)
    assert ideal_apc(trace, scope="session") == 0.0


def test_edge_cases() -> None:
    assert ideal_apc(make_trace([])) == 0.0
    assert ideal_apc(TINY, window=range(0)) == 0.0
    with pytest.raises(ValueError, match="outside"):
        ideal_apc(TINY, window=range(2, 5))
    with pytest.raises(ValueError, match="scope"):
        ideal_apc(TINY, scope="trace")  # type: ignore[arg-type]


def naive_matched(ids: tuple[int, ...], seen: set[int]) -> int:
    m = 0
    while m < len(ids) and ids[m] in seen:
        m += 1
    return m


def test_matched_blocks_exact_for_non_prefix_ids() -> None:
    assert matched_blocks((1, 2, 3, 4, 5), {1, 3}) == 1  # the search alone would say 3
    assert matched_blocks((3, 1, 2), {1, 3}) == 2
    assert matched_blocks((), {1}) == 0
    assert matched_blocks((1, 3), {1, 3}) == 2


@given(
    st.lists(st.integers(0, 6), max_size=12),
    st.sets(st.integers(0, 6)),
)
def test_matched_blocks_matches_a_linear_scan(ids: list[int], seen: set[int]) -> None:
    assert matched_blocks(tuple(ids), seen) == naive_matched(tuple(ids), seen)


@st.composite
def prefix_id_traces(draw: st.DrawFn) -> Trace:
    """Each call extends a prefix of an earlier call with fresh ids (so ids are prefix ids)."""
    n = draw(st.integers(0, 25))
    next_id = 0
    prompts: list[tuple[int, ...]] = []
    calls: list[tuple[str, int, tuple[int, ...]]] = []
    for _ in range(n):
        base: tuple[int, ...] = ()
        extend = draw(st.booleans())
        if prompts and extend:
            parent = draw(st.sampled_from(prompts))
            base = parent[: draw(st.integers(0, len(parent)))]
        fresh = draw(st.integers(0, 4))
        ids = base + tuple(range(next_id, next_id + fresh))
        next_id += fresh
        prompts.append(ids)
        tail = draw(st.integers(0, BT - 1))
        inp = max(1, len(ids) * BT + tail)
        calls.append((draw(st.sampled_from(["", "a", "b", "c"])), inp, ids))
    return make_trace(calls)


def reference_apc(trace: Trace, scope: str) -> tuple[int, int]:
    """ΣH, ΣP by longest common prefix with any earlier (same-session) prompt, O(n²)."""
    hits = prompt = 0
    for i, c in enumerate(trace.calls):
        best = 0
        for e in trace.calls[:i]:
            if scope == "session" and (not c.session or e.session != c.session):
                continue
            k = 0
            while k < min(len(c.block_ids), len(e.block_ids)) and c.block_ids[k] == e.block_ids[k]:
                k += 1
            best = max(best, k)
        hits += max(0, min(best * trace.block_tokens, c.input_tokens - 1))
        prompt += c.input_tokens
    return hits, prompt


@settings(max_examples=200, deadline=None)
@given(prefix_id_traces(), st.data())
def test_generated_traces(trace: Trace, data: st.DataObject) -> None:
    g = ideal_apc(trace, scope="global")
    s = ideal_apc(trace, scope="session")
    assert 0.0 <= s <= g < 1.0
    for scope, value in (("global", g), ("session", s)):
        hits, prompt = reference_apc(trace, scope)
        assert value == pytest.approx(hits / prompt if prompt else 0.0)
    n = len(trace.calls)
    cut = data.draw(st.integers(0, n))
    p1 = sum(c.input_tokens for c in trace.calls[:cut])
    p2 = sum(c.input_tokens for c in trace.calls[cut:])
    if n:
        left = ideal_apc(trace, window=range(cut)) if cut else 0.0
        right = ideal_apc(trace, window=range(cut, n)) if cut < n else 0.0
        assert g * (p1 + p2) == pytest.approx(left * p1 + right * p2)


def test_ttft_floor_prefills_only_what_no_cache_could_serve() -> None:
    latency = load_latency()
    floor = ttft_floor(TINY, latency, chunk_tokens=8192, window=[False, True, True, True])
    # calls 1-3 prefill 50-32, 64-48 and 64-63 new tokens on 32, 48 and 63 cached ones
    seconds = sorted(latency.prefill_scalar(n, h) for n, h in ((18, 32), (16, 48), (1, 63)))
    assert floor["p50"] == pytest.approx(seconds[1])
    assert seconds[1] < floor["p90"] < floor["p99"] < seconds[2]
    assert ttft_floor(TINY, latency, 8192, [False] * 4) == {}
    with pytest.raises(ValueError, match="window mask"):
        ttft_floor(TINY, latency, 8192, [True])
