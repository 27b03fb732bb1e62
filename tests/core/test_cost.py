"""The cost functions policies score by: TTFT terms, the load from the node's pool and the
fetch-or-recompute rule."""

from __future__ import annotations

import numpy as np
import pytest

from kvsched.core.cluster import ClusterConfig, ClusterState, build_cluster
from kvsched.core.cost import (
    fetch_from,
    fetch_when_cheaper,
    isolated_floor_s,
    pool_load,
    ttft_terms,
)
from kvsched.core.cost_model import default_pool_link
from kvsched.core.index import Tier
from kvsched.core.request_view import request_view
from kvsched.core.topology import LinkClass
from tests.conftest import chain, make_cluster, request, set_load


def test_ttft_terms_add_up_term_by_term() -> None:
    cluster = make_cluster(3)
    hashes = chain(1, 100)
    cluster.index.store(1, hashes[:60], None)
    set_load(cluster, 2, pending=50_000)
    view = request_view(cluster, request(1, hashes), 0.0)
    terms = ttft_terms(cluster.cost, cluster.load, view, view.hit_tokens)
    assert list(terms["transfer_s"]) == [0.0, 0.0, 0.0]  # no transfer unless given one
    assert list(terms["cached_tokens"]) == [0.0, 60 * 16, 0.0]
    assert terms["queue_s"][2] > 0 and terms["queue_s"][0] == 0
    assert terms["prefill_s"][1] < terms["prefill_s"][0]  # the hit is not recomputed
    assert np.array_equal(terms["ttft_s"], terms["queue_s"] + terms["prefill_s"])
    transfer = np.array([0.0, 0.5, 0.0])
    moved = ttft_terms(cluster.cost, cluster.load, view, view.hit_tokens, transfer)
    assert moved["ttft_s"][1] == terms["ttft_s"][1] + 0.5
    assert isolated_floor_s(view, terms) == float(np.min(terms["prefill_s"]))


def test_a_long_prefix_is_fetched_and_a_short_one_recomputed() -> None:
    cluster = make_cluster(3)
    system = chain(9, 300)  # 4.8K tokens: copying beats recomputing
    cluster.index.store(0, system, None)
    view = request_view(cluster, request(1, system + chain(5, 10)), 0.0)
    long = fetch_when_cheaper(
        cluster.cost, 0, view.req.prompt_tokens, view.hit_tokens, view.eligible
    )
    assert list(long.fetch) == [False, True, True]  # never the holder itself
    assert list(long.cached) == [300 * 16] * 3
    assert long.transfer_s[0] == 0 and long.transfer_s[1] > 0
    small = make_cluster(3)
    small.index.store(0, system[:2], None)  # 32 tokens: the link's setup costs more
    view = request_view(small, request(2, system[:2] + chain(5, 10)), 0.0)
    short = fetch_when_cheaper(
        small.cost, 0, view.req.prompt_tokens, view.hit_tokens, view.eligible
    )
    assert not short.fetch.any() and not short.transfer_s.any()
    assert list(short.cached) == [32.0, 0.0, 0.0]


def test_fetch_from_prices_the_missing_part_only_where_asked() -> None:
    cluster = make_cluster(3)
    hashes = chain(1, 100)
    cluster.index.store(0, hashes, None)
    cluster.index.store(1, hashes[:40], None)
    view = request_view(cluster, request(1, hashes + chain(2, 5)), 0.0)
    prefix = fetch_from(cluster.cost, 0, view.hit_tokens, np.array([False, True, False]))
    assert list(prefix.cached) == [1600.0, 1600.0, 0.0]
    assert prefix.transfer_s[1] == cluster.cost.transfer_s(0, 1, 60 * 16)
    assert prefix.transfer_s[2] == 0.0


# ---- loading a prefix from the node's pool -------------------------------------------------


def pooled_cluster(n: int = 3) -> ClusterState:
    """`n` instances on one node whose pool link moves 1 GB/s with no setup (round figures)."""
    return build_cluster(ClusterConfig(n_instances=n, pool_link=LinkClass(1e9, 0.0)))


