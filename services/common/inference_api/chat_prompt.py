"""A chat completion request's prompt, as vLLM's OpenAI server makes it.

`parse_chat` reads what shapes the prompt from a request body, with vLLM's defaults and checks
(vllm/entrypoints/openai/chat_completion/protocol.py, vllm/renderers/online_renderer.py,
params.py and hf.py); `ChatRenderer` renders it with the model's chat template. What vLLM does
that is not followed here is refused rather than guessed: a request's own `chat_template`
(vLLM refuses it too unless started with `--trust-request-chat-template`), and template
arguments that make transformers tokenize or mask (`tokenize`, `return_assistant_tokens_mask`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2

from services.common.inference_api.chat_content_format import ContentFormatOption, content_format
from services.common.inference_api.chat_messages import conversation, has_non_text_part
from services.common.inference_api.model_tokenizer import ModelTokenizer, jinja_template
from services.common.serving.api_errors import bad_request

_REASONING_EFFORTS = frozenset({"none", "minimal", "low", "medium", "high", "xhigh", "max"})
# transformers' `apply_chat_template` takes these itself: as template arguments they either do
# nothing when it does not tokenize (vLLM's case) or fail there.
_INERT_ARGUMENTS = frozenset(
    {"padding", "truncation", "max_length", "return_tensors", "return_dict", "tokenizer_kwargs"}
)
_CLASHING_ARGUMENTS = frozenset({"self", "conversation", "messages"})


@dataclass(frozen=True, slots=True)
class ChatRequest:
    """What the prompt of a chat request is made of."""

    messages: list[Any]
    tools: list[dict[str, Any]] | None  # as the template gets them
    documents: list[Any] | None
    add_generation_prompt: bool
    continue_final_message: bool
    variables: dict[str, Any]  # the request's template arguments (over the special tokens)
    # vLLM's decode side of a disaggregated prefill takes these instead of rendering.
    forwarded_ids: tuple[int, ...] | None


def parse_chat(body: Mapping[str, Any]) -> ChatRequest:
    """The chat fields of `body`, checked and merged as vLLM does; raises `ApiError` 400."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise bad_request("'messages' must be a list of messages", "messages")
    if body.get("chat_template") is not None:
        raise bad_request(_UNTRUSTED_TEMPLATE, "chat_template")
    tools = _tools(body)
    add_generation_prompt = _flag(body, "add_generation_prompt", True)
    continue_final_message = _flag(body, "continue_final_message", False)
    if add_generation_prompt and continue_final_message:
        raise bad_request(
            "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
            "continue_final_message",
        )
    documents = body.get("documents")
    if documents is not None and not (
        isinstance(documents, list)
        and all(
            isinstance(d, dict) and all(isinstance(v, str) for v in d.values()) for d in documents
        )
    ):
        raise bad_request("'documents' must be a list of objects of strings", "documents")
    effort = body.get("reasoning_effort")
    if effort is not None and effort not in _REASONING_EFFORTS:
        raise bad_request(
            f"'reasoning_effort' must be one of {sorted(_REASONING_EFFORTS)}", "reasoning_effort"
        )
    user = body.get("chat_template_kwargs")
    if user is None:
        user = {}
    elif not isinstance(user, dict):
        raise bad_request("'chat_template_kwargs' must be an object", "chat_template_kwargs")
    if user.get("chat_template") is not None:
        raise bad_request(_UNTRUSTED_TEMPLATE, "chat_template_kwargs")
    # vLLM's merge: the request's own fields over its template arguments, both over the
    # defaults; a None or "auto" never overrides (vllm/renderers/params.py, merge_kwargs).
    own = {
        "add_generation_prompt": add_generation_prompt,
        "continue_final_message": continue_final_message,
        "documents": documents,
        "reasoning_effort": effort,
    }
    if effort is not None and "enable_thinking" not in user:
        own["enable_thinking"] = effort != "none"
    merged = _over({"tools": tools, "tokenize": False}, _over(user, own))
    return ChatRequest(
        messages=messages,
        tools=_template_tools(merged.pop("tools")),
        documents=_template_documents(merged.pop("documents", None)),
        add_generation_prompt=bool(merged.pop("add_generation_prompt")),
        continue_final_message=bool(merged.pop("continue_final_message")),
        variables=_variables(merged),
        forwarded_ids=_forwarded_ids(body, messages),
    )


