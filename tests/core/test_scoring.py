"""The compiled scoring kernels against the numpy reference: the same inputs, bit-identical
floats and the same picks, function by function and decision by decision for every policy."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsched.core import _scoring, recording, scoring
from kvsched.core.cluster import ClusterConfig, ClusterState, Role, build_cluster
from kvsched.core.cost import (
    fetch_from,
    fetch_when_cheaper,
    isolated_floor_s,
    moving_terms,
    pool_load,
    ttft_terms,
)
from kvsched.core.decision import RequestInfo
from kvsched.core.index import Tier
from kvsched.core.load import LoadReport
from kvsched.core.migration import MigrationPlanner
from kvsched.core.pickers import argmin_eligible, masked_min
from kvsched.core.policies import ALL_POLICIES, POLICIES, make_policy, parse_spec
from kvsched.core.policies.elastic_cold_score import cold_score
from kvsched.core.request_view import RequestView, hit_vectors, request_view
from kvsched.core.scoring import Kernels
from kvsched.core.topology import TopologyConfig

# Finite, never -0.0 (numpy's own loops may order signed zeros differently; no score makes one).
tokens = st.integers(0, 40_000).map(float) | st.floats(0.0, 1e6).map(lambda x: x + 0.0)
seconds = st.floats(0.0, 10.0).map(lambda x: x + 0.0)
# 1 to 80 slots: past 64 (a machine word), past numpy's 8- and 16-element unrolled blocks.
sizes = st.integers(1, 80)


COMPILED = scoring.load_kernels()
KERNELS = (None, COMPILED)  # the reference, then the compiled kernels


def both(fn: Callable[[Kernels | None], Any]) -> tuple[Any, Any]:
    """`fn`'s result with the reference kernels (None) and with the compiled ones."""
    return fn(None), fn(COMPILED)


def scoring_with(kernels: Kernels | None, cluster: ClusterState, view: RequestView) -> RequestView:
    """`cluster` made to score with `kernels` (its cost model's), and `view` with them."""
    cluster.cost = replace(cluster.cost, kernels=kernels)
    return replace(view, kernels=kernels)


def assert_identical(a: Any, b: Any, where: str = "") -> None:
    """Equal structure, dtypes and bits (a float's sign and every last digit included)."""
    if isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray), where
        assert a.dtype == b.dtype and a.shape == b.shape, where
        assert a.tobytes() == b.tobytes(), f"{where}: {a} != {b}"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), where
        for key in a:
            assert_identical(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, tuple):
        assert isinstance(b, tuple) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_identical(x, y, f"{where}[{i}]")
    elif isinstance(a, float):
        assert type(b) is float and np.float64(a).tobytes() == np.float64(b).tobytes(), where
    else:
        assert type(a) is type(b) and a == b, f"{where}: {a!r} != {b!r}"


def cluster_of(
    n: int,
    chunk: int,
    roles: tuple[Role, ...] = (),
    prefill_ctx_s: float = 0.0,
    *,
    pure: bool = False,
) -> ClusterState:
    # Two instances a node: slots sit at every distance, so each transfer row differs.
    topology = TopologyConfig(instances_per_node=2, nodes_per_rack=2, racks_per_spine=2)
    config = ClusterConfig(n_instances=n, chunk_tokens=chunk, topology=topology, roles=roles)
    cluster = build_cluster(config, pure=pure)
    if prefill_ctx_s:  # a server profile's term (the GPU profiles have none)
        latency = replace(cluster.cost.latency, prefill_ctx_s=prefill_ctx_s)
        cluster.cost = replace(cluster.cost, latency=latency)
    return cluster


