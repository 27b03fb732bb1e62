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
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from services.common.anthropic_messages import check_cache_salt
from services.common.api_errors import bad_request
from services.common.openai_api import PromptTokenizer

Json = dict[str, Any]

_EFFORTS: Final = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
_SUMMARIES: Final = ("auto", "concise", "detailed")
_STATUSES: Final = ("in_progress", "completed", "incomplete")
_CONTINUED: Final = ("in_progress", "incomplete")
_PHASES: Final = ("commentary", "final_answer")
_ROLES: Final = ("user", "assistant", "system", "developer")
_MEDIA_PARTS: Final = ("input_image", "input_file")
_NAMESPACE_SEPARATOR: Final = "__"  # vLLM's flat name of a namespaced function
_CUSTOM_INPUT: Final = "input"  # the argument a custom tool's function shim takes
_CUSTOM_PARAMETERS: Final[Json] = {
    "type": "object",
    "properties": {
        _CUSTOM_INPUT: {"type": "string", "description": "The freeform text payload for this tool."}
    },
    "required": [_CUSTOM_INPUT],
    "additionalProperties": False,
}
_INCLUDES: Final = (
    "code_interpreter_call.outputs", "computer_call_output.output.image_url",
    "file_search_call.results", "message.input_image.image_url",
    "message.output_text.logprobs", "reasoning.encrypted_content",
)  # fmt: skip
_SERVICE_TIERS: Final = ("auto", "default", "flex", "scale", "priority")
_TEXT_FORMATS: Final = ("text", "json_schema", "json_object")
_MAX_STOP: Final = 4  # vLLM's VLLM_MAX_STOP_STRINGS default
_INT64: Final = 2**63


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


def chat_body(body: Mapping[str, Any], traits: TemplateTraits | None = None) -> dict[str, Any]:
    """The chat-completion body (for `openai_api.parse_request("chat", ...)`) whose prompt is
    the one vLLM renders for the Responses request `body`, with `model`, `max_tokens`
    (`max_output_tokens`), `stream`, `user` and `metadata` as well. `traits`: the model's
    (`template_traits`); without them, or where the template shows what the chat path cannot
    follow, a body with tool calls in its input is refused. Raises `ApiError` 400 for a body
    vLLM refuses, and for what the module docstring lists."""
    if not isinstance(body, Mapping):
        raise bad_request("request body must be a JSON object")
    _check_fields(body)
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
    tools = _tools(raw_tools)
    choice = _tool_choice(body.get("tool_choice", "auto"), raw_tools)
    items = body["input"]  # a string or a list (`_check_fields`)
    messages: list[Json] = []
    instructions = body.get("instructions")
    if instructions:
        messages.append({"role": "system", "content": instructions})
    if isinstance(items, str):
        messages.append({"role": "user", "content": items})
        last: Json | None = None
    else:
        for i, raw in enumerate(items):
            _add_item(messages, raw, f"input[{i}]")
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
    if _continues(last):
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
    elif raw_tools and _unset(kwargs.get("tools")):
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


# -- input items ---------------------------------------------------------------------------------


def _add_item(messages: list[Json], raw: object, where: str) -> None:
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
    _strings(raw, where, ("arguments", "call_id", "name"), ("id", "namespace"))
    _status(raw, where)
    name = raw["name"]
    if raw.get("namespace"):
        name = f"{raw['namespace']}{_NAMESPACE_SEPARATOR}{name}"
    return _call(raw["call_id"], name, raw["arguments"])


def _custom_call(raw: Json, where: str) -> Json:
    _strings(raw, where, ("call_id", "input", "name"), ("id", "namespace"))
    # ensure_ascii off: vLLM's encoding of the input (`encode_custom_tool_input`).
    arguments = json.dumps({_CUSTOM_INPUT: raw["input"] or ""}, ensure_ascii=False)
    return _call(raw["call_id"], raw["name"], arguments)


def _call(call_id: str, name: str, arguments: str) -> Json:
    return {"id": call_id, "function": {"name": name, "arguments": arguments}, "type": "function"}


def _reasoning(raw: Json, where: str) -> str:
    """A reasoning item's text (its first content text, else its first summary text)."""
    _strings(raw, where, (), ("id", "encrypted_content"))
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
    _strings(raw, where, ("call_id",) if custom else (), ("id",) if custom else ("id", "call_id"))
    if not custom:
        _status(raw, where)
    output = raw.get("output")
    if not isinstance(output, str | list):
        raise bad_request(f"{where}.output must be a string or a list of parts", "input")
    if isinstance(output, list):
        for j, part in enumerate(output):
            _input_part(part, f"{where}.output[{j}]")
    return {"role": "tool", "content": output, "tool_call_id": raw.get("call_id")}


