"""A chat request's messages as vLLM hands them to the chat template.

vLLM checks the messages against OpenAI's message types and its own looser ones (pydantic),
then rewrites each into a "conversation" message (`parse_chat_messages` in
vllm/renderers/chat_utils.py) for the template's content format (`chat_content_format`):

- content becomes one string, its text parts joined with "\\n" (empty ones dropped), or the
  list of parts as `{"type": "text", "text": ...}` (plus the part's unknown keys); `None` or no
  content becomes "" or [];
- "refusal", "thinking", "input_text" and "output_text" parts are text, a "tool_reference" part
  is its name; a part carrying media is refused: the models served here are text-only;
- an assistant message keeps its `tool_calls` (their JSON arguments parsed into an object,
  `{}` when they are not one) and its reasoning, a tool message its `tool_call_id` and its
  text parts joined into one string, every message its `name`;
- the first line of a system text starting "x-anthropic-billing-header" (it changes on every
  Claude Code request) is dropped;
- "developer" messages become "system" ones, merged into the first message, unless the
  template names the role.

Malformed messages are refused (`ApiError` 400); where vLLM's validation is too lax to follow
exactly (it coerces or ignores a few odd values), these checks are stricter.
"""

from __future__ import annotations

import json
from typing import Any

from services.common.inference_api.chat_content_format import ContentFormat
from services.common.serving.api_errors import bad_request

Message = dict[str, Any]

# Text parts, by type: the key holding their text.
_TEXT_KEY = {
    "text": "text",
    "input_text": "text",
    "output_text": "text",
    "refusal": "refusal",
    "thinking": "thinking",
}
_MEDIA_TYPES = frozenset(
    {
        "image_url", "input_image", "image_pil", "image_embeds", "audio_url", "input_audio",
        "audio_embeds", "video_url", "video_embeds", "prompt_embeds",
    }
)  # fmt: skip
# vLLM infers the type of a part that names none (or has a "uuid") from its keys, in this order.
_TYPE_FROM_KEY = (
    "image_url", "image_pil", "image_embeds", "audio_embeds", "video_embeds", "prompt_embeds",
    "audio_url", "input_audio", "video_url", "tool_reference",
)  # fmt: skip
# The keys of every content part type vLLM knows; others are copied to "openai" format parts.
_KNOWN_PART_KEYS = frozenset(
    {
        "audio_embeds", "audio_url", "closed", "data", "file", "image_embeds", "image_pil",
        "image_url", "input_audio", "name", "prompt_cache_breakpoint", "refusal", "text",
        "thinking", "type", "uuid", "video_embeds", "video_url",
    }
)  # fmt: skip
_TEXT_TYPES = frozenset({*_TEXT_KEY, "tool_reference"})
_NULL_CONTENT_ROLES = frozenset({"assistant", "function"})  # OpenAI's types allow None there
_BILLING_HEADER = "x-anthropic-billing-header"


def conversation(
    messages: list[Any], content_format: ContentFormat, *, template_knows_developer: bool
) -> list[Message]:
    """The messages the template gets; raises `ApiError` 400 for a malformed or non-text one."""
    out = [_message(raw, i, content_format) for i, raw in enumerate(messages)]
    developer = [m for m in out if m["role"] == "developer"]
    if developer and not template_knows_developer:
        return _merged_system([_as_system(m) if m["role"] == "developer" else m for m in out])
    if any(m["tools"] is not None for m in developer):
        # vLLM would pass them on re-validated (reordered keys): not followed here.
        raise bad_request("tools in a developer message are not supported", "messages")
    return out


def has_non_text_part(messages: list[Any]) -> bool:
    """Whether a message has a content part that is not text (vLLM's `has_non_text_content`)."""
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        for part in content if isinstance(content, list) else ():
            if not isinstance(part, dict):
                continue
            kind = part.get("type", "text")
            if any(key in part for key in _MEDIA_TYPES) or not (
                isinstance(kind, str) and kind in _TEXT_TYPES
            ):
                return True
    return False


def _message(raw: object, i: int, content_format: ContentFormat) -> Message:
    where = f"messages[{i}]"
    if not isinstance(raw, dict):
        raise bad_request(f"{where} must be an object", "messages")
    role = raw.get("role")
    if not isinstance(role, str):
        raise bad_request(f"{where}.role must be a string", "messages")
    if not isinstance(raw.get("name", ""), str):
        raise bad_request(f"{where}.name must be a string", "messages")
    content = raw.get("content")
    if content is None:
        if "content" in raw and role not in _NULL_CONTENT_ROLES:
            raise bad_request(f"{where}.content must not be null", "messages")
        parts: list[Any] = []
    elif isinstance(content, str):
        parts = [{"type": "text", "text": content}]
    elif isinstance(content, list):
        parts = content
    else:
        raise bad_request(f"{where}.content must be a string or a list of parts", "messages")
    if role == "system":
        parts = _without_billing_header(parts)
    items = [_part(part, f"{where}.content[{j}]", content_format) for j, part in enumerate(parts)]
    message: Message = {"role": role, "content": _joined(items, content_format)}
    if role == "assistant":
        _add_assistant_fields(message, raw, where)
    elif role == "tool":
        _add_tool_fields(message, raw, where)
    if isinstance(raw.get("name"), str):
        message["name"] = raw["name"]
    if isinstance(raw.get("task"), str):
        message["task"] = raw["task"]
    if role == "developer":
        message["tools"] = raw.get("tools")
    return message


