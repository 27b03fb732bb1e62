"""Write tests/data/vllm/prompt_tokens.json: the prompt token ids vLLM's own OpenAI front end
makes of chat and completion requests, for the demo tokenizer and test chat templates, and for
the tokenizer families of tests/data/tokenizers/ (tools/make_family_tokenizers.py).

Run with the vLLM environment's Python (`.venv-vllm/bin/python tools/make_vllm_prompt_vectors.py`);
no server starts: each request goes through vLLM's request models and `OnlineRenderer`
(`render_chat` / `render_completion`, what `vllm serve` runs before the engine) over a model
directory holding `kvsched/data/tokenizer/` (with another chat template per variant) and a
config.json, served as with `--enable-auto-tool-choice --tool-call-parser hermes`. Every case
of the demo tokenizer is run again for each family (`qwen2`, `mistral`: variant and name
prefixed with the family), over a model directory holding that family's tokenizer directory
(the file's `bases`) and a config.json of its architecture. The project's tests check
`services.common.inference_api.openai_api.PromptTokenizer` against the file without vLLM.
Every chat case also records whether transformers' plain
`apply_chat_template(messages, tokenize=True)` (or `tokenizer(prompt)`) gives the same ids: where
it does not, vLLM's preprocessing (content parts joined with "\\n", tool calls parsed, ...)
makes the difference, and vLLM's ids are the reference.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, NamedTuple

ROOT = Path(__file__).resolve().parent.parent
TOKENIZER = ROOT / "kvsched" / "data" / "tokenizer"
TEMPLATES = ROOT / "tests" / "data" / "chat_templates"
OUT = ROOT / "tests" / "data" / "vllm" / "prompt_tokens.json"


class Family(NamedTuple):
    """A variant over a tokenizer directory of its own, and its model's architecture."""

    base: Path
    architecture: str
    model_type: str


FAMILIES = {
    "qwen2": Family(ROOT / "tests/data/tokenizers/qwen2", "Qwen2ForCausalLM", "qwen2"),
    "mistral": Family(ROOT / "tests/data/tokenizers/mistral", "LlamaForCausalLM", "llama"),
}

U = "user"
LONG = " ".join(
    f"Block {i}: a shared prefix's KV cache is reused, ünïcödé {i * 7}." for i in range(60)
)
WEATHER: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
CALL: dict[str, Any] = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'},
}


def msg(role: str, content: Any = "", **extra: Any) -> dict[str, Any]:
    return {"role": role, "content": content, **extra}


def text(t: str, **extra: Any) -> dict[str, Any]:
    return {"type": "text", "text": t, **extra}


def chat(name: str, messages: list[Any], variant: str = "demo", **fields: Any) -> dict[str, Any]:
    return {
        "name": name,
        "kind": "chat",
        "variant": variant,
        "body": {"messages": messages, **fields},
    }


def completion(name: str, prompt: Any, **fields: Any) -> dict[str, Any]:
    return {
        "name": name,
        "kind": "completion",
        "variant": "demo",
        "body": {"prompt": prompt, **fields},
    }