@st.composite
def scenes(draw: st.DrawFn) -> tuple[ClusterState, RequestView]:
    """A cluster with drawn loads and a request view with drawn hits and candidates."""
    n = draw(sizes)
    chunk = draw(st.sampled_from([16, 512, 8192]))
    cluster = cluster_of(n, chunk, prefill_ctx_s=draw(st.sampled_from([0.0, 1.36e-6])))
    for slot in range(n):
        report = LoadReport(
            draw(st.integers(0, 50_000)),
            draw(seconds),
            draw(st.integers(0, 4)),
            draw(st.integers(0, 300)),
            draw(st.integers(0, 2_000_000)),
            draw(st.integers(0, 50_000)),
        )
        cluster.load.report(slot, report)
    vec = st.lists(tokens, min_size=n, max_size=n).map(np.array)
    hits = draw(vec)
    eligible = np.array(draw(st.lists(st.booleans(), min_size=n, max_size=n)))
    eligible[draw(st.integers(0, n - 1))] = True
    prompt = draw(st.integers(1, 2_000_000))
    req = RequestInfo(1, prompt, draw(st.integers(0, 4096)), (), "s")
    # Some of the hits only in the node's pool (loaded over the host link), or none anywhere.
    pool = np.minimum(draw(vec), hits) if draw(st.booleans()) else None
    return cluster, RequestView(req, eligible, hits / 16, hits, 0, None, pool)


@settings(deadline=None)  # an example builds a cluster: its time varies on a shared machine
@given(scenes(), st.booleans(), st.data())
def test_ttft_terms_are_bit_identical(
    scene: tuple[ClusterState, RequestView], with_transfer: bool, data: st.DataObject
) -> None:
    cluster, view = scene
    transfer = None
    if with_transfer:
        transfer = np.array(data.draw(st.lists(seconds, min_size=cluster.n, max_size=cluster.n)))

    def run(kernels: Kernels | None) -> tuple[dict[str, Any], float]:
        scored = scoring_with(kernels, cluster, view)
        terms = ttft_terms(cluster.cost, cluster.load, scored, scored.hit_tokens, transfer)
        return terms, isolated_floor_s(scored, terms)

    ref, got = both(run)
    assert_identical(ref[0], got[0], "terms")
    assert_identical(ref[1], got[1], "floor")


@settings(deadline=None)
@given(scenes(), st.data())
def test_moving_and_fetching_terms_are_bit_identical(
    scene: tuple[ClusterState, RequestView], data: st.DataObject
) -> None:
    cluster, view = scene
    slot = data.draw(st.integers(0, cluster.n - 1))
    load, hits, prompt = cluster.load, view.hit_tokens, view.req.prompt_tokens
    planner = MigrationPlanner(cluster, by_ttft=True, t_hot_tokens=0.0, min_gain_s=0.0)
    context = data.draw(st.integers(0, 2_000_000))
    fetch = np.array(data.draw(st.lists(st.booleans(), min_size=cluster.n, max_size=cluster.n)))

    def run(kernels: Kernels | None) -> dict[str, Any]:
        scored = scoring_with(kernels, cluster, view)
        cost = cluster.cost
        return {
            "moving": moving_terms(cost, load, scored, slot),
            "fetch_when_cheaper": tuple(
                fetch_when_cheaper(cost, slot, prompt, hits, scored.eligible)
            ),
            "candidates": planner.candidates(scored.eligible, slot, context),
            "fetch_from": tuple(fetch_from(cost, slot, hits, fetch)),
        }

    assert_identical(*both(run), "terms")


@settings(deadline=None)
@given(scenes(), st.data())
def test_cold_scores_and_best_slots_are_identical(
    scene: tuple[ClusterState, RequestView], data: st.DataObject
) -> None:
    cluster, view = scene
    n = cluster.n
    terms = ttft_terms(cluster.cost, cluster.load, view, view.hit_tokens)
    resident = np.array(data.draw(st.lists(tokens, min_size=n, max_size=n)))
    context = data.draw(st.integers(0, 100_000))
    capacity = data.draw(st.sampled_from([0.0, 50_000.0, 1e9]))
    pending = cluster.load.pending_prefill_s

    def score(kernels: Kernels | None) -> tuple[Any, ...]:
        out = cold_score(
            terms, pending, view.eligible, resident=resident, context_tokens=context,
            capacity_tokens=capacity, kernels=kernels,
        )  # fmt: skip
        return (*out, out[1] is view.eligible)  # none fits: the eligible mask itself

    assert_identical(*both(score), "cold_score")
    # Few distinct hits, so the longest is often tied.
    few = data.draw(st.lists(st.sampled_from([0.0, 1.0, 3.0]), min_size=n, max_size=n))
    tied = RequestView(view.req, view.eligible, np.array(few), np.array(few) * 16, 0, None)

    def best(kernels: Kernels | None) -> tuple[int, int]:
        return replace(view, kernels=kernels).best_slot, replace(tied, kernels=kernels).best_slot

    assert_identical(*both(best), "best_slot")


