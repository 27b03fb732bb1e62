"""An Anthropic Messages request (`/v1/messages`) as the chat-completion request vLLM 0.32 makes
of it, so that its prompt token ids come out of `openai_api.PromptTokenizer` exactly as vLLM's
engine gets them.

vLLM checks the body against its request model (vllm/entrypoints/anthropic/protocol.py), then
turns it into a chat completion request (`AnthropicServingMessages.to_chat_completion_request`,
vllm/entrypoints/anthropic/serving.py) and renders that as any chat request. What it does, and
`chat_body` does the same:

- the top-level `system` (a string, or its text blocks joined with no separator, a block
  starting "x-anthropic-billing-header" left out) becomes the first message; a `system` message
  among the messages (vLLM's own extension) stays where it is, or, for a chat template that
  only takes a system message first, is merged into that first one (`TemplateTraits`);
- a message's text blocks become its content (one string, or a list of text parts), empty ones
  dropped; its `thinking` blocks its `reasoning`, joined with no separator; `redacted_thinking`
  and `tool_reference` blocks and `cache_control` are ignored; `tool_use` blocks become tool
  calls (the input as JSON arguments);
- a user message's `tool_result` blocks become `tool` messages before it (text blocks joined
  with "\\n", other blocks dropped, a `tool_reference` as a second tool message); an assistant
  message's become a text part "Tool result: " + the content as Python prints it; a user
  message left with no content is dropped, an assistant message is kept even empty;
- the tools (`input_schema` as parameters, with `"type": "object"` added where it has no type),
  after the `tool_addition` / `tool_removal` blocks of system messages; `tool_choice` auto, any
  (required), none or a named tool; with tools and no `tool_choice`, "auto";
- `thinking.type` "disabled" sets the reasoning effort the server probed (`TemplateTraits`),
  `output_config.effort` sets it otherwise; `thinking` "adaptive", the output format and the
  sampling fields do not change the prompt; `thinking` "enabled" sets a thinking budget, which
  vLLM's engine refuses (400) unless started with a reasoning parser, and kvsched starts it
  with none: refused here too;
- `chat_template_kwargs`, `kv_transfer_params` and `cache_salt` pass as they are.

Malformed bodies are refused (`ApiError` 400) where vLLM's model refuses them. vLLM's model is
pydantic's in its lax mode, which takes "64" or 64.0 for 64 and "true" for true: those are
refused here, every field must have its JSON type. Also refused:

- an `image` block that has a source, or an image in a tool result (vLLM refuses them too for
  a text-only model, the only kind served here);
- a `tool_use` block without an id: vLLM makes one from the clock (`call_<unix seconds>`),
  which templates that print tool call ids would show;
- a system message among the messages, or `thinking` disabled, where the template's traits
  are not given (`chat_body`'s `traits`): their prompt depends on the template.

Sampling fields are not copied into the chat body (vLLM's ranges for them differ from the
chat path's checks); a Router forwarding the original body lets vLLM check them.

This module assembles the chat body; the request's fields are checked in `anthropic_request`
(its messages, blocks and tools in `anthropic_content`), converted in `anthropic_conversation`,
and the template's traits probed in `anthropic_template_traits`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from services.common.inference_api.anthropic_conversation import (
    chat_tool,
    chat_tool_choice,
    conversation,
    has_inline_system,
)
from services.common.inference_api.anthropic_request import MessagesRequest
from services.common.inference_api.anthropic_template_traits import TemplateTraits, template_traits
from services.common.inference_api.vllm_extension_fields import is_unset_template_argument
from services.common.serving.api_errors import bad_request

# `template_traits` is part of this module's interface: callers probe the traits here and hand
# them to `chat_body`.
__all__ = ["TemplateTraits", "chat_body", "session_id", "template_traits"]

Json = dict[str, Any]


def chat_body(body: Mapping[str, Any], traits: TemplateTraits | None = None) -> dict[str, Any]:
    """The chat-completion body (for `openai_api.parse_request("chat", ...)`) whose prompt is
    the one vLLM renders for the Messages request `body`, with `model`, `max_tokens`, `stream`
    and the session (`user`, see `session_id`) as well. `traits`: the model's
    (`template_traits`); without them a body whose prompt depends on them (a system message
    among the messages, `thinking` disabled) is refused. Raises `ApiError` 400 for a body vLLM
    refuses, and for what the module docstring lists."""
    if not isinstance(body, Mapping):
        raise bad_request("request body must be a JSON object")
    request = MessagesRequest(body)
    merge = False
    if has_inline_system(request.messages):
        merge = _needs_traits(traits, "a system message among the messages").merge_inline_system
    out: Json = {
        "model": request.model,
        "messages": conversation(request, merge),
        "max_tokens": request.max_tokens,
    }
    if request.stream:
        out["stream"] = True
        out["stream_options"] = {"include_usage": True}  # vLLM asks for usage when streaming
    kwargs = request.template_kwargs
    tools = request.tools()
    if tools is not None:
        if tools:
            out["tools"] = [chat_tool(tool) for tool in tools]
        elif is_unset_template_argument(kwargs.get("tools")):
            # vLLM hands the template an empty tool list, which a chat request cannot carry:
            # the template argument does the same (it stands in for the request's tools).
            kwargs = {**kwargs, "tools": []}
        choice = chat_tool_choice(request.tool_choice, tools)
        if choice is not None and tools:
            out["tool_choice"] = choice
    effort = request.effort
    if request.thinking_disabled:
        effort = _needs_traits(traits, "thinking disabled").disabled_thinking_effort
    if effort is not None:
        out["reasoning_effort"] = effort
    if kwargs:
        out["chat_template_kwargs"] = kwargs
    for key in ("cache_salt", "kv_transfer_params"):
        if body.get(key) is not None:
            out[key] = body[key]
    session = session_id(body)
    if session is not None:
        out["user"] = session
    return out


def session_id(body: Mapping[str, Any]) -> str | None:
    """`metadata.user_id` when it is a non-empty string (Claude Code's session id), else
    `None`; never raises."""
    metadata = body.get("metadata") if isinstance(body, Mapping) else None
    user = metadata.get("user_id") if isinstance(metadata, dict) else None
    return user if isinstance(user, str) and user else None


def _needs_traits(traits: TemplateTraits | None, what: str) -> TemplateTraits:
    if traits is None:
        raise bad_request(
            f"the prompt of a Messages request with {what} depends on the model's chat "
            "template, which this server did not probe"
        )
    return traits
