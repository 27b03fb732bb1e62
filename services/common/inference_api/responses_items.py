"""The input items of an OpenAI Responses request as the chat messages vLLM makes of them
(`_construct_message_from_response_item`, vllm/entrypoints/openai/responses/utils.py), each
item checked against the SDK's input item types as vLLM's model checks it: messages, function
and custom tool calls and their outputs, and reasoning items (`add_input_item`); and whether
the last one is to be continued (`should_continue_final_message`)."""

from __future__ import annotations

import json
from typing import Any, Final

from services.common.inference_api.responses_fields import check_strings
from services.common.inference_api.responses_tools import CUSTOM_INPUT, NAMESPACE_SEPARATOR
from services.common.serving.api_errors import bad_request

Json = dict[str, Any]

_STATUSES: Final = ("in_progress", "completed", "incomplete")
_CONTINUED: Final = ("in_progress", "incomplete")
_PHASES: Final = ("commentary", "final_answer")
_ROLES: Final = ("user", "assistant", "system", "developer")
_MEDIA_PARTS: Final = ("input_image", "input_file")


def add_input_item(messages: list[Json], raw: object, where: str) -> None:
    """The chat message `raw` becomes, appended to `messages` or merged into the assistant
    message last in it (vLLM's `_construct_message_from_response_item`)."""
    if not isinstance(raw, dict):
        raise bad_request(f"{where} must be an object", "input")
    kind = raw.get("type")
    prev = messages[-1] if messages and messages[-1].get("role") == "assistant" else None
    if kind in ("function_call", "custom_tool_call"):
        call = _function_call(raw, where) if kind == "function_call" else _custom_call(raw, where)
        if prev is None:
            messages.append({"role": "assistant", "tool_calls": [call]})
        elif prev.get("tool_calls") is None:
            prev["tool_calls"] = [call]
        elif isinstance(prev["tool_calls"], list):
            prev["tool_calls"] = [*prev["tool_calls"], call]
        else:
            raise bad_request(
                f"{where}: the assistant message before it has odd tool_calls", "input"
            )
    elif kind == "reasoning":
        text = _reasoning(raw, where)
        if prev is not None and prev.get("reasoning") is None:
            prev["reasoning"] = text
        else:
            messages.append({"role": "assistant", "reasoning": text})
    elif kind in ("function_call_output", "custom_tool_call_output"):
        messages.append(_tool_output(raw, where, custom=kind == "custom_tool_call_output"))
    elif "role" in raw and kind in (None, "message"):
        message = _message(raw, where)
        if message["role"] != "assistant" or not isinstance(message["content"], str):
            messages.append(message)  # as it is, its extra keys too (vLLM passes the item on)
        elif prev is not None and prev.get("content") is None:
            prev["content"] = message["content"]
        else:
            messages.append(message)
    else:
        raise bad_request(
            f"{where}: unsupported input item type {kind!r} (supported: message, function_call, "
            "function_call_output, custom_tool_call, custom_tool_call_output, reasoning)",
            "input",
        )


def _message(raw: Json, where: str) -> Json:
    """A message item as vLLM hands it on: an assistant's as `{"role", "content"}` with its
    first part's text, any other as it is."""
    role, content = raw.get("role"), raw.get("content")
    if role not in _ROLES:
        raise bad_request(f"{where}.role must be one of {sorted(_ROLES)}", "input")
    phase, status = raw.get("phase"), raw.get("status")
    phase_ok = phase is None or phase in _PHASES
    if isinstance(content, str):
        if not phase_ok:
            raise bad_request(f"{where}.phase must be one of {sorted(_PHASES)}", "input")
        return {"role": "assistant", "content": content} if role == "assistant" else dict(raw)
    if not isinstance(content, list):
        raise bad_request(f"{where}.content must be a string or a list of parts", "input")
    if role == "assistant":
        return {"role": "assistant", "content": _assistant_text(raw, content, where)}
    # The SDK's two message types: the one with a status takes no phase, the other any status.
    if not (phase_ok or status is None or status in _STATUSES):
        raise bad_request(f"{where}: invalid phase or status", "input")
    for j, part in enumerate(content):
        _input_part(part, f"{where}.content[{j}]")
    return dict(raw)


