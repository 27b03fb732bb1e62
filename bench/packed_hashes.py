"""A prompt's block hashes on the wire: the repeated `fixed64` field (the baseline) against
`packed_block_hashes` (the same u64 values as little-endian bytes), measured in the same run
on the same hashes, at both ends of a placement.

    .venv/bin/python -m bench.packed_hashes [--hashes 2048] [--repeats 2000]

* Conductor, hashes out: from a parsed `ScheduleRequest` to the Python ints the core takes
  (`block_hash_fields.block_hashes`: the repeated field's list copy, or the packed bytes'
  length check and one-loop unpack).
* Conductor, whole request: the wire bytes parsed and turned into the core's `RequestInfo`
  (`placement_messages.request_info`), what the Conductor does per placement before it decides.
* Router, request out: the prompt's hashes (a list of ints, as the hasher gives them) to a
  serialized `ScheduleRequest` (packing included).

Prints the median time per call of each (--repeats calls of each form, timed in blocks of 50,
the two forms' blocks interleaved),
the ratio packed / repeated, and both messages' sizes. The last 64 results of each are kept
alive, as the Conductor's index keeps the hashes it is given: otherwise each call would reuse
the memory of the ints the previous one freed, which the Conductor does not.
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time
from collections import deque
from collections.abc import Callable

from clients.python.packed_hashes import pack_hashes
from kvsched.api.conductor.v1 import conductor_service_pb2 as pb
from services.conductor import block_hash_fields, placement_messages

BLOCK = 16
CHUNK = 50  # calls timed together (one call is a few µs: the clock's own cost would show)
KEPT = 64  # results kept alive (see the docstring)


def median_calls_s(runs: tuple[Callable[[], object], ...], repeats: int) -> list[float]:
    """Median seconds per call of each of `runs`, over `repeats` calls each timed in blocks
    of CHUNK, the runs interleaved block by block (so a busy spell of the machine weighs on
    each alike), the last KEPT results of each kept alive."""
    kept: list[deque[object]] = [deque(maxlen=KEPT) for _ in runs]
    for run, ring in zip(runs, kept, strict=True):
        for _ in range(KEPT):
            ring.append(run())  # warm, and the ring full
    times: list[list[float]] = [[] for _ in runs]
    gc.disable()  # as timeit does: a collection would land in whichever block it fell in
    try:
        _timed_blocks(runs, kept, times, max(repeats // CHUNK, 1))
    finally:
        gc.enable()
    return [statistics.median(t) for t in times]


def _timed_blocks(
    runs: tuple[Callable[[], object], ...],
    kept: list[deque[object]],
    times: list[list[float]],
    blocks: int,
) -> None:
    for block in range(blocks):
        order = range(len(runs)) if block % 2 == 0 else reversed(range(len(runs)))
        for i in order:
            run, ring = runs[i], kept[i]
            started = time.perf_counter()
            for _ in range(CHUNK):
                ring.append(run())
            times[i].append((time.perf_counter() - started) / CHUNK)


def _request(hashes: list[int], *, packed: bool) -> pb.ScheduleRequest:
    request = pb.ScheduleRequest(
        request_id="bench-0", prompt_tokens=len(hashes) * BLOCK + 7, output_tokens=256
    )
    if packed:
        request.packed_block_hashes = pack_hashes(hashes)
    else:
        request.block_hashes.extend(hashes)
    return request


def measure(n: int, repeats: int) -> list[tuple[str, float, float]]:
    """(what, repeated s, packed s) per measure."""
    rng = random.Random(0)
    hashes = [rng.getrandbits(64) for _ in range(n)]
    limit = n  # the cluster's longest prompt, in blocks: this one's
    messages = {form: _request(hashes, packed=form == "packed") for form in ("rep", "packed")}
    wires = {form: m.SerializeToString() for form, m in messages.items()}
    for form, message in messages.items():  # both give the core the same request
        assert list(placement_messages.request_info(message, limit).block_hashes) == hashes, form

    def hashes_out(m: pb.ScheduleRequest) -> Callable[[], object]:
        return lambda: block_hash_fields.block_hashes(m.block_hashes, m.packed_block_hashes, limit)

    def request_in(wire: bytes) -> Callable[[], object]:
        return lambda: placement_messages.request_info(pb.ScheduleRequest.FromString(wire), limit)

    def request_out(packed: bool) -> Callable[[], object]:
        return lambda: _request(hashes, packed=packed).SerializeToString()

    cases: list[tuple[str, Callable[[], object], Callable[[], object]]] = [
        (
            "Conductor: hashes out of a parsed request",
            hashes_out(messages["rep"]),
            hashes_out(messages["packed"]),
        ),
        (
            "Conductor: wire bytes to RequestInfo",
            request_in(wires["rep"]),
            request_in(wires["packed"]),
        ),
        ("Router: hashes to wire bytes", request_out(False), request_out(True)),
    ]
    rows = []
    for what, rep, packed in cases:
        rep_s, packed_s = median_calls_s((rep, packed), repeats)
        rows.append((what, rep_s, packed_s))
    print(
        f"{n:,} block hashes; ScheduleRequest of {len(wires['rep']):,} bytes repeated, "
        f"{len(wires['packed']):,} packed; median per call of {repeats:,} calls"
    )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--hashes", type=int, default=2048, help="a 32K-token prompt's, at 16")
    parser.add_argument("--repeats", type=int, default=2000)
    args = parser.parse_args()
    rows = measure(args.hashes, args.repeats)
    print("| per call | repeated µs (baseline) | packed µs | packed / repeated |")
    print("|---|---:|---:|---:|")
    for what, rep, packed in rows:
        print(f"| {what} | {rep * 1e6:.1f} | {packed * 1e6:.1f} | {packed / rep:.2f} |")


if __name__ == "__main__":
    main()
