"""Deterministic output text: the same request always produces the same words."""

from __future__ import annotations

import json
import re
from array import array
from collections.abc import Sequence

import xxhash

from services.common.openai_api import PromptTokenizer

_WORD = re.compile(r" [a-z]{2,12}")
_MIX = 0x9E3779B97F4A7C15  # golden-ratio step: consecutive indices land far apart


class Words:
    """Vocabulary tokens that decode to one clean lowercase word with a leading space, with
    each word pre-encoded as a JSON string (chunks are built without calling json.dumps)."""

    def __init__(self, tokenizer: PromptTokenizer, seed: int) -> None:
        words = []
        for token_id in range(tokenizer.vocab_size):
            text = tokenizer.decode([token_id])
            if _WORD.fullmatch(text):
                words.append(text)
        if not words:
            raise ValueError("the tokenizer has no plain-word tokens to generate text with")
        self.words = words
        self.json = [json.dumps(w).encode() for w in words]
        self.seed = seed

    def start(self, prompt_ids: Sequence[int]) -> int:
        """A request's position in the word sequence, from its prompt."""
        return xxhash.xxh3_64_intdigest(array("I", prompt_ids).tobytes(), seed=self.seed)

    def index(self, start: int, i: int) -> int:
        """Which word is token `i` of the request starting at `start`."""
        return ((start + i * _MIX) >> 17) % len(self.words)