def _assistant_text(raw: Json, content: list[Any], where: str) -> str:
    """An assistant message's text: its first part's (vLLM drops the others)."""
    kinds = [part.get("type") if isinstance(part, dict) else None for part in content]
    if (
        content
        and all(k in ("output_text", "refusal") for k in kinds)
        and raw.get("type") == "message"
    ):
        # vLLM's output message: a status and a phase of its own, text parts with their
        # annotations (none here).
        for key, allowed in (("status", _STATUSES), ("phase", _PHASES)):
            if raw.get(key) is not None and raw[key] not in allowed:
                raise bad_request(f"{where}.{key} must be one of {sorted(allowed)}", "input")
        if not isinstance(raw.get("id", ""), str):
            raise bad_request(f"{where}.id must be a string", "input")
        for j, part in enumerate(content):
            _output_part(part, f"{where}.content[{j}]")
        if content[0]["type"] != "output_text":
            raise bad_request(f"{where}: an assistant message must start with output_text", "input")
        return str(content[0]["text"])
    if content and all(k == "input_text" for k in kinds):  # the SDK's easy message
        for j, part in enumerate(content):
            _input_part(part, f"{where}.content[{j}]")
        return str(content[0]["text"])
    raise bad_request(
        f"{where}: an assistant message's content must be a string, output_text parts (of a "
        "'message' item) or input_text parts",
        "input",
    )


def _input_part(part: object, where: str) -> None:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind in _MEDIA_PARTS:
        raise bad_request(
            f"{where} is an {kind!r} part, but this model is not multimodal: it takes text only",
            "input",
        )
    if kind != "input_text" or not isinstance(part, dict) or not isinstance(part.get("text"), str):
        raise bad_request(f"{where} must be an input_text part with a string 'text'", "input")


def _output_part(part: Json, where: str) -> None:
    key = "text" if part["type"] == "output_text" else "refusal"
    if not isinstance(part.get(key), str):
        raise bad_request(f"{where}.{key} must be a string", "input")
    if part["type"] == "output_text":
        if part.get("annotations", []) != []:
            raise bad_request(f"{where}: output text annotations are not supported", "input")
        if not isinstance(part.get("logprobs", []), list | None):
            raise bad_request(f"{where}.logprobs must be a list", "input")


def _function_call(raw: Json, where: str) -> Json:
    check_strings(raw, where, ("arguments", "call_id", "name"), ("id", "namespace"))
    _status(raw, where)
    name = raw["name"]
    if raw.get("namespace"):
        name = f"{raw['namespace']}{NAMESPACE_SEPARATOR}{name}"
    return _call(raw["call_id"], name, raw["arguments"])


def _custom_call(raw: Json, where: str) -> Json:
    check_strings(raw, where, ("call_id", "input", "name"), ("id", "namespace"))
    # ensure_ascii off: vLLM's encoding of the input (`encode_custom_tool_input`).
    arguments = json.dumps({CUSTOM_INPUT: raw["input"] or ""}, ensure_ascii=False)
    return _call(raw["call_id"], raw["name"], arguments)


def _call(call_id: str, name: str, arguments: str) -> Json:
    return {"id": call_id, "function": {"name": name, "arguments": arguments}, "type": "function"}


def _reasoning(raw: Json, where: str) -> str:
    """A reasoning item's text (its first content text, else its first summary text)."""
    check_strings(raw, where, (), ("id", "encrypted_content"))
    _status(raw, where)
    summary, content = raw.get("summary"), raw.get("content")
    if not _parts_of(summary, "summary_text") or not (
        content is None or _parts_of(content, "reasoning_text")
    ):
        raise bad_request(
            f"{where} needs a 'summary' list of summary_text parts (and 'content', if any, of "
            "reasoning_text parts)",
            "input",
        )
    if raw.get("encrypted_content"):
        raise bad_request("Encrypted content is not supported.", "input")
    if content:
        return str(content[0]["text"])
    return str(summary[0]["text"]) if summary else ""


def _parts_of(value: object, kind: str) -> bool:
    return isinstance(value, list) and all(
        isinstance(p, dict) and p.get("type") == kind and isinstance(p.get("text"), str)
        for p in value
    )


def _tool_output(raw: Json, where: str, *, custom: bool) -> Json:
    check_strings(
        raw, where, ("call_id",) if custom else (), ("id",) if custom else ("id", "call_id")
    )
    if not custom:
        _status(raw, where)
    output = raw.get("output")
    if not isinstance(output, str | list):
        raise bad_request(f"{where}.output must be a string or a list of parts", "input")
    if isinstance(output, list):
        for j, part in enumerate(output):
            _input_part(part, f"{where}.output[{j}]")
    return {"role": "tool", "content": output, "tool_call_id": raw.get("call_id")}


def should_continue_final_message(last: object) -> bool:
    """Whether the last input item is partial, to be continued (vLLM's
    `should_continue_final_message`)."""
    if not isinstance(last, dict) or last.get("type", "message") not in ("message", "reasoning"):
        return False
    return last.get("status") in _CONTINUED


def _status(raw: Json, where: str) -> None:
    if raw.get("status") is not None and raw["status"] not in _STATUSES:
        raise bad_request(f"{where}.status must be one of {sorted(_STATUSES)}", "input")
