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
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

import jinja2
import jinja2.ext
import jinja2.sandbox

from services.common.api_errors import ApiError, bad_request
from services.common.openai_api import PromptTokenizer, parse_request

Json = dict[str, Any]

_EFFORTS: Final = ("low", "medium", "high", "xhigh", "max")  # vLLM's AnthropicEffort
_DISPLAYS: Final = ("summarized", "omitted", "updates")
_ROLES: Final = ("user", "assistant", "system")
_BLOCK_TYPES: Final = (
    "text", "image", "tool_use", "tool_result", "tool_reference", "thinking",
    "redacted_thinking", "tool_addition", "tool_removal",
)  # fmt: skip
_TOOL_CHANGES: Final = ("tool_addition", "tool_removal")
# A content block's optional fields and the JSON type each must have (vLLM's model).
_BLOCK_FIELDS: Final[Mapping[str, type]] = {
    "text": str, "source": dict, "id": str, "tool_use_id": str, "name": str, "input": dict,
    "is_error": bool, "tool_name": str, "thinking": str, "signature": str, "data": str,
}  # fmt: skip
_CHOICES: Final = {"auto": "auto", "any": "required", "none": "none"}
_BILLING_HEADER: Final = "x-anthropic-billing-header"
_MAX_STOP_SEQUENCES: Final = 4  # vLLM's VLLM_MAX_STOP_STRINGS default
_CACHE_SALT_FORBIDDEN: Final = frozenset("@/\\\x00")
_MAX_CACHE_SALT: Final = 128
_MIN_THINKING_BUDGET: Final = 1024


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


def chat_body(body: Mapping[str, Any], traits: TemplateTraits | None = None) -> dict[str, Any]:
    """The chat-completion body (for `openai_api.parse_request("chat", ...)`) whose prompt is
    the one vLLM renders for the Messages request `body`, with `model`, `max_tokens`, `stream`
    and the session (`user`, see `session_id`) as well. `traits`: the model's
    (`template_traits`); without them a body whose prompt depends on them (a system message
    among the messages, `thinking` disabled) is refused. Raises `ApiError` 400 for a body vLLM
    refuses, and for what the module docstring lists."""
    if not isinstance(body, Mapping):
        raise bad_request("request body must be a JSON object")
    request = _Request(body)
    merge = False
    if request.has_inline_system:
        merge = _needs_traits(traits, "a system message among the messages").merge_inline_system
    out: Json = {
        "model": request.model,
        "messages": _conversation(request, merge),
        "max_tokens": request.max_tokens,
    }
    if request.stream:
        out["stream"] = True
        out["stream_options"] = {"include_usage": True}  # vLLM asks for usage when streaming
    kwargs = request.template_kwargs
    tools = request.tools()
    if tools is not None:
        if tools:
            out["tools"] = [_chat_tool(tool) for tool in tools]
        elif _unset(kwargs.get("tools")):
            # vLLM hands the template an empty tool list, which a chat request cannot carry:
            # the template argument does the same (it stands in for the request's tools).
            kwargs = {**kwargs, "tools": []}
        choice = _tool_choice(request.tool_choice, tools)
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


# -- the request, checked as vLLM's model checks it ---------------------------------------------


class _Request:
    """A Messages body's fields, checked (`ApiError` 400) as `AnthropicMessagesRequest`."""

    def __init__(self, body: Mapping[str, Any]) -> None:
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise bad_request("'model' is required: a non-empty string", "model")
        self.model = model
        self.max_tokens = _int(body, "max_tokens", required=True)
        if self.max_tokens <= 0:
            raise bad_request("max_tokens must be positive", "max_tokens")
        messages = body.get("messages")
        if not isinstance(messages, list):
            raise bad_request("'messages' must be a list of messages", "messages")
        self.messages = [_message(m, f"messages[{i}]") for i, m in enumerate(messages)]
        self.system = _system(body.get("system"))
        for key in ("metadata", "kv_transfer_params", "ec_transfer_params"):
            _optional(body, key, dict, "an object")
        self.template_kwargs: Json = dict(
            _optional(body, "chat_template_kwargs", dict, "an object") or {}
        )
        self.stream = bool(_optional(body, "stream", bool, "a boolean"))
        for key in ("return_mm_kwargs", "watermarking"):
            _optional(body, key, bool, "a boolean")
        for key in ("temperature", "top_p"):
            _number(body, key)
        _int(body, "top_k")
        _stop_sequences(body.get("stop_sequences"))
        check_cache_salt(body.get("cache_salt"))
        _vllm_xargs(body.get("vllm_xargs"))
        if body.get("mm_payload", "tensors") not in ("tensors", "none"):
            raise bad_request("'mm_payload' must be 'tensors' or 'none'", "mm_payload")
        self.effort = _output_effort(body.get("output_config"))
        self.thinking_disabled = _thinking(body, self.max_tokens)
        self.tool_choice = _choice(body.get("tool_choice"))
        raw_tools = _optional(body, "tools", list, "a list of tools")
        self._tools = (
            None
            if raw_tools is None
            else [_tool(t, f"tools[{i}]") for i, t in enumerate(raw_tools)]
        )
        self.has_inline_system = any(
            m["role"] == "system" and _system_text(m) for m in self.messages
        )

    def tools(self) -> list[Json] | None:
        """The tools in effect after the tool changes of system messages (vLLM's
        `_resolve_tools`): a tool added by reference is no longer deferred, one added by value
        is declared, a removed one dropped; raises `ApiError` 400 for a change naming a tool
        that is not declared."""
        changes = [
            block
            for m in self.messages
            if isinstance(m["content"], list)
            for block in m["content"]
            if block["type"] in _TOOL_CHANGES
        ]
        if not changes:
            return self._tools
        tools = {tool["name"]: tool for tool in self._tools or []}
        removed: set[str] = set()
        for block in changes:
            change = block["tool"]
            if change["type"] == "tool_definition":
                name = change["definition"]["name"]
                tools[name] = change["definition"]
            else:
                name = change["name"]
                if name not in tools:
                    raise bad_request(
                        f"{block['type']} references tool {name!r}, which is not declared in tools",
                        "messages",
                    )
                if block["type"] == "tool_addition":
                    tools[name] = {**tools[name], "defer_loading": None}
            if block["type"] == "tool_removal":
                removed.add(name)
            else:
                removed.discard(name)
        return [tool for name, tool in tools.items() if name not in removed]


