"""A model's tokenizer directory, read as transformers (and so vLLM) reads it.

A directory holds `tokenizer.json` (HF `tokenizers`) and, for a chat model,
`tokenizer_config.json` and possibly `chat_template.jinja`. What of it changes the token ids
vLLM feeds its model, and is followed here:

- the chat templates: `chat_template.jinja` (named "default") and
  `additional_chat_templates/*.jinja`, else `tokenizer_config.json`'s `chat_template`, a
  string or a list of named templates;
- the special tokens templates see (`bos_token`, `eos_token`, ... and any other `*_token`
  string of the config; a legacy `special_tokens_map.json` overrides them, as in transformers);
- `split_special_tokens` (special tokens written in a prompt are then plain text).

What adds BOS to a completion is `tokenizer.json`'s post-processor, as it is: with a
`tokenizer.json`, transformers drops the config's `add_bos_token` and `add_eos_token`.

Only tokenizers transformers takes from `tokenizer.json` as they are
(`tokenizer_class` "PreTrainedTokenizerFast") are accepted: for other classes transformers
rebuilds the tokenizer from the vocabulary with rules of its own.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib.abc import Traversable
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from kvsched.data_files import data_path

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"
TEMPLATES_DIR = "additional_chat_templates"
SPECIAL_TOKENS_FILE = "special_tokens_map.json"
_AS_IS_CLASSES = frozenset({"PreTrainedTokenizerFast", "TokenizersBackend"})
_NAMED_TOKENS = (
    "bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token",
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class TokenizerDir:
    """The tokenizer, the special tokens by name, and the chat templates by name (none for a
    model without one)."""

    tokenizer: Tokenizer
    special_tokens: dict[str, str]
    chat_templates: dict[str, str]

    @classmethod
    def load(cls, path: str | Path | None = None) -> TokenizerDir:
        """From a directory, or a `tokenizer.json` (with the files beside it); `None`: the
        demo model's (`kvsched/data/tokenizer/`). Raises `OSError`, or `ValueError` for a
        directory that cannot be read as transformers reads it."""
        if path is None:
            where: Traversable = data_path("tokenizer")
            tokenizer_file = where.joinpath(TOKENIZER_FILE)
        else:
            given = Path(path)
            where = given if given.is_dir() else given.parent
            tokenizer_file = where / TOKENIZER_FILE if given.is_dir() else given
        tokenizer = Tokenizer.from_str(tokenizer_file.read_text(encoding="utf-8"))
        config = _json(where.joinpath(CONFIG_FILE))
        if config is None:  # a bare tokenizer.json: taken as it is, no chat template
            return cls(tokenizer, {}, {})
        kind = config.get("tokenizer_class")
        if kind not in _AS_IS_CLASSES:
            raise ValueError(
                f"{where}: tokenizer_class {kind!r} is not supported: transformers rebuilds "
                "such tokenizers from their vocabulary, so tokenizer.json alone may not "
                f"tokenize as vLLM does (supported: {sorted(_AS_IS_CLASSES)})"
            )
        special = _special_tokens(config, _json(where.joinpath(SPECIAL_TOKENS_FILE)))
        missing = sorted(t for t in special.values() if tokenizer.token_to_id(t) is None)
        if missing:
            # transformers would add them as new tokens, with ids of its own.
            raise ValueError(f"{where}: special tokens {missing} are not in {TOKENIZER_FILE}")
        tokenizer.encode_special_tokens = bool(config.get("split_special_tokens", False))
        # transformers truncates and pads per call (vLLM asks for neither within the context).
        tokenizer.no_truncation()
        tokenizer.no_padding()
        return cls(tokenizer, special, _chat_templates(where, config))


def _json(file: Traversable) -> dict[str, Any] | None:
    if not file.is_file():
        return None
    value = json.loads(file.read_text(encoding="utf-8"))
    if not isinstance(value, dict):
        raise ValueError(f"{file}: not a JSON object")
    return value


def _token(value: object) -> str | None:
    """A special token's text: a string, or a serialized `AddedToken`."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _special_tokens(config: dict[str, Any], legacy: dict[str, Any] | None) -> dict[str, str]:
    """The tokens transformers' `special_tokens_map` holds, which templates see by name."""
    named: dict[str, Any] = {k: config.get(k) for k in _NAMED_TOKENS}
    named |= {k: v for k, v in config.items() if k.endswith("_token") and _token(v) is not None}
    extra = config.get("extra_special_tokens")
    if isinstance(extra, dict):
        named |= extra
    if legacy is not None and "added_tokens_decoder" not in config:
        named |= {k: v for k, v in legacy.items() if k != "extra_special_tokens"}
    return {k: token for k, v in named.items() if (token := _token(v)) is not None}


def _chat_templates(where: Traversable, config: dict[str, Any]) -> dict[str, str]:
    """The chat templates by name. Template files (transformers ≥ 4.43 saves them so:
    `chat_template.jinja` is "default", `additional_chat_templates/NAME.jinja` the others)
    replace the config's."""
    files = {"default": where.joinpath(TEMPLATE_FILE)}
    extra = where.joinpath(TEMPLATES_DIR)
    if extra.is_dir():
        files |= {
            f.name.removesuffix(".jinja"): f for f in extra.iterdir() if f.name.endswith(".jinja")
        }
    found = {name: f.read_text(encoding="utf-8") for name, f in files.items() if f.is_file()}
    if found:
        return found
    value = config.get("chat_template")
    if value is None:
        return {}
    if isinstance(value, str):
        return {"default": value}
    if isinstance(value, list) and all(
        isinstance(t, dict)
        and isinstance(t.get("name"), str)
        and isinstance(t.get("template"), str)
        for t in value
    ):
        return {t["name"]: t["template"] for t in value}
    raise ValueError(f"{where}: chat_template must be a string or a list of named templates")
