"""`sglang`: SGLang's cache-aware router, pinned to its own unit tests (cache_aware.rs's
balanced and imbalanced cases, tree.rs's smallest tenant) and to its approximate tree: it
believes what it routed, not what the engine kept."""

from __future__ import annotations

from random import Random

from kvsched.core import recording
from kvsched.core.decision import RequestInfo
from kvsched.core.policies import make_policy
from kvsched.core.policies.sglang import Sglang
from tests.conftest import chain, make_cluster, request


def sglang(n: int, **params: float) -> Sglang:
    policy = make_policy("sglang", make_cluster(n), params)
    assert isinstance(policy, Sglang)
    return policy


def place(policy: Sglang, req: RequestInfo, now: float = 0.0) -> int:
    return recording.place(policy.cluster, policy, req, now, Random(0)).instance


def test_balanced_load_the_same_text_and_its_prefix_go_where_it_went() -> None:
    """`test_cache_aware_with_balanced_load`: "hello world" twice, then "hello", all on the
    first one's worker (the prefix matches wholly: rate 1 > 0.3)."""
    policy = sglang(2)
    hello_world = chain(1, 10)
    first = place(policy, request(1, hello_world))
    assert place(policy, request(2, hello_world)) == first
    assert place(policy, request(3, hello_world[:5], prompt=5 * 16)) == first


def test_imbalanced_load_goes_to_the_least_loaded_and_still_enters_the_tree() -> None:
    """`test_cache_aware_with_imbalanced_load` (abs threshold 5, rel 2.0; worker 1 at load 20,
    worker 2 at 0): every request goes to worker 2, and the tree learns it."""
    policy = sglang(2, balance_abs_threshold=5, balance_rel_threshold=2.0, cache_threshold=0.5)
    cluster = policy.cluster
    for _ in range(20):
        cluster.load.charge(0, 0, 0.0, 0)
    text = chain(3, 4)
    policy.tree.add(0, "earlier", text, 0.0, subsume=True)  # worker 1 even holds the text
    for rid in range(5):
        assert place(policy, request(rid, text)) == 1
    assert policy.tree.shared(1, text) == len(text)


def test_a_low_match_goes_to_the_smallest_tree() -> None:
    """`test_get_smallest_tenant`: tenant 1 holds 6 characters, tenant 2 holds 3; a request
    matching neither goes to tenant 2."""
    policy = sglang(2)
    policy.tree.add(0, "apricot", chain(1, 6), 0.0, subsume=True)
    policy.tree.add(1, "cat", chain(2, 3), 0.0, subsume=True)
    assert place(policy, request(1, chain(3, 8))) == 1


def test_the_tree_believes_what_it_routed_not_what_the_engine_kept() -> None:
    """The engine evicted the prefix (its events say so): `cache_aware`, on the event-fed
    index, no longer sees a match; `sglang` still routes to where it sent the text."""
    policy = sglang(2)
    cluster = policy.cluster
    prompt = chain(1, 10)
    host = place(policy, request(1, prompt))
    cluster.index.store(host, prompt, None)
    cluster.index.remove(host, prompt)
    policy.tree.add(1 - host, "other", chain(2, 40), 0.0, subsume=True)  # a smaller tree there?
    assert place(policy, request(2, prompt)) == host


def test_the_tree_is_trimmed_to_its_budget_at_the_eviction_interval() -> None:
    # 2 blocks of 16 tokens at 4 characters a token: a 128-character budget.
    policy = sglang(1, max_tree_chars=128, eviction_interval_s=120)
    place(policy, request(1, chain(1, 10)), now=0.0)
    place(policy, request(2, chain(2, 10)), now=60.0)
    assert policy.tree.size(0) == 20  # no pass yet
    place(policy, request(3, chain(3, 1), prompt=16), now=120.0)
    # The pass ran before request 3 was inserted: 2 blocks were left, then 1 more.
    assert policy.tree.size(0) == 3
    assert policy.tree.shared(0, chain(2, 10)) == 2 and policy.tree.shared(0, chain(1, 10)) == 0
