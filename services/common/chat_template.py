"""Chat templates, rendered exactly as transformers' `apply_chat_template` renders them.

vLLM's OpenAI server renders a chat with the model's template through transformers
(vllm/renderers/hf.py calls `tokenizer.apply_chat_template(..., tokenize=False)`), so the text
(hence the token ids) the engine sees is what transformers' `render_jinja_template`
(transformers/utils/chat_template_utils.py) makes of it: a sandboxed, immutable jinja2
environment with `trim_blocks`, `lstrip_blocks` and the loop-control extension, a `tojson`
filter that does not escape HTML, `raise_exception` and `strftime_now` as globals, and the
"continue the final message" trick below. This module does the same with jinja2 alone.

A template that fails or raises is the client's problem (a template raises to refuse what it
cannot render: an unknown role, a misplaced system message): `ApiError` 400 with its message.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from services.common.api_errors import bad_request
from services.common.chat_content_format import ContentFormat, content_format

# transformers marks the end of the message to continue with this, renders, and cuts there.
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class _Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`, which transformers' templates may use to mark
    the assistant's text (for training masks): rendered as its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_body")
        return nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _body(self, caller: Callable[[], str]) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(
    value: object,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # transformers' filter: unlike jinja2's own it escapes no HTML and takes json.dumps' options.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


_ENV = _environment()


@lru_cache(maxsize=32)
def _compiled(source: str) -> jinja2.Template:
    return _ENV.from_string(source)


class ChatTemplate:
    """One chat template: compiled once (a syntax error raises `jinja2.TemplateSyntaxError`
    here), rendered as transformers renders it."""

    def __init__(self, source: str) -> None:
        self.source = source
        self._template = _compiled(source)
        self.content_format: ContentFormat = content_format(self._template, source)
        # vLLM turns "developer" messages into "system" ones unless the template names the role.
        self.knows_developer = '"developer"' in source or "'developer'" in source

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: list[dict[str, Any]] | None,
        documents: list[Any] | None,
        add_generation_prompt: bool,
        continue_final_message: bool,
        variables: Mapping[str, Any],
    ) -> str:
        """The prompt text; `variables` are the special tokens and the request's template
        arguments. Raises `ApiError` 400 where transformers raises, with its message."""
        if not messages:
            raise bad_request(
                "Cannot apply chat template to an empty conversation. Provide at least one "
                "message.",
                "messages",
            )
        if continue_final_message and add_generation_prompt:
            raise bad_request(
                "continue_final_message and add_generation_prompt are not compatible. Use "
                "continue_final_message when you want the model to continue the final "
                "message, and add_generation_prompt when you want to add a header that will "
                "prompt it to start a new assistant message instead."
            )
        final = ""
        if continue_final_message:
            messages, final = self._mark_final(messages)
        try:
            text = self._template.render(
                messages=messages,
                tools=tools,
                documents=documents,
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except Exception as exc:  # what the template raised (vLLM answers all of it with a 400)
            raise bad_request(f"The chat template failed: {exc}") from None
        return _cut_at_mark(text, final) if continue_final_message else text

    def _mark_final(
        self, messages: Sequence[Mapping[str, Any]]
    ) -> tuple[list[dict[str, Any]], str]:
        """`messages` with the tag after the final message's text, and that text."""
        marked = [dict(m) for m in messages]
        content = marked[-1].get("content")
        if content is None:
            raise bad_request(
                'continue_final_message is set but the final message has no "content" to continue!'
            )
        if "content" not in self.source:
            raise bad_request(
                'continue_final_message is set to "content" but this is not an accepted '
                "field in the chat_template"
            )
        if isinstance(content, list):
            parts = copy.deepcopy(content)
            for part in reversed(parts):
                if "text" in part:  # the last text part is the one continued
                    final = part["text"]
                    part["text"] = final + _CONTINUE_TAG
                    break
            else:
                raise bad_request(
                    "continue_final_message is set but we could not find any text to continue "
                    "in the final message!"
                )
            marked[-1]["content"] = parts
            return marked, str(final)
        marked[-1]["content"] = content + _CONTINUE_TAG
        return marked, str(content)


def _cut_at_mark(text: str, final: str) -> str:
    """The rendered chat up to the end of the final message's text, as transformers cuts it."""
    mark = _CONTINUE_TAG.strip()
    if final.strip() not in text or mark not in text:
        raise bad_request(
            "continue_final_message is set but the final message does not appear in the chat "
            "after applying the chat template! This can happen if the chat template deletes "
            "portions of the final message."
        )
    at = text.rindex(mark)
    if text[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return text[:at]
    return text[:at].rstrip()  # the template trimmed the space after the tag
