"""The workload: 64 instances' index as KV event batches (drawn as bench.placement draws it),
the prompts to place, and the Finish and load report that follow each decision."""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from bench.prefix_workload import draw_chains, draw_loads, draw_prompt
from clients.python.packed_hashes import pack_hashes
from kvsched.api.common.v1 import common_pb2 as common
from kvsched.api.conductor.v1 import conductor_service_pb2 as pb
from services.common.serving import durations

BLOCK = 16
SESSIONS = 64
OUTPUT_TOKENS = 256
TTFT_S, E2E_S = 0.3, 1.5  # what each Finish reports


@dataclass
class Workload:
    n: int
    prompt_tokens: int
    chains: list[list[int]]
    batches: list[pb.KvEventBatch]  # index load, in sequence per instance
    loads: list[common.LoadReport]  # each instance's reported load
    blocks: int


def instance_id(slot: int) -> str:
    return f"node-{slot // 2}/engine-{slot % 2}"


def instance_spec(slot: int) -> pb.InstanceSpec:
    return pb.InstanceSpec(
        instance_id=instance_id(slot),
        url=f"http://10.0.{slot // 2}.1:{8000 + slot % 2}",
        node=f"node-{slot // 2}",
        role=common.ROLE_BOTH,
    )


def build_workload(
    n: int, total_blocks: int, prompt_tokens: int, batch_blocks: int, *, seed: int, share: float
):
    """bench.placement.build's index (bench.prefix_workload's draws), as KV event batches per
    instance; `share` of the chains continue the shared system prefix."""
    rng = random.Random(seed)
    chains: list[list[int]] = []
    per_slot: list[list[list[int]]] = [[] for _ in range(n)]
    stored = 0
    for slot, chain in draw_chains(rng, total_blocks, n, share):
        per_slot[slot].append(chain)
        chains.append(chain)
        stored += len(chain)
    loads = [
        common.LoadReport(
            pending_prefill_tokens=load.pending_prefill_tokens,
            pending_prefill=durations.duration(load.pending_prefill_s),
            waiting=load.waiting,
            running=load.running,
            decode_tokens=load.decode_tokens,
            free_blocks=load.free_blocks,
        )
        for load in draw_loads(rng, n)
    ]
    batches: list[pb.KvEventBatch] = []
    for slot in range(n):
        events = [pb.KvEvent(load=loads[slot])]
        size = 0
        seq = 0
        for chain in per_slot[slot]:
            stored_event = pb.BlocksStored(block_hashes=chain, tier=common.TIER_GPU)
            events.append(pb.KvEvent(blocks_stored=stored_event))
            size += len(chain)
            if size >= batch_blocks:
                batches.append(pb.KvEventBatch(instance_id=instance_id(slot), sequence=seq))
                batches[-1].events.extend(events)
                events, size, seq = [], 0, seq + 1
        if events:
            batches.append(pb.KvEventBatch(instance_id=instance_id(slot), sequence=seq))
            batches[-1].events.extend(events)
    return Workload(n, prompt_tokens, chains, batches, loads, stored)


HASH_FORMS = ("repeated", "packed")  # block_hashes, or packed_block_hashes


def make_requests(
    work: Workload, count: int, tag: str, rng: random.Random, form: str = "repeated"
) -> list[pb.ScheduleRequest]:
    """Like bench.placement.requests (bench.prefix_workload.draw_prompt): a random part of an
    indexed chain, then new blocks; their hashes in `form` (HASH_FORMS)."""
    total = work.prompt_tokens // BLOCK
    out = []
    for i in range(count):
        hashes = draw_prompt(rng, work.chains, total)
        req = pb.ScheduleRequest(
            request_id=f"{tag}-{i}",
            prompt_tokens=work.prompt_tokens + 7,
            output_tokens=OUTPUT_TOKENS,
            session_id=f"s{rng.randrange(SESSIONS)}" if i % 4 == 0 else "",
        )
        if form == "packed":
            req.packed_block_hashes = pack_hashes(hashes)
        else:
            req.block_hashes.extend(hashes)
        out.append(req)
    return out


def finish_message(req: pb.ScheduleRequest, decision: pb.Decision) -> pb.FinishRequest:
    msg = pb.FinishRequest(
        request_id=req.request_id,
        session_id=req.session_id,
        instance_id=decision.instance_id,
        decode_instance_id=decision.decode_instance_id,
        prompt_tokens=req.prompt_tokens,
        output_tokens=req.output_tokens,
        cached_tokens=decision.cached_tokens,
        time_to_first_token=durations.duration(TTFT_S),
        end_to_end=durations.duration(E2E_S),
        ok=True,
    )
    if req.session_id:  # the session's context, for the policy's migration planning
        msg.block_hashes.extend(req.block_hashes)  # in the request's form: one is empty
        msg.packed_block_hashes = req.packed_block_hashes
    return msg


class Reports:
    """Load reports that follow finishes: per-instance sequence numbers."""

    def __init__(self, work: Workload) -> None:
        self.loads = work.loads
        self.next_seq = [0] * work.n
        for batch in work.batches:
            slot = slot_of(batch.instance_id)
            self.next_seq[slot] = max(self.next_seq[slot], batch.sequence + 1)

    def batch(self, iid: str) -> pb.KvEventBatch:
        slot = slot_of(iid)
        seq = self.next_seq[slot]
        self.next_seq[slot] = seq + 1
        b = pb.KvEventBatch(instance_id=iid, sequence=seq)
        b.events.add().load.CopyFrom(self.loads[slot])
        return b


_ID = re.compile(r"node-(\d+)/engine-(\d+)")


def slot_of(iid: str) -> int:
    m = _ID.fullmatch(iid)
    assert m is not None, iid
    return int(m.group(1)) * 2 + int(m.group(2))
