"""Chat requests refused with a 400 that says why, never a 500: non-text parts, roles the
template refuses, templates that raise or break the sandbox, malformed messages, and what
vLLM would do that is not followed here."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from services.common.inference_api.openai_api import ApiError, PromptTokenizer, parse_request

DEMO = Path(__file__).resolve().parents[2] / "kvsched" / "data" / "tokenizer"
HI = [{"role": "user", "content": "hi"}]
# vLLM takes a tool call's arguments as a JSON string only.
OBJECT_ARGUMENTS = {"id": "1", "type": "function", "function": {"name": "f", "arguments": {}}}


@pytest.fixture(scope="module")
def tok() -> PromptTokenizer:
    return PromptTokenizer()


def with_template(tmp_path: Path, template: str) -> PromptTokenizer:
    """The demo tokenizer with another chat template."""
    for src in DEMO.iterdir():
        shutil.copyfile(src, tmp_path / src.name)
    (tmp_path / "chat_template.jinja").write_text(template, encoding="utf-8")
    return PromptTokenizer(tmp_path)


def refusal(tok: PromptTokenizer, **body: Any) -> ApiError:
    with pytest.raises(ApiError) as err:
        tok.prompt_ids(parse_request("chat", body))
    error = err.value
    assert error.status == 400
    assert set(error.body()["error"]) == {"message", "type", "param", "code"}
    assert error.body()["error"]["type"] == "invalid_request_error"
    return error


@pytest.mark.parametrize(
    ("part", "kind"),
    [
        ({"type": "image_url", "image_url": {"url": "http://h/i.png"}}, "image_url"),
        ({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}, "input_audio"),
        ({"type": "video_url", "video_url": {"url": "http://h/v.mp4"}}, "video_url"),
        ({"image_url": "http://h/i.png"}, "image_url"),  # no type: vLLM infers it
        ({"type": "text", "text": "t", "uuid": "u"}, None),  # a uuid marks a media part
    ],
)
def test_non_text_parts_are_refused_by_name(
    tok: PromptTokenizer, part: dict[str, Any], kind: str | None
) -> None:
    content = [{"type": "text", "text": "look"}, part]
    error = refusal(tok, messages=[{"role": "user", "content": content}])
    assert error.param == "messages" and "messages[0].content[1]" in error.message
    if kind:
        assert f"'{kind}' part" in error.message and "text only" in error.message


def test_a_role_the_template_does_not_know(tok: PromptTokenizer) -> None:
    error = refusal(tok, messages=[{"role": "wizard", "content": "x"}])
    assert error.message == 'The chat template failed: This model has no role "wizard".'
    late = refusal(tok, messages=[*HI, {"role": "system", "content": "late"}])
    assert "Only the first message may be a system message." in late.message


def test_a_template_that_raises(tmp_path: Path) -> None:
    tok = with_template(
        tmp_path, "{{ raise_exception('tools are not supported, ' + messages[0].role) }}"
    )
    assert "tools are not supported, user" in refusal(tok, messages=HI).message


@pytest.mark.parametrize(
    ("template", "says"),
    [
        ("{{ messages.append(1) }}", "unsafe"),  # the sandbox's lists are immutable
        ("{{ ''.__class__.__mro__ }}", "access to attribute '__class__' of 'str' object is unsafe"),
        ("{% for i in range(10**7) %}{% endfor %}", "Range too big"),
        ("{{ 'a' + 1 }}", "can only concatenate"),
        ("{{ messages[0].content.nope() }}", "has no attribute 'nope'"),
    ],
)
def test_templates_that_break_the_sandbox_or_fail(tmp_path: Path, template: str, says: str) -> None:
    assert says in refusal(with_template(tmp_path, template), messages=HI).message


def test_a_template_that_does_not_compile_stops_the_start(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="chat template 'default', line 1"):
        with_template(tmp_path, "{% if %}")


@pytest.mark.parametrize(
    ("messages", "says"),
    [
        (["hello"], "messages[0] must be an object"),
        ([{"content": "x"}], "messages[0].role must be a string"),
        ([{"role": "user", "content": 5}], "string or a list of parts"),
        ([{"role": "user", "content": None}], "must not be null"),
        ([{"role": "user", "content": "x", "name": 3}], "name must be a string"),
        ([{"role": "user", "content": [3]}], "content[0] must be a string or an object"),
        ([{"role": "user", "content": [{"type": "text"}]}], "content[0].text must be a string"),
        ([{"role": "user", "content": [{"text": "x"}]}], "missing 'type'"),
        ([{"role": "user", "content": [{"type": "file", "file": {}}]}], "unsupported chat content"),
        ([{"role": "tool", "content": "x", "tool_call_id": 1}], "tool_call_id must be a string"),
        ([{"role": "assistant", "tool_calls": {}}], "tool_calls must be a list"),
        ([{"role": "assistant", "tool_calls": [{"type": "function"}]}], "string 'id'"),
        (
            [{"role": "assistant", "tool_calls": [OBJECT_ARGUMENTS]}],
            "string 'name' and 'arguments'",
        ),
        (
            [{"role": "assistant", "tool_calls": [{"id": "1", "type": "custom", "custom": {}}]}],
            "only support assistant tool_calls of type 'function'",
        ),
        ([], "empty conversation"),
    ],
)
def test_malformed_messages(tok: PromptTokenizer, messages: list[Any], says: str) -> None:
    assert says in refusal(tok, messages=messages).message


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        ({"chat_template": "{{ 'x' }}"}, "--trust-request-chat-template"),
        ({"chat_template_kwargs": {"chat_template": "x"}}, "--trust-request-chat-template"),
        ({"chat_template_kwargs": {"tokenize": True}}, "tokenize is not supported"),
        ({"chat_template_kwargs": {"return_assistant_tokens_mask": True}}, "requires"),
        ({"chat_template_kwargs": {"messages": []}}, "may not set messages"),
        ({"chat_template_kwargs": {"tools": "x"}}, "list of objects"),
        ({"chat_template_kwargs": {"documents": [1]}}, "Documents should be a list of dicts"),
        ({"documents": [{"title": 1}]}, "'documents' must be"),
        ({"reasoning_effort": "extreme"}, "'reasoning_effort' must be one of"),
        ({"continue_final_message": True}, "Cannot set both"),
        ({"add_special_tokens": "yes"}, "'add_special_tokens' must be a boolean"),
        ({"tools": [{"type": "function", "function": {}}]}, "string 'name'"),
        ({"tools": [{"type": "retrieval"}]}, "of type 'function'"),
        ({"tools": [{"function": {"name": "f", "description": 1}}]}, "'description' must be"),
        ({"tools": [{"function": {"name": "f", "strict": "yes"}}]}, "must be booleans"),
        ({"tool_choice": "required"}, "`tools` must be set"),
        ({"tools": [{"function": {"name": "f"}}], "tool_choice": "sometimes"}, "'tool_choice'"),
        (
            {"tools": [{"function": {"name": "f"}}], "tool_choice": {"function": {"name": "g"}}},
            "does not match any",
        ),
        ({"kv_transfer_params": {"prompt_token_ids": []}}, "non-empty list"),
    ],
)
def test_refused_request_fields(tok: PromptTokenizer, fields: dict[str, Any], says: str) -> None:
    assert says in refusal(tok, messages=HI, **fields).message


def test_forwarded_ids_outside_the_vocabulary(tok: PromptTokenizer) -> None:
    params = {"prompt_token_ids": [0, tok.vocab_size]}
    assert "out of vocabulary" in refusal(tok, messages=HI, kv_transfer_params=params).message


def test_continuing_a_message_the_template_drops(tmp_path: Path) -> None:
    tok = with_template(tmp_path, "{% for m in messages %}{{ m.role }}{% endfor %}{{ 'content' }}")
    messages = [*HI, {"role": "assistant", "content": "partial"}]
    error = refusal(
        tok, messages=messages, add_generation_prompt=False, continue_final_message=True
    )
    assert "does not appear in the chat" in error.message


def test_developer_tools_are_refused_when_the_template_names_developer(tmp_path: Path) -> None:
    tok = with_template(tmp_path, "{% for m in messages %}{{ m.role == 'developer' }}{% endfor %}")
    tools = [{"type": "function", "function": {"name": "f"}}]
    error = refusal(tok, messages=[{"role": "developer", "content": "d", "tools": tools}])
    assert "tools in a developer message" in error.message


def test_a_tokenizer_without_a_chat_template(tmp_path: Path) -> None:
    shutil.copyfile(DEMO / "tokenizer.json", tmp_path / "tokenizer.json")
    tok = PromptTokenizer(tmp_path / "tokenizer.json")
    assert "no longer allowed" in refusal(tok, messages=HI).message
    assert tok.prompt_ids(parse_request("completion", {"prompt": "x"}))[0] == 0  # BOS, as is


def test_named_templates_without_a_default(tmp_path: Path) -> None:
    for src in DEMO.iterdir():
        shutil.copyfile(src, tmp_path / src.name)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text(encoding="utf-8"))
    config["chat_template"] = [{"name": "tool_use", "template": "{{ tools | tojson }}"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    tok = PromptTokenizer(tmp_path)
    assert "multiple chat templates with no default" in refusal(tok, messages=HI).message
    tools = [{"type": "function", "function": {"name": "f"}}]
    text = tok.render_chat(parse_request("chat", {"messages": HI, "tools": tools}).chat)  # type: ignore[arg-type]
    assert json.loads(text)[0]["function"] == {"name": "f", "description": None, "parameters": None}
