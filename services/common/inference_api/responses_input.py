"""An OpenAI Responses request (`/v1/responses`) as the chat-completion request whose prompt is
the one vLLM 0.32 renders for it, so that its prompt token ids come out of
`openai_api.PromptTokenizer` exactly as vLLM's engine gets them.

vLLM checks the body against its request model (vllm/entrypoints/openai/responses/protocol.py,
the OpenAI SDK's input item types), turns `instructions` and `input` into chat messages
(`construct_input_messages`, vllm/entrypoints/openai/responses/utils.py) and renders them as a
chat request (`OnlineRenderer.render_responses`). What it does, and `chat_body` does the same:

- `instructions` (when not empty) become a first system message; a string `input` one user
  message;
- a message item (user, system, developer) passes as it is, its `input_text` parts as text; an
  assistant message becomes one with the text of its first part only;
- `function_call` and `custom_tool_call` items become tool calls (a namespaced function's name
  as `<namespace>__<name>`, a custom tool's input as `{"input": ...}`), `reasoning` items the
  reasoning (their first content text, else their first summary text), both merged into the
  assistant message before them where it has none yet, as is an assistant's text after
  reasoning or calls; `function_call_output` and `custom_tool_call_output` items become tool
  messages;
- a last message or reasoning item whose `status` is "in_progress" or "incomplete" is
  continued (no generation prompt);
- the function tools as chat tools, namespaced functions flattened, a custom tool as a function
  of one string argument `input`; `tool_choice` checked as vLLM checks it;
- `reasoning.effort` as the reasoning effort, `chat_template_kwargs`, `kv_transfer_params` and
  `cache_salt` as they are; and, unlike a chat request, the rendered prompt tokenized with the
  tokenizer's special tokens (vLLM's default for Responses): a template that writes BOS gets a
  second one.

Sampling and output fields do not change the prompt; they are only checked for their JSON
type (vLLM checks their ranges itself when the body reaches it). vLLM's model is pydantic's in
its lax mode, which takes "64" for 64 and "true" for true: those are refused here, every field
must have its JSON type. Refused (`ApiError` 400) where vLLM refuses, and also:

- `previous_response_id`: the conversation it names is state kept by the server that answered
  it, which kvsched cannot see (a vLLM storing no responses, its default, answers 404);
- `truncation: "auto"`: vLLM would cut a prompt that does not fit the context;
- tools other than function, custom and namespace tools, and a `tool_choice` naming a hosted
  tool: vLLM drops them from the prompt, but checks them against many SDK types not followed
  here;
- tool calls in the input where the chat template prints a call's function object whole
  (`TemplateTraits`), or where the template's traits are not given: vLLM's Responses path
  hands the template the function's keys as "name", "arguments", the chat path that
  `PromptTokenizer` follows as "arguments", "name", and such a template shows the order;
- input item shapes other than those listed above (vLLM takes a few more, mostly through the
  SDK's permissive types: an item of another type carrying a `role`, an assistant message
  with no parts or with parts of mixed kinds), an assistant message whose first part is not
  text (vLLM fails on it with a 500), and output text annotations;
- images and files in messages or tool outputs (vLLM refuses them too for a text-only model,
  the only kind served here).

Sampling fields are not copied into the chat body (vLLM's ranges for them differ from the
chat path's checks); a Router forwarding the original body lets vLLM check them.

This module assembles the chat body; the request's fields are checked in `responses_fields`,
its input items converted in `responses_items`, its tools in `responses_tools`, and the
template's traits probed in `responses_template_traits`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from services.common.inference_api.responses_fields import check_fields
from services.common.inference_api.responses_items import (
    add_input_item,
    should_continue_final_message,
)
from services.common.inference_api.responses_template_traits import TemplateTraits, template_traits
from services.common.inference_api.responses_tools import chat_tool_choice, chat_tools
from services.common.inference_api.vllm_extension_fields import is_unset_template_argument
from services.common.serving.api_errors import bad_request

# `template_traits` is part of this module's interface: callers probe the traits here and hand
# them to `chat_body`.
__all__ = ["TemplateTraits", "chat_body", "template_traits"]

Json = dict[str, Any]


def chat_body(body: Mapping[str, Any], traits: TemplateTraits | None = None) -> dict[str, Any]:
    """The chat-completion body (for `openai_api.parse_request("chat", ...)`) whose prompt is
    the one vLLM renders for the Responses request `body`, with `model`, `max_tokens`
    (`max_output_tokens`), `stream`, `user` and `metadata` as well. `traits`: the model's
    (`template_traits`); without them, or where the template shows what the chat path cannot
    follow, a body with tool calls in its input is refused. Raises `ApiError` 400 for a body
    vLLM refuses, and for what the module docstring lists."""
    if not isinstance(body, Mapping):
        raise bad_request("request body must be a JSON object")
    check_fields(body)
    if body.get("previous_response_id") is not None:
        raise bad_request(
            "previous_response_id is not supported: the conversation it names is kept by the "
            "server that answered it, out of kvsched's sight; send the whole conversation in "
            "'input' instead",
            "previous_response_id",
        )
    if body.get("truncation") == "auto":
        raise bad_request(
            "truncation 'auto' is not supported: vLLM would cut a prompt over the context to "
            "fit, which the prompt's blocks cannot follow; use 'disabled'",
            "truncation",
        )
    raw_tools = body.get("tools", [])
    tools = chat_tools(raw_tools)
    choice = chat_tool_choice(body.get("tool_choice", "auto"), raw_tools)
    items = body["input"]  # a string or a list (`check_fields`)
    messages: list[Json] = []
    instructions = body.get("instructions")
    if instructions:
        messages.append({"role": "system", "content": instructions})
    if isinstance(items, str):
        messages.append({"role": "user", "content": items})
        last: Json | None = None
    else:
        for i, raw in enumerate(items):
            add_input_item(messages, raw, f"input[{i}]")
        last = items[-1] if items else None
        if (traits is None or traits.call_key_order_shows) and any(
            m.get("tool_calls") for m in messages
        ):
            raise bad_request(
                "tool calls in the input are not supported for this model: its chat template "
                "prints a call's function whole, and vLLM's Responses path orders its keys as "
                "kvsched's renderer does not",
                "input",
            )
    out: Json = {"messages": messages, "add_special_tokens": True}
    if should_continue_final_message(last):
        out["add_generation_prompt"] = False
        out["continue_final_message"] = True
    kwargs = dict(body.get("chat_template_kwargs") or {})
    if tools:
        out["tools"] = tools
        names = {tool["function"]["name"] for tool in tools}
        if isinstance(choice, str) or choice["function"]["name"] in names:
            # (A choice naming a namespace's custom tool, not shown to the model, is left out:
            # it does not change the prompt.)
            out["tool_choice"] = choice
    elif raw_tools and is_unset_template_argument(kwargs.get("tools")):
        # Tools, none of them shown to the model: vLLM hands the template an empty tool list,
        # which a chat request cannot carry; the template argument does the same.
        kwargs["tools"] = []
    reasoning = body.get("reasoning")
    effort = reasoning.get("effort") if isinstance(reasoning, dict) else None
    if effort is not None:
        out["reasoning_effort"] = effort
    if kwargs:
        out["chat_template_kwargs"] = kwargs
    fields = {"max_output_tokens": "max_tokens"}
    for key in ("model", "stream", "user", "metadata", "cache_salt", "kv_transfer_params"):
        fields[key] = key
    for key, chat_key in fields.items():
        if body.get(key) is not None:
            out[chat_key] = body[key]
    return out
