"""A session's prompt tokenized and hashed incrementally: each turn, only what is new.

An agent session re-sends, every turn, a prompt that is mostly the previous turn's. A fast
(Rust) tokenizer splits its input on added tokens before it normalizes and pre-tokenizes
(tokenizers' `AddedVocabulary::extract_and_normalize`), and every stage after that works on
each split alone, so a text cut right before an added token's occurrence tokenizes as its two
pieces do: ``ids(text) == ids(text[:cut]) + ids(text[cut:])``, when

- the tokenizer does not split special tokens (`split_special_tokens` off);
- the token is not `normalized` (matched on the raw text, not within a split), not `lstrip`
  (it would take the whitespace left of the cut), not `single_word` (its match depends on
  the character left of the cut), and does not start with whitespace (an `rstrip` token left
  of the cut would take it); where any token is `single_word`, it does not start with a word
  character either (that token's match would depend on it);
- every normalizer, pre-tokenizer and model is one whose output depends on a split's text
  alone. The one that also looks at where a split lies is `Metaspace` with
  `prepend_scheme: "first"` (a ▁ only at offset 0 of the input): a later piece starts with the
  token, so its first text lies past offset 0 in the piece as in the whole;
- the post-processor only adds fixed ids before and after (`TemplateProcessing`'s BOS): the
  pieces are tokenized without it and those ids added once (`PieceTokenizer.affixes`).

Where one of these does not hold, or for a Python tokenizer, every text is one piece. Matches
are found leftmost-longest, as tokenizers finds them, over every token that can consume text
where tokens overlap.

`SessionPrompts` keeps, per session, the previous turn's piece digests, ids and block hashes,
and on the next turn tokenizes only the pieces from the first one that changed on, and hashes
only the blocks from the first whose ids changed on (vLLM's hashes are a chain; it resumes at
the last kept checkpoint before it, `_CHECKPOINT`). Pure: no I/O.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any, TypeVar

from kvsched.core.vllm_hashing import AdapterKey, VllmBlockHasher
from services.common.model_tokenizer import ModelTokenizer

# Components whose output depends on a split's text alone (tokenizers 0.23). Metaspace also
# reads a split's offset, which pieces keep (module docstring); anything else, a component
# added later included, makes every text one piece.
_NORMALIZERS = frozenset(
    {"BertNormalizer", "Strip", "StripAccents", "NFC", "NFD", "NFKC", "NFKD", "Lowercase",
     "Nmt", "Precompiled", "Replace", "Prepend", "ByteLevel", "Sequence"}
)  # fmt: skip
_PRE_TOKENIZERS = frozenset(
    {"BertPreTokenizer", "ByteLevel", "CharDelimiterSplit", "Metaspace", "Whitespace",
     "WhitespaceSplit", "Split", "Punctuation", "Digits", "UnicodeScripts", "FixedLength",
     "Sequence"}
)  # fmt: skip
_MODELS = frozenset({"BPE", "WordPiece", "WordLevel", "Unigram"})
# Post-processors that add fixed ids around the sequence (ByteLevel's changes offsets only).
_POST_PROCESSORS = frozenset(
    {"TemplateProcessing", "BertProcessing", "RobertaProcessing", "ByteLevel", "Sequence"}
)
# A record keeps the digest of every this many blocks, where the hash chain can resume (at
# most this many less one blocks hashed again), not all of them (32 bytes each for SHA-256,
# which would cost more than the ids of a 16-token block).
_CHECKPOINT = 8
# Texts to learn a post-processor's fixed ids from, and check them on.
_PROBES = ("hello world", "a", " x  y\n", "")

Affixes = tuple[tuple[int, ...], tuple[int, ...]]
_Items = TypeVar("_Items", bytes, "array[int]")
_KEY_BYTES = 32  # a piece's SHA-256


@dataclass(frozen=True, slots=True)
class CutToken:
    """An added token of a tokenizer, and whether a text may be cut right before it."""

    content: str
    id: int
    safe: bool
    reason: str  # why not ("" where safe)


def cut_points(model: ModelTokenizer) -> tuple[CutToken, ...]:
    """Every added token of `model`'s Rust backend (none for a Python tokenizer), in id
    order, with whether a text may be cut before its occurrences (module docstring)."""
    return _analyse(model)[0]


class PieceTokenizer:
    """A `ModelTokenizer` that tokenizes a text as pieces cut before each safe added-token
    occurrence (`cut_points`), with ids equal to tokenizing it whole. Immutable, thread-safe."""

    def __init__(self, model: ModelTokenizer) -> None:
        """Reads `model`'s backend once (its JSON, a few tokenizations to learn the
        post-processor's ids); changes nothing of `model`'s."""
        self.model = model
        self.tokens, affixes, self._scan = _analyse(model)
        # With no safe token the whole text is one piece, tokenized as `model` tokenizes it.
        self.cuts = affixes is not None and any(t.safe for t in self.tokens)
        self._affixes: dict[bool, Affixes] = affixes or {True: ((), ()), False: ((), ())}
        self._safe = frozenset(t.content for t in self.tokens if t.safe)
        backend = model.backend
        ids = max(model.vocab_size, backend.get_vocab_size(True) if backend else 0)
        self.typecode = "H" if ids <= 1 << 16 else "I"  # an id array's

    def affixes(self, add_special_tokens: bool) -> Affixes:
        """The ids the post-processor puts before and after a text's own ids (`()`, `()`
        when it tokenizes whole: its ids then include them)."""
        return self._affixes[add_special_tokens] if self.cuts else ((), ())

    def pieces(self, text: str) -> list[str]:
        """`text` cut right before each match of a safe token (but at 0): `[text]` when
        nothing is cut. The pieces join to `text`; none is empty unless `text` is."""
        if not self.cuts:
            return [text]
        starts = self._cut_starts(text)
        if not starts:
            return [text]
        bounds = [0, *starts, len(text)]
        return [text[a:b] for a, b in pairwise(bounds)]

    def piece_ids(self, pieces: Sequence[str], add_special_tokens: bool) -> list[list[int]]:
        """Each piece's ids without the post-processor's (`affixes`), tokenized in one batch
        (in parallel in the Rust backend); when nothing is cut, the one piece's ids as
        `model.encode` gives them, affixes included. Raises `TypeError` for text that is not
        Unicode (a lone surrogate)."""
        if not self.cuts:
            return [self.model.encode(p, add_special_tokens) for p in pieces]
        if not pieces:
            return []
        backend = self.model.backend
        assert backend is not None  # `cuts` needs one
        batch = backend.encode_batch_fast(list(pieces), add_special_tokens=False)
        return [e.ids for e in batch]

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        """`text`'s ids, equal to `model.encode(text, add_special_tokens)`, tokenized as
        pieces (in parallel); raises as `piece_ids` does."""
        head, tail = self.affixes(add_special_tokens)
        out = list(head)
        for ids in self.piece_ids(self.pieces(text), add_special_tokens):
            out += ids
        out += tail
        return out

    def _cut_starts(self, text: str) -> list[int]:
        """Where safe tokens' matches start in `text`, ascending, 0 left out."""
        scan = self._scan
        if scan.disjoint:
            # No two tokens can overlap: every occurrence is a match, each group's own.
            starts: list[int] = []
            for pattern in scan.patterns:
                starts += [m.start() for m in pattern.finditer(text)]
            starts.sort()
        else:
            starts = [m.start() for m in scan.patterns[0].finditer(text) if m[0] in self._safe]
        if starts and starts[0] == 0:
            del starts[0]
        return starts


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


