"""The fields of an OpenAI Responses request checked as vLLM's request model checks them: the
top-level fields other than the input and tools for their JSON type, and the ones vLLM refuses
outright (`check_fields`); and the string keys of an input item or a tool (`check_strings`).

vLLM's model is pydantic's in its lax mode, which takes "64" for 64 and "true" for true: those
are refused here, every field must have its JSON type. Sampling fields are only checked for
their type: vLLM checks their ranges itself when the body reaches it."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Final

from services.common.inference_api.vllm_extension_fields import check_cache_salt, is_vllm_xargs
from services.common.serving.api_errors import bad_request

_EFFORTS: Final = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
_SUMMARIES: Final = ("auto", "concise", "detailed")
_INCLUDES: Final = (
    "code_interpreter_call.outputs", "computer_call_output.output.image_url",
    "file_search_call.results", "message.input_image.image_url",
    "message.output_text.logprobs", "reasoning.encrypted_content",
)  # fmt: skip
_SERVICE_TIERS: Final = ("auto", "default", "flex", "scale", "priority")
_TEXT_FORMATS: Final = ("text", "json_schema", "json_object")
_MAX_STOP: Final = 4  # vLLM's VLLM_MAX_STOP_STRINGS default
_INT64: Final = 2**63


def check_fields(body: Mapping[str, Any]) -> None:
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
    "vllm_xargs": _nullable(is_vllm_xargs),
    "kv_transfer_params": _nullable(_is_dict),
    "ec_transfer_params": _nullable(_is_dict),
    "chat_template_kwargs": _nullable(_is_dict),
}


def check_strings(
    raw: Mapping[str, Any],
    where: str,
    required: tuple[str, ...],
    optional: tuple[str, ...],
    *,
    param: str = "input",
) -> None:
    """Raise a 400 (for `param`) where a `required` key of the item or tool `raw` (at `where`)
    is not a string, or an `optional` one is neither null nor a string."""
    for key in required:
        if not isinstance(raw.get(key), str):
            raise bad_request(f"{where}.{key} must be a string", param)
    for key in optional:
        if raw.get(key) is not None and not isinstance(raw[key], str):
            raise bad_request(f"{where}.{key} must be a string", param)
