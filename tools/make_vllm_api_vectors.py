"""Write tests/data/vllm/api_prompt_tokens.json: the prompt token ids vLLM 0.32 feeds its engine
for Anthropic Messages (`/v1/messages`) and OpenAI Responses (`/v1/responses`) requests, or the
HTTP status it answers, for the demo tokenizer and the tokenizer families of tests/data/tokenizers/.

Run from the repository root with the vLLM environment's Python
(`.venv-vllm/bin/python -m tools.make_vllm_api_vectors`);
no server starts. Each body goes the way `vllm serve` takes it before its engine, with vLLM's own
code, over the model directories and front end of `tools/make_vllm_prompt_vectors.py` (`Front`,
served as with `--enable-auto-tool-choice --tool-call-parser hermes`):

- Messages: FastAPI's validation (`AnthropicMessagesRequest`), then
  `AnthropicServingMessages.to_chat_completion_request` with what the server probes from the chat
  template at start (whether inline system messages are merged into the first one) or on the
  first `thinking: disabled` request (the reasoning effort that stands for it), then the chat
  front end's `render_chat`;
- Responses: FastAPI's validation (`ResponsesRequest`), the serving's own checks (background,
  `previous_response_id`, which the default server, storing nothing, answers with a 404), then
  `OnlineRenderer.render_responses`;
- both: then the output length and sampling parameters the serving makes, and the engine's
  admission checks of them (`InputProcessor._validate_params`), for a server started as
  kvsched's launcher starts it (no `--reasoning-parser`).

An exception on the way becomes the status vLLM's exception handlers give it. A case may say
that kvsched refuses it (`kvsched_refuses`: words its 400 holds) where vLLM's prompt cannot be
followed exactly. The project's tests (tests/common/test_api_prompt_tokens.py) check
`services.common.inference_api.anthropic_messages` and
`services.common.inference_api.responses_input` against the file without vLLM.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from tools.make_vllm_prompt_vectors import FAMILIES, ROOT, Front, write_variant

OUT = ROOT / "tests" / "data" / "vllm" / "api_prompt_tokens.json"
MODEL = "tiny-llama"
VARIANTS = ("demo", *FAMILIES)  # the demo tokenizer, then each family's own directory

U = "user"
A = "assistant"
WEATHER_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city"],
}


def text(t: str, **extra: Any) -> dict[str, Any]:
    return {"type": "text", "text": t, **extra}


def msg(role: str, content: Any, **extra: Any) -> dict[str, Any]:
    return {"role": role, "content": content, **extra}


# -- Anthropic Messages ----------------------------------------------------------------------

WEATHER_TOOL: dict[str, Any] = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "input_schema": WEATHER_SCHEMA,
}
NOW_TOOL: dict[str, Any] = {"name": "now", "input_schema": {"properties": {}}}


def tool_use(id_: str, name: str = "get_weather", **input_: Any) -> dict[str, Any]:
    return {"type": "tool_use", "id": id_, "name": name, "input": input_ or {"city": "Paris"}}


def tool_result(id_: str, content: Any, **extra: Any) -> dict[str, Any]:
    return {"type": "tool_result", "tool_use_id": id_, "content": content, **extra}


def messages_case(
    name: str, messages: Any, *, refused: str | None = None, **fields: Any
) -> dict[str, Any]:
    body = {"model": MODEL, "max_tokens": 64, "messages": messages, **fields}
    return _case("messages", name, body, refused)


def messages_cases() -> list[dict[str, Any]]:
    hi = [msg(U, "Hello!")]
    weather_turns = [
        msg(U, "Weather in Paris?"),
        msg(A, [text("Let me look."), tool_use("toolu_1", days=2)]),
        msg(U, [tool_result("toolu_1", "sunny")]),
    ]
    c = messages_case
    return [
        c("text", hi),
        c("one text block", [msg(U, [text("Hello!")])]),
        c("several text blocks", [msg(U, [text("first"), text(""), text("second")])]),
        c("cache_control ignored", [msg(U, [text("a", cache_control={"type": "ephemeral"})])]),
        c("system string", hi, system="Be brief."),
        c(
            "system blocks",
            hi,
            system=[text("You are Claude Code."), text(" Be brief.", cache_control={"x": 1})],
        ),
        c(
            "system billing header block",
            hi,
            system=[text("x-anthropic-billing-header: cc_version=1; cch=42"), text("Rules.")],
        ),
        c("system billing header string", hi, system="x-anthropic-billing-header: a\nRules."),
        c("empty system", hi, system=""),
        c("multi-turn", [msg(U, "Hi"), msg(A, "Hello."), msg(U, "Bye")], system="Be brief."),
        c("assistant last", [msg(U, "Count"), msg(A, "1, 2,")]),
        c("empty user blocks dropped", [msg(U, "Hi"), msg(A, "Hello."), msg(U, [])]),
        c("empty assistant blocks", [msg(U, "Hi"), msg(A, [text("")]), msg(U, "Again")]),
        c("tools", hi, tools=[WEATHER_TOOL, NOW_TOOL], system="You help."),
        c("tool_choice any", hi, tools=[WEATHER_TOOL], tool_choice={"type": "any"}),
        c("tool_choice none", hi, tools=[WEATHER_TOOL], tool_choice={"type": "none"}),
        c(
            "tool_choice tool",
            hi,
            tools=[WEATHER_TOOL],
            tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
        ),
        c("tool_choice without tools", hi, tool_choice={"type": "any"}),
        c(
            "tool_choice names no tool",
            hi,
            tools=[WEATHER_TOOL],
            tool_choice={"type": "tool", "name": "x"},
        ),
        c("empty tools", hi, tools=[]),
        c(
            "tool strict and deferred",
            hi,
            tools=[{**WEATHER_TOOL, "strict": True}, {**NOW_TOOL, "defer_loading": True}],
        ),
        c("tool use and result", [*weather_turns, msg(U, "Thanks")], tools=[WEATHER_TOOL]),
        c(
            "tool results with text",
            [
                msg(U, "Two cities?"),
                msg(A, [tool_use("t1"), tool_use("t2", city="Rome")]),
                msg(
                    U,
                    [
                        tool_result("t1", [text("rain"), text("wind")]),
                        tool_result("t2", "error: no data", is_error=True),
                        text("Summarise."),
                    ],
                ),
            ],
            tools=[WEATHER_TOOL],
        ),
        c(
            "tool result empty",
            [msg(U, "x"), msg(A, [tool_use("t1")]), msg(U, [tool_result("t1", [])])],
        ),
        c(
            "tool result with tool_reference",
            [
                msg(U, "x"),
                msg(A, [tool_use("t1", "tool_search")]),
                msg(
                    U,
                    [
                        tool_result(
                            "t1",
                            [text("found"), {"type": "tool_reference", "tool_name": "get_weather"}],
                        )
                    ],
                ),
            ],
            tools=[WEATHER_TOOL],
        ),
        c(
            "tool use input unicode",
            [msg(U, "x"), msg(A, [tool_use("t1", city="Zürich 🙂", n=[1, 2.5, None, True])])],
        ),
        c(
            "tool result in assistant message",
            [msg(U, "x"), msg(A, [text("a"), tool_result("t9", [text("r", extra=1)])])],
        ),
        c(
            "thinking blocks",
            [
                msg(U, "x"),
                msg(
                    A,
                    [
                        {"type": "thinking", "thinking": "Hmm.", "signature": "s"},
                        {"type": "redacted_thinking", "data": "xyz"},
                        {"type": "thinking", "thinking": " Yes."},
                        text("Answer."),
                    ],
                ),
                msg(U, "More"),
            ],
        ),
        c(
            "thinking enabled",
            hi,
            thinking={"type": "enabled", "budget_tokens": 1024},
            max_tokens=2048,
        ),
        c("thinking adaptive", hi, thinking={"type": "adaptive", "display": "omitted"}),
        c("thinking disabled", hi, thinking={"type": "disabled"}),
        c("output effort", hi, output_config={"effort": "high"}),
        c(
            "output format",
            hi,
            output_config={"format": {"type": "json_schema", "schema": {"type": "object"}}},
        ),
        c("template kwargs", hi, chat_template_kwargs={"enable_thinking": False, "x": 1}),
        c(
            "sampling and stream flags",
            hi,
            stream=True,
            stop_sequences=["\n\n", "END"],
            temperature=0.2,
            top_p=0.9,
            top_k=5,
            metadata={"user_id": "session-1"},
        ),
        c("cache salt", hi, cache_salt="salt-1"),
        c("forwarded prompt ids", hi, kv_transfer_params={"prompt_token_ids": [0, 3, 5]}),
        c("inline system message", [msg(U, "Hi"), msg("system", "Reminder."), msg(U, "Go")]),
        c(
            "tool added in a system message",
            [
                msg(
                    "system",
                    [
                        text("Tools changed."),
                        {
                            "type": "tool_addition",
                            "tool": {"type": "tool_definition", "definition": NOW_TOOL},
                        },
                        {
                            "type": "tool_removal",
                            "tool": {"type": "tool_reference", "name": "get_weather"},
                        },
                    ],
                ),
                msg(U, "Hi"),
            ],
            tools=[WEATHER_TOOL],
        ),
        c(
            "Claude Code shaped",
            [
                msg(
                    U,
                    [
                        text("<system-reminder>ctx</system-reminder>"),
                        text("Fix the bug.", cache_control={"type": "ephemeral"}),
                    ],
                ),
                msg(
                    A,
                    [
                        {"type": "thinking", "thinking": "Look first.", "signature": "sig"},
                        tool_use("toolu_01", "Read", file_path="/a.py"),
                    ],
                ),
                msg(
                    U,
                    [
                        tool_result(
                            "toolu_01", [text("1\tprint(1)")], cache_control={"type": "ephemeral"}
                        )
                    ],
                ),
            ],
            system=[
                text("x-anthropic-billing-header: cc_version=2.0; cch=9f"),
                text("You are Claude Code.", cache_control={"type": "ephemeral"}),
            ],
            tools=[
                {
                    "name": "Read",
                    "description": "Read a file.",
                    "input_schema": {
                        "type": "object",
                        "properties": {"file_path": {"type": "string"}},
                        "required": ["file_path"],
                        "$schema": "http://json-schema.org/draft-07/schema#",
                    },
                }
            ],
            metadata={"user_id": "user_abc_account__session_1234"},
            thinking={"type": "adaptive"},
            stream=True,
            max_tokens=4096,
        ),
        c(
            "user thinking only dropped",
            [msg(U, [{"type": "thinking", "thinking": "t"}]), msg(U, "x")],
        ),
        c("image without source dropped", [msg(U, [{"type": "image"}, text("Hello!")])]),
        c(
            "tool result drops empty image and documents",
            [
                msg(U, "x"),
                msg(A, [tool_use("t1")]),
                msg(
                    U,
                    [
                        tool_result(
                            "t1",
                            [
                                {"type": "image", "source": {"type": "url", "url": ""}},
                                {"type": "document", "source": {}},
                                {"type": "text"},
                                text("ok"),
                            ],
                        )
                    ],
                ),
            ],
        ),
        c(
            "tool result without content",
            [
                msg(U, "x"),
                msg(A, [tool_use("t1")]),
                msg(U, [tool_result("t1", None, is_error=True)]),
            ],
        ),
        c("tool_choice tool without tools", hi, tool_choice={"type": "tool", "name": "x"}),
        c("empty tools with tool_choice any", hi, tools=[], tool_choice={"type": "any"}),
        c(
            "thinking disabled over output effort",
            hi,
            thinking={"type": "disabled"},
            output_config={"effort": "max"},
        ),
        c(
            "tool added by reference",
            [
                msg(
                    "system",
                    [{"type": "tool_addition", "tool": {"type": "tool_reference", "name": "now"}}],
                ),
                msg(U, "Hi"),
            ],
            tools=[WEATHER_TOOL, {**NOW_TOOL, "defer_loading": True}],
        ),
        c(
            "inline system and system",
            [msg(U, "Hi"), msg("system", [text("Re"), text("minder.")]), msg(U, "Go")],
            system=[text("Base.")],
        ),
        c(
            "inline system billing header",
            [msg(U, "Hi"), msg("system", "x-anthropic-billing-header: a"), msg(U, "Go")],
        ),
        c(
            "tool use without id",
            [msg(U, "x"), msg(A, [{"type": "tool_use", "name": "get_weather", "input": {}}])],
            refused="tool_use block without an id",
        ),
        c("lax number string", hi, max_tokens="64", refused="max_tokens"),
        # -- refused by vLLM ---------------------------------------------------------------
        c("no model", hi, model=None),
        c("empty model", hi, model=""),
        c("max_tokens zero", hi, max_tokens=0),
        c("max_tokens not a number", hi, max_tokens="lots"),
        c("messages not a list", {"role": U, "content": "x"}),
        c("tool role", [msg("tool", "x")]),
        c("content a number", [msg(U, 5)]),
        c("unknown block type", [msg(U, [{"type": "video", "source": {}}])]),
        c("text block text a number", [msg(U, [{"type": "text", "text": 5}])]),
        c(
            "image block",
            [
                msg(
                    U,
                    [
                        text("see"),
                        {"type": "image", "source": {"type": "url", "url": "http://h/i.png"}},
                    ],
                )
            ],
        ),
        c(
            "image in tool result",
            [
                msg(U, "x"),
                msg(A, [tool_use("t1")]),
                msg(
                    U,
                    [
                        tool_result(
                            "t1",
                            [{"type": "image", "source": {"type": "base64", "data": "AAAA"}}],
                        )
                    ],
                ),
            ],
        ),
        c("thinking budget too small", hi, thinking={"type": "enabled", "budget_tokens": 10}),
        c(
            "thinking budget over max_tokens",
            hi,
            thinking={"type": "enabled", "budget_tokens": 1024},
        ),
        c("thinking type unknown", hi, thinking={"type": "sometimes"}),
        c("tool without schema", hi, tools=[{"name": "now"}]),
        c("tool_choice tool without name", hi, tools=[WEATHER_TOOL], tool_choice={"type": "tool"}),
        c("too many stop sequences", hi, stop_sequences=["a", "b", "c", "d", "e"]),
        c("system a number", hi, system=5),
        c(
            "tool change in a user message",
            [msg(U, [{"type": "tool_addition", "tool": {"type": "tool_reference", "name": "x"}}])],
        ),
        c(
            "tool removal of an undeclared tool",
            [
                msg(
                    "system",
                    [{"type": "tool_removal", "tool": {"type": "tool_reference", "name": "x"}}],
                )
            ],
        ),
        c(
            "tool input a list",
            [msg(U, "x"), msg(A, [{"type": "tool_use", "id": "t", "input": [1]}])],
        ),
        c("content null", [msg(U, None)]),
        c("no messages", []),
        c(
            "tool result text not a string",
            [msg(U, [tool_result("t", [{"type": "text", "text": 5}])])],
        ),
        c("cache salt with a slash", hi, cache_salt="a/b"),
        c("cache salt too long", hi, cache_salt="s" * 129),
        c("request chat template", hi, chat_template_kwargs={"chat_template": "{{ 'x' }}"}),
    ]


# -- OpenAI Responses ------------------------------------------------------------------------

WEATHER_FN: dict[str, Any] = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": WEATHER_SCHEMA,
}


def item(role: str, content: Any, **extra: Any) -> dict[str, Any]:
    return {"type": "message", "role": role, "content": content, **extra}


def in_text(t: str) -> dict[str, Any]:
    return {"type": "input_text", "text": t}


def out_text(t: str) -> dict[str, Any]:
    return {"type": "output_text", "text": t}


def call(
    call_id: str, name: str = "get_weather", arguments: str = '{"city": "Paris"}'
) -> dict[str, Any]:
    return {"type": "function_call", "call_id": call_id, "name": name, "arguments": arguments}


def call_output(call_id: str, output: Any) -> dict[str, Any]:
    return {"type": "function_call_output", "call_id": call_id, "output": output}


def reasoning(t: str, **extra: Any) -> dict[str, Any]:
    return {
        "type": "reasoning",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": t}],
        **extra,
    }


def responses_case(
    name: str, input_: Any, *, refused: str | None = None, **fields: Any
) -> dict[str, Any]:
    body = {"model": MODEL, "input": input_, **fields}
    return _case("responses", name, body, refused)


def responses_cases() -> list[dict[str, Any]]:
    hi = [item(U, [in_text("Hello!")])]
    weather = [
        item(U, "Weather in Paris?"),
        call("call_1"),
        call_output("call_1", '{"temp": 21}'),
    ]
    c = responses_case
    return [
        c("text", "Hello!"),
        c("instructions", "Hello!", instructions="Be brief."),
        c("empty instructions", "Hello!", instructions=""),
        c("easy message", [{"role": U, "content": "Hello!"}]),
        c("input_text parts", [item(U, [in_text("first"), in_text("second")])]),
        c(
            "multi-turn",
            [
                item(U, "Hi"),
                item(A, [out_text("Hello.")]),
                {"role": A, "content": "How can I help?"},
                item(U, [in_text("Bye")]),
            ],
            instructions="Be brief.",
        ),
        c(
            "assistant output parts",
            [item(U, "x"), item(A, [out_text("one"), out_text("two")]), item(U, "y")],
        ),
        c(
            "developer and system messages",
            [item("developer", "Rules."), item("system", "More."), item(U, "x")],
        ),
        c(
            "tools",
            hi,
            tools=[
                WEATHER_FN,
                {"type": "function", "name": "now", "parameters": None, "strict": True},
            ],
        ),
        c("tool_choice required", hi, tools=[WEATHER_FN], tool_choice="required"),
        c(
            "tool_choice named",
            hi,
            tools=[WEATHER_FN],
            tool_choice={"type": "function", "name": "get_weather"},
        ),
        c("tool_choice none", hi, tools=[WEATHER_FN], tool_choice="none"),
        c("tool_choice none without tools", hi, tool_choice="none"),
        c("function call and output", [*weather, item(U, "Thanks")], tools=[WEATHER_FN]),
        c(
            "reasoning, text and calls merged",
            [
                item(U, "Two cities?"),
                reasoning("Both."),
                item(A, [out_text("Checking.")]),
                call("c1"),
                call("c2", arguments='{"city": "Rome"}'),
                call_output("c1", "rain"),
                call_output("c2", [in_text("sun"), in_text("wind")]),
            ],
            tools=[WEATHER_FN],
        ),
        c(
            "reasoning summary only",
            [
                item(U, "x"),
                {"type": "reasoning", "summary": [{"type": "summary_text", "text": "S."}]},
                item(A, [out_text("y")]),
                item(U, "z"),
            ],
        ),
        c(
            "call arguments not JSON",
            [item(U, "x"), call("c1", arguments="not json"), call_output("c1", "?")],
        ),
        c(
            "partial assistant message",
            [item(U, "Count"), item(A, [out_text("1, 2,")], status="in_progress")],
        ),
        c("partial reasoning", [item(U, "x"), reasoning("Hmm", status="incomplete")]),
        c("reasoning effort", "Hello!", reasoning={"effort": "low", "summary": "auto"}),
        c("reasoning effort none", "Hello!", reasoning={"effort": "none"}),
        c("template kwargs", "Hello!", chat_template_kwargs={"enable_thinking": True}),
        c(
            "sampling and stream flags",
            "Hello!",
            stream=True,
            temperature=0.3,
            top_p=0.9,
            max_output_tokens=32,
            store=False,
            stop=["\n"],
            text={"format": {"type": "json_object"}},
            metadata={"session_id": "s-1"},
            user="u-1",
        ),
        c(
            "namespace and custom tools",
            [
                item(U, "x"),
                {"type": "custom_tool_call", "call_id": "k1", "name": "shell", "input": "ls -l"},
                {"type": "custom_tool_call_output", "call_id": "k1", "output": "a.txt"},
            ],
            tools=[
                {
                    "type": "namespace",
                    "name": "geo",
                    "description": "Geo tools.",
                    "tools": [WEATHER_FN],
                },
                {"type": "custom", "name": "shell", "description": "Run a command."},
            ],
            tool_choice={"type": "function", "name": "get_weather"},
        ),
        c("cache salt", "Hello!", cache_salt="salt-1"),
        c("continued user message", [item(U, [in_text("Complete: ")], status="in_progress")]),
        c(
            "text then reasoning merged",
            [
                item(U, "x"),
                item(A, [out_text("y")]),
                reasoning("why"),
                reasoning("more"),
                item(U, "z"),
            ],
        ),
        c(
            "assistant input_text parts",
            [item(U, "x"), {"role": A, "content": [in_text("y"), in_text("z")]}, item(U, "w")],
        ),
        c(
            "output without call id",
            [item(U, "x"), call("c1"), {"type": "function_call_output", "output": "r"}],
            tools=[WEATHER_FN],
        ),
        c(
            "only hidden tools",
            hi,
            tools=[
                {
                    "type": "namespace",
                    "name": "ns",
                    "description": "d",
                    "tools": [{"type": "custom", "name": "k"}],
                }
            ],
        ),
        c(
            "allowed tools and custom choice",
            hi,
            tools=[WEATHER_FN, {"type": "custom", "name": "shell"}],
            tool_choice={
                "type": "allowed_tools",
                "mode": "required",
                "tools": [{"type": "function", "name": "get_weather"}],
            },
        ),
        c(
            "custom tool choice",
            hi,
            tools=[{"type": "custom", "name": "shell"}],
            tool_choice={"type": "custom", "name": "shell"},
        ),
        c(
            "Codex shaped",
            [
                item("developer", [in_text("You are Codex.")]),
                item(U, [in_text("List files.")]),
                reasoning("Use shell.", summary=[{"type": "summary_text", "text": "S"}]),
                call("call_a", "shell", '{"command": ["ls"]}'),
                call_output("call_a", "a.py\nb.py"),
            ],
            instructions="Be concise.",
            tools=[
                {
                    "type": "function",
                    "name": "shell",
                    "description": "Run.",
                    "strict": False,
                    "parameters": {
                        "type": "object",
                        "properties": {"command": {"type": "array", "items": {"type": "string"}}},
                    },
                }
            ],
            tool_choice="auto",
            parallel_tool_calls=False,
            reasoning={"effort": "medium", "summary": "auto"},
            store=False,
            stream=True,
            include=["reasoning.encrypted_content"],
            prompt_cache_key="k-1",
        ),
        c(
            "assistant without parts",
            [item(U, "x"), {"role": A, "content": []}],
            refused="assistant message",
        ),
        c(
            "hosted tool",
            "Hello!",
            tools=[{"type": "web_search"}],
            refused="only function, custom and namespace tools",
        ),
        c(
            "output annotations",
            [
                item(U, "x"),
                item(
                    A,
                    [
                        {
                            **out_text("y"),
                            "annotations": [
                                {
                                    "type": "file_citation",
                                    "file_id": "f",
                                    "filename": "a",
                                    "index": 0,
                                }
                            ],
                        }
                    ],
                ),
                item(U, "z"),
            ],
            refused="annotations",
        ),
        c("lax number string", "Hello!", max_output_tokens="64", refused="max_output_tokens"),
        c("forwarded prompt ids", "Hello!", kv_transfer_params={"prompt_token_ids": [0, 3, 5]}),
        c(
            "previous input messages ignored",
            "Hello!",
            previous_input_messages=[{"role": U, "content": "earlier"}],
        ),
        c("unknown fields ignored", "Hello!", conversation="conv_1", add_special_tokens=False),
        c(
            "truncation auto",
            "Hello!",
            truncation="auto",
            refused="truncation",
        ),
        c(
            "previous_response_id",
            "Hello!",
            previous_response_id="resp_1",
            refused="previous_response_id",
        ),
        # -- refused by vLLM ---------------------------------------------------------------
        c("no input", None),
        c("input a number", 5),
        c("empty input list", []),
        c(
            "input_image part",
            [item(U, [in_text("see"), {"type": "input_image", "image_url": "http://h/i.png"}])],
        ),
        c("input_file part", [item(U, [{"type": "input_file", "file_id": "file_1"}])]),
        c("item_reference", [{"type": "item_reference", "id": "msg_1"}]),
        c("unknown item type", [{"type": "telepathy", "thought": "x"}]),
        c("encrypted reasoning", [item(U, "x"), reasoning("r", encrypted_content="gAAA")]),
        c("tool role message", [{"role": "tool", "content": "x"}]),
        c("prompt template", "Hello!", prompt={"id": "pmpt_1"}),
        c("background", "Hello!", background=True),
        c("tool_choice required without tools", "Hello!", tool_choice="required"),
        c(
            "tool_choice names no tool",
            "Hello!",
            tools=[WEATHER_FN],
            tool_choice={"type": "function", "name": "x"},
        ),
        c(
            "custom tool with a grammar",
            "Hello!",
            tools=[
                {
                    "type": "custom",
                    "name": "g",
                    "format": {"type": "grammar", "syntax": "lark", "definition": "x"},
                }
            ],
        ),
        c("instructions a list", "Hello!", instructions=["a"]),
        c(
            "ambiguous namespaced choice",
            "Hello!",
            tools=[
                {"type": "namespace", "name": n, "description": "d", "tools": [WEATHER_FN]}
                for n in ("a", "b")
            ],
            tool_choice={"type": "function", "name": "get_weather"},
        ),
        c("multimodal kwargs", "Hello!", mm_processor_kwargs={"x": 1}),
        c("too many stop strings", "Hello!", stop=["a", "b", "c", "d", "e"]),
        c("include unknown", "Hello!", include=["everything"]),
        c("call status unknown", [item(U, "x"), {**call("c1"), "status": "done"}]),
        c(
            "reasoning without summary",
            [
                item(U, "x"),
                {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "r"}]},
            ],
        ),
        c(
            "previous input and response ids",
            "Hello!",
            previous_input_messages=[{"role": U, "content": "x"}],
            previous_response_id="resp_1",
        ),
        c("request chat template", "Hello!", chat_template_kwargs={"chat_template": "{{ 'x' }}"}),
    ]


def _case(api: str, name: str, body: dict[str, Any], refused: str | None) -> dict[str, Any]:
    body = {k: v for k, v in body.items() if v is not None}  # None: the field left out
    case: dict[str, Any] = {"api": api, "name": name, "body": body}
    if refused is not None:
        case["kvsched_refuses"] = refused
    return case


# -- vLLM ------------------------------------------------------------------------------------


def _module(name: str) -> Any:
    return importlib.import_module(name)


class Api:
    """vLLM's Messages and Responses serving over one model directory, up to its engine."""

    def __init__(self, model: Path) -> None:
        self.front = Front(model)
        anthropic = _module("vllm.entrypoints.anthropic.serving").AnthropicServingMessages
        responses = _module("vllm.entrypoints.openai.responses.serving").OpenAIServingResponses
        # The servings' request paths before the engine need only these of their state
        # (their constructors want a running engine).
        self.messages = object.__new__(anthropic)
        self.messages.online_renderer = self.front.renderer
        self.messages.model_config = self.front.renderer.model_config
        self.messages._merge_inline_system = anthropic._should_merge_inline_system(
            self.front.renderer
        )
        self.messages._disabled_thinking_effort = None  # "auto", as vllm serve's default
        self.responses = object.__new__(responses)
        self.responses.use_harmony = False
        self.responses.enable_store = False
        self.responses.response_store = {}
        # What the serving and the engine check of a rendered request before running it: its
        # sampling parameters, and the engine's admission (`InputProcessor._validate_params`,
        # of a server started as kvsched starts it: no reasoning parser).
        config = self.front.renderer.model_config
        self.processor = _module("vllm.v1.engine.input_processor").InputProcessor(
            _module("vllm.config").VllmConfig(model_config=config),
            self.front.renderer.renderer,
        )
        self.sampling_defaults = config.get_diff_sampling_param()

    async def traits(self) -> dict[str, Any]:
        """What the Messages serving probes from the chat template."""
        return {
            "merge_inline_system": self.messages._merge_inline_system,
            "disabled_thinking_effort": await self.messages._get_disabled_thinking_effort(),
        }

    async def run(self, api: str, body: dict[str, Any]) -> dict[str, Any]:
        errors = _module("vllm.entrypoints.serve.exception_handling.error_response")
        body = json.loads(json.dumps(body))  # vLLM may change what it is given
        try:
            result = await (self._messages(body) if api == "messages" else self._responses(body))
        except _module("pydantic").ValidationError as exc:  # FastAPI's validation: a 400
            return {"status": 400, "message": str(exc).splitlines()[0]}
        except Exception as exc:  # what vLLM's exception handlers answer
            error = errors.create_error_response(exc).error
            return {"status": error.code, "message": error.message}
        if not isinstance(result, tuple | list) and hasattr(result, "error"):
            return {"status": result.error.code, "message": result.error.message}
        return {"ids": list(result[0]["prompt_token_ids"])}

    async def _messages(self, body: dict[str, Any]) -> Any:
        protocol = _module("vllm.entrypoints.anthropic.protocol")
        request = protocol.AnthropicMessagesRequest.model_validate(body)
        serving = self.messages
        effort = "none"
        if request.thinking is not None and request.thinking.type == "disabled":
            effort = await serving._get_disabled_thinking_effort()
        chat = serving.to_chat_completion_request(
            request,
            merge_inline_system=serving._merge_inline_system,
            disabled_thinking_effort=effort,
        )
        result = await self.front.renderer.render_chat(chat)
        if hasattr(result, "error"):
            return result
        asked = chat.max_completion_tokens or chat.max_tokens
        self._admit(chat, result[1][0], asked, None)
        return result[1]

    def _admit(self, request: Any, engine_input: Any, asked: int | None, truncate: Any) -> None:
        """What the serving does with a rendered request before its engine runs it (the
        output length and sampling parameters), and the engine's checks of them."""
        config = self.front.renderer.model_config
        limit = _module("vllm.entrypoints.serve.utils.api_utils").get_max_tokens(
            config.max_model_len,
            asked,
            len(engine_input["prompt_token_ids"]),
            self.sampling_defaults,
            None,
            truncate_prompt_tokens=truncate,
        )
        params = request.to_sampling_params(limit, self.sampling_defaults)
        self.processor._validate_params(params, ("generate",))

    async def _responses(self, body: dict[str, Any]) -> Any:
        protocol = _module("vllm.entrypoints.openai.responses.protocol")
        request = protocol.ResponsesRequest.model_validate(body)
        serving = self.responses
        error = serving._validate_create_responses_input(request)
        if error is not None:
            return error
        if request.previous_response_id is not None:  # nothing is stored: not found
            return serving._make_not_found_error(request.previous_response_id)
        result = await self.front.renderer.render_responses(request)
        if hasattr(result, "error"):
            return result
        truncate = -1 if request.truncation != "disabled" else None
        self._admit(request, result.engine_input, request.max_output_tokens, truncate)
        return [result.engine_input]


