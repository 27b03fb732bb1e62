"""What a Router adds to a long agent session's time to first token, its prompt tokenized
whole on every turn (the path before `services.router.prompt_pieces`) against only what is
new since the session's previous turn, on a live local cluster (`kvsched up`'s processes,
started here: two Routers, one simulated engine).

The session is `bench.session_prompts`'s: a system prompt, a task, then each turn a tool call
and its result, growing to about `--tokens` tokens over `--turns` turns. Each repetition sends
the whole session three times, turn by turn and interleaved: straight to the engine, through
the Router that tokenizes only what is new, and through one started with
`--session-prompt-tokens 0` (every turn tokenized and hashed whole). Each request streams one
token; its TTFT is from the request's send to its first event. The engine runs `--time-scale`
(1e-4: a prefill of 80K tokens is under a millisecond), so what it adds is its own front end
(it renders and tokenizes the chat, as vLLM's does), the same on every path. "added" is a
Router's TTFT less the direct one's, turn by turn, the median over `--repeats` repetitions.

Then a text completion of the last turn's length, each repetition a text of its own (nothing
cached): straight to the engine as text, which it tokenizes; straight to it as the text's
token ids; and through the incremental Router, which tokenizes it and hands the engine its ids
(`services.router.prepare.hands_over_ids`).

    .venv/bin/python -m bench.session_ttft [--turns 20] [--tokens 80000] [--repeats 5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp

from bench.session_prompts import session
from services.common.inference_api.openai_api import PromptTokenizer
from services.launcher.__main__ import demo_keys
from services.launcher.cluster_options import ClusterOptions
from services.launcher.plan import Child, plan_cluster
from services.launcher.supervisor import Supervisor

PATHS = ("direct", "incremental", "whole")


async def ttft(
    http: aiohttp.ClientSession, url: str, body: dict[str, Any], headers: dict[str, str]
) -> tuple[float, int]:
    """Seconds to the first event of a streamed completion, and the prompt's tokens."""
    started = time.perf_counter()
    first = 0.0
    tokens = 0
    async with http.post(url, json=body, headers=headers) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{url}: HTTP {resp.status}: {(await resp.text())[:300]}")
        async for line in resp.content:
            if not line.startswith(b"data: "):
                continue
            if not first:
                first = time.perf_counter() - started
            if line.startswith(b"data: [DONE]"):
                break
            usage = json.loads(line[6:]).get("usage")
            if usage:
                tokens = usage["prompt_tokens"]
    return first, tokens


async def run(args: argparse.Namespace) -> dict[str, Any]:
    bodies = session(PromptTokenizer(), args.turns, args.tokens, args.follow_up)
    with tempfile.TemporaryDirectory(prefix="kvsched-bench-") as tmp:
        run_dir = Path(tmp)
        key = demo_keys(run_dir / "api-keys.json")
        opts = ClusterOptions(
            routers=2, nodes=1, engines_per_node=1, policy="cache_aware",
            time_scale=args.time_scale, kv_pool_bytes=0,
        )  # fmt: skip
        plan = plan_cluster(opts, run_dir, run_dir / "api-keys.json", key)
        plan = replace(plan, children=tuple(map(_whole_second_router, plan.children)))
        sup = Supervisor(plan, run_dir / "logs")
        try:
            await sup.start()
            (engine,) = plan.stage("engine")
            incremental, whole = (r.endpoint["url"] for r in plan.stage("router"))
            urls = {
                "direct": engine.endpoint["url"],
                "incremental": incremental,
                "whole": whole,
            }
            model = engine.endpoint["model"]
            times: dict[str, list[list[float]]] = {p: [] for p in PATHS}
            tokens: list[int] = [0] * len(bodies)
            timeout = aiohttp.ClientTimeout(total=600)
            async with aiohttp.ClientSession(timeout=timeout) as http:
                for rep in range(args.repeats + 1):  # the first one warms up
                    per_path: dict[str, list[float]] = {p: [] for p in PATHS}
                    for turn, body in enumerate(bodies):
                        request = {**body, "model": model, "max_tokens": 1, "stream": True,
                                   "stream_options": {"include_usage": True}}  # fmt: skip
                        for path in PATHS:
                            headers = {"x-session-id": f"{path}-{rep}"}
                            if path != "direct":
                                headers["Authorization"] = f"Bearer {key}"
                            url = urls[path] + "/v1/chat/completions"
                            took, n = await ttft(http, url, request, headers)
                            per_path[path].append(took)
                            tokens[turn] = n or tokens[turn]
                    if rep:
                        for path in PATHS:
                            times[path].append(per_path[path])
                last = {**bodies[-1], "model": model}
                completion = await completions(http, urls, key, last, repeats=args.repeats)
            return {"tokens": tokens, "times": times, "completion": completion}
        finally:
            sup.stop()


