"""The simulated engine's replay socket answers as a real vLLM 0.32's did
(tests/data/vllm/cpu-0.32-capture/replay_probe.txt): a DEALER asking from seq 0 after two
batches gets each as `[b"", topic, seq, payload]`, then the end marker `[b"", b"", -1, b""]`;
with `shape="array"` (vLLM ≤ 0.11) without the topic frames."""

from __future__ import annotations

import ast
import asyncio
import re

import zmq
import zmq.asyncio

from services.engine.kv_publisher import END_SEQ, KvEventPublisher
from services.kv_events.vllm_wire import Shape, decode_frames, encode_frames
from tests.common.test_kv_events_capture import CAPTURE, captured

TOPIC = b"kv-events"
SENT = captured("frames")  # the two batches the probe replayed


def probe_replies() -> list[list[bytes]]:
    """The replies replay_probe.txt records, in order (each payload cut to 12 bytes there)."""
    replies = []
    for line in (CAPTURE / "replay_probe.txt").read_text().splitlines():
        if match := re.fullmatch(r"raw replay reply: (\d+) frames (\[.*\])", line):
            frames = ast.literal_eval(match[2])
            assert len(frames) == int(match[1])
            replies.append(frames)
    return replies


async def replay_from_zero(shape: Shape) -> list[list[bytes]]:
    """Publish the captured batches, then ask the replay socket from seq 0 as a DEALER; the
    replies up to the end marker."""
    pub = KvEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", topic=TOPIC, shape=shape)
    pub.start()
    dealer = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    try:
        for frames in SENT:
            batch = decode_frames(frames)
            await pub.publish(batch.events, batch.ts)
        dealer.connect(str(pub.replay_endpoint))
        await dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        replies = [await asyncio.wait_for(dealer.recv_multipart(), 5.0)]
        while replies[-1][-2] != END_SEQ:  # the sequence number's frame
            replies.append(await asyncio.wait_for(dealer.recv_multipart(), 5.0))
        return replies
    finally:
        dealer.close()
        await pub.close()


async def test_replies_are_framed_as_vllm_032s() -> None:
    probe = probe_replies()
    assert [len(r) for r in probe] == [4, 4, 4]  # two batches, then the end marker
    got = await replay_from_zero("map")
    assert [len(r) for r in got] == [len(r) for r in probe]
    assert got[-1] == probe[-1] == [b"", b"", b"\xff" * 8, b""]
    for ours, theirs, frames in zip(got, probe, SENT, strict=False):
        assert ours[:3] == theirs[:3] == [b"", TOPIC, frames[1]]  # delimiter, topic, seq
        assert frames[2].startswith(theirs[3])  # the probe replayed these very batches
        assert decode_frames(ours[1:]) == decode_frames(frames)


async def test_legacy_replies_have_no_topic() -> None:
    got = await replay_from_zero("array")
    payloads = []
    for frames in SENT:
        batch = decode_frames(frames)
        legacy = encode_frames(TOPIC, batch.seq, batch.ts, batch.events, shape="array")
        payloads.append(legacy[2])
    assert got == [
        [b"", SENT[0][1], payloads[0]],
        [b"", SENT[1][1], payloads[1]],
        [b"", END_SEQ, b""],
    ]
