"""The in-process baseline: the client's log replayed through an identical `ConductorState`."""

from __future__ import annotations

import time

from bench.grpc_placement.results import ModeResult, Op
from bench.grpc_placement.workload import Workload, instance_spec
from kvsched.core.cluster import Role
from services.conductor import convert
from services.conductor.keys import InstanceRecord, InstanceSpec
from services.conductor.settings import ConductorSettings
from services.conductor.state import ConductorState


def baseline(policy: str, work: Workload, log: list[Op], results: dict[str, ModeResult]) -> None:
    """Replay the client's log through an identical ConductorState, timing each decision."""
    settings = ConductorSettings(policy=policy, max_instances=work.n, persist_blocks=False)
    state = ConductorState(
        settings.cluster_config(),
        policy,
        settings.seed,
        transfer_prefix="baseline",
        persist_blocks=False,
    )
    for slot in range(work.n):
        spec = instance_spec(slot)
        record = InstanceRecord(
            InstanceSpec(spec.instance_id, spec.url, spec.node, Role.BOTH), slot, slot + 1
        )
        state.add_instance(record)
    for batch in work.batches:
        state.apply_events(batch.instance_id, batch.sequence, False, convert.kv_events(batch))
    clock = time.perf_counter
    for op in log:
        res = results[op.mode]
        req = op.request
        if op.finish is None:
            t = clock()
            info = state.request_info(
                req.request_id,
                req.prompt_tokens,
                req.output_tokens,
                req.block_hashes,
                req.session_id,
            )
            decision = state.place(info, op.now)
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
            convert.finish(state, op.finish, op.now)
            b = op.report
            # Reports of one instance sent on different streams may be logged out of order:
            # the replay applies them in log order, so it numbers them itself.
            seq = state.instances[b.instance_id].next_sequence
            state.apply_events(b.instance_id, seq, False, convert.kv_events(b))
            res.base_work_s += clock() - t
    for res in results.values():
        if res.base_latencies:
            res.base_rate = len(res.base_latencies) / res.base_work_s