def _message(raw: object, where: str) -> Json:
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


def _system(system: object) -> str | list[Json] | None:
    if system is None or isinstance(system, str):
        return system
    if not isinstance(system, list):
        raise bad_request("'system' must be a string or a list of blocks", "system")
    blocks = [_block(b, f"system[{j}]") for j, b in enumerate(system)]
    _refuse_tool_changes(blocks, "system")
    return blocks


def _refuse_tool_changes(blocks: list[Json], where: str) -> None:
    for block in blocks:
        if block["type"] in _TOOL_CHANGES:
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
        if value is not None and not _is(value, kind_of):
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
    if kind in _TOOL_CHANGES:
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
        return {"type": kind, "definition": _tool(raw.get("definition"), f"{where}.definition")}
    raise bad_request(f"{where} must be a tool_reference or a tool_definition", "messages")


def _tool(raw: object, where: str) -> Json:
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


def _choice(raw: object) -> Json | None:
    if raw is None:
        return None
    kind = raw.get("type") if isinstance(raw, dict) else None
    if not isinstance(raw, dict) or kind not in ("auto", "any", "tool", "none"):
        raise bad_request(
            "'tool_choice' must be an object of type 'auto', 'any', 'tool' or 'none'",
            "tool_choice",
        )
    name = raw.get("name")
    if name is not None and not isinstance(name, str):
        raise bad_request("tool_choice.name must be a string", "tool_choice")
    parallel = raw.get("disable_parallel_tool_use")
    if parallel is not None and not isinstance(parallel, bool):
        raise bad_request("tool_choice.disable_parallel_tool_use must be a boolean", "tool_choice")
    if kind == "tool" and not name:
        raise bad_request("tool_choice.name is required when type is 'tool'", "tool_choice")
    return {"type": kind, "name": name}


def _thinking(body: Mapping[str, Any], max_tokens: int) -> bool:
    """Whether thinking is disabled; checks the `thinking` config (and its budget)."""
    thinking = body.get("thinking")
    if thinking is None:
        return False
    kind = thinking.get("type") if isinstance(thinking, dict) else None
    if not isinstance(thinking, dict) or kind not in ("enabled", "disabled", "adaptive"):
        raise bad_request(
            "'thinking' must be an object of type 'enabled', 'disabled' or 'adaptive'", "thinking"
        )
    display = thinking.get("display")
    if kind != "disabled" and display is not None and display not in _DISPLAYS:
        raise bad_request(f"thinking.display must be one of {sorted(_DISPLAYS)}", "thinking")
    if kind == "enabled":
        budget = _int(thinking, "budget_tokens", required=True, where="thinking.")
        if budget < _MIN_THINKING_BUDGET:
            raise bad_request(
                f"thinking.budget_tokens must be at least {_MIN_THINKING_BUDGET}", "thinking"
            )
        transfer = body.get("kv_transfer_params")
        # vLLM leaves the budget unchecked for the prefill leg of a disaggregated request.
        remote_decode = isinstance(transfer, dict) and transfer.get("do_remote_decode")
        if budget >= max_tokens and not remote_decode:
            raise bad_request("thinking.budget_tokens must be less than max_tokens", "thinking")
        # The budget becomes the request's `thinking_token_budget`, which vLLM's engine takes
        # only with a reasoning parser; kvsched starts vLLM with none.
        raise bad_request(
            "thinking_token_budget is set but reasoning_config is not configured: thinking "
            "'enabled' needs vLLM started with --reasoning-parser (use 'adaptive')",
            "thinking",
        )
    return bool(kind == "disabled")


