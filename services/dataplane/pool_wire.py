"""The wire format of the node KV pool's socket, which this module owns: the local socket
between a node's engines (kvsched's vLLM connector, a simulated engine's pool link) and its
Messenger's KV pool, a Unix stream socket, owner-only, carrying length-prefixed JSON objects,
one answer per call, in order.

The connector imports it inside vLLM's own environment: it imports the standard library only
(and the wing's front door, `services.dataplane`, imports nothing until a name is asked).

A call is `{"op": OP, ...arguments}`; its answer `{"ok": true, ...results}` or `{"ok": false,
"error": why}`. The operations (the pool's side is `services.dataplane.pool_server`):

- `attach` {format: {kind, layers, chunk_bytes, block_size}} → {path, pages}: the engine's
  block format; the pool's memory file to map and its pages.
- `load` {block_hashes, start, end, hold_s} → {export_id, blocks, pages, path}: pin the pool's
  blocks `block_hashes[start:end]` from `start` on (`blocks` of them, each on its page of the
  pool's memory file `path`: a Messenger that restarted has a new one; none held: a null
  `export_id` and nothing pinned).
- `release` {export_id[, copied_bytes, copy_s]} → {released}: an engine that loaded the
  export's blocks says how many bytes it copied and how long that took (counted by the pool).
- `save` {block_hashes, upto, hold_s} → {import_id, have, pages, path}: stage pages for the
  blocks of `block_hashes[:upto]` after the `have` the pool holds (no import when it holds
  them all).
- `commit` {import_id, token_ids, cache_salt[, lora, copied_bytes, copy_s]} → {stored}: the
  staged pages are written (that many bytes, in that time); the pool checks the token ids
  hash to the blocks (with a LoRA adapter's [name, path] in every block's keys, when `lora`
  names one), then holds them.
- `abort` {import_id} → {aborted}.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from typing import Any

MAX_MESSAGE_BYTES = 64 << 20
HEADER = struct.Struct(">I")
OPS = frozenset({"attach", "load", "release", "save", "commit", "abort"})


class WireError(Exception):
    """A message that breaks the framing or is not a JSON object."""


def encode(message: dict[str, Any]) -> bytes:
    """One framed message."""
    body = json.dumps(message, separators=(",", ":")).encode()
    if len(body) > MAX_MESSAGE_BYTES:
        raise WireError(f"a message of {len(body)} bytes is over {MAX_MESSAGE_BYTES}")
    return HEADER.pack(len(body)) + body


def body_length(header: bytes) -> int:
    """The length a message's header announces; raises `WireError` when over the limit."""
    (length,) = HEADER.unpack(header)
    if length > MAX_MESSAGE_BYTES:
        raise WireError(f"a message of {length} bytes is over {MAX_MESSAGE_BYTES}")
    return int(length)


def decode(body: bytes) -> dict[str, Any]:
    """A message's JSON object; raises `WireError`."""
    try:
        message = json.loads(body)
    except (ValueError, RecursionError) as exc:  # not UTF-8, not JSON, absurd numbers or depth
        raise WireError(f"not JSON: {exc}") from None
    if not isinstance(message, dict):
        raise WireError("a message must be a JSON object")
    return message


def map_pool_file(path: str) -> mmap.mmap:
    """The pool's memory file `path` (named by `attach`, `load` and `save`), mapped shared
    and read/write, whole. Raises `OSError` (or `ValueError` for an empty file)."""
    fd = os.open(path, os.O_RDWR)
    try:
        return mmap.mmap(fd, os.fstat(fd).st_size, mmap.MAP_SHARED)
    finally:
        os.close(fd)