@dataclass(frozen=True, slots=True)
class _Scan:
    """How to find the cut points: one pattern per first character over the safe tokens
    (`disjoint`: no two tokens can overlap, so every occurrence is a match), else one
    pattern over every token that can consume text, in tokenizers' leftmost-longest order."""

    patterns: tuple[re.Pattern[str], ...]
    disjoint: bool


_Analysis = tuple[tuple[CutToken, ...], dict[bool, Affixes] | None, _Scan]


def _analyse(model: ModelTokenizer) -> _Analysis:
    """`model`'s added tokens with their verdicts, the post-processor's fixed ids per
    `add_special_tokens` (None: where texts are never cut), and how to find cut points."""
    backend = model.backend
    none = _Scan((), True)
    if backend is None:
        return (), None, none
    spec = json.loads(backend.to_str())
    added: list[dict[str, Any]] = sorted(spec.get("added_tokens") or [], key=lambda a: a["id"])
    whole = _whole_reason(model, spec)
    affixes = None if whole else _learn_affixes(model)
    if not whole and affixes is None:
        whole = "the post-processor adds more than fixed ids around the text"
    any_single_word = any(a["single_word"] for a in added)
    tokens = tuple(
        CutToken(a["content"], a["id"], not reason, reason)
        for a in added
        for reason in [whole or _token_reason(a, any_single_word)]
    )
    if whole:
        return tokens, None, none
    # Only tokens matched on the raw text split it before anything else runs (the
    # normalized ones are matched within those splits).
    raw = sorted({a["content"] for a in added if not a["normalized"] and a["content"]})
    safe = sorted({t.content for t in tokens if t.safe})
    if _disjoint(raw):
        groups: dict[str, list[str]] = {}
        for content in safe:
            groups.setdefault(content[0], []).append(content)
        # A pattern per first character starts with a literal, which `re` finds fastest.
        scan = _Scan(tuple(re.compile(_trie_pattern(g)) for g in groups.values()), True)
    else:
        scan = _Scan((re.compile(_trie_pattern(raw)),), False)
    return tokens, affixes, scan


