"""Many models in one cluster: a request is placed only on instances that serve its model, and
what another model's instances hold counts for nothing (two models' blocks of the same tokens
hash alike), for every policy."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvsched.core.cluster import ClusterConfig, Role
from kvsched.core.decision import Completion
from kvsched.core.events import BlocksStored
from kvsched.core.policies import ALL_POLICIES, POLICIES
from kvsched.core.scheduler import Scheduler
from tests.conftest import chain, request

N = 8
MODELS = ("llama", "qwen")  # slots 0-3 serve the first, 4-7 the second


def two_models(spec: str) -> Scheduler:
    core = Scheduler(ClusterConfig(n_instances=N), spec, seed=3, max_prompt_tokens=131_072)
    roles = POLICIES[spec].roles(N // 2)
    for slot in range(N):
        core.add_instance(slot, Role(roles[slot % (N // 2)]), model=MODELS[slot // (N // 2)])
    # The first model's first instance holds a long prefix that the second model's requests
    # share token for token: it must not draw them.
    core.apply(0, [BlocksStored(chain(9, 40))])
    return core


def served_by(slot: int) -> str:
    return MODELS[slot // (N // 2)]


@pytest.mark.parametrize("spec", ALL_POLICIES)
def test_a_request_runs_where_its_model_is_served_and_moves_no_other_models_kv(
    spec: str,
) -> None:
    core = two_models(spec)
    for i in range(24):
        model = MODELS[i % 2]
        hashes = chain(9, 40)[: 20 + i] if i % 3 else chain(100 + i, 12)
        req = replace(request(i + 1, hashes, session=f"s{i % 5}-{model}"), model=model)
        decision = core.place(req, float(i))
        if decision.rejected:
            continue
        assert served_by(decision.instance) == model, (i, decision)
        if decision.decode_instance >= 0:
            assert served_by(decision.decode_instance) == model
        for plan in decision.transfers:
            assert served_by(plan.source) == served_by(plan.target) == model, plan
        if i == 1:  # the second model's first request of the shared chain
            assert decision.cached_tokens == 0  # the first model's blocks are no hit
        done = Completion(req.request_id, req.session_id, decision.instance,
                          decision.decode_instance, req.prompt_tokens, 16, decision.cached_tokens,
                          req.block_hashes, float(i), float(i) + 0.2, float(i) + 0.5)  # fmt: skip
        for plan in core.finish(done, float(i) + 0.5):  # a session moved in its idle gap
            assert served_by(plan.source) == served_by(plan.target) == model, plan


def test_a_request_naming_no_model_may_run_anywhere() -> None:
    core = two_models("cache_aware")
    decision = core.place(request(1, chain(9, 40)), 0.0)
    assert decision.instance == 0 and decision.cached_tokens > 0


def test_one_model_in_the_cluster_changes_no_decision() -> None:
    plain = Scheduler(ClusterConfig(n_instances=4), "elastic", seed=3, max_prompt_tokens=131_072)
    named = Scheduler(ClusterConfig(n_instances=4), "elastic", seed=3, max_prompt_tokens=131_072)
    for slot in range(4):
        plain.add_instance(slot, Role.BOTH)
        named.add_instance(slot, Role.BOTH, model="llama")
    for core in (plain, named):
        core.apply(1, [BlocksStored(chain(9, 40))])
    for i in range(12):
        req = request(i + 1, chain(9, 40)[: 10 + i], session=f"s{i % 3}")
        a, b = plain.place(req, float(i)), named.place(replace(req, model="llama"), float(i))
        assert (a.instance, a.cached_tokens, a.rule, a.transfers) == (
            b.instance, b.cached_tokens, b.rule, b.transfers,
        )  # fmt: skip
