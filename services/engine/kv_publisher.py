"""Publishing KV events the way vLLM's `ZmqEventPublisher` does: a PUB socket sending
`[topic, seq, payload]`, and a ROUTER socket answering replay requests from a buffer of the
latest batches. A DEALER asks with `[b"", start_seq]` and receives, as from vLLM 0.32, every
buffered batch from `start_seq` on as `[b"", topic, seq, payload]`, then the end marker
`[b"", b"", seq −1, b""]`; with `shape="array"` (vLLM ≤ 0.11), as that vLLM answered, without
the topic: `[b"", seq, payload]`, then `[b"", seq −1, b""]`."""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Sequence

import zmq
import zmq.asyncio

from services.kv_events.vllm_wire import Event, Shape, encode_frames

END_SEQ = (-1).to_bytes(8, "big", signed=True)


class KvEventPublisher:
    """One engine's event publisher; sequence numbers start at 0 and rise by one a batch."""

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        *,
        topic: bytes = b"",
        buffer_steps: int = 10_000,
        shape: Shape = "map",
        dp_rank: int = 0,
    ) -> None:
        self._ctx = zmq.asyncio.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.bind(endpoint)
        self._replay = None
        if replay_endpoint is not None:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.bind(replay_endpoint)
        self.topic = topic
        self.shape: Shape = shape
        self.dp_rank = dp_rank
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)  # (seq, payload)
        self.next_seq = 0  # sequence number of the next batch
        self._serving: asyncio.Task[None] | None = None

    @property
    def endpoint(self) -> str:
        return str(self._pub.getsockopt_string(zmq.LAST_ENDPOINT))

    @property
    def replay_endpoint(self) -> str | None:
        if self._replay is None:
            return None
        return str(self._replay.getsockopt_string(zmq.LAST_ENDPOINT))

    def start(self) -> None:
        """Start answering replay requests (on the running event loop)."""
        if self._replay is not None and self._serving is None:
            self._serving = asyncio.get_running_loop().create_task(self._serve_replay())

    async def publish(self, events: Sequence[Event], ts: float) -> int:
        """Send one batch; returns its sequence number."""
        seq = self.next_seq
        self.next_seq += 1
        frames = encode_frames(self.topic, seq, ts, events, self.dp_rank, shape=self.shape)
        self._buffer.append((seq, frames[2]))
        await self._pub.send_multipart(frames)
        return seq

    async def _serve_replay(self) -> None:
        replay = self._replay
        assert replay is not None
        while True:
            request = await replay.recv_multipart()
            if len(request) != 3 or len(request[2]) != 8:
                continue  # not a replay request: ignore it
            client, start = request[0], int.from_bytes(request[2], "big")
            # Like vLLM, replies carry the publisher's topic at reply time, not the one a batch
            # was published under, and the end marker an empty one; vLLM ≤ 0.11 sent neither.
            legacy = self.shape == "array"
            topic: list[bytes] = [] if legacy else [self.topic]
            end_topic: list[bytes] = [] if legacy else [b""]
            for seq, payload in list(self._buffer):
                if seq >= start:
                    await replay.send_multipart(
                        [client, b"", *topic, seq.to_bytes(8, "big"), payload]
                    )
            await replay.send_multipart([client, b"", *end_topic, END_SEQ, b""])

    async def close(self) -> None:
        if self._serving is not None:
            self._serving.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._serving
        self._pub.close()
        if self._replay is not None:
            self._replay.close()