class ChatRenderer:
    """Renders chat requests as vLLM does (vllm/renderers/hf.py, `safe_apply_chat_template`):
    the messages as vLLM hands them to a template (`chat_messages`), then transformers'
    `apply_chat_template` with the model's template, or the one the server was given."""

    def __init__(
        self,
        tokenizer: ModelTokenizer,
        chat_template: str | None = None,
        content_format: ContentFormatOption = "auto",
    ) -> None:
        """`chat_template`: a template's text in place of the tokenizer's (vLLM's
        `--chat-template`, read by `load_chat_template`); `content_format`: vLLM's
        `--chat-template-content-format`. Raises `ValueError` for a template with a syntax
        error, so that a server does not start with it."""
        self._tokenizer = tokenizer
        self._chat_template = chat_template
        self._content_format = content_format
        own = tokenizer.hf.chat_template
        if chat_template is not None:
            templates = {"given": chat_template}
        elif isinstance(own, str):
            templates = {"default": own}
        elif own is None or (
            isinstance(own, dict) and all(isinstance(t, str) for t in own.values())
        ):
            templates = dict(own or {})
        else:
            raise ValueError(
                f"{tokenizer.directory}: chat_template must be a string or a list of named "
                "templates"
            )
        self._has_template = bool(templates)
        for name, source in templates.items():
            try:
                jinja_template(source)
            except jinja2.TemplateSyntaxError as exc:
                raise ValueError(f"chat template {name!r}, line {exc.lineno}: {exc}") from exc

    def render(self, chat: ChatRequest) -> str:
        """The prompt text; raises `ApiError` 400 for what vLLM or the template refuses."""
        source = self._source(chat.tools)
        fmt = self._content_format
        messages = conversation(
            chat.messages,
            content_format(source) if fmt == "auto" else fmt,
            template_knows_developer='"developer"' in source or "'developer'" in source,
        )
        try:
            text = self._tokenizer.hf.apply_chat_template(
                messages,
                tools=chat.tools,
                documents=chat.documents,
                chat_template=source,
                add_generation_prompt=chat.add_generation_prompt,
                continue_final_message=chat.continue_final_message,
                tokenize=False,
                **chat.variables,
            )
        except Exception as exc:  # what the template raised: vLLM answers all of it with a 400
            raise bad_request(f"The chat template failed: {_template_error_reason(exc)}") from None
        return str(text)

    def _source(self, tools: list[dict[str, Any]] | None) -> str:
        """The template's text: transformers' choice (`get_chat_template`: "tool_use" for a
        request with tools where there is one, else "default"), or a 400 in vLLM's words or
        else in transformers'."""
        if not self._has_template:
            raise bad_request(
                "As of transformers v4.44, default chat template is no longer allowed, so you "
                "must provide a chat template if the tokenizer does not define one."
            )
        try:
            return str(self._tokenizer.hf.get_chat_template(self._chat_template, tools=tools))
        except ValueError as exc:
            raise bad_request(str(exc)) from None


def load_chat_template(value: str) -> str:
    """vLLM's `--chat-template` (`load_chat_template`): the text of the file `value` names,
    else `value` itself where it looks like a template (holds `{`, `}` or a newline); raises
    `ValueError` for what looks like a path that cannot be read."""
    try:
        return Path(value).read_text(encoding="utf-8")
    except OSError as exc:
        if not any(c in value for c in "{}\n"):
            raise ValueError(
                f"The supplied chat template ({value}) looks like a file path, but it failed to "
                f"be opened: {exc}"
            ) from None
        return value