@st.composite
def tied_vectors(draw: st.DrawFn) -> tuple[list[float], list[float], list[float], list[bool]]:
    # Three values only, so ties are common and the tie-breaks decide.
    n = draw(sizes)
    few = st.lists(st.sampled_from([0.0, 1.0, 2.5]), min_size=n, max_size=n)
    return draw(few), draw(few), draw(few), draw(st.lists(st.booleans(), min_size=n, max_size=n))


@settings(deadline=None)
@given(tied_vectors(), st.integers(0, 2))
def test_picks_are_the_same_ties_and_all(
    vectors: tuple[list[float], list[float], list[float], list[bool]], n_keys: int
) -> None:
    values, first, second, mask = vectors
    arrays = np.array(values), np.array(first), np.array(second)
    eligible = np.array(mask)
    keys = arrays[1 : 1 + n_keys]
    if not eligible.any():
        for kernels in KERNELS:
            with pytest.raises(ValueError):
                argmin_eligible(arrays[0], eligible, *keys, kernels=kernels)
            with pytest.raises(ValueError):
                masked_min(arrays[0], eligible, kernels=kernels)
        return
    argmin = both(lambda kernels: argmin_eligible(arrays[0], eligible, *keys, kernels=kernels))
    assert_identical(*argmin, "argmin")
    least = both(lambda kernels: masked_min(arrays[0] - arrays[1], eligible, kernels=kernels))
    assert_identical(*least, "min")


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 70), st.data())
def test_request_views_are_identical(n: int, data: st.DataObject) -> None:
    cluster = cluster_of(n, 8192)
    slots = st.integers(0, n - 1)
    base = list(range(1, 41))
    for _ in range(data.draw(st.integers(0, 12))):
        cut = data.draw(st.integers(1, 40))
        tier = data.draw(st.sampled_from([Tier.GPU, Tier.CPU]))
        cluster.index.store(data.draw(slots), base[:cut], None, tier)
    if data.draw(st.booleans()):
        cluster.index.speculate(data.draw(slots), base[: data.draw(st.integers(1, 40))], 1.0)
    prompt = data.draw(st.integers(1, 50 * 16))
    req = RequestInfo(1, prompt, 16, (*base, 99, 98), None)

    def view(kernels: Kernels | None) -> RequestView:
        cluster.cost = replace(cluster.cost, kernels=kernels)
        return request_view(cluster, req, 0.0)

    ref, got = both(view)
    for name in ("eligible", "hit_blocks", "hit_tokens", "max_blocks", "pool_tokens"):
        assert_identical(getattr(ref, name), getattr(got, name), name)


@settings(deadline=None)
@given(
    st.integers(0, 80),
    st.lists(st.dictionaries(st.integers(0, 79), st.integers(0, 5000)), max_size=3),
    st.sampled_from([1, 16, 64]),
    st.integers(0, 80_000),
)
def test_hit_vectors_are_identical(
    n: int, matches: list[dict[int, int]], block_size: int, cap: int
) -> None:
    kept = tuple({slot: count for slot, count in m.items() if slot < n} for m in matches)
    ref = hit_vectors(n, kept, block_size, cap)
    got = _scoring.hit_vectors(n, kept, block_size, cap)
    assert_identical(ref, got, "hit vectors")
    _, tokens, pool = ref
    if pool is not None:  # the pool adds to the GPU's hit
        assert pool.any() and (pool >= 0).all() and (pool <= tokens).all()


@settings(deadline=None)
@given(scenes(), st.data())
def test_pool_loads_are_identical(
    scene: tuple[ClusterState, RequestView], data: st.DataObject
) -> None:
    cluster, view = scene
    n = cluster.n
    pool = np.minimum(
        np.array(data.draw(st.lists(tokens, min_size=n, max_size=n))), view.hit_tokens
    )
    prefill = np.array(data.draw(st.lists(seconds, min_size=n, max_size=n)))
    ref, got = both(
        lambda kernels: pool_load(replace(cluster.cost, kernels=kernels), pool, prefill)
    )
    assert_identical(ref, got, "pool load")
    load, wait = ref
    assert (wait <= load).all()  # the prefill hides some of the load, never adds to it


