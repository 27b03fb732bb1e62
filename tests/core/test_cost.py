"""The cost functions policies score by: TTFT terms and the fetch-or-recompute rule."""

from __future__ import annotations

import numpy as np

from kvsched.core.cost import fetch_from, fetch_when_cheaper, isolated_floor_s, ttft_terms
from kvsched.core.request_view import request_view
from tests.conftest import chain, make_cluster, request, set_load


def test_ttft_terms_add_up_term_by_term() -> None:
    cluster = make_cluster(3)
    hashes = chain(1, 100)
    cluster.index.store(1, hashes[:60], None)
    set_load(cluster, 2, pending=50_000)
    view = request_view(cluster, request(1, hashes))
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
    view = request_view(cluster, request(1, system + chain(5, 10)))
    long = fetch_when_cheaper(
        cluster.cost, 0, view.req.prompt_tokens, view.hit_tokens, view.eligible
    )
    assert list(long.fetch) == [False, True, True]  # never the holder itself
    assert list(long.cached) == [300 * 16] * 3
    assert long.transfer_s[0] == 0 and long.transfer_s[1] > 0
    small = make_cluster(3)
    small.index.store(0, system[:2], None)  # 32 tokens: the link's setup costs more
    view = request_view(small, request(2, system[:2] + chain(5, 10)))
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
    view = request_view(cluster, request(1, hashes + chain(2, 5)))
    prefix = fetch_from(cluster.cost, 0, view.hit_tokens, np.array([False, True, False]))
    assert list(prefix.cached) == [1600.0, 1600.0, 0.0]
    assert prefix.transfer_s[1] == cluster.cost.transfer_s(0, 1, 60 * 16)
    assert prefix.transfer_s[2] == 0.0
