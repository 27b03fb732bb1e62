"""Block hashes out of a message's two fields, `block_hashes` (repeated) and
`packed_block_hashes` (8 bytes a hash), with the checks that raise `RequestError`: both set,
or packed bytes that are not whole hashes or hold too many."""

from __future__ import annotations

from collections.abc import Sequence

from clients.python.packed_hashes import hash_count, unpack_hashes
from kvsched.core.packed import PackedHashes
from kvsched.core.requests import RequestError


def block_hashes(
    repeated: Sequence[int], packed: bytes, max_blocks: int, where: str = ""
) -> Sequence[int]:
    """A message's block hashes from whichever of its two fields is set: `repeated`
    (`block_hashes`, copied out as today; the core checks its length) or `packed`
    (`packed_block_hashes`, its length checked before a single int is made, then unpacked in
    one C loop). Raises RequestError when both are set, or when the packed bytes are not a
    whole number of 8-byte hashes or hold more than `max_blocks`; `where` prefixes the
    field names in the message (e.g. "event 3: ")."""
    if not packed:
        return repeated[:]  # a list copy: the fastest way out of a repeated field
    if repeated:
        raise RequestError(
            "invalid", f"{where}block_hashes and packed_block_hashes are both set; give one"
        )
    _check_packed(packed, max_blocks, where)
    return unpack_hashes(packed)


def _check_packed(packed: bytes, max_blocks: int, where: str) -> None:
    try:
        n = hash_count(packed)
    except ValueError as exc:
        raise RequestError("invalid", f"{where}packed_block_hashes: {exc}") from None
    if n > max_blocks:
        raise RequestError(
            "invalid", f"{where}packed_block_hashes holds {n} block hashes; at most {max_blocks}"
        )


def event_hashes(
    repeated: Sequence[int], packed: bytes, max_blocks: int, where: str
) -> Sequence[int]:
    """An event's block hashes, refused as `block_hashes` refuses them; packed ones stay
    packed (`PackedHashes`): the compiled index reads their bytes, no Python int a hash."""
    if not packed:
        return tuple(repeated)
    if repeated:
        raise RequestError(
            "invalid", f"{where}block_hashes and packed_block_hashes are both set; give one"
        )
    _check_packed(packed, max_blocks, where)
    return PackedHashes(packed)