def _output_effort(config: object) -> str | None:
    if config is None:
        return None
    if not isinstance(config, dict):
        raise bad_request("'output_config' must be an object", "output_config")
    effort = config.get("effort")
    if effort is not None and effort not in _EFFORTS:
        raise bad_request(f"output_config.effort must be one of {list(_EFFORTS)}", "output_config")
    fmt = config.get("format")
    if fmt is not None and not (
        isinstance(fmt, dict)
        and fmt.get("type", "json_schema") == "json_schema"
        and isinstance(fmt.get("schema", {}), dict | None)
    ):
        raise bad_request(
            "output_config.format must be {'type': 'json_schema', 'schema': {...}}",
            "output_config",
        )
    return effort if isinstance(effort, str) else None


def _stop_sequences(value: object) -> None:
    if value is None:
        return
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise bad_request("'stop_sequences' must be a list of strings", "stop_sequences")
    if len(value) > _MAX_STOP_SEQUENCES:
        raise bad_request(
            f"'stop_sequences' holds at most {_MAX_STOP_SEQUENCES} strings", "stop_sequences"
        )


def check_cache_salt(value: object) -> None:
    """Raise vLLM's 400 for a `cache_salt` the chat request it makes of a Messages or a
    Responses body would refuse: at most 128 characters, none of '@', '/', '\\' or NUL
    (the Messages model alone takes 1 to 1024); None passes."""
    if value is None:
        return
    if (
        not isinstance(value, str)
        or not value
        or len(value) > _MAX_CACHE_SALT
        or any(c in _CACHE_SALT_FORBIDDEN for c in value)
    ):
        raise bad_request(
            "Parameter 'cache_salt' must be a non-empty string of at most 128 characters "
            "without '@', '/', '\\' or NUL.",
            "cache_salt",
        )


def _vllm_xargs(value: object) -> None:
    def scalar(v: object) -> bool:
        return isinstance(v, str | int | float) and not isinstance(v, bool)

    if value is None:
        return
    if not isinstance(value, dict) or not all(
        scalar(v) or (isinstance(v, list) and all(scalar(x) for x in v)) for v in value.values()
    ):
        raise bad_request(
            "'vllm_xargs' must map names to strings, numbers or lists of them", "vllm_xargs"
        )


# -- the conversion ------------------------------------------------------------------------------


def _conversation(request: _Request, merge_inline_system: bool) -> list[Json]:
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


def _chat_tool(tool: Json) -> Json:
    function = {
        "name": tool["name"],
        "description": tool["description"],
        "parameters": tool["input_schema"],
    }
    for key in ("strict", "defer_loading"):
        if tool.get(key) is not None:
            function[key] = tool[key]
    return {"type": "function", "function": function}


def _tool_choice(choice: Json | None, tools: list[Json]) -> str | Json | None:
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


def _needs_traits(traits: TemplateTraits | None, what: str) -> TemplateTraits:
    if traits is None:
        raise bad_request(
            f"the prompt of a Messages request with {what} depends on the model's chat "
            "template, which this server did not probe"
        )
    return traits


def _media_refusal() -> ApiError:
    return bad_request(
        "an image is not supported: this model is not multimodal, it takes text only", "messages"
    )


# -- the chat template's traits ------------------------------------------------------------------


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
    if none is None or any(_probe(tokenizer, effort) == none for effort in _EFFORTS):
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


# -- JSON checks ---------------------------------------------------------------------------------

_NAMES: Final[Mapping[type, str]] = {
    str: "a string",
    dict: "an object",
    bool: "a boolean",
    list: "a list",
    int: "an integer",
}


def _is(value: object, kind: type) -> bool:
    return isinstance(value, kind) and not (kind is int and isinstance(value, bool))


def _optional(body: Mapping[str, Any], key: str, kind: type, name: str) -> Any:
    value = body.get(key)
    if value is not None and not _is(value, kind):
        raise bad_request(f"'{key}' must be {name}", key)
    return value


def _int(body: Mapping[str, Any], key: str, *, required: bool = False, where: str = "") -> int:
    value = body.get(key)
    if value is None and not required:
        return 0
    if not isinstance(value, int) or isinstance(value, bool):
        raise bad_request(f"'{where}{key}' must be an integer", key)
    return value


def _number(body: Mapping[str, Any], key: str) -> None:
    value = body.get(key)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
        raise bad_request(f"'{key}' must be a number", key)


def _unset(value: object) -> bool:
    """vLLM's merge of template arguments lets None and "auto" stand for unset."""
    return value is None or value == "auto"
