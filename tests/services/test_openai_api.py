"""The request parsing, chat rendering and tokenizer the Router and the engine share."""

from __future__ import annotations

import json

import pytest

from services.common.openai_api import (
    DEFAULT_MAX_TOKENS,
    ApiError,
    PromptTokenizer,
    check_length,
    parse_request,
    rate_limited,
    render_chat,
)


@pytest.fixture(scope="module")
def tok() -> PromptTokenizer:
    return PromptTokenizer()


def test_completion_text_and_defaults() -> None:
    req = parse_request("completion", {"prompt": "hi", "extra_field": [1, 2]})
    assert req.prompt_text == "hi" and req.prompt_ids is None
    assert req.max_tokens == DEFAULT_MAX_TOKENS["completion"]
    assert not req.stream and not req.include_usage and req.session_id is None


def test_completion_token_ids_and_batch_of_one() -> None:
    assert parse_request("completion", {"prompt": [5, 6, 7]}).prompt_ids == (5, 6, 7)
    assert parse_request("completion", {"prompt": [[5, 6]]}).prompt_ids == (5, 6)
    assert parse_request("completion", {"prompt": ["x"]}).prompt_text == "x"


def test_stream_usage_session_salt() -> None:
    body = {
        "prompt": "x",
        "stream": True,
        "stream_options": {"include_usage": True},
        "user": "u1",
        "max_completion_tokens": 7,
        "cache_salt": "s",
    }
    req = parse_request("completion", body)
    assert (req.stream, req.include_usage, req.session_id, req.max_tokens) == (True, True, "u1", 7)
    assert req.cache_salt == "s"
    meta = parse_request("chat", {"messages": [{"role": "user", "content": "x"}], "user": "u",
                                   "metadata": {"session_id": "m"}})  # fmt: skip
    assert meta.session_id == "m"


@pytest.mark.parametrize(
    ("kind", "body", "param"),
    [
        ("completion", {}, "prompt"),
        ("completion", {"prompt": []}, "prompt"),
        ("completion", {"prompt": ["a", "b"]}, "prompt"),
        ("completion", {"prompt": [1, -2]}, "prompt"),
        ("completion", {"prompt": [1, True]}, "prompt"),
        ("completion", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ("completion", {"prompt": "x", "max_tokens": "9"}, "max_tokens"),
        ("completion", {"prompt": "x", "stream": "yes"}, "stream"),
        ("completion", {"prompt": "x", "n": 2}, "n"),
        ("completion", {"prompt": "x", "model": 3}, "model"),
        ("completion", {"prompt": "x", "cache_salt": 3}, "cache_salt"),
        ("chat", {"messages": []}, "messages"),
        ("chat", {"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
        ("chat", {"messages": [{"role": "user", "content": 5}]}, "messages"),
        ("chat", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
    ],
)
def test_bad_bodies_are_400s_naming_the_field(
    kind: str, body: dict[str, object], param: str
) -> None:
    with pytest.raises(ApiError) as err:
        parse_request(kind, body)  # type: ignore[arg-type]
    assert err.value.status == 400 and err.value.param == param
    shape = err.value.body()["error"]
    assert set(shape) == {"message", "type", "param", "code"}
    assert shape["type"] == "invalid_request_error"


def test_chat_template_parts_and_roles() -> None:
    text = render_chat(
        [
            {"role": "system", "content": "be brief"},
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            },
        ]
    )
    assert text == "<|begin_of_text|><|system|>\nbe brief\n<|user|>\nab\n<|assistant|>\n"


def test_tokenizer_is_shipped_deterministic_and_checks_vocabulary(tok: PromptTokenizer) -> None:
    req = parse_request("chat", {"messages": [{"role": "user", "content": "KV cache"}]})
    ids = tok.prompt_ids(req)
    assert ids == tok.prompt_ids(req) and ids[0] == 0  # <|begin_of_text|> is token 0
    assert tok.decode(ids) == req.prompt_text
    with pytest.raises(ApiError, match="out of vocabulary"):
        tok.prompt_ids(parse_request("completion", {"prompt": [1, tok.vocab_size]}))


def test_length_check_in_vllm_words() -> None:
    check_length(100, 28, 128)
    with pytest.raises(ApiError, match="maximum context length is 128 tokens") as err:
        check_length(100, 29, 128)
    assert err.value.param == "max_tokens"


def test_rate_limited_response_has_retry_after() -> None:
    resp = rate_limited("busy", 1.2).response()
    assert resp.status == 429 and resp.headers["Retry-After"] == "2"
    assert resp.body is not None
    assert json.loads(bytes(resp.body))["error"]["code"] == "rate_limit_exceeded"  # type: ignore[arg-type]