def test_the_kernels_take_the_vectors_policies_hand_them() -> None:
    # Else the tests above would pass on the reference twice.
    cluster = cluster_of(5, 8192)
    cluster.index.store(2, [1, 2, 3], None)
    view = request_view(cluster, RequestInfo(1, 100, 16, (1, 2, 3, 4), None), 0.0)
    cost, load, hits = cluster.cost, cluster.load, view.hit_tokens
    consts = cost.kernel_constants
    queue = load.pending_prefill_s
    ttft = _scoring.ttft(100.0, hits, load.running, load.decode_tokens, queue, None, consts)
    assert isinstance(ttft, tuple) and list(ttft[1]) == [0.0] * 5
    assert isinstance(_scoring.moving(2, hits, cost.setup_s, cost.s_per_byte, 1.0), tuple)
    fetch = _scoring.fetch_when_cheaper(
        2, 100.0, hits, view.eligible, cost.setup_s, cost.s_per_byte, consts, 0.0
    )
    assert isinstance(fetch, tuple) and fetch[0].dtype == np.bool_
    assert isinstance(
        _scoring.fetch_from(2, hits, fetch[0], cost.setup_s, cost.s_per_byte, 1.0), tuple
    )
    numpy_slot = np.int64(2)  # a slot may come out of numpy
    assert isinstance(_scoring.moving(numpy_slot, hits, cost.setup_s, cost.s_per_byte, 1.0), tuple)  # type: ignore[arg-type]
    assert _scoring.argmin(-hits, view.eligible, (load.in_flight,)) == 2
    assert _scoring.masked_min(hits, view.eligible) == 0.0
    assert _scoring.best_slot(view.hit_blocks, view.eligible) == 2
    score = _scoring.cold_score(hits, hits, hits, view.eligible, hits, 10.0, 1e9)
    assert isinstance(score, tuple) and score[1] is not view.eligible
    found = _scoring.candidates(view.eligible, load.free_blocks, 16, 50.0, hits, 2)
    assert isinstance(found, np.ndarray) and list(found) == [True, True, False, True, True]
    assert list(view.hit_blocks) == [0, 0, 3, 0, 0]


def test_other_vectors_fall_back_to_the_reference() -> None:
    # Integer, strided or read-only vectors are not the kernels' kind: the reference runs.
    values = np.array([3, 1, 2, 1])
    eligible = np.array([True, True, True, True])
    strided = np.array([5.0, 0.0, 1.0, 0.0, 1.0, 0.0, 0.5, 0.0])[::2]
    for kernels in KERNELS:
        assert argmin_eligible(values, eligible, kernels=kernels) == 1
        assert argmin_eligible(strided, eligible, strided, kernels=kernels) == 3
        assert masked_min(strided, eligible, kernels=kernels) == 0.5
    assert _scoring.masked_min(values, eligible) is NotImplemented
    assert _scoring.argmin(strided, eligible, ()) is NotImplemented


def test_the_kernels_refuse_mismatched_vectors_and_slots() -> None:
    eligible = np.ones(3, dtype=bool)
    with pytest.raises(ValueError, match="vectors of 4 and 3 slots"):
        _scoring.masked_min(np.zeros(4), eligible)
    cost = cluster_of(3, 8192).cost
    with pytest.raises(IndexError, match="slot 3 of 3"):
        _scoring.moving(3, np.zeros(3), cost.setup_s, cost.s_per_byte, 1.0)
    with pytest.raises(IndexError, match="slot 5 of 2"):
        _scoring.hit_vectors(2, ({5: 1},), 16, 100)
    with pytest.raises(TypeError, match="takes 2 arguments"):
        _scoring.masked_min(np.zeros(3))  # type: ignore[call-arg]


