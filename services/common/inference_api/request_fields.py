"""The sampling and output fields of a completion body that the OpenAI API defines, checked
as OpenAI checks them (type, then range) with its error messages, one table for all: a value
the engine would refuse, or that would silently change the request (`n: true`, `temperature:
"hot"`), is a 400 before the request is placed. `null` is every field's default. (NaN and
Infinity never get here: `openai_api.read_json` refuses them as invalid JSON.)"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final, Literal

from services.common.serving.api_errors import ApiError, bad_request

_EXPECTED: Final = {"integer": "an integer", "decimal": "a decimal"}


@dataclass(frozen=True, slots=True)
class Number:
    """An integer or a decimal (an integer is a decimal too; a boolean is neither), within
    `minimum` (exclusive when `above`) and `maximum`."""

    kind: Literal["integer", "decimal"]
    minimum: float | None = None
    maximum: float | None = None
    above: bool = False  # the minimum itself is refused

    def check(self, name: str, value: object) -> None:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise _wrong_type(name, _EXPECTED[self.kind], value)
        if self.kind == "integer" and isinstance(value, float):
            raise _wrong_type(name, _EXPECTED[self.kind], value)
        if not math.isfinite(value):
            raise bad_request(f"Invalid '{name}': expected a finite number.", name)
        low = self.minimum
        if low is not None and (value <= low if self.above else value < low):
            relation = ">" if self.above else ">="
            raise _out_of_range(name, f"{self.kind} below minimum", f"{relation} {low}", value)
        high = self.maximum
        if high is not None and value > high:
            raise _out_of_range(name, f"{self.kind} above maximum", f"<= {high}", value)


@dataclass(frozen=True, slots=True)
class Boolean:
    """`true` or `false`."""

    def check(self, name: str, value: object) -> None:
        if not isinstance(value, bool):
            raise _wrong_type(name, "a boolean", value)


@dataclass(frozen=True, slots=True)
class StringOrStrings:
    """A string or an array of strings (`stop`)."""

    def check(self, name: str, value: object) -> None:
        if isinstance(value, str):
            return
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise _wrong_type(name, "a string or an array of strings", value)


Field = Number | Boolean | StringOrStrings

# OpenAI's API reference (and vLLM's protocol for n, max_tokens, top_p).
FIELDS: Final[Mapping[str, Field]] = {
    "n": Number("integer", minimum=1),
    "max_tokens": Number("integer", minimum=1),
    "max_completion_tokens": Number("integer", minimum=1),
    "temperature": Number("decimal", minimum=0, maximum=2),
    "top_p": Number("decimal", minimum=0, maximum=1, above=True),
    "presence_penalty": Number("decimal", minimum=-2, maximum=2),
    "frequency_penalty": Number("decimal", minimum=-2, maximum=2),
    "stream": Boolean(),
    "stop": StringOrStrings(),
}


def check_fields(body: Mapping[str, object]) -> None:
    """Raise `ApiError` 400 (`param`: the field) for the first field of `FIELDS` that `body`
    sets to a value of the wrong type or out of range."""
    for name, field in FIELDS.items():
        value = body.get(name)
        if value is not None:
            field.check(name, value)


def _json_type(value: object) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a decimal"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


def _wrong_type(name: str, expected: str, value: object) -> ApiError:
    return bad_request(
        f"Invalid type for '{name}': expected {expected}, but got {_json_type(value)} instead.",
        name,
    )


def _out_of_range(name: str, what: str, expected: str, value: float) -> ApiError:
    return bad_request(
        f"Invalid '{name}': {what} value. Expected a value {expected}, but got {value} instead.",
        name,
    )
