"""A model's tokenizer, loaded as vLLM loads it: transformers' `AutoTokenizer` over the model's
tokenizer directory, any tokenizer class (vllm/tokenizers/hf.py, `get_tokenizer`).

transformers builds many tokenizers (Qwen2's, Llama's, Gemma's ...) from the vocabulary with
rules of its own rather than taking `tokenizer.json` as it is, so only transformers itself
gives the ids vLLM feeds its model. What is taken from it here:

- the ids of a text: through the fast tokenizer's own Rust backend where there is one (the
  same call transformers makes, `encode_batch`, with no truncation or padding, which lets go of
  the GIL and is safe from many threads: transformers' own `encode` first resets the backend's
  truncation, so two threads must not share it), else through the Python tokenizer under a
  lock;
- the chat templates and their rendering (`apply_chat_template`, in `chat_prompt`).

Nothing is downloaded: the directory must hold the files (`local_files_only`), and no code of
the model's is run (`trust_remote_code` off, vLLM's default).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jinja2
from tokenizers import Tokenizer

from kvsched.data_files import data_path

# transformers logs that it found no PyTorch at import: tokenizers need none. It is imported
# where a tokenizer is first loaded, not with this module: a process that only parses
# requests (the Router's body worker) does without it (1.3 s of CPU and 40 MB here).
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")


class ModelTokenizer:
    """A model's tokenizer as transformers loads it (see the module docstring). Thread-safe."""

    def __init__(self, path: str | Path | None = None) -> None:
        """`path`: a tokenizer directory, or a file in one (its `tokenizer.json`); `None`: the
        demo model's (`kvsched/data/tokenizer/`). Raises `ValueError` for a directory
        transformers cannot load a tokenizer from, naming it and saying why."""
        where = data_path("tokenizer") if path is None else Path(path)
        if where.is_file():
            where = where.parent
        if not where.is_dir():
            raise ValueError(f"{where}: no such tokenizer directory")
        from transformers import AutoTokenizer  # noqa: PLC0415  (see the import note above)

        try:
            self.hf: Any = AutoTokenizer.from_pretrained(
                str(where), local_files_only=True, trust_remote_code=False
            )
        except Exception as exc:  # transformers raises OSError, ValueError, KeyError ...
            raise ValueError(f"{where}: transformers cannot load its tokenizer: {exc}") from exc
        self.directory = where
        self.backend = _private_backend(self.hf)
        self._lock = threading.Lock()
        vocab = self.hf.get_vocab()
        # vLLM's bound on prompt token ids (`max_token_id`): some tokenizers count special
        # tokens in `vocab_size` that `get_vocab` leaves out.
        self.vocab_size = max(max(vocab.values(), default=-1) + 1, int(self.hf.vocab_size))

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        """`text`'s ids as vLLM's `tokenizer(text, add_special_tokens=...)` gives them; raises
        `TypeError` for text that is not Unicode (a lone surrogate)."""
        if self.backend is not None:
            batch = self.backend.encode_batch_fast([text], add_special_tokens=add_special_tokens)
            return list(batch[0].ids)
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise TypeError(str(exc)) from None
        with self._lock:
            return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: Sequence[int]) -> str:
        with self._lock:
            return str(self.hf.decode(list(ids), skip_special_tokens=False))


def _private_backend(hf: Any) -> Tokenizer | None:
    """A copy of a fast tokenizer's Rust backend that only this object uses, set as
    transformers sets it for each call (`split_special_tokens`, no truncation or padding);
    `None` for a Python tokenizer."""
    backend = getattr(hf, "backend_tokenizer", None) if getattr(hf, "is_fast", False) else None
    if not isinstance(backend, Tokenizer):
        return None
    own = Tokenizer.from_str(backend.to_str())
    own.encode_special_tokens = bool(getattr(hf, "split_special_tokens", False))
    own.no_truncation()
    own.no_padding()
    return own


def jinja_template(source: str) -> jinja2.Template:
    """The chat template `source` compiled as transformers compiles it (its sandbox and
    extensions; cached there), as vLLM reads a template's syntax tree; raises
    `jinja2.TemplateSyntaxError`."""
    from transformers.utils.chat_template_utils import _compile_jinja_template  # noqa: PLC0415

    return _compile_jinja_template(source)  # type: ignore[no-any-return]
