"""Sessions' prompts tokenized and hashed incrementally: each turn, only what is new.

An agent session re-sends, every turn, a prompt that is mostly the previous turn's.
`SessionPrompts` keeps, per session, the previous turn's piece digests, ids and block hashes
(its pieces as `PieceTokenizer` cuts them: `prompt_pieces`), and on the next turn tokenizes
only the pieces from the first one that changed on, and hashes only the blocks from the first
whose ids changed on (vLLM's hashes are a chain; it resumes at the last kept checkpoint before
it, `_CHECKPOINT`). Pure: no I/O.
"""

from __future__ import annotations

import hashlib
import threading
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

from kvsched.core.vllm_hashing import AdapterKey, VllmBlockHasher
from services.router.prompt_pieces import PieceTokenizer

# A record keeps the digest of every this many blocks, where the hash chain can resume (at
# most this many less one blocks hashed again), not all of them (32 bytes each for SHA-256,
# which would cost more than the ids of a 16-token block).
_CHECKPOINT = 8
_Items = TypeVar("_Items", bytes, "array[int]")
_KEY_BYTES = 32  # a piece's SHA-256


@dataclass(frozen=True, slots=True)
class SessionPromptStats:
    """What a `SessionPrompts` has done and keeps (counts since it was made)."""

    sessions: int  # records kept
    tokens_kept: int  # their ids, summed
    calls: int
    reused_tokens: int  # ids taken from a previous turn
    tokenized_tokens: int  # ids tokenized anew
    reused_blocks: int  # block hashes taken from a previous turn
    hashed_blocks: int  # block hashes computed


class _Turn:
    """A session's previous turn: what the next one can reuse. Never changed once made."""

    __slots__ = (
        "adapter", "digests", "ends", "flag", "hasher", "hashes", "head", "ids", "keys", "salt"
    )  # fmt: skip

    def __init__(
        self,
        *,
        keys: bytes,
        ends: array[int],
        ids: array[int],
        head: int,
        flag: bool,
        hasher: VllmBlockHasher,
        salt: str | None,
        adapter: AdapterKey | None,
        digests: bytes,
        hashes: array[int],
    ) -> None:
        # Each piece's SHA-256, one after the other: not its text (a second copy of the
        # prompt), and one object rather than one per piece.
        self.keys = keys
        self.ends = ends  # where each piece's ids end, after the head (cumulative)
        self.ids = ids  # the prompt's ids, the post-processor's included
        self.head = head  # how many of them the post-processor put first
        self.flag = flag  # add_special_tokens
        self.hasher = hasher
        self.salt = salt
        self.adapter = adapter  # the LoRA adapter its blocks were hashed for
        self.digests = digests  # every `_CHECKPOINT`-th block's digest, one after the other
        self.hashes = hashes  # array('Q'): each full block's 64-bit hash


