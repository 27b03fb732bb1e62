"""Turn a trace's block ids into our chained block hashes, once per trace.

Each block id stands for `block_tokens` pseudo tokens (`kvsched.core.hashing.pseudo_tokens`), so
the hashes are exactly what `BlockHasher.hash_tokens` would give on the expanded prompt; since a
block id names a whole prefix, each (parent hash, id) pair is hashed once and memoised.
"""

from __future__ import annotations

import struct
from array import array
from dataclasses import dataclass

import xxhash

from kvsched.core.hashing import BlockHasher
from kvsched.sim.traces.model import Trace

_PAIR = struct.Struct("<II")


@dataclass(frozen=True)
class PreparedTrace:
    """A trace plus our hashes of every call's full prompt blocks."""

    trace: Trace
    hashes: tuple[tuple[int, ...], ...]
    seed: int


def prepare(trace: Trace, seed: int = 0, tenant_salt: bytes = b"") -> PreparedTrace:
    hasher = BlockHasher(trace.block_tokens, seed)
    filler = _filler(trace.block_tokens)
    root = hasher.root(tenant_salt)
    memo: dict[tuple[int, int], int] = {}
    out: list[tuple[int, ...]] = []
    for call in trace.calls:
        parent = root
        chain: list[int] = []
        for block_id in call.block_ids:
            key = (parent, block_id)
            h = memo.get(key)
            if h is None:
                local = xxhash.xxh3_64_intdigest(
                    _PAIR.pack(block_id & 0xFFFFFFFF, block_id >> 32) + filler, seed=seed
                )
                h = memo[key] = hasher.chain(parent, local)
            chain.append(h)
            parent = h
        out.append(tuple(chain))
    return PreparedTrace(trace, tuple(out), seed)


def _filler(block_tokens: int) -> bytes:
    values = array("I", range(2, block_tokens))
    if struct.pack("=I", 1) != struct.pack("<I", 1):
        values.byteswap()
    return values.tobytes()
