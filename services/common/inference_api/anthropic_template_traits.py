"""What vLLM's Anthropic Messages serving learns from the model's chat template when it starts
(`TemplateTraits`), probed the same way (`template_traits`): whether inline system messages
are merged into the first one, and the reasoning effort `thinking` disabled stands for."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox

from services.common.inference_api.anthropic_request import EFFORTS
from services.common.inference_api.openai_api import PromptTokenizer, parse_request
from services.common.serving.api_errors import ApiError

Json = dict[str, Any]


@dataclass(frozen=True, slots=True)
class TemplateTraits:
    """What vLLM's Messages serving learns from the model's chat template (`template_traits`)."""

    # Inline system messages are merged into the first one: the template refuses a system
    # message after the first message.
    merge_inline_system: bool
    # The reasoning effort `thinking: {"type": "disabled"}` stands for: "none", or "low" where
    # the template takes "none" like some other effort, or refuses it.
    disabled_thinking_effort: str


def template_traits(tokenizer: PromptTokenizer, chat_template: str | None = None) -> TemplateTraits:
    """The traits vLLM probes from the chat template `tokenizer` renders with (`chat_template`:
    the server's `--chat-template` text, as `PromptTokenizer` got it): vLLM's
    `_should_merge_inline_system` and `_probe_disabled_thinking_effort`. Raises what the
    template raises when rendered other than a `jinja2.TemplateError` (vLLM would not start)."""
    no_tools: tuple[list[Json] | None, ...] = (None, [])  # vLLM checks both templates
    sources = (_template_source(tokenizer, chat_template, tools) for tools in no_tools)
    merge = any(_needs_system_first(source) for source in sources)
    return TemplateTraits(merge, _disabled_thinking_effort(tokenizer))


def _template_source(
    tokenizer: PromptTokenizer, chat_template: str | None, tools: list[Json] | None
) -> str | None:
    """The template vLLM resolves (`resolve_chat_template`): the server's, else the
    tokenizer's choice for `tools`; `None` where there is none."""
    try:
        return str(tokenizer.model.hf.get_chat_template(chat_template, tools=tools))
    except (ValueError, TypeError):  # transformers: no template, or no such named one
        return None


def _needs_system_first(source: str | None) -> bool:
    """Whether the template refuses a system message after the first message, as vLLM finds
    out (`_detect_merge_inline_system`): rendered plainly (none of transformers' helpers, so a
    template calling `raise_exception` fails too) for [system, user, system, user]."""
    if not source:
        return True
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    turns = [{"role": role, "content": "t"} for role in ("system", "user", "system", "user")]
    try:
        env.from_string(source).render(messages=turns, add_generation_prompt=False)
    except jinja2.TemplateError:
        return True
    return False


def _disabled_thinking_effort(tokenizer: PromptTokenizer) -> str:
    """vLLM's `_probe_disabled_thinking_effort`: "none", unless the template refuses it or
    renders it as one of the efforts, then "low"."""
    none = _probe(tokenizer, "none")
    if none is None or any(_probe(tokenizer, effort) == none for effort in EFFORTS):
        return "low"
    return "none"


def _probe(tokenizer: PromptTokenizer, effort: str) -> tuple[list[int], str] | None:
    body = {"messages": [{"role": "user", "content": "Hi"}], "reasoning_effort": effort}
    try:
        request = parse_request("chat", body)
        assert request.chat is not None
        return tokenizer.prompt_ids(request), tokenizer.render_chat(request.chat)
    except ApiError:
        return None
