"""The TCP backend's wire format (all integers big-endian).

A reader opens one connection per export and says hello: HELLO (magic "KVT1", id length)
and the export id in UTF-8. The server answers a REPLY (status, payload length): OK with the
source layout as LAYOUT, or REFUSED with a UTF-8 reason, after which it closes.

Then each read is one REQUEST (magic "KVRQ", layer, number of runs) followed by that many RUN
(source page, count). The server answers each request, in order, with a REPLY: OK followed by
the XXH3-64 checksum of each chunk the runs move (little-endian u64, computed from the source
memory as it is sent) and then exactly those chunks of that layer, run after run; or REFUSED
with a reason (and closes). Requests may be pipelined.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

from services.dataplane.transfer.runs import Run, Runs

HELLO_MAGIC = b"KVT1"
REQUEST_MAGIC = b"KVRQ"
HELLO = struct.Struct("!4sH")  # magic, export id bytes
REQUEST = struct.Struct("!4sII")  # magic, layer, runs
RUN = struct.Struct("!II")  # source page, count
REPLY = struct.Struct("!IQ")  # status, payload bytes
LAYOUT = struct.Struct("!IIQ")  # layers, pages, chunk_bytes
SUM_BYTES = 8  # one chunk's checksum in an answer
OK = 0
REFUSED = 1
MAX_EXPORT_ID = 256  # bytes
MAX_REASON = 1024  # bytes


class Malformed(ValueError):
    """A frame that breaks the protocol (the message says how)."""


def encode_hello(export_id: str) -> bytes:
    raw = export_id.encode()
    if not 0 < len(raw) <= MAX_EXPORT_ID:
        raise ValueError(f"an export id is 1..{MAX_EXPORT_ID} bytes, got {len(raw)}")
    return HELLO.pack(HELLO_MAGIC, len(raw)) + raw


def decode_hello(head: bytes | bytearray) -> int:
    """The export id's length in bytes, from a HELLO."""
    magic, size = HELLO.unpack(head)
    if magic != HELLO_MAGIC:
        raise Malformed(f"bad hello magic {bytes(magic)!r}")
    if not 0 < size <= MAX_EXPORT_ID:
        raise Malformed(f"export id of {size} bytes (1..{MAX_EXPORT_ID})")
    return int(size)


def decode_export_id(raw: bytes | bytearray) -> str:
    try:
        return bytes(raw).decode()
    except UnicodeDecodeError as e:
        raise Malformed("export id is not UTF-8") from e


def encode_runs(runs: Sequence[Run]) -> bytes:
    return b"".join([RUN.pack(r.src_page, r.count) for r in runs])


def encode_request(layer: int, runs: Runs) -> bytes:
    """A REQUEST and its RUNs (encoded once per `runs`, whatever the layer)."""
    body = runs.memo(encode_runs, lambda: encode_runs(runs))
    return REQUEST.pack(REQUEST_MAGIC, layer, len(runs)) + body


def decode_request(head: bytes | bytearray, max_runs: int) -> tuple[int, int]:
    """(layer, number of runs) from a REQUEST; at most `max_runs` runs."""
    magic, layer, nruns = REQUEST.unpack(head)
    if magic != REQUEST_MAGIC:
        raise Malformed(f"bad request magic {bytes(magic)!r}")
    if not 0 < nruns <= max_runs:
        raise Malformed(f"{nruns} runs in one request (1..{max_runs})")
    return int(layer), int(nruns)


def decode_runs(raw: bytes | bytearray) -> list[tuple[int, int]]:
    """(source page, count) of each RUN in `raw`."""
    return list(RUN.iter_unpack(raw))


def encode_layout(layers: int, pages: int, chunk_bytes: int) -> bytes:
    return REPLY.pack(OK, LAYOUT.size) + LAYOUT.pack(layers, pages, chunk_bytes)


def encode_refusal(reason: str) -> bytes:
    raw = reason.encode()[:MAX_REASON]
    return REPLY.pack(REFUSED, len(raw)) + raw


def decode_reply(head: bytes | bytearray) -> tuple[int, int]:
    """(status, payload bytes) of a REPLY."""
    status, size = REPLY.unpack(head)
    return int(status), int(size)