def _whole_reason(model: ModelTokenizer, spec: dict[str, Any]) -> str:
    """Why no text of `model` may be cut ("" where texts may be)."""
    backend = model.backend
    assert backend is not None
    if backend.encode_special_tokens:
        return "split_special_tokens is on"
    for kind, known in (("normalizer", _NORMALIZERS), ("pre_tokenizer", _PRE_TOKENIZERS),
                        ("post_processor", _POST_PROCESSORS)):  # fmt: skip
        unknown = sorted(set(_types(spec.get(kind))) - known)
        if unknown:
            return f"{kind} {', '.join(unknown)} is not known to work on each split alone"
    model_spec = spec.get("model") or {}
    if model_spec.get("type") not in _MODELS:
        return f"model {model_spec.get('type')} is not known to work on each word alone"
    if model_spec.get("dropout"):
        return "BPE dropout makes ids random"
    return ""


def _token_reason(added: dict[str, Any], any_single_word: bool) -> str:
    """Why a text may not be cut before token `added` ("" where it may)."""
    content: str = added["content"]
    if not content:
        return "empty"
    if added["normalized"]:
        return "normalized (matched within splits, after the normalizer)"
    if added["lstrip"]:
        return "lstrip (takes the whitespace left of the cut)"
    if added["single_word"]:
        return "single_word (its match depends on the character left of the cut)"
    first = content[0]
    if first.isspace():  # all of Unicode's White_Space, which tokenizers' `\s` is
        return "starts with whitespace (an rstrip token left of the cut would take it)"
    if any_single_word and not (first.isascii() and not first.isalnum() and first != "_"):
        return "starts with a word character (a single_word token left of the cut sees it)"
    return ""


def _types(spec: Any) -> Iterable[str]:
    """The component types in a normalizer, pre-tokenizer or post-processor spec, those
    inside a Sequence included."""
    if not isinstance(spec, dict):
        return
    yield str(spec.get("type"))
    for key in ("normalizers", "pretokenizers", "processors"):
        for inner in spec.get(key) or ():
            yield from _types(inner)


def _learn_affixes(model: ModelTokenizer) -> dict[bool, Affixes] | None:
    """The ids the post-processor puts before and after a text, per `add_special_tokens`,
    learnt from `_PROBES` and checked on all of them; None where no fixed ids explain all."""
    out: dict[bool, Affixes] = {False: ((), ())}
    bare = [model.encode(p, False) for p in _PROBES]
    full = [model.encode(p, True) for p in _PROBES]
    first, inner = full[0], bare[0]
    for at in range(len(first) - len(inner) + 1):
        if first[at : at + len(inner)] != inner:
            continue
        head, tail = tuple(first[:at]), tuple(first[at + len(inner) :])
        if all(f == [*head, *b, *tail] for f, b in zip(full, bare, strict=True)):
            out[True] = (head, tail)
            return out
    return None


def _disjoint(tokens: Sequence[str]) -> bool:
    """Whether no two occurrences of `tokens` can overlap: none holds another, and no
    token's proper suffix is another's (or its own) proper prefix."""
    prefixes = {t[:i] for t in tokens for i in range(1, len(t))}
    if any(t[i:] in prefixes for t in tokens for i in range(1, len(t))):
        return False
    return not any(a != b and a in b for a in tokens for b in tokens)


def _trie_pattern(tokens: Sequence[str]) -> str:
    """A regex matching `tokens` leftmost-longest, as tokenizers' Aho-Corasick does: a trie
    whose nodes try their children before ending (the longest match at a position first)."""
    trie: dict[str, Any] = {}
    for token in tokens:
        node = trie
        for ch in token:
            node = node.setdefault(ch, {})
        node[""] = {}  # a token ends here

    def emit(node: dict[str, Any]) -> str:
        branches = [re.escape(ch) + emit(child) for ch, child in sorted(node.items()) if ch]
        ends = "" in node
        if not branches:
            return ""
        if len(branches) == 1 and not ends:
            return branches[0]
        return "(?:" + "|".join(branches) + ("|)" if ends else ")")

    return emit(trie)


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