def cases() -> list[dict[str, Any]]:
    hi = [msg(U, "Hello!")]
    return [
        # -- the demo template ------------------------------------------------------------
        chat("user only", hi),
        chat("system and user", [msg("system", "Be brief."), msg(U, "What is a KV cache?")]),
        chat(
            "multi-turn",
            [msg("system", "Be brief."), msg(U, "Hi"), msg("assistant", "Hello."), msg(U, "Bye")],
        ),
        chat("several text parts", [msg(U, [text("first"), text("second"), text("third")])]),
        chat("empty text part dropped", [msg(U, [text("a"), text(""), text("b")])]),
        chat("strings among parts", [msg(U, ["plain", text("typed")])]),
        chat("empty content", [msg(U, "")]),
        chat("empty part list", [msg(U, [])]),
        chat("no content key", [{"role": U}]),
        chat(
            "text-like parts",
            [
                msg(
                    U,
                    [
                        text("t"),
                        {"type": "refusal", "refusal": "r"},
                        {"type": "thinking", "thinking": "th"},
                        {"type": "input_text", "text": "in"},
                        {"type": "output_text", "text": "out"},
                    ],
                )
            ],
        ),
        chat(
            "tool reference part",
            [msg(U, [text("use"), {"type": "tool_reference", "name": "get_weather"}])],
        ),
        chat(
            "unknown keys ignored",
            [msg(U, [text("a", cache_control={"type": "ephemeral"})], foo=1)],
        ),
        chat("names", [msg("system", "s", name="sys"), msg(U, "u", name="bob")]),
        chat("special tokens in text", [msg(U, "say <|user|> and <|end_of_text|> please")]),
        chat(
            "unicode",
            [
                msg("system", "Réponds en français 🙂"),
                msg(U, "日本語のテキスト، العربية, e\u0301, \t tab\r\n"),
            ],
        ),
        chat("long", [msg("system", LONG[:2000]), msg(U, LONG)]),
        chat("tools", hi, tools=[WEATHER]),
        chat(
            "tools with system",
            [msg("system", "You help."), *hi],
            tools=[WEATHER],
            tool_choice="auto",
        ),
        chat(
            "tools, no description",
            hi,
            tools=[{"type": "function", "function": {"name": "now"}}],
            tool_choice="none",
        ),
        chat(
            "tools, strict and defer_loading",
            hi,
            tools=[
                {
                    "type": "function",
                    "function": {"name": "now", "strict": True, "extra": 1},
                    "defer_loading": True,
                }
            ],
            tool_choice="required",
        ),
        chat(
            "tool_choice named",
            hi,
            tools=[WEATHER, {"function": {"name": "now", "parameters": {"b": 1.5, "a": ["é"]}}}],
            tool_choice={"type": "function", "function": {"name": "now"}},
        ),
        chat(
            "tool calls and results",
            [
                msg(U, "Weather?"),
                msg("assistant", None, tool_calls=[CALL, {**CALL, "id": "call_2"}]),
                msg("tool", "sunny", tool_call_id="call_1"),
                msg("tool", [text("rain"), text("wind")], tool_call_id="call_2"),
                msg("assistant", "Sunny, then rain."),
                msg(U, "Thanks"),
            ],
            tools=[WEATHER],
        ),
        chat(
            "tool call with text",
            [msg(U, "Weather?"), msg("assistant", "Let me look.", tool_calls=[CALL])],
        ),
        chat(
            "tool call arguments not JSON",
            [
                msg(U, "x"),
                msg(
                    "assistant",
                    "",
                    tool_calls=[{**CALL, "function": {"name": "f", "arguments": "not json"}}],
                ),
            ],
        ),
        chat(
            "tool call arguments not an object",
            [
                msg(U, "x"),
                msg(
                    "assistant",
                    "",
                    tool_calls=[{**CALL, "function": {"name": "f", "arguments": "[1, 2]"}}],
                ),
            ],
        ),
        chat(
            "tool call arguments empty",
            [
                msg(U, "x"),
                msg(
                    "assistant",
                    "",
                    tool_calls=[{**CALL, "function": {"name": "f", "arguments": ""}}],
                ),
            ],
        ),
        chat("empty tool calls dropped", [msg(U, "x"), msg("assistant", "ok", tool_calls=[])]),
        chat("tool result without id", [msg("tool", "result")]),
        chat(
            "no generation prompt",
            [msg(U, "x"), msg("assistant", "y")],
            add_generation_prompt=False,
        ),
        chat(
            "continue final message",
            [msg(U, "Count"), msg("assistant", "1, 2,")],
            add_generation_prompt=False,
            continue_final_message=True,
        ),
        chat(
            "continue with trailing spaces",
            [msg(U, "x"), msg("assistant", "ends  ")],
            add_generation_prompt=False,
            continue_final_message=True,
        ),
        chat(
            "continue empty",
            [msg(U, "x"), msg("assistant", "")],
            add_generation_prompt=False,
            continue_final_message=True,
        ),
        chat(
            "continue a user message",
            [msg(U, "Complete this")],
            add_generation_prompt=False,
            continue_final_message=True,
        ),
        chat(
            "continue a tool call",
            [msg(U, "x"), msg("assistant", None, tool_calls=[CALL])],
            add_generation_prompt=False,
            continue_final_message=True,
        ),
        chat("add_special_tokens", hi, add_special_tokens=True),
        chat("add_special_tokens false", hi, add_special_tokens=False),
        chat(
            "template kwargs",
            hi,
            chat_template_kwargs={
                "unused": 1,
                "enable_thinking": True,
                "add_generation_prompt": False,
            },
        ),
        chat("bos_token overridden", hi, chat_template_kwargs={"bos_token": "BOS:"}),
        chat("developer becomes system", [msg("developer", "Rules."), msg(U, "x")]),
        chat(
            "system and developer merged",
            [msg("system", "S."), msg(U, "x"), msg("developer", "D.")],
        ),
        chat(
            "claude billing header",
            [
                msg(
                    "system",
                    "x-anthropic-billing-header: cc_version=1; cch=42\nYou are Claude Code.",
                ),
                msg(U, "x"),
            ],
        ),
        chat(
            "claude billing header alone",
            [
                msg("system", [text("x-anthropic-billing-header: cch=1"), text("Rest.")]),
                msg(U, "x"),
            ],
        ),
        chat("reasoning", [msg(U, "x"), msg("assistant", "y", reasoning_content="because")]),
        chat(
            "documents and reasoning effort",
            hi,
            documents=[{"title": "t", "text": "d"}],
            reasoning_effort="low",
        ),
        chat("forwarded prompt ids", hi, kv_transfer_params={"prompt_token_ids": [0, 3, 5, 7]}),
        chat(
            "forwarded ids with echo",
            hi,
            echo=True,
            kv_transfer_params={"prompt_token_ids": [0, 3]},
        ),
        # -- refused by vLLM ---------------------------------------------------------------
        chat(
            "image part",
            [msg(U, [text("see"), {"type": "image_url", "image_url": {"url": "http://h/i.png"}}])],
        ),
        chat(
            "audio part",
            [msg(U, [{"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}])],
        ),
        chat("image part without type", [msg(U, [{"image_url": "http://h/i.png"}])]),
        chat("file part", [msg(U, [{"type": "file", "file": {"file_id": "f"}}])]),
        chat("unknown part type", [msg(U, [{"type": "weird", "text": "a"}])]),
        chat("text part without text", [msg(U, [{"type": "text"}])]),
        chat("unknown role", [msg("wizard", "x")]),
        chat("function role", [msg(U, "x"), msg("function", "r", name="f")]),
        chat("late system message", [msg(U, "x"), msg("system", "late")]),
        chat("no messages", []),
        chat("content not text", [msg(U, 5)]),
        chat("null user content", [msg(U, None)]),
        chat("no role", [{"content": "x"}]),
        chat("message not an object", ["hello"]),
        chat(
            "custom tool call",
            [
                msg(U, "x"),
                msg(
                    "assistant",
                    "",
                    tool_calls=[
                        {"id": "1", "type": "custom", "custom": {"name": "f", "input": "i"}}
                    ],
                ),
            ],
        ),
        chat(
            "tool call arguments as object",
            [
                msg(U, "x"),
                msg(
                    "assistant",
                    "",
                    tool_calls=[{**CALL, "function": {"name": "f", "arguments": {"a": 1}}}],
                ),
            ],
        ),
        chat("empty tools", hi, tools=[]),
        chat("tool_choice without tools", hi, tool_choice="required"),
        chat(
            "tool_choice names no tool",
            hi,
            tools=[WEATHER],
            tool_choice={"type": "function", "function": {"name": "nope"}},
        ),
        chat("continue with generation prompt", [msg(U, "x")], continue_final_message=True),
        chat("request chat template", hi, chat_template="{{ 'x' }}"),
        chat("template kwargs set messages", hi, chat_template_kwargs={"messages": []}),
        chat("template kwargs documents not objects", hi, chat_template_kwargs={"documents": [1]}),
        # -- what reaches the template (test templates that print it) ----------------------
        chat(
            "string format: message fields",
            [
                msg("system", "s"),
                msg(U, [text("a", x=1), text(""), "b"], name="n", task="t"),
                msg(
                    "assistant",
                    None,
                    tool_calls=[{"x0": 0, **CALL, "function": {"fx": 1, **CALL["function"]}}],
                    reasoning="r",
                ),
                msg("tool", "res", tool_call_id=None),
            ],
            "string_dump",
            tools=[WEATHER],
            documents=[{"title": "t", "text": "d"}],
        ),
        chat(
            "string format: template kwargs",
            hi,
            "string_dump",
            chat_template_kwargs={"extra": {"k": "auto", "n": None}, "unset": "auto"},
        ),
        chat(
            "string format: auto kwarg dropped",
            hi,
            "string_dump",
            chat_template_kwargs={"extra": "auto"},
        ),
        chat(
            "string format: kwargs tools replace tools",
            hi,
            "string_dump",
            tools=[WEATHER],
            chat_template_kwargs={"tools": [{"x": 1}]},
        ),
        chat(
            "string format: developer list content",
            [msg(U, "x"), msg("developer", [text("d1"), text("d2")]), msg("system", "s")],
            "string_dump",
        ),
        chat(
            "openai format: parts",
            [
                msg(
                    U,
                    [
                        text("a", cache_control={"type": "ephemeral"}),
                        text(""),
                        "plain",
                        {"type": "refusal", "refusal": "r", "x": 1},
                        {"type": "tool_reference", "name": "t"},
                    ],
                ),
                msg("assistant", None),
                msg("tool", [text("x"), text(""), text("y")], tool_call_id="c"),
            ],
            "openai_dump",
        ),
        chat(
            "openai format: continue last text part",
            [msg(U, "x"), msg("assistant", [text("one"), text("two")])],
            "openai_dump",
            add_generation_prompt=False,
            continue_final_message=True,
        ),
        chat(
            "openai format: developer merged",
            [msg("system", [text("s1"), text("s2")]), msg("developer", "d")],
            "openai_dump",
        ),
        chat(
            "openai format: claude billing header",
            [msg("system", [text("x-anthropic-billing-header: a\nkept", y=2)]), msg(U, "x")],
            "openai_dump",
        ),
        chat("named templates: default", hi, "named"),
        chat("named templates: tool_use", hi, "named", tools=[WEATHER]),
        chat("chat_template.jinja wins", hi, "jinja_file"),
        chat("template files: default", hi, "extra_templates"),
        chat("template files: tool_use", hi, "extra_templates", tools=[WEATHER]),
        chat("no add_bos_token: chat", hi, "no_bos", add_special_tokens=True),
        chat("split special tokens", [msg(U, "say <|user|> please")], "split_special_tokens"),
        chat("special_tokens_map.json", hi, "special_tokens_map"),
        # -- completions -------------------------------------------------------------------
        completion("text", "The KV cache"),
        completion("text without special tokens", "The KV cache", add_special_tokens=False),
        completion("text starting with BOS", "<|begin_of_text|>The KV cache"),
        completion("text with special tokens inside", "a <|user|> b <|end_of_text|>"),
        completion("unicode text", "Ünïcödé 🙂 日本語"),
        completion("whitespace", " \n\t "),
        completion("long text", LONG),
        completion("batch of one", ["one prompt"]),
        completion("token ids", [5, 6, 7, 0, 1]),
        completion("token ids with special tokens", [5, 6, 7], add_special_tokens=True),
        completion("token ids, batch of one", [[9, 8]]),
        completion("empty text", ""),
        completion("suffix", "def f(", suffix="return 1"),
        {**completion("no add_bos_token", "The KV cache"), "variant": "no_bos"},
        {**completion("split special tokens", "a <|user|> b"), "variant": "split_special_tokens"},
        {**completion("special_tokens_map.json", "The KV cache"), "variant": "special_tokens_map"},
    ]


def family_cases(demo_cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every case of the demo tokenizer again for each family, after all of them."""
    return [
        {**case, "name": f"{family}: {case['name']}", "variant": family}
        for family in FAMILIES
        for case in demo_cases
        if case["variant"] == "demo"
    ]


def variants() -> dict[str, dict[str, Any]]:
    """Tokenizer directories as files to write over the demo tokenizer's (a JSON value is
    merged into tokenizer_config.json), or over a family's own directory (none)."""
    string_dump = (TEMPLATES / "dump_string.jinja").read_text(encoding="utf-8")
    openai_dump = (TEMPLATES / "dump_openai.jinja").read_text(encoding="utf-8")
    demo = json.loads((TOKENIZER / "tokenizer_config.json").read_text(encoding="utf-8"))
    return {
        "demo": {},
        "string_dump": {"tokenizer_config.json": {"chat_template": string_dump}},
        "openai_dump": {"tokenizer_config.json": {"chat_template": openai_dump}},
        "named": {
            "tokenizer_config.json": {
                "chat_template": [
                    {"name": "default", "template": demo["chat_template"]},
                    {"name": "tool_use", "template": string_dump},
                ]
            }
        },
        "jinja_file": {"chat_template.jinja": openai_dump},
        "extra_templates": {
            "chat_template.jinja": demo["chat_template"],
            "additional_chat_templates/tool_use.jinja": string_dump,
        },
        "no_bos": {"tokenizer_config.json": {"add_bos_token": False}},
        "split_special_tokens": {"tokenizer_config.json": {"split_special_tokens": True}},
        "special_tokens_map": {"special_tokens_map.json": {"bos_token": {"content": "<|user|>"}}},
        **{family: {} for family in FAMILIES},  # their own directories, as they are
    }


def bases() -> dict[str, str]:
    """The variants' tokenizer directories other than the demo one (repository-relative)."""
    return {name: family.base.relative_to(ROOT).as_posix() for name, family in FAMILIES.items()}


def write_tokenizer_variant(out: Path, files: dict[str, Any], base: Path = TOKENIZER) -> Path:
    """The tokenizer directory `base` (by default the demo one) at `out` (made), with `files`
    written over it: a JSON object is merged into the file it names, text replaces it. The
    tests read the same variants."""
    out.mkdir(parents=True, exist_ok=True)
    for src in base.iterdir():
        if src.is_file():
            shutil.copyfile(src, out / src.name)
    for name, value in files.items():
        path = out / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(value, dict):  # merged into the JSON file
            old = json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
            path.write_text(json.dumps(old | value), encoding="utf-8")
        else:
            path.write_text(value, encoding="utf-8")
    return out


def write_variant(out: Path, name: str, files: dict[str, Any]) -> None:
    """A model directory vLLM loads: the tokenizer variant and a tiny model's config (a
    family's: its architecture, vocabulary size and special token ids)."""
    family = FAMILIES.get(name)
    write_tokenizer_variant(out, files, family.base if family else TOKENIZER)
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 4096,
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32,
        "hidden_act": "silu", "max_position_embeddings": 8192, "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "rope_theta": 10000.0, "tie_word_embeddings": False, "bos_token_id": 0,
        "eos_token_id": 1, "dtype": "float32",
    }  # fmt: skip
    if family:
        tok = _module("transformers").AutoTokenizer.from_pretrained(str(out))
        # Qwen2 has no BOS token; its configs name <|endoftext|>, its pad token, instead.
        bos = tok.bos_token_id if tok.bos_token_id is not None else tok.pad_token_id
        config |= {
            "architectures": [family.architecture], "model_type": family.model_type,
            "vocab_size": len(tok),
            "bos_token_id": bos, "eos_token_id": tok.eos_token_id,
        }  # fmt: skip
    (out / "config.json").write_text(json.dumps(config), encoding="utf-8")


class Front:
    """vLLM's OpenAI front end (no engine) over one model directory."""

    def __init__(self, model: Path) -> None:
        configs = _module("vllm.config")
        config = configs.ModelConfig(model=str(model), tokenizer=str(model), max_model_len=8192)
        renderer = _module("vllm.renderers").renderer_from_config(
            configs.VllmConfig(model_config=config)
        )
        self.renderer = _module("vllm.renderers.online_renderer").OnlineRenderer(
            config,
            renderer,
            request_logger=None,
            chat_template=None,
            chat_template_content_format="auto",
            enable_auto_tools=True,
            tool_parser="hermes",
        )
        self.hf = _module("transformers").AutoTokenizer.from_pretrained(str(model))

    async def vllm(self, kind: str, body: dict[str, Any]) -> dict[str, Any]:
        api = "vllm.entrypoints.openai"
        errors = _module("vllm.entrypoints.serve.exception_handling.error_response")
        body = json.loads(json.dumps(body))  # vLLM may change what it is given
        try:
            if kind == "chat":
                request = _module(f"{api}.chat_completion.protocol").ChatCompletionRequest(**body)
                result = await self.renderer.render_chat(request)
            else:
                request = _module(f"{api}.completion.protocol").CompletionRequest(**body)
                result = await self.renderer.render_completion(request)
        except Exception as exc:  # what vLLM's exception handlers answer
            error = errors.create_error_response(exc).error
            return {"status": error.code, "message": error.message}
        if not isinstance(result, tuple | list):
            return {"status": result.error.code, "message": result.error.message}
        inputs = result[1] if kind == "chat" else result
        return {"ids": list(inputs[0]["prompt_token_ids"])}

    def transformers(self, kind: str, body: dict[str, Any]) -> list[int] | None:
        """What transformers alone makes of the request (None: it refuses)."""
        try:
            if kind == "completion":
                prompt = body["prompt"][0] if isinstance(body["prompt"], list) else body["prompt"]
                add = body.get("add_special_tokens", True)
                return list(self.hf(prompt, add_special_tokens=add)["input_ids"])
            return list(
                self.hf.apply_chat_template(
                    body["messages"],
                    tools=body.get("tools"),
                    documents=body.get("documents"),
                    add_generation_prompt=body.get("add_generation_prompt", True),
                    continue_final_message=body.get("continue_final_message", False),
                    tokenize=True,
                    return_dict=False,
                    **(body.get("chat_template_kwargs") or {}),
                )
            )
        except Exception:
            return None


def _module(name: str) -> Any:
    """A module of the vLLM environment (imported where it runs; .venv has none of them)."""
    return importlib.import_module(name)


async def vectors() -> dict[str, Any]:
    all_variants = variants()
    out: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        fronts = {}
        for name, files in all_variants.items():
            model = Path(tmp) / name
            model.mkdir()
            write_variant(model, name, files)
            fronts[name] = Front(model)
        demo_cases = cases()
        for case in [*demo_cases, *family_cases(demo_cases)]:
            front = fronts[case["variant"]]
            result = await front.vllm(case["kind"], case["body"])
            prompt = case["body"].get("prompt")
            as_text = not isinstance(prompt, list) or isinstance(prompt[0], str)  # not token ids
            if "ids" in result and as_text:
                hf = front.transformers(case["kind"], case["body"])
                result["transformers"] = "same" if hf == result["ids"] else "differs"
            out.append({**case, "vllm": result})
    return {
        "note": (
            "Made by tools/make_vllm_prompt_vectors.py with the vLLM environment: each request "
            "through vLLM's request models and OnlineRenderer (what `vllm serve "
            "--enable-auto-tool-choice --tool-call-parser hermes` runs before its engine) over "
            "kvsched/data/tokenizer with the variant's files written over it. `vllm` holds the "
            "prompt token ids or the error status; `transformers` says whether transformers' "
            "plain apply_chat_template / tokenizer call gives the same ids."
        ),
        "vllm_version": _module("vllm").__version__,
        "transformers_version": _module("transformers").__version__,
        "variants": all_variants,
        "bases": bases(),
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
