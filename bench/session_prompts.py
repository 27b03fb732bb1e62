"""An agent session's prompt, turn by turn: ids and block hashes computed whole (the Router's
path today) against incrementally (`services.router.session_prompts.SessionPrompts`).

For each tokenizer family (`bench.tokenize.FAMILIES`), a session of `--turns` turns with
tools: a system prompt and a task, then each turn one tool call and its result (repository
text, `bench.tokenize.text_of`), with a follow-up answer and question every `--follow-up`
turns, growing to about `--tokens` tokens. Per turn, each the median of `--repeats` runs:
rendering the chat template (which neither path avoids), tokenizing and hashing the rendered
text whole, the same incrementally from the previous turn's record, and incrementally from
no record (a session's first request: the pieces tokenized in one parallel batch). Every
turn's incremental ids and hashes are checked equal to the whole path's.

    .venv/bin/python -m bench.session_prompts [--turns 20] [--tokens 80000] [--repeats 7]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from bench.common import median_s
from bench.tokenize import FAMILIES, text_of
from kvsched.core.vllm_hashing import VllmBlockHasher
from services.common.inference_api.openai_api import PromptTokenizer, parse_request
from services.router.prompt_pieces import PieceTokenizer
from services.router.session_prompts import SessionPrompts

SALT = "tenant-a"
TOOLS = [
    {"type": "function", "function": {
        "name": "read_file", "description": "Read a file of the repository.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                       "required": ["path"]}}},
    {"type": "function", "function": {
        "name": "run", "description": "Run a shell command and return its output.",
        "parameters": {"type": "object", "properties": {"command": {"type": "string"}},
                       "required": ["command"]}}},
]  # fmt: skip


def session(tok: PromptTokenizer, turns: int, tokens: int, follow_up: int) -> list[dict[str, Any]]:
    """Each turn's request body: the conversation so far, a generation prompt after it."""
    text = text_of(tok, tokens)
    system_chars = len(text) // 40
    system, rest = text[:system_chars], text[system_chars:]
    step = len(rest) // max(turns - 1, 1)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a coding agent.\n\n" + system},
        {"role": "user", "content": "Review kvsched/core and report what could be faster."},
    ]
    bodies = []
    for turn in range(1, turns + 1):
        bodies.append({"messages": list(messages), "tools": TOOLS})
        if turn % follow_up == 0:
            messages += [
                {"role": "assistant", "content": f"Here is what I found so far (turn {turn})."},
                {"role": "user", "content": "Good. Keep going, and look at the tests too."},
            ]
        call = f"call_{turn}"
        messages += [
            {"role": "assistant", "content": None, "tool_calls": [{
                "id": call, "type": "function",
                "function": {"name": "read_file", "arguments": json.dumps({"path": f"f{turn}.py"})},
            }]},
            {"role": "tool", "tool_call_id": call,
             "content": rest[(turn - 1) * step : turn * step]},
        ]  # fmt: skip
    return bodies


def family_rows(
    tok: PromptTokenizer, hasher: VllmBlockHasher, args: argparse.Namespace
) -> list[tuple[int, int, int, float, float, float, float]]:
    """Per turn: (turn, prompt tokens, tokens tokenized anew, render s, whole s,
    incremental s, first-request s)."""
    pieces = PieceTokenizer(tok.model)
    prompts = SessionPrompts(pieces, max_tokens=1 << 30)
    rows = []
    previous: str | None = None
    for turn, body in enumerate(session(tok, args.turns, args.tokens, args.follow_up), 1):
        req = parse_request("chat", body)
        chat = req.chat
        assert chat is not None
        flag = req.add_special_tokens
        text = tok.render_chat(chat)
        render = median_s(lambda: tok.render_chat(chat), args.repeats)  # noqa: B023
        ids = tok.encode(text, flag)
        hashes = hasher.hash_prompt(ids, SALT)
        whole = median_s(lambda: hasher.hash_prompt(tok.encode(text, flag), SALT), args.repeats)  # noqa: B023
        incremental = _from_previous(
            prompts, previous, text, flag, hasher=hasher, repeats=args.repeats
        )
        cold = median_s(
            lambda: prompts.ids_and_hashes(None, text, flag, hasher, SALT),  # noqa: B023
            args.repeats,
        )
        before = prompts.stats().tokenized_tokens
        got_ids, got_hashes = prompts.ids_and_hashes("session", text, flag, hasher, SALT)
        assert (list(got_ids), list(got_hashes)) == (ids, hashes), f"turn {turn}: they differ"
        fresh = prompts.stats().tokenized_tokens - before
        previous = text
        rows.append((turn, len(ids), fresh, render, whole, incremental, cold))
    return rows


def _from_previous(
    prompts: SessionPrompts,
    previous: str | None,
    text: str,
    flag: bool,
    *,
    hasher: VllmBlockHasher,
    repeats: int,
) -> float:
    """The median time of `text`'s ids and hashes from a record of the `previous` turn's
    prompt: each timed call gets a session of its own, whose record an untimed call made,
    so that no call sees another's (the first one warms up)."""
    times = []
    for i in range(repeats + 1):
        key = f"timed-{i}"
        if previous is not None:
            prompts.ids_and_hashes(key, previous, flag, hasher, SALT)
        started = time.perf_counter()
        prompts.ids_and_hashes(key, text, flag, hasher, SALT)
        times.append(time.perf_counter() - started)
        prompts.discard(key)
    return statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--turns", type=int, default=20)
    parser.add_argument("--tokens", type=int, default=80_000)
    parser.add_argument("--follow-up", type=int, default=7, help="a user question every N turns")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--hash-algo", default="sha256")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--show", default="1,2,5,7,8,10,15,20", help="turns to print; 'all'")
    args = parser.parse_args()
    hasher = VllmBlockHasher(args.block_size, args.hash_algo)
    show = None if args.show == "all" else {int(t) for t in args.show.split(",")}
    print(f"median of {args.repeats}; {args.block_size}-token blocks ({args.hash_algo}); "
          f"a user follow-up every {args.follow_up} turns")  # fmt: skip
    print(
        "| family | turn | prompt tokens | tokenized anew | render ms | whole ids+hashes ms "
        "| incremental ms | whole / incremental | first request (no record) ms |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for family, path in FAMILIES.items():
        tok = PromptTokenizer(path)
        for turn, n, fresh, render, whole, incr, cold in family_rows(tok, hasher, args):
            if show is None or turn in show:
                print(
                    f"| {family} | {turn} | {n:,} | {fresh:,} | {render * 1e3:.2f} | "
                    f"{whole * 1e3:.2f} | {incr * 1e3:.2f} | {whole / incr:.1f}x | "
                    f"{cold * 1e3:.2f} |"
                )


if __name__ == "__main__":
    main()
