"""The request parsing and tokenizer the Router and the engine share (chat rendering against
vLLM's: test_vllm_prompt_tokens.py; refusals: test_chat_refusals.py)."""

from __future__ import annotations

import json

import pytest

from services.common.inference_api.openai_api import (
    DEFAULT_MAX_TOKENS,
    ApiError,
    PromptTokenizer,
    check_length,
    parse_request,
    rate_limited,
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
        ("completion", {"prompt": ["a", ""]}, "prompt"),
        ("completion", {"prompt": [[1], []]}, "prompt"),
        ("completion", {"prompt": ["a", 1]}, "prompt"),
        ("completion", {"prompt": [1, -2]}, "prompt"),
        ("completion", {"prompt": [1, True]}, "prompt"),
        ("completion", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ("completion", {"prompt": "x", "max_tokens": "9"}, "max_tokens"),
        ("completion", {"prompt": "x", "stream": "yes"}, "stream"),
        ("completion", {"prompt": "x", "n": 0}, "n"),
        ("completion", {"prompt": "x", "model": 3}, "model"),
        ("completion", {"prompt": "x", "cache_salt": 3}, "cache_salt"),
        ("completion", {"prompt": ""}, "prompt"),
        ("completion", {"prompt": "x", "suffix": "y"}, "suffix"),
        ("completion", {"prompt": "x", "add_special_tokens": "no"}, "add_special_tokens"),
        ("completion", {"prompt": "x", "truncate_prompt_tokens": 3}, "truncate_prompt_tokens"),
        ("chat", {"messages": "hi"}, "messages"),
        ("chat", {"messages": [], "add_generation_prompt": 1}, "add_generation_prompt"),
        ("chat", {"messages": [], "tools": []}, "tools"),
        ("chat", {"messages": [], "chat_template_kwargs": []}, "chat_template_kwargs"),
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


def test_chat_is_rendered_with_the_demo_template(tok: PromptTokenizer) -> None:
    body = {"messages": [{"role": "system", "content": "be brief"},
                         {"role": "user", "content": [{"type": "text", "text": "a"},
                                                      {"type": "text", "text": "b"}]}]}  # fmt: skip
    req = parse_request("chat", body)
    assert req.chat is not None and not req.add_special_tokens
    text = tok.render_chat(req.chat)
    assert text == (
        "<|begin_of_text|><|system|>\nbe brief<|end_of_text|>"
        "<|user|>\na\nb<|end_of_text|><|assistant|>\n"
    )
    assert tok.prompt_ids(req) == tok.encode(text)


def test_tokenizer_is_shipped_deterministic_and_checks_vocabulary(tok: PromptTokenizer) -> None:
    req = parse_request("chat", {"messages": [{"role": "user", "content": "KV cache"}]})
    ids = tok.prompt_ids(req)
    assert ids == tok.prompt_ids(req) and ids[0] == 0  # <|begin_of_text|> is token 0
    assert req.chat is not None and tok.decode(ids) == tok.render_chat(req.chat)
    with pytest.raises(ApiError, match="out of vocabulary"):
        tok.prompt_ids(parse_request("completion", {"prompt": [1, tok.vocab_size]}))


def test_completions_add_bos_unless_told_not_to(tok: PromptTokenizer) -> None:
    text = tok.prompt_ids(parse_request("completion", {"prompt": "KV cache"}))
    bare = parse_request("completion", {"prompt": "KV cache", "add_special_tokens": False})
    assert text == [0, *tok.prompt_ids(bare)] == [0, *tok.encode("KV cache")]
    ids = parse_request("completion", {"prompt": [5, 6], "add_special_tokens": True})
    assert tok.prompt_ids(ids) == [5, 6]  # token ids are taken as they are
    chat = {"messages": [{"role": "user", "content": "x"}]}
    plain = tok.prompt_ids(parse_request("chat", chat))
    assert tok.prompt_ids(parse_request("chat", {**chat, "add_special_tokens": True})) == [
        0,
        *plain,
    ]


def test_length_check_in_vllm_words() -> None:
    assert check_length(100, 28, 128) == 28
    assert check_length(100, 128, 128) == 28  # served, cut at the context, as vLLM does
    with pytest.raises(ApiError, match="maximum context length is 128 tokens") as err:
        check_length(128, 1, 128)
    assert err.value.param == "input_tokens"
    with pytest.raises(ApiError, match="cannot be greater than max_model_len=128") as err:
        check_length(10, 129, 128)
    assert err.value.param == "max_tokens"


def test_rate_limited_response_has_retry_after() -> None:
    resp = rate_limited("busy", 1.2).response()
    assert resp.status == 429 and resp.headers["Retry-After"] == "2"
    assert resp.body is not None
    assert json.loads(bytes(resp.body))["error"]["code"] == "rate_limit_exceeded"  # type: ignore[arg-type]


def test_a_batch_of_prompts_and_n_choices_parse_as_vllm_takes_them() -> None:
    req = parse_request("completion", {"prompt": ["a", [5, 6], "b"], "n": 3})
    assert (req.prompt_text, req.more_prompts, req.n) == ("a", ((5, 6), "b"), 3)
    ids = parse_request("completion", {"prompt": [[1, 2], [3]]})
    assert (ids.prompt_ids, ids.more_prompts) == ((1, 2), ((3,),))
    assert parse_request("completion", {"prompt": [7, 8]}).prompt_ids == (7, 8)  # one prompt
    assert PromptTokenizer().batch_ids(req)[1:] == [[5, 6], PromptTokenizer().encode("b", True)]
