"""The tools of an OpenAI Responses request as the chat tools vLLM shows the chat template
(`construct_tool_dicts`): function tools as they are, a namespace's functions flattened to
`<namespace>__<name>`, a custom tool as a function of one string argument `input`
(`chat_tools`); and its `tool_choice` checked and resolved as vLLM does (`chat_tool_choice`).
Hosted tools are refused: vLLM drops them from the prompt, but checks them against many SDK
types not followed here."""

from __future__ import annotations

from typing import Any, Final

from services.common.inference_api.responses_fields import check_strings
from services.common.serving.api_errors import bad_request

Json = dict[str, Any]

NAMESPACE_SEPARATOR: Final = "__"  # vLLM's flat name of a namespaced function
CUSTOM_INPUT: Final = "input"  # the argument a custom tool's function shim takes
_CUSTOM_PARAMETERS: Final[Json] = {
    "type": "object",
    "properties": {
        CUSTOM_INPUT: {"type": "string", "description": "The freeform text payload for this tool."}
    },
    "required": [CUSTOM_INPUT],
    "additionalProperties": False,
}


def chat_tools(raw: object) -> list[Json]:
    """The chat tools vLLM shows the template (`construct_tool_dicts`), in request order."""
    if not isinstance(raw, list):
        raise bad_request("'tools' must be a list of tools", "tools")
    out: list[Json] = []
    for i, tool in enumerate(raw):
        where = f"tools[{i}]"
        kind = tool.get("type") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or kind not in ("function", "custom", "namespace"):
            raise bad_request(
                f"{where}: only function, custom and namespace tools are supported", "tools"
            )
        if kind == "function":
            name = tool.get("name")
            out.append(_function_tool(tool, name if isinstance(name, str) else None, where))
        elif kind == "custom":
            _custom_tool(tool, where)
            out.append(_chat_tool(tool["name"], tool.get("description"), _CUSTOM_PARAMETERS))
        else:
            out += _namespace_tools(tool, where)
    return out


def _function_tool(tool: Json, name: str | None, where: str) -> Json:
    if name is None:
        raise bad_request(f"{where}.name must be a string", "tools")
    parameters = tool.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise bad_request(f"{where}.parameters must be an object", "tools")
    check_strings(tool, where, (), ("description",), param="tools")
    _flags(tool, where, ("strict", "defer_loading", "async"))
    return _chat_tool(name, tool.get("description"), parameters, tool)


def _custom_tool(tool: Json, where: str) -> None:
    check_strings(tool, where, ("name",), ("description",), param="tools")
    _flags(tool, where, ("defer_loading", "async"))
    fmt = tool.get("format")
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "grammar":
        raise bad_request(
            "Custom tools with a grammar format are not supported; only free-form text custom "
            "tools are accepted.",
            "tools",
        )
    if fmt is not None and kind != "text":
        raise bad_request(f"{where}.format must be {{'type': 'text'}}", "tools")


def _namespace_tools(tool: Json, where: str) -> list[Json]:
    check_strings(tool, where, ("name", "description"), (), param="tools")
    inner = tool.get("tools")
    if not isinstance(inner, list):
        raise bad_request(f"{where}.tools must be a list of tools", "tools")
    out = []
    for j, member in enumerate(inner):
        kind = member.get("type") if isinstance(member, dict) else None
        if not isinstance(member, dict) or kind not in ("function", "custom"):
            raise bad_request(f"{where}.tools[{j}] must be a function or custom tool", "tools")
        if kind == "custom":  # a namespace's custom tools are not shown to the model
            _custom_tool(member, f"{where}.tools[{j}]")
            continue
        name = member.get("name")
        if not isinstance(name, str):
            raise bad_request(f"{where}.tools[{j}].name must be a string", "tools")
        flat = f"{tool['name']}{NAMESPACE_SEPARATOR}{name}"
        out.append(_function_tool(member, flat, f"{where}.tools[{j}]"))
    return out


def _chat_tool(name: str, description: Any, parameters: Any, tool: Json | None = None) -> Json:
    function: Json = {"name": name, "description": description, "parameters": parameters}
    for key in ("strict", "defer_loading"):
        if tool is not None and tool.get(key) is not None:
            function[key] = tool[key]
    return {"type": "function", "function": function}


def chat_tool_choice(choice: object, tools: list[Any]) -> str | Json:
    """The chat `tool_choice`, after vLLM's checks (`check_tool_usage`); `tools`: the
    request's tools as sent (checked by `chat_tools`)."""
    has_tools = bool(tools)
    if isinstance(choice, str) and choice in ("none", "auto", "required"):
        if choice == "required" and not has_tools:
            raise bad_request(
                "Tool choice 'required' must be specified with 'tools' parameter.", "tool_choice"
            )
        return choice
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind == "allowed_tools" and isinstance(choice, dict):
        mode, allowed = choice.get("mode"), choice.get("tools")
        if mode not in ("auto", "required") or not (
            isinstance(allowed, list) and all(isinstance(t, dict) for t in allowed)
        ):
            raise bad_request("allowed_tools needs a mode and a list of tools", "tool_choice")
        return str(mode)
    if kind not in ("function", "custom") or not isinstance(choice, dict):
        raise bad_request(
            "'tool_choice' must be 'none', 'auto', 'required', allowed_tools or a named function "
            "or custom tool (hosted tools are not supported)",
            "tool_choice",
        )
    name = choice.get("name")
    if not has_tools or not name:
        raise bad_request("Tool choice 'function' not found in 'tools' parameter.", "tool_choice")
    if not isinstance(name, str):
        raise bad_request("tool_choice.name must be a string", "tool_choice")
    return {"type": "function", "function": {"name": _named_tool(name, tools)}}


def _named_tool(name: str, tools: list[Json]) -> str:
    """A named tool choice's flat name (vLLM's `_resolve_named_tool_choice`): the name itself,
    or the one namespaced function of that name."""
    exact: set[str] = set()
    local: dict[str, list[str]] = {}
    for tool in tools:
        if tool["type"] == "namespace":
            for member in tool["tools"]:
                flat = f"{tool['name']}{NAMESPACE_SEPARATOR}{member['name']}"
                exact.add(flat)
                local.setdefault(member["name"], []).append(flat)
        else:
            exact.add(tool["name"])
    if name in exact:
        return name
    candidates = local.get(name, [])
    if len(candidates) == 1:
        return candidates[0]
    if candidates:
        raise bad_request(
            f"Tool choice '{name}' is ambiguous: it is defined in more than one namespace "
            f"({', '.join(candidates)}). Select it by its full '<namespace>__<name>' name.",
            "tool_choice",
        )
    raise bad_request("Tool choice 'function' not found in 'tools' parameter.", "tool_choice")


def _flags(raw: Json, where: str, keys: tuple[str, ...]) -> None:
    for key in keys:
        if raw.get(key) is not None and not isinstance(raw[key], bool):
            raise bad_request(f"{where}.{key} must be a boolean", "tools")
