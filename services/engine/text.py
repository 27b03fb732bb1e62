"""Deterministic output text: the same request always produces the same words."""

from __future__ import annotations

import json
import re
from array import array
from collections.abc import Sequence

import xxhash

from services.common.inference_api.openai_api import PromptTokenizer

_WORD = re.compile(r" [a-z]{2,12}")
MAX_WORDS = 512
_MIX = 0x9E3779B97F4A7C15
_M64 = (1 << 64) - 1


class Words:
    """Vocabulary tokens that decode to one clean lowercase word with a leading space, with
    each word pre-encoded as a JSON string (chunks are built without calling json.dumps)."""

    def __init__(self, tokenizer: PromptTokenizer, seed: int) -> None:
        words = []
        for token_id in range(tokenizer.vocab_size):
            text = tokenizer.decode([token_id])
            if _WORD.fullmatch(text):
                words.append(text)
                if len(words) == MAX_WORDS:  # enough variety; a big vocabulary starts fast
                    break
        if not words:
            raise ValueError("the tokenizer has no plain-word tokens to generate text with")
        self.words = words
        self.json = [json.dumps(w).encode() for w in words]
        self._inner = [j[1:-1] for j in self.json]  # without the quotes, to join
        self.seed = seed

    def start(self, prompt_ids: Sequence[int]) -> int:
        """A request's position in the word sequence, from its prompt."""
        return xxhash.xxh3_64_intdigest(array("I", prompt_ids).tobytes(), seed=self.seed)

    def index(self, start: int, i: int) -> int:
        """Which word is token `i` of the request starting at `start`."""
        x = (start + (i + 1) * _MIX) & _M64  # splitmix64: a cheap, well-mixed hash of (start, i)
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
        return (x ^ (x >> 31)) % len(self.words)

    def text(self, start: int, lo: int, hi: int) -> str:
        """Tokens `lo` to `hi` (exclusive) of the request starting at `start`, as text."""
        words, index = self.words, self.index
        return "".join([words[index(start, i)] for i in range(lo, hi)])

    def json_text(self, start: int, lo: int, hi: int) -> bytes:
        """The same text as a JSON string, from the words' pre-encoded forms."""
        if hi - lo == 1:
            return self.json[self.index(start, lo)]
        inner, index = self._inner, self.index
        return b'"' + b"".join([inner[index(start, i)] for i in range(lo, hi)]) + b'"'
