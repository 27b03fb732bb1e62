"""The OpenAI fields of a completion body: each refused value a 400 naming its field with
OpenAI's message, each valid one (and null) accepted, through `parse_request`."""

from __future__ import annotations

from typing import Any

import pytest

from services.common.inference_api.openai_api import ApiError, parse_request

PROMPT = {"prompt": "Hello"}

REFUSED: list[tuple[dict[str, Any], str, str]] = [
    ({"n": True}, "n", "Invalid type for 'n': expected an integer, but got a boolean instead."),
    ({"n": 1.0}, "n", "expected an integer, but got a decimal"),
    ({"n": "1"}, "n", "expected an integer, but got a string"),
    ({"n": 0}, "n", "Invalid 'n': integer below minimum value. Expected a value >= 1, but got 0"),
    ({"temperature": -5}, "temperature", "decimal below minimum value. Expected a value >= 0"),
    (
        {"temperature": 2.5},
        "temperature",
        "above maximum value. Expected a value <= 2, but got 2.5",
    ),
    ({"temperature": "hot"}, "temperature", "expected a decimal, but got a string instead."),
    ({"temperature": float("nan")}, "temperature", "expected a finite number"),
    ({"temperature": [1]}, "temperature", "expected a decimal, but got an array"),
    ({"top_p": 0}, "top_p", "Expected a value > 0, but got 0 instead."),
    ({"top_p": 1.5}, "top_p", "Expected a value <= 1"),
    ({"top_p": {}}, "top_p", "but got an object instead"),
    ({"max_tokens": 0}, "max_tokens", "Expected a value >= 1, but got 0"),
    ({"max_tokens": 8.0}, "max_tokens", "expected an integer, but got a decimal"),
    ({"max_completion_tokens": False}, "max_completion_tokens", "but got a boolean"),
    ({"presence_penalty": -2.5}, "presence_penalty", "Expected a value >= -2"),
    ({"frequency_penalty": 3}, "frequency_penalty", "Expected a value <= 2, but got 3"),
    ({"frequency_penalty": "0"}, "frequency_penalty", "expected a decimal, but got a string"),
    ({"stream": 1}, "stream", "expected a boolean, but got an integer"),
    ({"stream": "true"}, "stream", "expected a boolean, but got a string"),
    ({"stop": 5}, "stop", "expected a string or an array of strings, but got an integer"),
    ({"stop": ["a", 1]}, "stop", "but got an array instead"),
]

ACCEPTED: list[dict[str, Any]] = [
    {"n": 1, "temperature": 0, "top_p": 1, "presence_penalty": -2, "frequency_penalty": 2},
    {"temperature": 2, "top_p": 0.01, "max_tokens": 1, "stream": True, "stop": "\n"},
    {"temperature": 0.7, "max_completion_tokens": 5, "stop": ["a", "b"], "stream": False},
    {"n": None, "temperature": None, "top_p": None, "stop": None, "stream": None},
]


@pytest.mark.parametrize("kind", ["completion", "chat"])
@pytest.mark.parametrize("fields, param, message", REFUSED)
def test_refused_values_name_their_field(
    kind: str, fields: dict[str, Any], param: str, message: str
) -> None:
    body = {**PROMPT, "messages": [{"role": "user", "content": "hi"}], **fields}
    with pytest.raises(ApiError) as refused:
        parse_request("chat" if kind == "chat" else "completion", body)
    assert refused.value.status == 400
    assert refused.value.param == param
    assert message in refused.value.message


@pytest.mark.parametrize("fields", ACCEPTED)
def test_valid_values_are_accepted(fields: dict[str, Any]) -> None:
    req = parse_request("completion", {**PROMPT, **fields})
    assert req.stream is bool(fields.get("stream"))
    assert req.max_tokens == fields.get("max_tokens", fields.get("max_completion_tokens", 16))