class SessionPrompts:
    """Sessions' prompts, each turn's ids and block hashes computed from the previous turn's
    where its leading pieces are the same: a bounded LRU of one record per session.
    Thread-safe: tokenizing and hashing run outside the lock; two calls for one session at
    once both return the right ids, and the one that finishes last is kept."""

    def __init__(
        self, tokenizer: PieceTokenizer, max_tokens: int = 1 << 23, max_sessions: int = 65536
    ) -> None:
        """`max_tokens`: the ids kept over all records (each id kept costs 2 bytes, 4 for a
        vocabulary over 65,536, plus 0.75 bytes of block hashes with 16-token blocks and
        SHA-256: the default keeps 100 sessions of 80K tokens in about 40 MB);
        `max_sessions`: the records. Raises `ValueError` for a bound under 1."""
        if max_tokens < 1 or max_sessions < 1:
            raise ValueError("max_tokens and max_sessions must be at least 1")
        self.tokenizer = tokenizer
        self.max_tokens = max_tokens
        self.max_sessions = max_sessions
        self._lock = threading.Lock()
        self._turns: OrderedDict[str, _Turn] = OrderedDict()  # least recently used first
        self._kept = 0
        self._counts = [0, 0, 0, 0, 0]  # calls, reused/tokenized tokens, reused/hashed blocks

    def ids_and_hashes(
        self,
        key: str | None,
        text: str,
        add_special_tokens: bool,
        hasher: VllmBlockHasher,
        cache_salt: str | None = None,
        *,
        adapter: AdapterKey | None = None,
    ) -> tuple[array[int], array[int]]:
        """`text`'s ids, equal to `tokenizer.model.encode(text, add_special_tokens)`, and
        their block hashes, equal to `hasher.hash_prompt(ids, cache_salt, adapter)` (arrays,
        which the record keeps too: read them, never change them; a list of 80K ids costs
        2 ms to make): the leading
        pieces equal to session `key`'s previous turn taken from it, the rest tokenized, and
        the blocks whose ids are all the previous turn's leading ids taken from it, the rest
        hashed. Keeps this turn as `key`'s (last writer wins), evicting the least recently
        used records over the bounds; `key` None: none read or kept. Raises `TypeError` for
        text that is not Unicode (a lone surrogate); changes only its own records."""
        tok = self.tokenizer
        pieces = tok.pieces(text)
        keys = _piece_keys(pieces)
        salt = cache_salt or None  # vLLM salts the first block only with a non-empty salt
        old = self._get(key)
        same = 0  # leading pieces equal to the previous turn's
        if old is not None and (tok.cuts or old.flag == add_special_tokens):
            same = _common_prefix(keys, old.keys, 0) // _KEY_BYTES
        head, tail = tok.affixes(add_special_tokens)
        ids = array(tok.typecode, head)
        reused = 0
        if same:
            assert old is not None
            reused = old.ends[same - 1]
            ids += old.ids[old.head : old.head + reused]
            ends = old.ends[:same]
        else:
            ends = array("I")
        count = reused
        for piece in tok.piece_ids(pieces[same:], add_special_tokens):
            ids.fromlist(piece)
            count += len(piece)
            ends.append(count)
        ids.fromlist(list(tail))

        kept = 0  # leading blocks whose hashes are the previous turn's
        if old is not None and (old.hasher, old.salt, old.adapter) == (hasher, salt, adapter):
            known = len(head) + reused if same and old.flag == add_special_tokens else 0
            kept = _common_prefix(old.ids, ids, known) // hasher.block_size
            kept -= kept % _CHECKPOINT  # the chain resumes after a kept digest
        digests, hashes = _hash_blocks(hasher, ids, salt, adapter, old=old, kept=kept)

        turn = _Turn(
            keys=keys, ends=ends, ids=ids, head=len(head), flag=add_special_tokens,
            hasher=hasher, salt=salt, adapter=adapter, digests=digests, hashes=hashes,
        )  # fmt: skip
        self._put(key, turn, (1, reused, count - reused, kept, len(hashes) - kept))
        return ids, hashes

    def discard(self, key: str) -> None:
        """Forget session `key`'s record (nothing where there is none)."""
        with self._lock:
            turn = self._turns.pop(key, None)
            if turn is not None:
                self._kept -= len(turn.ids)

    def stats(self) -> SessionPromptStats:
        """What it keeps and has done so far."""
        with self._lock:
            return SessionPromptStats(len(self._turns), self._kept, *self._counts)

    def _get(self, key: str | None) -> _Turn | None:
        """`key`'s record, now the most recently used."""
        if key is None:
            return None
        with self._lock:
            turn = self._turns.get(key)
            if turn is not None:
                self._turns.move_to_end(key)
            return turn

    def _put(self, key: str | None, turn: _Turn, counts: Sequence[int]) -> None:
        """Keep `turn` as `key`'s (none over `max_tokens` alone), evict past the bounds,
        and add `counts` to the totals."""
        size = len(turn.ids)
        with self._lock:
            for i, n in enumerate(counts):
                self._counts[i] += n
            if key is None:
                return
            old = self._turns.pop(key, None)
            if old is not None:
                self._kept -= len(old.ids)
            if size > self.max_tokens:
                return
            self._turns[key] = turn
            self._kept += size
            while self._kept > self.max_tokens or len(self._turns) > self.max_sessions:
                _, evicted = self._turns.popitem(last=False)
                self._kept -= len(evicted.ids)


def _piece_keys(pieces: Sequence[str]) -> bytes:
    """Each piece's SHA-256 (of its UTF-8), joined; raises `TypeError` for a lone surrogate,
    as the tokenizer does."""
    try:
        return b"".join([hashlib.sha256(p.encode()).digest() for p in pieces])
    except UnicodeEncodeError as exc:
        raise TypeError(str(exc)) from None


def _common_prefix(a: _Items, b: _Items, known: int) -> int:
    """How many leading items `a` and `b` share, given the first `known` are shared:
    galloping then bisecting over slice compares (memcmp-speed), not item by item."""
    n = min(len(a), len(b))
    lo, step = min(known, n), 64
    while lo < n:
        hi = min(n, lo + step)
        if a[lo:hi] != b[lo:hi]:
            while hi - lo > 1:  # a[lo:hi] differs somewhere, a[:lo] does not
                mid = (lo + hi) // 2
                if a[lo:mid] == b[lo:mid]:
                    lo = mid
                else:
                    hi = mid
            return lo
        lo, step = hi, step * 2
    return n


def _hash_blocks(
    hasher: VllmBlockHasher,
    ids: array[int],
    salt: str | None,
    adapter: AdapterKey | None,
    *,
    old: _Turn | None,
    kept: int,
) -> tuple[bytes, array[int]]:
    """Every `_CHECKPOINT`-th block's digest (joined) and every full block's 64-bit hash for
    `ids`: the first `kept` blocks' (a multiple of `_CHECKPOINT`) taken from `old`, the
    chain resumed from the last of them."""
    bs, every = hasher.block_size, _CHECKPOINT
    hashes = array("Q")
    digests, parent = bytearray(), None
    if kept:
        assert old is not None
        width = len(old.digests) // (len(old.hashes) // every)
        digests += old.digests[: kept // every * width]
        hashes = old.hashes[:kept]
        parent = bytes(digests[-width:])
    for n, start in enumerate(range(kept * bs, len(ids) - bs + 1, bs), kept + 1):
        parent = hasher.next_digest(parent, ids[start : start + bs], salt, adapter)
        if n % every == 0:
            digests += parent
        # A KV event's hash: the digest's low 64 bits, big-endian (`event_hash`).
        hashes.append(int.from_bytes(parent[-8:], "big"))
    return bytes(digests), hashes