def _continues(last: object) -> bool:
    """Whether the last input item is partial, to be continued (`should_continue_final_message`)."""
    if not isinstance(last, dict) or last.get("type", "message") not in ("message", "reasoning"):
        return False
    return last.get("status") in _CONTINUED


# -- tools ---------------------------------------------------------------------------------------


def _tools(raw: object) -> list[Json]:
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
    _strings(tool, where, (), ("description",), param="tools")
    _flags(tool, where, ("strict", "defer_loading", "async"))
    return _chat_tool(name, tool.get("description"), parameters, tool)


def _custom_tool(tool: Json, where: str) -> None:
    _strings(tool, where, ("name",), ("description",), param="tools")
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
    _strings(tool, where, ("name", "description"), (), param="tools")
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
        flat = f"{tool['name']}{_NAMESPACE_SEPARATOR}{name}"
        out.append(_function_tool(member, flat, f"{where}.tools[{j}]"))
    return out


def _chat_tool(name: str, description: Any, parameters: Any, tool: Json | None = None) -> Json:
    function: Json = {"name": name, "description": description, "parameters": parameters}
    for key in ("strict", "defer_loading"):
        if tool is not None and tool.get(key) is not None:
            function[key] = tool[key]
    return {"type": "function", "function": function}


def _tool_choice(choice: object, tools: list[Any]) -> str | Json:
    """The chat `tool_choice`, after vLLM's checks (`check_tool_usage`)."""
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
                flat = f"{tool['name']}{_NAMESPACE_SEPARATOR}{member['name']}"
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


# -- the chat template's traits ------------------------------------------------------------------

_PROBE_TOOL: Final[Json] = {
    "type": "function",
    "function": {"name": "f", "description": "d", "parameters": {"type": "object"}},
}


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


# -- the other fields ----------------------------------------------------------------------------


def _check_fields(body: Mapping[str, Any]) -> None:
    """The request's fields other than the input and tools, checked as vLLM's model checks
    them (their JSON types; the ones vLLM refuses outright)."""
    items = body.get("input")
    if not isinstance(items, str | list):
        raise bad_request("'input' is required: a string or a list of input items", "input")
    for key, check in _FIELDS.items():
        value = body.get(key, _ABSENT)
        if value is not _ABSENT and not check(value):
            raise bad_request(f"'{key}' has an invalid value", key)
    if body.get("prompt") is not None:
        raise bad_request("prompt template is not supported", "prompt")
    if body.get("background"):
        # vLLM stores no responses by default, and a background one needs storing.
        raise bad_request(
            "This vLLM engine does not support `store=True` and therefore does not support "
            "the background mode.",
            "background",
        )
    for key in ("mm_processor_kwargs", "media_io_kwargs"):
        if body.get(key):
            raise bad_request(f"Per-request {key} are disabled by default", key)
    if body.get("previous_input_messages") and body.get("previous_response_id"):
        raise bad_request(
            "Only one of `previous_input_messages` and `previous_response_id` can be set.",
            "previous_response_id",
        )
    check_cache_salt(body.get("cache_salt"))


_ABSENT: Final = object()