def test_a_pool_only_prefix_costs_more_than_a_gpu_hit_and_less_than_a_cold_start() -> None:
    cluster = make_cluster(3)
    hashes = chain(1, 100)
    cluster.index.store(0, hashes, None)  # in slot 0's GPU memory
    cluster.index.store(1, hashes, None, Tier.CPU)  # only in slot 1's node pool
    cluster.index.store(1, hashes[:30], None)  # of which its GPU memory keeps the first 30
    view = request_view(cluster, request(1, hashes + chain(2, 10)), 0.0)
    assert view.pool_tokens is not None
    assert list(view.pool_tokens) == [0.0, 70 * 16, 0.0]
    assert list(view.hit_tokens) == [1600.0, 1600.0, 0.0]  # any tier's hit is a hit
    terms = ttft_terms(cluster.cost, cluster.load, view, view.hit_tokens)
    link = cluster.cost.pool_link
    kv = cluster.cost.kv_bytes_per_token
    assert terms["load_s"][1] == pytest.approx(
        link.setup_s + 70 * 16 * kv / link.bandwidth_bytes_per_s
    )
    assert terms["load_s"][0] == terms["load_s"][2] == 0.0
    assert terms["prefill_s"][0] == terms["prefill_s"][1]  # loaded tokens are not recomputed
    ttft = terms["ttft_s"]
    assert ttft[0] < ttft[1] < ttft[2]
    assert ttft[1] - ttft[0] == pytest.approx(terms["load_wait_s"][1])
    expected = terms["queue_s"] + terms["prefill_s"] + terms["transfer_s"] + terms["load_wait_s"]
    assert np.array_equal(ttft, expected)
    assert isolated_floor_s(view, terms) == float(np.min(terms["prefill_s"]))  # slot 0's


def test_the_load_overlaps_the_prefill_layer_by_layer() -> None:
    cost = pooled_cluster().cost
    kv, layers = cost.kv_bytes_per_token, cost.model.layers
    tokens = 1000.0
    load_s = tokens * kv / 1e9  # 0.131 s for Llama-3.1-8B's 128 KiB a token
    pool = np.array([tokens, tokens, 0.0])
    # Prefill-bound: only the first layer's load is not hidden.
    # Load-bound: the prefill hides all but its own last layer's share.
    prefill = np.array([1.0, 0.05, 1.0])
    load, wait = pool_load(cost, pool, prefill)
    assert load == pytest.approx([load_s, load_s, 0.0])
    assert wait[0] == pytest.approx(load_s / layers)
    assert wait[1] == pytest.approx(load_s - 0.05 + 0.05 / layers)
    assert wait[2] == 0.0  # nothing to load


def test_a_gpu_only_index_prices_no_load() -> None:
    cluster = make_cluster(3)
    hashes = chain(1, 10)
    cluster.index.store(0, hashes, None)
    cluster.index.store(1, hashes[:4], None, Tier.CPU)  # the pool holds less than the GPU
    cluster.index.store(1, hashes, None)
    view = request_view(cluster, request(1, hashes), 0.0)
    assert view.pool_tokens is None
    terms = ttft_terms(cluster.cost, cluster.load, view, view.hit_tokens)
    for name in ("pool_tokens", "load_s", "load_wait_s"):
        assert list(terms[name]) == [0.0, 0.0, 0.0], name


def test_the_pool_link_is_configuration() -> None:
    assert pooled_cluster().cost.pool_link == LinkClass(1e9, 0.0)
    assert make_cluster(1).cost.pool_link == default_pool_link()
    assert default_pool_link().bandwidth_bytes_per_s == 50e9  # PCIe Gen5 x16, achieved
    with pytest.raises(ValueError, match="pool link needs a positive bandwidth"):
        ClusterConfig(n_instances=1, pool_link=LinkClass(0.0, 0.0))
    with pytest.raises(ValueError, match="non-negative setup"):
        ClusterConfig(n_instances=1, pool_link=LinkClass(1e9, -1.0))


def test_the_isolated_floor_counts_the_load_it_cannot_hide() -> None:
    # Admission asks whether any instance could meet the SLO on an idle cluster: loading a
    # long pool-only prefix for a short prompt is part of that floor.
    cluster = make_cluster(3)
    hashes = chain(1, 6000)  # 96K tokens: their load outlasts the 80 new tokens' prefill
    cluster.index.store(1, hashes, None, Tier.CPU)
    view = request_view(cluster, request(1, hashes + chain(2, 5)), 0.0)
    terms = ttft_terms(cluster.cost, cluster.load, view, view.hit_tokens)
    wait = terms["load_wait_s"][1]
    assert wait > terms["prefill_s"][1]  # load-bound
    assert isolated_floor_s(view, terms) == terms["prefill_s"][1] + terms["transfer_s"][1] + wait
