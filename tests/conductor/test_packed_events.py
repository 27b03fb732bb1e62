"""KV event batches whose hashes are packed bytes go into the compiled index as bytes: the
same batches (stored chains with and without parents, in every tier, removals, clears, load
reports, resyncs with and without merge) leave the same index, counters, cursors and etcd
writes whichever form carries the hashes and whichever block store (compiled or the pure
reference, `KVSCHED_PURE_INDEX=1`) indexes them; a bad packed length refuses its whole batch
with nothing applied."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from clients.python import pack_hashes
from kvsched.api.conductor.v1 import conductor_service_pb2 as pb
from kvsched.core.cluster import Role
from kvsched.core.events import BlocksRemoved, BlocksStored
from kvsched.core.index import Tier
from kvsched.core.packed import PackedHashes
from kvsched.core.requests import RequestError
from services.conductor import kv_event_batches
from services.conductor.keys import InstanceRecord, InstanceSpec
from services.conductor.settings import ConductorSettings
from services.conductor.term import Term
from services.kv_events.messages import TIER_VALUES
from tests.conductor.test_conductor import IID

N = 3
HASHES = [1, 2, 3, 4, 5, 6, 7, 2**63, 2**64 - 1, 0]
chains = st.lists(st.sampled_from(HASHES), max_size=6)
tiers = st.sampled_from(list(Tier))
event = st.one_of(
    st.tuples(st.just("stored"), chains, st.none() | st.sampled_from(HASHES), tiers),
    st.tuples(st.just("removed"), chains, tiers),
    st.tuples(st.just("cleared")),
    st.tuples(st.just("load"), st.integers(0, 9)),
)
# (slot, resync, merge, events)
batches = st.lists(
    st.tuples(st.integers(0, N - 1), st.booleans(), st.booleans(), st.lists(event, max_size=5)),
    max_size=12,
)
Script = list[tuple[int, bool, bool, list[tuple[object, ...]]]]


def term(*, pure: bool) -> Term:
    settings = ConductorSettings(max_instances=N, policy="elastic", pure_kernels=pure)
    t = Term.build(settings, "test")
    assert t.state.cluster.index.compiled is not pure
    for slot in range(N):
        spec = InstanceSpec(IID[slot], f"http://{slot}", f"node-{slot}", Role.BOTH)
        t.state.add_instance(InstanceRecord(spec, slot, slot + 1))
    return t


def message(
    slot: int, seq: int, resync: bool, merge: bool, events: list[tuple[object, ...]], *, pack: bool
) -> pb.KvEventBatch:
    out = pb.KvEventBatch(instance_id=IID[slot], sequence=seq, resync=resync, merge=merge)
    for e in events:
        msg = out.events.add()
        if e[0] == "stored":
            _, hashes, parent, tier = e
            s = msg.blocks_stored
            s.tier = TIER_VALUES[tier]  # type: ignore[index]
            if parent is not None:
                s.parent_block_hash = parent  # type: ignore[assignment]
            if pack:
                s.packed_block_hashes = pack_hashes(hashes)  # type: ignore[arg-type]
            else:
                s.block_hashes.extend(hashes)  # type: ignore[arg-type]
        elif e[0] == "removed":
            _, hashes, tier = e
            r = msg.blocks_removed
            r.tier = TIER_VALUES[tier]  # type: ignore[index]
            if pack:
                r.packed_block_hashes = pack_hashes(hashes)  # type: ignore[arg-type]
            else:
                r.block_hashes.extend(hashes)  # type: ignore[arg-type]
        elif e[0] == "cleared":
            msg.all_blocks_cleared.SetInParent()
        else:
            msg.load.waiting = e[1]  # type: ignore[assignment]
    return out


def apply(t: Term, batch: pb.KvEventBatch) -> int:
    events = kv_event_batches.kv_events(batch, t.state.scheduler.limits.max_blocks)
    return t.cursors.apply(
        batch.instance_id, batch.sequence, batch.resync, events, merge=batch.merge
    )


def observe(t: Term) -> tuple[object, ...]:
    index = t.state.cluster.index
    masks, parents, children, counts = index._blocks.snapshot()
    return (
        masks,
        parents,
        {k: sorted(v) for k, v in children.items()},
        counts,
        index.counters,
        [index.match(HASHES, tier) for tier in Tier],
        [t.state.instances[iid].next_sequence for iid in IID[:N]],
        list(t.state.cluster.load.waiting),
        list(t.outbox.writes.items()),
    )


def run(script: Script, *, pure: bool, pack: bool) -> tuple[object, ...]:
    t = term(pure=pure)
    for slot, resync, merge, events in script:
        seq = t.state.instances[IID[slot]].next_sequence
        assert apply(t, message(slot, seq, resync, merge, events, pack=pack)) == seq + 1
    return observe(t)


@settings(max_examples=150, deadline=None)
@given(batches)
def test_packed_events_leave_the_index_the_reference_leaves(script: Script) -> None:
    reference = run(script, pure=True, pack=False)
    assert run(script, pure=False, pack=True) == reference  # bytes into the compiled store
    assert run(script, pure=True, pack=True) == reference  # bytes into the reference
    assert run(script, pure=False, pack=False) == reference


@pytest.mark.parametrize("pure", [True, False])
def test_a_bad_packed_length_refuses_the_whole_batch_and_applies_nothing(pure: bool) -> None:
    t = term(pure=pure)
    apply(t, message(0, 0, False, False, [("stored", [1, 2, 3], None, Tier.GPU)], pack=True))
    before = observe(t)
    batch = message(
        0,
        1,
        False,
        False,
        [("removed", [3], Tier.GPU), ("stored", [4, 5], 2, Tier.CPU), ("cleared",)],
        pack=True,
    )
    batch.events[1].blocks_stored.packed_block_hashes += b"\x00\x01\x02"
    with pytest.raises(RequestError, match="event 1: packed_block_hashes: 19 bytes") as err:
        apply(t, batch)
    assert err.value.kind == "invalid"
    too_long = message(0, 1, False, False, [("removed", [1], Tier.GPU)], pack=True)
    too_long.events[0].blocks_removed.packed_block_hashes = bytes(8 * 8193)
    with pytest.raises(RequestError, match="holds 8193 block hashes; at most 8192"):
        apply(t, too_long)
    assert observe(t) == before


def test_packed_hashes_reach_the_core_unpacked_only_on_demand() -> None:
    batch = message(
        0,
        0,
        False,
        False,
        [("stored", [1, 2], 7, Tier.CPU), ("removed", [2], Tier.GPU), ("stored", [3], None, 0)],
        pack=True,
    )
    stored, removed, _ = kv_event_batches.kv_events(batch, 8192)
    assert type(stored.hashes) is PackedHashes and type(removed.hashes) is PackedHashes  # type: ignore[union-attr]
    assert stored == BlocksStored((1, 2), 7, Tier.CPU) and removed == BlocksRemoved((2,))