def test_each_kind_of_argument_is_refused_as_the_kernels_always_have() -> None:
    # The kernels read their arguments through one opener: numbers and constants first, then
    # vectors, then the slot, then the transfer matrices' rows.
    cost, hits = cluster_of(3, 8192).cost, np.zeros(3)
    consts = cost.kernel_constants
    with pytest.raises(TypeError, match="constants: a tuple of 8 numbers"):
        _scoring.ttft(1.0, hits, hits, hits, hits, None, consts[:7])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="must be real number"):  # the number before the slot
        _scoring.moving(9, hits, cost.setup_s, cost.s_per_byte, "kv")  # type: ignore[arg-type]
    assert _scoring.moving(9, np.arange(3), cost.setup_s, cost.s_per_byte, 1.0) is NotImplemented  # type: ignore[arg-type]
    square = np.zeros((2, 2))  # a matrix of another size: the reference runs
    assert _scoring.fetch_from(0, hits, hits > 0, square, square, 1.0) is NotImplemented
    with pytest.raises(TypeError, match="fetch_when_cheaper takes 8 arguments"):
        _scoring.fetch_when_cheaper(0, 1.0, hits)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="tiebreaks: a tuple of vectors"):
        _scoring.argmin(hits, hits > -1, [hits])  # type: ignore[arg-type]
    assert _scoring.argmin(hits, hits > -1, (hits,) * 9) is NotImplemented
    with pytest.raises(ValueError, match="vectors of 3 and 2 slots"):
        _scoring.argmin(hits, hits > -1, (hits, hits[:2]))
    pool = cost.pool_constants  # read before the vectors, as the pool load always has
    with pytest.raises(TypeError, match="constants: a tuple of 4 numbers"):
        _scoring.pool_load(np.arange(3), hits, pool[:3])  # type: ignore[arg-type]
    assert _scoring.pool_load(np.arange(3), hits, pool) is NotImplemented  # type: ignore[arg-type]


def place_all(spec: str, seed: int, *, pure: bool) -> list[tuple[Any, ...]]:
    """Every decision of `spec` on a busy 16-instance cluster, with all of its terms, the core
    compiled or (`pure`) its references."""
    rng = random.Random(seed)
    name, params = parse_spec(spec)
    cluster = cluster_of(16, 8192, POLICIES[name].roles(16, params), pure=pure)
    policy = make_policy(spec, cluster)
    chains = [[rng.getrandbits(64) for _ in range(64)] for _ in range(12)]
    for chain in chains:
        cluster.index.store(rng.randrange(16), chain[: rng.randrange(1, 65)], None)
    for chain in chains[::3]:  # a node's pool holds some prefixes: both its instances do
        node = rng.randrange(4)
        for slot in range(2 * node, 2 * node + 2):
            cluster.index.store(slot, chain[: rng.randrange(1, 65)], None, Tier.CPU)
    for slot in range(16):
        load = LoadReport(rng.randrange(0, 30_000), rng.random(), 2, 8, 40_000, 20_000)
        cluster.load.report(slot, load)
    out: list[tuple[Any, ...]] = []
    for i in range(60):
        prompt = rng.choice(chains)[: rng.randrange(1, 65)] + [rng.getrandbits(64)] * 4
        req = RequestInfo(i, len(prompt) * 16 + 3, 64, tuple(prompt), f"s{i % 7}")
        try:
            d = recording.place(cluster, policy, req, i * 0.05, rng)
        except ValueError as exc:  # e.g. no decode instance with room: both must say so
            out += [(str(exc),), ("", 0.0, True), ()]
            continue
        out.append((d.instance, d.decode_instance, d.cached_tokens, d.fetched_tokens))
        out.append((d.rule, d.estimated_ttft_s, d.rejected, d.retry_after_s, d.terms))
        out.append(tuple((t.kind, t.source, t.target, t.est_seconds) for t in d.transfers))
    return out


@pytest.mark.parametrize("spec", ALL_POLICIES)
def test_every_policy_decides_bit_identically(spec: str) -> None:
    ref, got = both(lambda kernels: place_all(spec, 7, pure=kernels is None))
    assert_identical(tuple(ref), tuple(got), spec)
    assert any(row[0] != "" and not row[2] for row in ref[1::3]), "no placement was made"


def test_a_cluster_scores_as_it_was_built_and_keeps_it_as_its_cost_model_changes() -> None:
    assert COMPILED is _scoring and scoring.load_kernels(pure=True) is None
    pure, compiled = cluster_of(4, 8192, pure=True), cluster_of(4, 8192)
    assert pure.cost.kernels is None and not pure.index.compiled
    assert compiled.cost.kernels is _scoring and compiled.index.compiled
    compiled.add_instance(3, Role.BOTH, node=0)  # a new topology: a new cost model
    measured = compiled.cost.with_measured_transfer(0, 3, 1 << 20, 0.01)
    assert compiled.cost.kernels is measured.kernels is _scoring