def _template_error_reason(exc: BaseException) -> str:
    """The most specific reason in `exc`'s chain: the template's own words where it raised
    (vllm/renderers/hf.py, `_template_error_reason`)."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, jinja2.TemplateError):
            return str(current)
        current = current.__cause__ or current.__context__
    return str(exc)


_UNTRUSTED_TEMPLATE = (
    "Chat template is passed with request, but --trust-request-chat-template is not set. "
    "Refused request with untrusted chat template."
)


def _over(defaults: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    return {**defaults, **{k: v for k, v in overrides.items() if not _unset(v)}}


def _unset(value: object) -> bool:
    return value is None or (isinstance(value, str) and value == "auto")


def _flag(body: Mapping[str, Any], key: str, default: bool) -> bool:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(f"'{key}' must be a boolean", key)
    return value


def _tools(body: Mapping[str, Any]) -> list[dict[str, Any]] | None:
    """The request's tools as vLLM dumps them for the template (`ChatCompletionToolsParam`:
    its fields only, in its order, `description` and `parameters` even when null), after
    vLLM's `tool_choice` checks."""
    tools = body.get("tools")
    choice = body.get("tool_choice", "auto" if tools else "none")
    if tools == []:
        raise bad_request(
            "`tools` must not be an empty array. Either provide at least one tool or omit the "
            "field entirely.",
            "tools",
        )
    if tools is not None and not isinstance(tools, list):
        raise bad_request("'tools' must be a list of tools", "tools")
    dumped = None if tools is None else [_tool(tool, f"tools[{i}]") for i, tool in enumerate(tools)]
    if choice in (None, "none", "auto", "required"):
        if choice in ("auto", "required") and dumped is None:
            raise bad_request("When using `tool_choice`, `tools` must be set.", "tool_choice")
        return dumped
    function = choice.get("function") if isinstance(choice, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise bad_request(
            '\'tool_choice\' must be "none", "auto", "required" or '
            '{"type": "function", "function": {"name": ...}}',
            "tool_choice",
        )
    if dumped is None:
        raise bad_request("When using `tool_choice`, `tools` must be set.", "tool_choice")
    if all(tool["function"]["name"] != function["name"] for tool in dumped):
        raise bad_request(
            "The tool specified in `tool_choice` does not match any of the specified `tools`",
            "tool_choice",
        )
    return dumped


def _tool(tool: object, where: str) -> dict[str, Any]:
    if not isinstance(tool, dict) or tool.get("type", "function") != "function":
        raise bad_request(f"{where} must be a tool of type 'function'", "tools")
    function = tool.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise bad_request(f"{where}.function must be an object with a string 'name'", "tools")
    description, parameters = function.get("description"), function.get("parameters")
    if not isinstance(description, str | None) or not isinstance(parameters, dict | None):
        raise bad_request(
            f"{where}.function: 'description' must be a string, 'parameters' an object", "tools"
        )
    defer = tool.get("defer_loading")
    strict, own_defer = function.get("strict"), function.get("defer_loading")
    if not all(isinstance(flag, bool | None) for flag in (defer, strict, own_defer)):
        raise bad_request(f"{where}: 'strict' and 'defer_loading' must be booleans", "tools")
    dumped = {"name": function["name"], "description": description, "parameters": parameters}
    if strict is not None:
        dumped["strict"] = strict
    if own_defer is not None or defer is not None:  # the tool's own flag goes to its function
        dumped["defer_loading"] = defer if own_defer is None else own_defer
    out: dict[str, Any] = {"type": "function", "function": dumped}
    if defer is not None:
        out["defer_loading"] = defer
    return out


def _template_tools(tools: object) -> list[dict[str, Any]] | None:
    # `chat_template_kwargs.tools` replaces the request's tools, unchecked by vLLM; transformers
    # takes JSON schemas (objects) only.
    if tools is not None and not (
        isinstance(tools, list) and all(isinstance(t, dict) for t in tools)
    ):
        raise bad_request("chat_template_kwargs.tools must be a list of objects", "tools")
    return tools


def _template_documents(documents: object) -> list[Any] | None:
    if documents is not None and not (
        isinstance(documents, list) and all(isinstance(d, dict) for d in documents)
    ):
        raise bad_request("Documents should be a list of dicts with 'title' and 'text' keys!")
    return documents


def _variables(arguments: dict[str, Any]) -> dict[str, Any]:
    """The template arguments the template sees (transformers takes its own ones)."""
    if arguments.pop("tokenize"):
        raise bad_request(
            "chat_template_kwargs.tokenize is not supported: the prompt is tokenized as vLLM "
            "tokenizes it, after rendering",
            "chat_template_kwargs",
        )
    if arguments.pop("return_assistant_tokens_mask", False):
        raise bad_request(
            "`return_assistant_tokens_mask=True` requires `return_dict=True` and `tokenize=True`",
            "chat_template_kwargs",
        )
    clashing = sorted(_CLASHING_ARGUMENTS & arguments.keys())
    if clashing:
        raise bad_request(
            f"chat_template_kwargs may not set {', '.join(clashing)}", "chat_template_kwargs"
        )
    return {k: v for k, v in arguments.items() if k not in _INERT_ARGUMENTS}


def _forwarded_ids(body: Mapping[str, Any], messages: list[Any]) -> tuple[int, ...] | None:
    """`kv_transfer_params.prompt_token_ids`: vLLM takes them as the prompt unless `echo` is
    set or a message holds more than text (it renders those)."""
    params = body.get("kv_transfer_params")
    ids = params.get("prompt_token_ids") if isinstance(params, dict) else None
    if ids is None or body.get("echo") or has_non_text_part(messages):
        return None
    if not (isinstance(ids, list) and ids and all(type(t) is int and t >= 0 for t in ids)):
        raise bad_request(
            "`kv_transfer_params['prompt_token_ids']` must be a non-empty list of non-negative "
            "integers.",
            "kv_transfer_params.prompt_token_ids",
        )
    return tuple(ids)
