"""The chat messages and tools vLLM makes of a checked Anthropic Messages request
(`AnthropicServingMessages.to_chat_completion_request`, vllm/entrypoints/anthropic/serving.py):
the system prompt and messages as chat messages (`conversation`, `has_inline_system`), the
tools as chat tools (`chat_tool`) and the tool choice as the chat one (`chat_tool_choice`)."""

from __future__ import annotations

import json
from typing import Any, Final

from services.common.inference_api.anthropic_request import MessagesRequest
from services.common.serving.api_errors import ApiError, bad_request

Json = dict[str, Any]

_CHOICES: Final = {"auto": "auto", "any": "required", "none": "none"}
_BILLING_HEADER: Final = "x-anthropic-billing-header"


def conversation(request: MessagesRequest, merge_inline_system: bool) -> list[Json]:
    """The chat messages vLLM makes of the request (`_convert_system_message`,
    `_convert_messages`)."""
    out: list[Json] = []
    parts: list[str] = []
    system = request.system
    if isinstance(system, str) and system:
        parts.append(system)
    elif isinstance(system, list):
        parts += _texts(system)
    if merge_inline_system:
        parts += [
            text for m in request.messages if m["role"] == "system" if (text := _system_text(m))
        ]
    if parts:
        out.append({"role": "system", "content": "".join(parts)})
    for message in request.messages:
        role, content = message["role"], message["content"]
        if role == "system":
            text = None if merge_inline_system else _system_text(message)
            if text:
                out.append({"role": "system", "content": text})
            continue
        converted: Json = {"role": role}
        if isinstance(content, str):
            converted["content"] = content
        else:
            _convert_blocks(content, converted, out)
        if not (role == "user" and "content" not in converted):
            out.append(converted)
    return out


def has_inline_system(messages: list[Json]) -> bool:
    """Whether the checked `messages` hold a system message with text (one that is not only
    Claude Code's billing header), whose place in the prompt depends on the template."""
    return any(m["role"] == "system" and _system_text(m) for m in messages)


def _texts(blocks: list[Json]) -> list[str]:
    """A system prompt's text blocks, Claude Code's billing header left out (it changes on
    every request)."""
    return [
        b["text"]
        for b in blocks
        if b["type"] == "text" and b.get("text") and not b["text"].startswith(_BILLING_HEADER)
    ]


def _system_text(message: Json) -> str | None:
    content = message["content"]
    if isinstance(content, str):
        return None if content.startswith(_BILLING_HEADER) else content
    return "".join(_texts(content)) or None


def _convert_blocks(blocks: list[Json], message: Json, out: list[Json]) -> None:
    """A message's blocks into `message` (content, tool calls, reasoning); the tool messages
    a user's tool results become go to `out`, before it."""
    role = message["role"]
    parts: list[Json] = []
    calls: list[Json] = []
    reasoning: list[str] = []
    for block in blocks:
        kind = block["type"]
        if kind == "text" and block.get("text"):
            parts.append({"type": "text", "text": block["text"]})
        elif kind == "image" and block.get("source"):
            raise _media_refusal()
        elif kind == "thinking" and block.get("thinking") is not None:
            reasoning.append(block["thinking"])
        elif kind == "tool_use":
            calls.append(_tool_call(block))
        elif kind == "tool_result":
            if role == "user":
                out += _tool_messages(block)
            else:
                content = block.get("content")
                # vLLM writes the content as Python prints it (a list as its repr).
                text = str(content) if content else ""
                parts.append({"type": "text", "text": f"Tool result: {text}"})
    if reasoning:
        message["reasoning"] = "".join(reasoning)
    if calls:
        message["tool_calls"] = calls
    if len(parts) == 1:
        message["content"] = parts[0]["text"]
    elif parts:
        message["content"] = parts


def _tool_call(block: Json) -> Json:
    if not block.get("id"):
        raise bad_request(
            "a tool_use block without an id is not supported: vLLM makes one from the clock",
            "messages",
        )
    # ensure_ascii and the separators are json.dumps' defaults, as vLLM writes them.
    arguments = json.dumps(block.get("input") or {})
    return {
        "id": block["id"],
        "type": "function",
        "function": {"name": block.get("name") or "", "arguments": arguments},
    }


def _tool_messages(block: Json) -> list[Json]:
    """The tool messages of a user's tool result (`_convert_user_tool_result`)."""
    content = block.get("content")
    call_id = block.get("tool_use_id") or ""
    texts: list[str] = []
    references: list[Json] = []
    for item in content if isinstance(content, list) else ():
        kind = item.get("type")
        if kind == "text":
            text = item.get("text", "")
            if not isinstance(text, str):
                raise bad_request("a tool_result's text block needs a string 'text'", "messages")
            texts.append(text)
        elif kind == "image":
            source = item.get("source", {})
            if not isinstance(source, dict):
                raise bad_request(
                    "a tool_result's image block needs an object 'source'", "messages"
                )
            # vLLM drops an image whose URL source is empty; any other is an image to see.
            if source.get("type") != "url" or source.get("url"):
                raise _media_refusal()
        elif kind == "tool_reference":
            name = item.get("tool_name") or item.get("name")
            if name:
                references.append({"type": "tool_reference", "name": name})
    text = content if isinstance(content, str) else "\n".join(texts)
    out = [{"role": "tool", "tool_call_id": call_id, "content": text or ""}]
    if references:
        out.append({"role": "tool", "tool_call_id": call_id, "content": references})
    return out


def chat_tool(tool: Json) -> Json:
    """A checked tool (`anthropic_content.checked_tool`) as a chat function tool."""
    function = {
        "name": tool["name"],
        "description": tool["description"],
        "parameters": tool["input_schema"],
    }
    for key in ("strict", "defer_loading"):
        if tool.get(key) is not None:
            function[key] = tool[key]
    return {"type": "function", "function": function}


def chat_tool_choice(choice: Json | None, tools: list[Json]) -> str | Json | None:
    """The chat `tool_choice` (with tools; none given: "auto"); raises `ApiError` 400 for a
    named tool that is not among them, as vLLM does when it renders."""
    if choice is None:
        return "auto"
    if choice["type"] != "tool":
        return _CHOICES[choice["type"]]
    if all(tool["name"] != choice["name"] for tool in tools):
        raise bad_request(
            f"The tool with name {choice['name']!r} is not found in the tools list.", "tool_choice"
        )
    return {"type": "function", "function": {"name": choice["name"]}}


def _media_refusal() -> ApiError:
    return bad_request(
        "an image is not supported: this model is not multimodal, it takes text only", "messages"
    )
