"""The messages, content blocks and tools of an Anthropic Messages request, checked (`ApiError`
400) as vLLM's request model checks them (`AnthropicMessage`, `AnthropicContentBlock`,
`AnthropicTool` in vllm/entrypoints/anthropic/protocol.py), each returned as that model leaves
it: `checked_message`, `checked_system` (the top-level `system`) and `checked_tool`. vLLM's
model is pydantic's in its lax mode; here every field must have its JSON type."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from services.common.serving.api_errors import bad_request

Json = dict[str, Any]

_ROLES: Final = ("user", "assistant", "system")
_BLOCK_TYPES: Final = (
    "text", "image", "tool_use", "tool_result", "tool_reference", "thinking",
    "redacted_thinking", "tool_addition", "tool_removal",
)  # fmt: skip
# The blocks by which a system message adds or removes tools (`MessagesRequest.tools`).
TOOL_CHANGES: Final = ("tool_addition", "tool_removal")
# A content block's optional fields and the JSON type each must have (vLLM's model).
_BLOCK_FIELDS: Final[Mapping[str, type]] = {
    "text": str, "source": dict, "id": str, "tool_use_id": str, "name": str, "input": dict,
    "is_error": bool, "tool_name": str, "thinking": str, "signature": str, "data": str,
}  # fmt: skip


def checked_message(raw: object, where: str) -> Json:
    """The message `raw` (at `where`) as `{"role", "content"}`, its blocks checked; tool
    changes are refused outside system messages."""
    if not isinstance(raw, dict):
        raise bad_request(f"{where} must be an object", "messages")
    role = raw.get("role")
    if role not in _ROLES:
        raise bad_request(f"{where}.role must be 'user', 'assistant' or 'system'", "messages")
    content = raw.get("content")
    if isinstance(content, list):
        content = [_block(b, f"{where}.content[{j}]") for j, b in enumerate(content)]
        if role != "system":
            _refuse_tool_changes(content, where)
    elif not isinstance(content, str):
        raise bad_request(f"{where}.content must be a string or a list of blocks", "messages")
    return {"role": role, "content": content}


def checked_system(system: object) -> str | list[Json] | None:
    """The top-level `system`: None, a string or its checked blocks (no tool changes)."""
    if system is None or isinstance(system, str):
        return system
    if not isinstance(system, list):
        raise bad_request("'system' must be a string or a list of blocks", "system")
    blocks = [_block(b, f"system[{j}]") for j, b in enumerate(system)]
    _refuse_tool_changes(blocks, "system")
    return blocks


def _refuse_tool_changes(blocks: list[Json], where: str) -> None:
    for block in blocks:
        if block["type"] in TOOL_CHANGES:
            raise bad_request(
                f'{where}: {block["type"]} blocks are only allowed in messages with role "system"',
                "messages",
            )


def _block(raw: object, where: str) -> Json:
    """A content block with its fields checked (`AnthropicContentBlock`)."""
    if not isinstance(raw, dict):
        raise bad_request(f"{where} must be an object", "messages")
    kind = raw.get("type")
    if kind not in _BLOCK_TYPES:
        raise bad_request(
            f"{where}.type must be one of {', '.join(sorted(_BLOCK_TYPES))}", "messages"
        )
    for key, kind_of in _BLOCK_FIELDS.items():
        value = raw.get(key)
        if value is not None and not has_json_type(value, kind_of):
            raise bad_request(f"{where}.{key} must be {_NAMES[kind_of]}", "messages")
    content = raw.get("content")
    if content is not None and not (
        isinstance(content, str)
        or (isinstance(content, list) and all(isinstance(c, dict) for c in content))
    ):
        raise bad_request(f"{where}.content must be a string or a list of objects", "messages")
    block = dict(raw)
    tool = raw.get("tool")
    if tool is not None:
        block["tool"] = _tool_change(tool, f"{where}.tool")
    if kind in TOOL_CHANGES:
        if tool is None:
            raise bad_request(f"{where}: tool is required for {kind} blocks", "messages")
        if kind == "tool_removal" and block["tool"]["type"] != "tool_reference":
            raise bad_request(f"{where}: tool_removal only accepts a tool_reference", "messages")
    return block


def _tool_change(raw: object, where: str) -> Json:
    kind = raw.get("type") if isinstance(raw, dict) else None
    if kind == "tool_reference" and isinstance(raw, dict):
        if not isinstance(raw.get("name"), str):
            raise bad_request(f"{where}.name must be a string", "messages")
        return {"type": kind, "name": raw["name"]}
    if kind == "tool_definition" and isinstance(raw, dict):
        return {
            "type": kind,
            "definition": checked_tool(raw.get("definition"), f"{where}.definition"),
        }
    raise bad_request(f"{where} must be a tool_reference or a tool_definition", "messages")


def checked_tool(raw: object, where: str) -> Json:
    """A tool as vLLM's model leaves it (`AnthropicTool`): `"type": "object"` added to a
    schema without a type, at its end."""
    if not isinstance(raw, dict):
        raise bad_request(f"{where} must be an object", "tools")
    name, schema = raw.get("name"), raw.get("input_schema")
    if not isinstance(name, str) or not isinstance(schema, dict):
        raise bad_request(f"{where} needs a string 'name' and an object 'input_schema'", "tools")
    description = raw.get("description")
    if description is not None and not isinstance(description, str):
        raise bad_request(f"{where}.description must be a string", "tools")
    for key in ("strict", "defer_loading"):
        if raw.get(key) is not None and not isinstance(raw[key], bool):
            raise bad_request(f"{where}.{key} must be a boolean", "tools")
    if "type" not in schema:
        schema = {**schema, "type": "object"}
    return {
        "name": name,
        "description": description,
        "input_schema": schema,
        "strict": raw.get("strict"),
        "defer_loading": raw.get("defer_loading"),
    }


_NAMES: Final[Mapping[type, str]] = {
    str: "a string",
    dict: "an object",
    bool: "a boolean",
    list: "a list",
    int: "an integer",
}


def has_json_type(value: object, kind: type) -> bool:
    """Whether `value` is of the JSON type `kind` stands for (a boolean is no integer)."""
    return isinstance(value, kind) and not (kind is int and isinstance(value, bool))