def _nullable(check: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda v: v is None or check(v)


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _is_str(v: object) -> bool:
    return isinstance(v, str)


def _is_bool(v: object) -> bool:
    return isinstance(v, bool)


def _is_dict(v: object) -> bool:
    return isinstance(v, dict)


def _reasoning_config(v: object) -> bool:
    return (
        isinstance(v, dict)
        and v.get("effort") in (*_EFFORTS, None)
        and v.get("summary") in (*_SUMMARIES, None)
        and v.get("generate_summary") in (*_SUMMARIES, None)
    )


def _text_config(v: object) -> bool:
    if not isinstance(v, dict):
        return False
    fmt = v.get("format")
    if fmt is None:
        return True
    if not isinstance(fmt, dict) or fmt.get("type") not in _TEXT_FORMATS:
        return False
    return fmt["type"] != "json_schema" or (
        isinstance(fmt.get("name"), str) and isinstance(fmt.get("schema"), dict)
    )


def _stop(v: object) -> bool:
    return isinstance(v, str) or (
        isinstance(v, list) and len(v) <= _MAX_STOP and all(isinstance(s, str) for s in v)
    )


def _xargs(v: object) -> bool:
    def scalar(x: object) -> bool:
        return isinstance(x, str) or _is_number(x)

    return isinstance(v, dict) and all(
        scalar(x) or (isinstance(x, list) and all(scalar(y) for y in x)) for x in v.values()
    )


# Each field vLLM's model reads (but the input, tools and tool choice), with its check; a
# `_nullable` one may be null.
_FIELDS: Final[Mapping[str, Callable[[Any], bool]]] = {
    "background": _nullable(_is_bool),
    "include": _nullable(lambda v: isinstance(v, list) and all(x in _INCLUDES for x in v)),
    "instructions": _nullable(_is_str),
    "max_output_tokens": _nullable(_is_int),
    "max_tool_calls": _nullable(_is_int),
    "metadata": _nullable(
        lambda v: isinstance(v, dict) and all(isinstance(x, str) for x in v.values())
    ),
    "model": _nullable(_is_str),
    "logit_bias": _nullable(lambda v: isinstance(v, dict) and all(map(_is_number, v.values()))),
    "parallel_tool_calls": _nullable(_is_bool),
    "previous_response_id": _nullable(_is_str),
    "reasoning": _nullable(_reasoning_config),
    "include_reasoning": _is_bool,
    "service_tier": lambda v: v in _SERVICE_TIERS,
    "store": _nullable(_is_bool),
    "stream": _nullable(_is_bool),
    "temperature": _nullable(_is_number),
    "text": _nullable(_text_config),
    "top_logprobs": _nullable(_is_int),
    "top_p": _nullable(_is_number),
    "top_k": _nullable(_is_int),
    "min_p": _nullable(_is_number),
    "truncation": lambda v: v in ("auto", "disabled", None),
    "user": _nullable(_is_str),
    "skip_special_tokens": _is_bool,
    "include_stop_str_in_output": _is_bool,
    "presence_penalty": _nullable(lambda v: _is_number(v) and -2 <= v <= 2),
    "frequency_penalty": _nullable(lambda v: _is_number(v) and -2 <= v <= 2),
    "prompt_cache_key": _nullable(_is_str),
    "watermarking": _nullable(_is_bool),
    "request_id": _is_str,
    "session_id": _nullable(_is_str),
    "media_io_kwargs": _nullable(_is_dict),
    "mm_processor_kwargs": _nullable(_is_dict),
    "priority": lambda v: _is_int(v) and -_INT64 <= v < _INT64,
    "mm_payload": lambda v: v in ("tensors", "none"),
    "return_mm_kwargs": _nullable(_is_bool),
    "enable_response_messages": _is_bool,
    "previous_input_messages": _nullable(
        lambda v: isinstance(v, list) and all(isinstance(m, dict) for m in v)
    ),
    "structured_outputs": _nullable(_is_dict),
    "repetition_penalty": _nullable(_is_number),
    "seed": _nullable(lambda v: _is_int(v) and -_INT64 <= v < _INT64),
    "stop": _nullable(_stop),
    "stop_token_ids": _nullable(lambda v: isinstance(v, list) and all(map(_is_int, v))),
    "ignore_eos": _is_bool,
    "vllm_xargs": _nullable(_xargs),
    "kv_transfer_params": _nullable(_is_dict),
    "ec_transfer_params": _nullable(_is_dict),
    "chat_template_kwargs": _nullable(_is_dict),
}


def _strings(
    raw: Json,
    where: str,
    required: tuple[str, ...],
    optional: tuple[str, ...],
    *,
    param: str = "input",
) -> None:
    for key in required:
        if not isinstance(raw.get(key), str):
            raise bad_request(f"{where}.{key} must be a string", param)
    for key in optional:
        if raw.get(key) is not None and not isinstance(raw[key], str):
            raise bad_request(f"{where}.{key} must be a string", param)


def _flags(raw: Json, where: str, keys: tuple[str, ...]) -> None:
    for key in keys:
        if raw.get(key) is not None and not isinstance(raw[key], bool):
            raise bad_request(f"{where}.{key} must be a boolean", "tools")


def _status(raw: Json, where: str) -> None:
    if raw.get("status") is not None and raw["status"] not in _STATUSES:
        raise bad_request(f"{where}.status must be one of {sorted(_STATUSES)}", "input")


def _unset(value: object) -> bool:
    """vLLM's merge of template arguments lets None and "auto" stand for unset."""
    return value is None or value == "auto"