def _part(part: object, where: str, content_format: ContentFormat) -> str | dict[str, Any] | None:
    """A text part as its text ("string" format) or as a text part ("openai" format); `None`
    for a tool reference without a name."""
    openai = content_format == "openai"
    if isinstance(part, str):
        return {"type": "text", "text": part} if openai else part
    if not isinstance(part, dict):
        raise bad_request(f"{where} must be a string or an object", "messages")
    kind = part.get("type")
    if kind is None or part.get("uuid") is not None:
        kind = next((key for key in _TYPE_FROM_KEY if key in part), None)
        if kind is None:
            raise bad_request(f"{where}: missing 'type' field in content part", "messages")
    if not isinstance(kind, str):
        raise bad_request(f"{where}: invalid 'type' field in content part", "messages")
    if kind in _MEDIA_TYPES:
        raise bad_request(
            f"{where} is a {kind!r} part, but this model is not multimodal: it takes text only",
            "messages",
        )
    if kind == "tool_reference":
        name = part.get("name")
        if name is not None and not isinstance(name, str):
            raise bad_request(f"{where}.name must be a string", "messages")
        return {"type": "tool_reference", "name": name} if openai else name
    key = _TEXT_KEY.get(kind)
    if key is None:
        raise bad_request(
            f"{where}: unsupported chat content part type {kind!r} (supported: text, "
            f"{', '.join(sorted(set(_TEXT_KEY) - {'text'}))}, tool_reference)",
            "messages",
        )
    text = part.get(key)
    if not isinstance(text, str):
        raise bad_request(f"{where}.{key} must be a string", "messages")
    if not openai:
        return text
    extra = {k: v for k, v in part.items() if k not in _KNOWN_PART_KEYS}
    return {"type": "text", "text": text, **extra}


def _joined(items: list[str | dict[str, Any] | None], content_format: ContentFormat) -> Any:
    if content_format == "openai":
        return [item for item in items if item is not None]
    return "\n".join(item for item in items if isinstance(item, str) and item)


def _add_assistant_fields(message: Message, raw: dict[str, Any], where: str) -> None:
    calls = raw.get("tool_calls")
    if calls is not None:
        if not isinstance(calls, list):
            raise bad_request(f"{where}.tool_calls must be a list", "messages")
        if calls:  # vLLM drops an empty list (templates take the plain assistant path)
            message["tool_calls"] = [
                _tool_call(call, f"{where}.tool_calls[{k}]") for k, call in enumerate(calls)
            ]
    reasoning = raw.get("reasoning")
    if reasoning is None:
        reasoning = raw.get("reasoning_content")
    if reasoning is not None:
        message["reasoning"] = reasoning
        message["reasoning_content"] = reasoning


def _tool_call(call: object, where: str) -> dict[str, Any]:
    """A tool call as vLLM passes it on: its known keys in OpenAI's order, then the others;
    the arguments parsed into an object."""
    if not isinstance(call, dict):
        raise bad_request(f"{where} must be an object", "messages")
    if call.get("type") != "function":
        raise bad_request(
            f"{where}: chat completions only support assistant tool_calls of type 'function'",
            "messages",
        )
    function = call.get("function")
    if not isinstance(call.get("id"), str) or not isinstance(function, dict):
        raise bad_request(f"{where} needs a string 'id' and a 'function' object", "messages")
    name, arguments = function.get("name"), function.get("arguments")
    if not isinstance(name, str) or not isinstance(arguments, str):
        raise bad_request(f"{where}.function needs a string 'name' and 'arguments'", "messages")
    fn_extra = {k: v for k, v in function.items() if k not in ("arguments", "name")}
    extra = {k: v for k, v in call.items() if k not in ("id", "function", "type")}
    parsed = {"arguments": _arguments(arguments), "name": name, **fn_extra}
    return {"id": call["id"], "function": parsed, "type": "function", **extra}


def _arguments(text: str) -> dict[str, Any]:
    # vLLM keeps a conversation whose history holds malformed arguments going with {}.
    try:
        value = json.loads(text) if text else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _add_tool_fields(message: Message, raw: dict[str, Any], where: str) -> None:
    if "tool_call_id" in raw:
        if not isinstance(raw["tool_call_id"], str | None):
            raise bad_request(f"{where}.tool_call_id must be a string", "messages")
        message["tool_call_id"] = raw["tool_call_id"]
    content = message["content"]
    # Tool results reach the template as one string, whatever the format, unless they hold
    # more than text (a tool reference).
    if isinstance(content, list) and all(item.get("type") == "text" for item in content):
        message["content"] = "\n".join(item.get("text", "") for item in content)


def _without_billing_header(parts: list[Any]) -> list[Any]:
    out = []
    for part in parts:
        text = part.get("text") if isinstance(part, dict) and part.get("type") == "text" else part
        if not (isinstance(text, str) and text.startswith(_BILLING_HEADER)):
            out.append(part)
            continue
        rest = text.partition("\n")[2]
        if rest:
            out.append(rest if isinstance(part, str) else {**part, "text": rest})
    return out


def _as_system(message: Message) -> Message:
    converted = {k: v for k, v in message.items() if k != "tools"}
    converted["role"] = "system"
    return converted


def _merged_system(messages: list[Message]) -> list[Message]:
    """All system messages merged into one first message (as vLLM does after turning developer
    messages into system ones: some templates only take a system message first)."""
    texts: list[str] = []
    others: list[Message] = []
    merge = False
    for i, message in enumerate(messages):
        if message["role"] != "system":
            others.append(message)
            continue
        merge = merge or i > 0 or bool(texts)
        content = message.get("content", "")
        if isinstance(content, list):
            content = "\n".join(
                part["text"] if isinstance(part, dict) else part
                for part in content
                if isinstance(part, str) or (isinstance(part, dict) and "text" in part)
            )
        if content:
            texts.append(content)
    if not merge:
        return messages
    return [{"role": "system", "content": "\n\n".join(texts)}, *others]
