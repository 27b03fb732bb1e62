"""The in-process baseline: the client's log replayed through an identical Conductor term."""

from __future__ import annotations

import time

from bench.grpc_placement.results import ModeResult, Op
from bench.grpc_placement.workload import Workload, instance_spec
from kvsched.core.cluster import Role
from services.conductor import kv_event_batches, placement_messages
from services.conductor.keys import InstanceRecord, InstanceSpec
from services.conductor.settings import ConductorSettings
from services.conductor.term import Term


def baseline(policy: str, work: Workload, log: list[Op], results: dict[str, ModeResult]) -> None:
    """Replay the client's log through an identical Conductor term, timing each decision."""
    settings = ConductorSettings(policy=policy, max_instances=work.n, persist_blocks=False)
    term = Term.build(settings, "baseline")
    state, cursors = term.state, term.cursors
    limit = state.scheduler.limits.max_blocks
    for slot in range(work.n):
        spec = instance_spec(slot)
        record = InstanceRecord(
            InstanceSpec(spec.instance_id, spec.url, spec.node, Role.BOTH), slot, slot + 1
        )
        state.add_instance(record)
    for batch in work.batches:
        cursors.apply(
            batch.instance_id, batch.sequence, False, kv_event_batches.kv_events(batch, limit)
        )
    clock = time.perf_counter
    for op in log:
        res = results[op.mode]
        req = op.request
        if op.finish is None:
            t = clock()
            info = placement_messages.request_info(req, limit)
            decision = state.scheduler.place(info, op.now)
            dt = clock() - t
            res.base_latencies.append(dt)
            res.base_work_s += dt
            if decision.rebound:
                res.rebinds += 1
                res.rebound_ids.add(req.request_id)
            mine = "rejected" if decision.rejected else state.id_of(decision.instance)
            res.agree += res.answers.get(req.request_id) == mine
        else:
            assert op.report is not None
            t = clock()
            state.scheduler.finish(placement_messages.completion(state, op.finish, op.now), op.now)
            b = op.report
            # Reports of one instance sent on different streams may be logged out of order:
            # the replay applies them in log order, so it numbers them itself.
            seq = state.instances[b.instance_id].next_sequence
            cursors.apply(b.instance_id, seq, False, kv_event_batches.kv_events(b, limit))
            res.base_work_s += clock() - t
    for res in results.values():
        if res.base_latencies:
            res.base_rate = len(res.base_latencies) / res.base_work_s