async def vectors() -> dict[str, Any]:
    cases = [*messages_cases(), *responses_cases()]
    out: list[dict[str, Any]] = []
    traits: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for variant in VARIANTS:
            model = Path(tmp) / variant
            model.mkdir()
            write_variant(model, variant, {})
            api = Api(model)
            traits[variant] = await api.traits()
            for case in cases:
                result = await api.run(case["api"], case["body"])
                if "kvsched_refuses" in case and "ids" in result:
                    # Only whether vLLM serves it: the ids of some (a tool call id made from
                    # the clock) change from run to run.
                    result = {"served": True}
                out.append({**case, "variant": variant, "vllm": result})
    return {
        "note": (
            "Made by tools/make_vllm_api_vectors.py with the vLLM environment: each Messages or "
            "Responses body through vLLM's request model, its conversion to a chat prompt and "
            "OnlineRenderer (what `vllm serve --enable-auto-tool-choice --tool-call-parser "
            "hermes` runs before its engine), then the engine's admission checks of its "
            "sampling parameters, over the demo tokenizer (`demo`) or a family's "
            "directory (`bases`). `vllm` holds the prompt token ids or the error status; "
            "`traits` what the Messages serving probed from each chat template; "
            "`kvsched_refuses` marks a case kvsched answers with a 400 holding those words "
            "(`vllm` then says only whether vLLM serves it)."
        ),
        "vllm_version": _module("vllm").__version__,
        "transformers_version": _module("transformers").__version__,
        "bases": {
            name: family.base.relative_to(ROOT).as_posix() for name, family in FAMILIES.items()
        },
        "traits": traits,
        "cases": out,
    }


def main() -> None:
    data = asyncio.run(vectors())
    cases = data.pop("cases")
    head = json.dumps(data, indent=1, ensure_ascii=False)[:-2]  # without the closing brace
    lines = ",\n  ".join(json.dumps(case, ensure_ascii=False) for case in cases)
    OUT.write_text(f'{head},\n "cases": [\n  {lines}\n ]\n}}\n', encoding="utf-8")
    print(f"wrote {OUT}: {len(cases)} cases", file=sys.stderr)


if __name__ == "__main__":
    main()
