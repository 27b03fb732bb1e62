"""The Router's tokenizer: how many tokens a prompt has at least, known before it is
tokenized.

A token stands for at most `max_token_bytes` UTF-8 bytes of the prompt (the longest piece of
the vocabulary), so a prompt of `n` bytes has at least `ceil(n / max_token_bytes)` tokens.
That bound costs one pass over the text, where tokenizing a 10 MB prompt takes seconds and a
gigabyte and a half: a prompt the bound alone puts beyond the context is refused without it.

The bound holds only where one token cannot stand for more text than its piece spells: a BPE
model (byte-level, or without fused unknowns) behind normalizers that never shorten the text.
For any other tokenizer `max_token_bytes` is `None` and nothing is refused early.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from services.common.inference_api.chat_content_format import ContentFormatOption
from services.common.inference_api.openai_api import CompletionRequest, PromptTokenizer

# The most JSON bytes one byte of text can take: a control character escaped as \u0001.
JSON_ESCAPE_BYTES = 6
# Room in a body for what is not the prompt: sampling fields, stop strings, tools, a schema.
BODY_OVERHEAD_BYTES = 1 << 20
# The longest UTF-8 character: what one unknown character costs a BPE without byte fallback.
_MAX_CHAR_BYTES = 4


class RouterTokenizer(PromptTokenizer):
    """The Router's tokenizer: a `PromptTokenizer` that also knows the fewest tokens a
    request's prompt can have (`least_tokens`) without tokenizing it."""

    def __init__(
        self,
        path: str | Path | None = None,
        *,
        chat_template: str | None = None,
        content_format: ContentFormatOption = "auto",
    ) -> None:
        super().__init__(path, chat_template=chat_template, content_format=content_format)
        backend = self.model.backend
        # A Python tokenizer's rules are its own code: no bound is known.
        self.max_token_bytes = (
            None if backend is None else max_token_bytes(json.loads(backend.to_str()))
        )

    def least_tokens(self, request: CompletionRequest) -> int:
        """`least_tokens` with this tokenizer's `max_token_bytes`."""
        return least_tokens(request, self.max_token_bytes)


def least_tokens(request: CompletionRequest, max_token_bytes: int | None) -> int:
    """A lower bound on the prompt's token count (0: none known): a token-id prompt's length,
    else its text's (a chat's message contents summed) UTF-8 bytes over `max_token_bytes`
    (`None`: not known). The chat template and special tokens only add to it."""
    if request.prompt_ids is not None:
        return len(request.prompt_ids)
    chat = request.chat
    if chat is not None and chat.forwarded_ids is not None:
        return len(chat.forwarded_ids)
    if max_token_bytes is None:
        return 0
    if request.prompt_text is not None:
        size = _utf8_len(request.prompt_text)
    elif chat is not None:
        size = sum(_utf8_len(text) for text in _message_texts(chat.messages))
    else:
        return 0
    return math.ceil(size / max_token_bytes)


def body_bytes_bound(max_model_len: int, max_token_bytes: int | None) -> int | None:
    """The longest request body a prompt within `max_model_len` tokens can need; `None` where
    `max_token_bytes` is not known. Each token stands for at most `max_token_bytes` bytes of
    text, each byte spelled in JSON in at most `JSON_ESCAPE_BYTES` (a control character as
    `\\u0001`), plus `BODY_OVERHEAD_BYTES` for the other fields (sampling, a schema). A chat
    message's own JSON (role, braces: tens of bytes) is within what one token allows, and a
    template spends tokens on each message."""
    if max_token_bytes is None:
        return None
    return max_model_len * max_token_bytes * JSON_ESCAPE_BYTES + BODY_OVERHEAD_BYTES


def max_token_bytes(spec: dict[str, Any]) -> int | None:
    """The most prompt bytes one token of the tokenizer `spec` (a `tokenizer.json`) stands
    for; `None` where that is unbounded or not known (see the module docstring)."""
    model = spec.get("model") or {}
    if model.get("type") != "BPE" or not _never_shortens(spec.get("normalizer")):
        return None
    if _has_type(spec.get("pre_tokenizer"), "ByteLevel"):
        # Each character of a byte-level piece stands for one byte of the text.
        longest = max(map(len, model.get("vocab", {})), default=0)
    elif model.get("fuse_unk"):
        return None  # one unknown token for a whole run of unknown characters
    else:
        longest = max((len(p.encode()) for p in model.get("vocab", {})), default=0)
        longest = max(longest, _MAX_CHAR_BYTES)  # an unknown character
    added = [str(t.get("content", "")) for t in spec.get("added_tokens") or []]
    longest = max([longest, *(len(text.encode()) for text in added)])
    return longest or None


def _never_shortens(normalizer: dict[str, Any] | None) -> bool:
    """Whether the normalizer only keeps or lengthens the text (then a normalized piece's
    bytes bound the prompt bytes it came from): none, prepending, or replacing a string by
    one at least as long, as Llama 2's sentencepiece-style tokenizers do."""
    if normalizer is None:
        return True
    kind = normalizer.get("type")
    if kind == "Sequence":
        return all(_never_shortens(n) for n in normalizer.get("normalizers", []))
    if kind == "Prepend":
        return True
    if kind == "Replace":
        pattern = normalizer.get("pattern", {}).get("String")
        content = normalizer.get("content", "")
        return isinstance(pattern, str) and len(content.encode()) >= len(pattern.encode())
    return False  # NFC, lowercasing, stripping ...: any of them may shorten the text


def _has_type(node: dict[str, Any] | None, kind: str) -> bool:
    if node is None:
        return False
    parts = node.get("pretokenizers") or []
    return node.get("type") == kind or any(_has_type(p, kind) for p in parts)


def _message_texts(messages: list[Any]) -> list[str]:
    """The text of each message's content (a string, or its text parts)."""
    texts = []
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            texts.append(content)
        elif isinstance(content, list):
            texts += [p["text"] for p in content if isinstance(p, dict) and _is_text(p)]
    return texts


def _is_text(part: dict[str, Any]) -> bool:
    return isinstance(part.get("text"), str)


def _utf8_len(text: str) -> int:
    # A lone surrogate (JSON allows "\ud800") is not UTF-8, but still text to tokenize.
    return len(text.encode("utf-8", "surrogatepass"))
