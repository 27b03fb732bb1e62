"""A text tokenized as pieces, cut right before added tokens, with the ids of tokenizing it
whole: which added tokens of a tokenizer are such cut points (and why the others are not), and
`PieceTokenizer`, which cuts and tokenizes. Pieces let a session's next turn tokenize only
what is new (`session_prompts`).

A fast (Rust) tokenizer splits its input on added tokens before it normalizes and pre-tokenizes
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
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

from services.common.inference_api.model_tokenizer import ModelTokenizer

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
# Texts to learn a post-processor's fixed ids from, and check them on.
_PROBES = ("hello world", "a", " x  y\n", "")

Affixes = tuple[tuple[int, ...], tuple[int, ...]]


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
