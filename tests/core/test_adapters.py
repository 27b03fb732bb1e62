"""LoRA adapters: a request runs only where its adapter is held or can be loaded within the
engine's slots, a held adapter is cheaper than a load, and the placement says what to load
and unload, for every policy."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from kvsched.core.adapters import AdapterChange, AdapterReport, AdapterSlots
from kvsched.core.cluster import ClusterConfig, Role
from kvsched.core.decision import Completion, RequestInfo
from kvsched.core.events import BlocksStored
from kvsched.core.load import LoadReport
from kvsched.core.policies import ALL_POLICIES, POLICIES
from kvsched.core.scheduler import Scheduler
from tests.conftest import chain, request

N = 4
ADAPTER_BYTES = 30_000_000  # a rank-16 adapter of an 8B model's attention


def report(capacity: int, held: tuple[str, ...] = (), busy: tuple[str, ...] = ()) -> LoadReport:
    adapters = AdapterReport(capacity, frozenset(held), frozenset(busy))
    return LoadReport(0, 0.0, 0, 0, 0, 1000, adapters)


def for_adapter(req: RequestInfo, adapter: str) -> RequestInfo:
    return replace(req, adapter=adapter, adapter_bytes=ADAPTER_BYTES)


def cluster(spec: str, capacities: tuple[int, ...] = (0, 2, 2, 1)) -> Scheduler:
    core = Scheduler(ClusterConfig(n_instances=N), spec, seed=3, max_prompt_tokens=131_072)
    roles = POLICIES[spec].roles(N)
    for slot in range(N):
        core.add_instance(slot, Role(roles[slot]))
        core.apply(slot, [report(capacities[slot])])
    return core


# ---- the slots alone ---------------------------------------------------------------------------


def test_a_held_adapter_costs_nothing_a_loadable_one_its_load_and_no_slot_rules_out() -> None:
    slots = AdapterSlots(4)
    slots.report(0, AdapterReport(1, frozenset({"a"})))
    slots.report(1, AdapterReport(1, frozenset({"b"}), busy=frozenset({"b"})))
    slots.report(2, AdapterReport(2, frozenset({"b"})))
    slots.report(3, AdapterReport(1, frozenset({"b"})))  # "b" idle: it may leave for "a"
    able, seconds = slots.costs("a", 0.5, now=100.0)
    assert able.tolist() == [True, False, True, True]
    assert seconds.tolist() == [0.0, 0.0, 0.5, 1.0]


def test_a_load_takes_a_slot_at_once_and_is_said_until_a_report_shows_it() -> None:
    slots = AdapterSlots(1)
    slots.report(0, AdapterReport(1))
    assert slots.place(0, "a", 0.0) == AdapterChange(load="a")
    # The load is not yet seen: the slot is taken, and "a" is asked for again.
    assert slots.costs("b", 0.5, 1.0)[0].tolist() == [False]
    assert slots.place(0, "a", 1.0) == AdapterChange(load="a")
    slots.report(0, AdapterReport(1, frozenset({"a"})))
    assert slots.place(0, "a", 2.0) == AdapterChange()


def test_an_idle_adapter_is_unloaded_for_another_the_oldest_first_never_a_busy_or_recent_one() -> (
    None
):
    slots = AdapterSlots(1, grace_s=10.0)
    slots.report(0, AdapterReport(2, frozenset({"a", "b"})))
    slots.place(0, "a", 0.0)
    slots.place(0, "b", 5.0)
    assert slots.costs("c", 0.5, 9.0)[0].tolist() == [False]  # both placed within the grace
    assert slots.place(0, "c", 12.0) == AdapterChange(load="c", unload="a")
    slots.report(0, AdapterReport(2, frozenset({"b", "c"}), busy=frozenset({"b"})))
    # "c" is recent and "b" runs: nothing can make room.
    assert slots.costs("d", 0.5, 20.0)[0].tolist() == [False]
    slots.report(0, AdapterReport(2, frozenset({"b", "c"})))
    assert slots.place(0, "d", 30.0) == AdapterChange(load="d", unload="b")


def test_a_report_of_no_capacity_or_a_reset_slot_serves_no_adapter() -> None:
    slots = AdapterSlots(2)
    slots.report(0, AdapterReport(0))
    slots.report(1, AdapterReport(2, frozenset({"a"})))
    slots.reset(1)
    assert not slots.costs("a", 0.1, 0.0)[0].any()


# ---- placements, every policy ----------------------------------------------------------------


@pytest.mark.parametrize("spec", ALL_POLICIES)
def test_an_adapter_request_runs_only_where_the_adapter_fits_for_every_policy(spec: str) -> None:
    core = cluster(spec)
    adapters = core.cluster.adapters
    for i in range(12):
        now = 11.0 * i  # past the grace: an idle adapter may make room
        adapter = ("a", "b", "c")[i % 3]
        req = for_adapter(request(i + 1, chain(10 + i % 4, 8), session=f"s{i % 4}"), adapter)
        decision = core.place(req, now)
        if decision.rejected:
            continue
        for slot, change in (
            (decision.instance, decision.adapter_change),
            (decision.decode_instance, decision.decode_adapter_change),
        ):
            assert slot != 0, decision  # slot 0 serves no adapter
            held = adapters.holds(slot, now)
            assert adapter in held and len(held) <= adapters.capacity[slot]
            if change.load:  # what the Router loads, the engine then reports
                core.apply(slot, [report(adapters.capacity[slot], tuple(held))])
        done = Completion(req.request_id, req.session_id, decision.instance,
                          decision.decode_instance, req.prompt_tokens, 16, decision.cached_tokens,
                          req.block_hashes, now, now + 0.2, now + 0.5)  # fmt: skip
        core.finish(done, now + 0.5)


@pytest.mark.parametrize("spec", ALL_POLICIES)
def test_every_slot_in_use_rejects_for_a_while_and_never_overfills(spec: str) -> None:
    core = cluster(spec, capacities=(0, 1, 1, 1))
    for slot, name in ((1, "a"), (2, "b")):  # busy: their engines run them
        core.apply(slot, [report(1, (name,), (name,))])
    core.place(for_adapter(request(1, chain(1, 4)), "c"), 0.0)  # slot 3's, placed just now
    refused = core.place(for_adapter(request(2, chain(2, 4)), "d"), 4.0)
    assert refused.rejected and refused.rule == "adapter_slots_full"
    # Retried once "c" may leave (where it was placed: no prefill slot had room for it on
    # the disaggregated policies' roles, which refused it too).
    assert refused.retry_after_s in (core.cluster.adapters.grace_s - 4.0, 10.0)
    assert core.explain(for_adapter(request(3, chain(2, 4)), "d"), 4.0).rejected


def test_a_held_adapter_wins_over_a_load_and_the_load_is_a_ttft_term() -> None:
    core = cluster("elastic", capacities=(0, 2, 2, 2))
    core.apply(2, [report(2, ("a",))])
    req = for_adapter(request(1, chain(1, 4), session="s"), "a")
    explained = core.explain(req, 0.0)
    rows = {row["instance"]: row for row in explained.explain()}
    assert rows[2]["adapter_load_s"] == 0.0 and rows[1]["adapter_load_s"] > 0.0
    decision = core.place(req, 0.0)
    assert decision.instance == 2 and decision.adapter_change == AdapterChange()
    # Elsewhere, it would be loaded first.
    other = core.place(for_adapter(request(2, chain(2, 4)), "b"), 0.0)
    assert other.adapter_change.load == "b"


def test_requests_without_adapters_decide_as_before() -> None:
    plain = Scheduler(ClusterConfig(n_instances=N), "elastic", seed=3, max_prompt_tokens=131_072)
    lora = cluster("elastic")
    for slot in range(N):
        plain.add_instance(slot, Role.BOTH)
    for core in (plain, lora):
        core.apply(1, [BlocksStored(chain(9, 40))])
    for i in range(10):
        req = request(i + 1, chain(9, 40)[: 10 + i], session=f"s{i % 3}")
        a, b = plain.place(req, float(i)), lora.place(req, float(i))
        assert (a.instance, a.cached_tokens, a.rule) == (b.instance, b.cached_tokens, b.rule)
        assert np.array_equal(a.terms["ttft_s"], b.terms["ttft_s"])
