"""What the prompt of an OpenAI Responses request depends on in the model's chat template
(`TemplateTraits`), found by rendering probes with the tokenizer (`template_traits`), for
`responses_input.chat_body` to refuse what the chat path cannot follow."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

from services.common.inference_api.openai_api import PromptTokenizer

Json = dict[str, Any]

_PROBE_TOOL: Final[Json] = {
    "type": "function",
    "function": {"name": "f", "description": "d", "parameters": {"type": "object"}},
}


@dataclass(frozen=True, slots=True)
class TemplateTraits:
    """What the prompt of a Responses request depends on in the model's chat template
    (`template_traits`)."""

    # The template shows the order of a tool call's function keys (it prints the object
    # whole, e.g. `tool_call.function | tojson`): vLLM's Responses path writes "name" before
    # "arguments", the chat path (`PromptTokenizer`'s) "arguments" first.
    call_key_order_shows: bool


def template_traits(tokenizer: PromptTokenizer, chat_template: str | None = None) -> TemplateTraits:
    """The traits of the chat template `tokenizer` renders with (`chat_template`: the server's
    `--chat-template` text, as `PromptTokenizer` got it), found by rendering a tool call with
    its function's keys in either order, with and without tools. A template that fails on
    them counts as showing the order."""
    shows = False
    for tools in (None, [_PROBE_TOOL]):
        renders = {_render_call(tokenizer, chat_template, tools, first) for first in (0, 1)}
        shows = shows or len(renders) != 1 or None in renders
    return TemplateTraits(call_key_order_shows=shows)


def _render_call(
    tokenizer: PromptTokenizer, chat_template: str | None, tools: list[Json] | None, first: int
) -> str | None:
    """A tool call rendered with its function's "arguments" (`first` 0) or "name" (1) first;
    `None` where the template fails."""
    items = [("arguments", {"a": 1}), ("name", "f")]
    function = dict(items if first == 0 else items[::-1])
    messages = [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "function": function}]},
    ]
    hf = tokenizer.model.hf
    try:
        source = hf.get_chat_template(chat_template, tools=tools)
        text = hf.apply_chat_template(
            messages, tools=tools, chat_template=source, tokenize=False, add_generation_prompt=False
        )
    except Exception:  # whatever transformers or the template raise: the order cannot be told
        return None
    return str(text)
