"""An Anthropic Messages body's fields, checked (`ApiError` 400) as vLLM's request model
checks them (`AnthropicMessagesRequest`, vllm/entrypoints/anthropic/protocol.py), and what the
chat request is made from: `MessagesRequest`. vLLM's model is pydantic's in its lax mode, which
takes "64" or 64.0 for 64 and "true" for true: those are refused here, every field must have
its JSON type. Its messages, blocks and tools are checked by `anthropic_content`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from services.common.inference_api.anthropic_content import (
    TOOL_CHANGES,
    checked_message,
    checked_system,
    checked_tool,
    has_json_type,
)
from services.common.inference_api.vllm_extension_fields import check_cache_salt, is_vllm_xargs
from services.common.serving.api_errors import bad_request

Json = dict[str, Any]

EFFORTS: Final = ("low", "medium", "high", "xhigh", "max")  # vLLM's AnthropicEffort
_DISPLAYS: Final = ("summarized", "omitted", "updates")
_MAX_STOP_SEQUENCES: Final = 4  # vLLM's VLLM_MAX_STOP_STRINGS default
_MIN_THINKING_BUDGET: Final = 1024


class MessagesRequest:
    """A Messages body's fields, checked (`ApiError` 400) as `AnthropicMessagesRequest`:
    `model`, `max_tokens`, `messages` and `system` (as `anthropic_content` leaves them),
    `template_kwargs`, `stream`, `effort` (`output_config.effort`), `thinking_disabled`,
    `tool_choice` (`{"type", "name"}`, or None) and the tools in effect (`tools()`)."""

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
        self.messages = [checked_message(m, f"messages[{i}]") for i, m in enumerate(messages)]
        self.system = checked_system(body.get("system"))
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
            else [checked_tool(t, f"tools[{i}]") for i, t in enumerate(raw_tools)]
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
            if block["type"] in TOOL_CHANGES
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
    if effort is not None and effort not in EFFORTS:
        raise bad_request(f"output_config.effort must be one of {list(EFFORTS)}", "output_config")
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


def _vllm_xargs(value: object) -> None:
    if value is not None and not is_vllm_xargs(value):
        raise bad_request(
            "'vllm_xargs' must map names to strings, numbers or lists of them", "vllm_xargs"
        )


def _optional(body: Mapping[str, Any], key: str, kind: type, name: str) -> Any:
    value = body.get(key)
    if value is not None and not has_json_type(value, kind):
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