async def completions(
    http: aiohttp.ClientSession, urls: dict[str, str], key: str, body: dict[str, Any], *,
    repeats: int,
) -> dict[str, Any]:  # fmt: skip
    """A text completion as long as `body`'s chat: direct as text, direct as ids, and
    through the incremental Router, `repeats` times each (after one to warm up), each text
    unlike the others."""
    tok = PromptTokenizer()
    text = "\n".join(str(m.get("content") or "") for m in body["messages"])
    out: dict[str, list[float]] = {"text": [], "ids": [], "router": []}
    tokens = 0
    for rep in range(repeats + 1):
        prompt = f"{rep} {text}"
        request = {"model": body["model"], "prompt": prompt, "max_tokens": 1, "stream": True,
                   "stream_options": {"include_usage": True}}  # fmt: skip
        as_ids = {**request, "prompt": tok.encode(prompt, True)}
        auth = {"Authorization": f"Bearer {key}"}
        for name, url, sent, headers in (
            ("text", urls["direct"], request, {}),
            ("ids", urls["direct"], as_ids, {}),
            ("router", urls["incremental"], request, auth),
        ):
            took, tokens = await ttft(http, url + "/v1/completions", sent, headers)
            if rep:
                out[name].append(took)
    return {"tokens": tokens, **out}


def _whole_second_router(child: Child) -> Child:
    if child.name != "router-1":
        return child
    return replace(child, argv=(*child.argv, "--session-prompt-tokens", "0"))


def rows(out: dict[str, Any]) -> list[dict[str, float]]:
    """Per turn: the prompt's tokens, each path's median TTFT and each Router's added TTFT
    (median over repetitions of its TTFT less the direct one's), milliseconds."""
    times = out["times"]
    table = []
    for turn, tokens in enumerate(out["tokens"]):
        row: dict[str, float] = {"turn": turn + 1, "tokens": tokens}
        for path in PATHS:
            row[f"{path}_ms"] = 1e3 * statistics.median(rep[turn] for rep in times[path])
        for path in ("incremental", "whole"):
            added = [a[turn] - d[turn] for a, d in zip(times[path], times["direct"], strict=True)]
            row[f"added_{path}_ms"] = 1e3 * statistics.median(added)
        table.append(row)
    return table


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--turns", type=int, default=20)
    p.add_argument("--tokens", type=int, default=80_000)
    p.add_argument("--follow-up", type=int, default=7, help="a user question every N turns")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--time-scale", type=float, default=1e-4)
    p.add_argument("--show", default="1,5,10,15,20", help="turns to print; 'all'")
    p.add_argument("--json", type=Path, help="also write the table here")
    args = p.parse_args()
    out = asyncio.run(run(args))
    table = rows(out)
    show = None if args.show == "all" else {int(t) for t in args.show.split(",")}
    print("turn  tokens   direct  incremental  whole   added: incremental  whole (ms, median)")
    for row in table:
        if show is None or row["turn"] in show:
            print(
                f"{row['turn']:4.0f} {row['tokens']:7.0f} {row['direct_ms']:8.1f} "
                f"{row['incremental_ms']:12.1f} {row['whole_ms']:6.1f} "
                f"{row['added_incremental_ms']:19.1f} {row['added_whole_ms']:6.1f}"
            )
    c = out["completion"]
    text, ids, routed = (1e3 * statistics.median(c[p]) for p in ("text", "ids", "router"))
    print(
        f"a text completion of {c['tokens']} tokens, TTFT median: straight to the engine as "
        f"text {text:.1f} ms, as ids {ids:.1f} ms; through the Router (it tokenizes, the engine "
        f"gets the ids) {routed:.1f} ms"
    )
    if args.json:
        document = {"session": table, "completion": c}
        args.json.write_text(json.dumps(document, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
