"""Prompt token ids equal to vLLM's for Anthropic Messages and OpenAI Responses requests: every
case of tests/data/vllm/api_prompt_tokens.json (made by tools/make_vllm_api_vectors.py with
vLLM 0.32's own conversion and renderer) gives, through `anthropic_messages.chat_body` or
`responses_input.chat_body` and `PromptTokenizer`, the ids vLLM fed its engine, or a 400 where
vLLM refused the body (or where kvsched refuses what it cannot follow), for the demo tokenizer
and the tokenizer families of tests/data/tokenizers/. Also: the Messages session id, and
arbitrary JSON never raising anything but `ApiError`."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.common.inference_api import anthropic_messages, responses_input
from services.common.inference_api.openai_api import ApiError, PromptTokenizer, parse_request

REPO = Path(__file__).resolve().parents[2]
VECTORS = json.loads((REPO / "tests/data/vllm/api_prompt_tokens.json").read_text(encoding="utf-8"))
CASES = VECTORS["cases"]
DEMO = PromptTokenizer()  # the shipped tokenizer, for the arbitrary bodies


@pytest.fixture(scope="module")
def tokenizers() -> dict[str, PromptTokenizer]:
    out = {"demo": PromptTokenizer()}  # the shipped one, read from the package
    for family, path in VECTORS["bases"].items():
        out[family] = PromptTokenizer(REPO / path)
    return out


Traits = dict[str, Any]  # per API, per tokenizer


@pytest.fixture(scope="module")
def traits(tokenizers: dict[str, PromptTokenizer]) -> Traits:
    return {
        "messages": {n: anthropic_messages.template_traits(t) for n, t in tokenizers.items()},
        "responses": {n: responses_input.template_traits(t) for n, t in tokenizers.items()},
    }


def prompt_ids(case: Mapping[str, Any], tok: PromptTokenizer, traits: Any) -> list[int]:
    body = case["body"]
    if case["api"] == "messages":
        chat = anthropic_messages.chat_body(body, traits)
    else:
        chat = responses_input.chat_body(body, traits)
    json.dumps(chat)  # a JSON body, as a client would send
    return tok.prompt_ids(parse_request("chat", chat))


def has_tool_calls(case: Mapping[str, Any]) -> bool:
    items = case["body"].get("input")
    kinds = ("function_call", "custom_tool_call")
    return isinstance(items, list) and any(
        isinstance(i, dict) and i.get("type") in kinds for i in items
    )


def test_vectors_cover_the_cases_asked_for() -> None:
    for api in ("messages", "responses"):
        for variant in ("demo", *VECTORS["bases"]):
            cases = [c for c in CASES if c["api"] == api and c["variant"] == variant]
            assert sum("ids" in c["vllm"] for c in cases) >= 25
            assert sum("status" in c["vllm"] for c in cases) >= 10


def test_messages_traits_are_vllms(traits: Traits) -> None:
    for variant, expected in VECTORS["traits"].items():
        got = traits["messages"][variant]
        assert {
            "merge_inline_system": got.merge_inline_system,
            "disabled_thinking_effort": got.disabled_thinking_effort,
        } == expected


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c['api']}-{c['variant']}: {c['name']}")
def test_prompt_ids_are_vllms(
    case: dict[str, Any], tokenizers: dict[str, PromptTokenizer], traits: Traits
) -> None:
    tok = tokenizers[case["variant"]]
    own = traits[case["api"]][case["variant"]]
    expected = case["vllm"]
    refused = case.get("kvsched_refuses")
    if (
        case["api"] == "responses"
        and has_tool_calls(case)
        and own.call_key_order_shows
        and "ids" in expected
        and refused is None
    ):
        refused = "tool calls in the input are not supported for this model"
        # The refusal is needed: the chat path's key order would show.
        plain = responses_input.TemplateTraits(call_key_order_shows=False)
        assert prompt_ids(case, tok, plain) != expected["ids"]
    if "ids" in expected and refused is None:
        assert prompt_ids(case, tok, own) == expected["ids"]
        return
    with pytest.raises(ApiError) as err:
        prompt_ids(case, tok, own)
    assert err.value.status == 400
    assert err.value.body()["error"]["message"]
    if refused is not None:
        assert refused in err.value.message
    else:
        assert expected["status"] == 400


def test_responses_traits(traits: Traits) -> None:
    # Of the test templates, only the [INST] one prints a tool call's function whole.
    shows = {n: t.call_key_order_shows for n, t in traits["responses"].items()}
    assert shows == {"demo": False, "qwen2": False, "mistral": True}


# -- the Messages session id ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ({"metadata": {"user_id": "user_1_account__session_abc"}}, "user_1_account__session_abc"),
        ({"metadata": {"user_id": ""}}, None),
        ({"metadata": {"user_id": 5}}, None),
        ({"metadata": {"session_id": "s"}}, None),
        ({"metadata": "user_id"}, None),
        ({"metadata": None}, None),
        ({}, None),
    ],
)
def test_session_id(body: dict[str, Any], expected: str | None) -> None:
    assert anthropic_messages.session_id(body) == expected


def test_session_id_reaches_the_chat_request() -> None:
    body = {
        "model": "m",
        "max_tokens": 8,
        "messages": [{"role": "user", "content": "hi"}],
        "metadata": {"user_id": "s-1"},
    }
    assert parse_request("chat", anthropic_messages.chat_body(body)).session_id == "s-1"


def test_template_dependent_bodies_need_traits() -> None:
    hi = [{"role": "user", "content": "hi"}]
    for extra in (
        {"messages": [*hi, {"role": "system", "content": "late"}]},
        {"messages": hi, "thinking": {"type": "disabled"}},
    ):
        with pytest.raises(ApiError) as err:
            anthropic_messages.chat_body({"model": "m", "max_tokens": 8, **extra})
        assert err.value.status == 400 and "chat template" in err.value.message
    calls = [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}]
    with pytest.raises(ApiError) as err:
        responses_input.chat_body({"input": calls})
    assert err.value.status == 400


# -- arbitrary JSON ------------------------------------------------------------------------------

# Keys and strings both APIs read, so that arbitrary bodies reach deep into them.
WORDS = [
    "model", "max_tokens", "messages", "system", "role", "content", "type", "text", "user",
    "assistant", "developer", "tool", "tools", "tool_choice", "name", "input", "input_schema",
    "id", "tool_use", "tool_use_id", "tool_result", "tool_reference", "tool_name", "thinking",
    "redacted_thinking", "image", "source", "url", "tool_addition", "tool_removal",
    "tool_definition", "definition", "disabled", "enabled", "adaptive", "budget_tokens", "any",
    "auto", "none", "required", "metadata", "user_id", "output_config", "effort", "stream",
    "instructions", "message", "input_text", "output_text", "function_call", "arguments",
    "call_id", "function_call_output", "output", "reasoning", "summary", "summary_text",
    "reasoning_text", "status", "in_progress", "custom_tool_call", "custom", "namespace",
    "function", "parameters", "allowed_tools", "mode", "annotations", "kv_transfer_params",
    "prompt_token_ids", "chat_template_kwargs", "cache_salt", "truncation", "low",
]  # fmt: skip
scalars = (
    st.none()
    | st.booleans()
    | st.integers(-3, 5000)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.sampled_from(WORDS)
    | st.text(max_size=4)
)
keys = st.sampled_from(WORDS) | st.text(max_size=3)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(keys, inner, max_size=5),
    max_leaves=40,
)
objects = st.dictionaries(keys, values, max_size=6)
messages_bodies = objects | st.fixed_dictionaries(
    {"model": st.just("m"), "max_tokens": st.just(64), "messages": st.lists(objects, max_size=4)},
    optional={"system": values, "tools": st.lists(objects, max_size=2), "tool_choice": objects},
)
responses_bodies = objects | st.fixed_dictionaries(
    {"input": st.lists(objects, max_size=4) | st.text(max_size=4)},
    optional={"tools": st.lists(objects, max_size=2), "tool_choice": values, "reasoning": objects},
)


def only_api_errors(make: Callable[[], dict[str, Any]], tok: PromptTokenizer) -> None:
    """`make()` and the prompt of the chat body it makes raise nothing but a 400."""
    try:
        tok.prompt_ids(parse_request("chat", make()))
    except ApiError as exc:
        assert exc.status == 400


@settings(max_examples=150, deadline=None)
@given(body=messages_bodies | objects)
def test_messages_bodies_raise_only_api_errors(body: dict[str, Any]) -> None:
    traits = anthropic_messages.TemplateTraits(True, "low")
    only_api_errors(lambda: anthropic_messages.chat_body(body), DEMO)
    only_api_errors(lambda: anthropic_messages.chat_body(body, traits), DEMO)


@settings(max_examples=150, deadline=None)
@given(body=responses_bodies | objects)
def test_responses_bodies_raise_only_api_errors(body: dict[str, Any]) -> None:
    traits = responses_input.TemplateTraits(call_key_order_shows=False)
    only_api_errors(lambda: responses_input.chat_body(body), DEMO)
    only_api_errors(lambda: responses_input.chat_body(body, traits), DEMO)
