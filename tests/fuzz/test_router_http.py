"""Fuzzes running Routers over HTTP: a Conductor, two simulated engines and two Routers (one
asking for API keys), sent thousands of hypothesis-drawn requests (fuzzed OpenAI bodies, raw
garbage, odd paths, methods and headers) on a keep-alive client. No answer is a 500 (a bug's)
or past 599, every error on `/v1/...` is OpenAI's JSON error, no request without a key gets an
answer from the keyed Router, the servers are still up at the end, and a phase of requests
that must all be refused leaves the Conductor's state as it was."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.common.inference_api.openai_api import DEFAULT_MODEL
from services.conductor.app import Conductor
from services.router.app import Router
from tests.fuzz.conftest import fuzz_settings
from tests.router.conftest import EngineProcess, Stack
from tests.router.test_errors import openai_error

pytestmark = [
    pytest.mark.slow,
    # Hypothesis warns when the global `random` state changes while it draws, taking it for a
    # strategy's doing: here the servers, on the loop in the other thread, use `random`.
    pytest.mark.filterwarnings("ignore:Do not use the `random` module inside strategies"),
]

T = TypeVar("T")

BATCH = 50  # requests per hypothesis example
MIXED_EXAMPLES = 160  # 8,000 requests of every kind
REFUSED_EXAMPLES = 50  # 2,500 requests that must all be refused
MIN_REQUESTS = 10_000


@dataclass(frozen=True)
class FuzzRequest:
    """One request as the fuzzer sends it: `keyed` ones to a Router that asks for API keys
    (the fuzzer has none), the others to one that does not."""

    method: str
    path: str
    body: bytes | None
    headers: dict[str, str] = field(default_factory=dict)
    keyed: bool = False


def to_either_router(requests: st.SearchStrategy[FuzzRequest]) -> st.SearchStrategy[FuzzRequest]:
    return st.builds(lambda r, keyed: replace(r, keyed=keyed), requests, st.booleans())


# -- strategies ---------------------------------------------------------------------------

POST_PATHS = ["/v1/completions", "/v1/chat/completions", "/v1/messages", "/v1/responses",
              "/v1/embeddings", "/tokenize", "/detokenize"]  # fmt: skip
OPENAI_PATHS = [*POST_PATHS, "/v1/models", "/v1/models/" + DEFAULT_MODEL]
KNOWN_PATHS = [*OPENAI_PATHS, "/health", "/metrics"]
METHODS = ["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"]

# Text a JSON body may carry: any code point, lone surrogates included (json.dumps escapes
# them as `\ud800`: valid JSON whose text is not Unicode).
any_text = st.text(st.characters(codec=None), max_size=40)
huge_text = st.integers(1_000, 200_000).map(lambda n: "x" * n)
numbers = st.one_of(
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from([0, -1, 1, 2**31, 2**63, -(2**63), 1e308, -1e-308, 0.5]),
)
scalars = st.one_of(st.none(), st.booleans(), numbers, any_text)
json_values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(any_text, inner, max_size=4)
    ),
    max_leaves=12,
)
# a field's value: right-looking or wrong-typed, out of range, huge or empty
field_values = st.one_of(json_values, huge_text, st.just(""), st.just([]), st.just({}))

COMPLETION_FIELDS = [
    "model", "prompt", "max_tokens", "temperature", "top_p", "n", "stream", "stop", "seed",
    "logprobs", "echo", "user", "session_id", "presence_penalty", "frequency_penalty",
    "stream_options", "min_tokens", "prompt_cache_key", "tokens", "input", "system",
    "instructions", "metadata", "thinking", "max_output_tokens", "previous_response_id",
]  # fmt: skip
CHAT_FIELDS = [
    *(f for f in COMPLETION_FIELDS if f not in {"prompt", "echo"}),
    "messages", "max_completion_tokens", "response_format", "tools", "tool_choice",
]  # fmt: skip

messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "assistant"]), "content": any_text}
    ),
    min_size=1,
    max_size=3,
)


def openai_body(fields: list[str], base: dict[str, Any]) -> st.SearchStrategy[dict[str, Any]]:
    """A valid-shaped body (`base`) with some of `fields` given fuzzed values, and extras."""
    return st.builds(
        lambda overrides, extra: {**base, **extra, **overrides},
        st.dictionaries(st.sampled_from(fields), field_values, max_size=3),
        st.dictionaries(any_text, json_values, max_size=2),
    )


completion_bodies = openai_body(
    COMPLETION_FIELDS, {"model": DEFAULT_MODEL, "prompt": "Hello there", "max_tokens": 4}
)
chat_bodies = st.builds(
    lambda body, msgs: {"messages": msgs, **body},
    openai_body(CHAT_FIELDS, {"model": DEFAULT_MODEL, "max_tokens": 4}),
    messages,
)


def nested(depth: int) -> bytes:
    return b'{"model": "m", "prompt": ' + b"[" * depth + b"]" * depth + b"}"


raw_bodies = st.one_of(
    st.binary(max_size=200),
    st.integers(1, 200_000).map(nested),
    st.sampled_from([b"", b"null", b"[]", b"{", b'{"prompt": NaN}', b'"\\ud800"', b"\xff\xfe"]),
    json_values.map(lambda v: json.dumps(v).encode()),
)
json_bodies = st.one_of(completion_bodies, chat_bodies).map(lambda b: json.dumps(b).encode())

# Header values aiohttp's client sends as they are: no control characters, Latin-1 bytes.
header_text = st.text(
    st.characters(min_codepoint=0x21, max_codepoint=0xFF, exclude_characters="\x7f"),
    max_size=300,
)
headers = st.fixed_dictionaries(
    {},
    optional={
        "Content-Type": st.one_of(
            st.sampled_from(
                ["application/json", "text/plain", "application/json; charset=latin-1", ""]
            ),
            header_text,
        ),
        "x-session-id": header_text,
        "X-Claude-Code-Session-Id": header_text,
        "session_id": header_text,
        "X-Request-Id": header_text,
        "Authorization": st.one_of(header_text, header_text.map("Bearer ".__add__)),
        "Accept-Encoding": header_text,
    },
)

random_paths = st.one_of(
    st.sampled_from(KNOWN_PATHS),
    st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), max_size=30).map(
        lambda p: "/" + p.lstrip("/")
    ),
    st.sampled_from(OPENAI_PATHS).map(lambda p: p + "/extra"),
)


def fuzz_requests() -> st.SearchStrategy[FuzzRequest]:
    """Requests of every kind: OpenAI bodies to the OpenAI routes, garbage anywhere."""
    to_openai = st.builds(
        FuzzRequest,
        st.just("POST"),
        st.sampled_from(POST_PATHS),
        st.one_of(json_bodies, raw_bodies),
        headers,
    )
    anything = st.builds(
        FuzzRequest,
        st.sampled_from(METHODS),
        random_paths,
        st.one_of(st.none(), raw_bodies, json_bodies),
        headers,
    )
    return st.one_of(to_openai, anything)


# Requests that must be refused: a body that is not a JSON object, or a field of a type no
# request may carry, or a path the Router does not serve.
not_an_object = st.one_of(
    st.binary(max_size=100).filter(lambda b: not b.lstrip().startswith(b"{")),
    st.sampled_from([b"", b"null", b"[]", b"{", b"\xff\xfe", b'{"prompt": NaN}']),
)
wrong_type = st.one_of(
    st.builds(lambda b, v: {**b, "max_tokens": v}, completion_bodies, any_text),
    st.builds(lambda b, v: {**b, "messages": v}, chat_bodies, st.one_of(any_text, numbers)),
).map(lambda b: json.dumps(b).encode())
refused_requests = st.one_of(
    st.builds(
        FuzzRequest,
        st.just("POST"),
        st.sampled_from(POST_PATHS),
        st.one_of(not_an_object, wrong_type),
        st.just({"Content-Type": "application/json"}),
    ),
    st.builds(
        FuzzRequest,
        st.sampled_from(METHODS),
        st.sampled_from(OPENAI_PATHS).map(lambda p: p + "/nothing-here"),
        st.none(),
    ),
)


# -- the checks ---------------------------------------------------------------------------


def api_error(body: bytes) -> None:
    """An error body as the API shapes it: Anthropic's on `/v1/messages` where the Router
    refused it (an engine's own passes as it is), else OpenAI's."""
    parsed = json.loads(body)
    if isinstance(parsed, dict) and parsed.get("type") == "error":
        error = parsed["error"]
        assert set(error) == {"type", "message"} and error["message"], parsed
        assert "Traceback" not in error["message"]
        return
    openai_error(body)


@dataclass(frozen=True)
class Routers:
    """The two Routers fuzzed: one open, one asking for API keys."""

    open: Router
    keyed: Router


async def send(http: aiohttp.ClientSession, routers: Routers, req: FuzzRequest) -> int:
    """Send `req` and check its answer; returns the status."""
    router = routers.keyed if req.keyed else routers.open
    async with http.request(
        req.method,
        router.url + req.path,
        data=req.body,
        headers=req.headers,
        skip_auto_headers=["Content-Type"],
    ) as resp:
        body = await resp.read()
        status = resp.status
        # (a 502, 503 or 504 says an engine was slow or away, which a loaded machine may make)
        assert status != 500 and status < 600, (req, status, body[:500])
        api = req.path.startswith(("/v1/", "/tokenize", "/detokenize"))
        if api and status >= 400 and req.method != "HEAD":
            assert resp.content_type == "application/json", (req, status, body[:500])
            api_error(body)
        if req.keyed and api:
            assert status >= 400, (req, status, body[:500])  # no key, no answer
        return status


def conductor_state(conductor: Conductor) -> dict[str, Any]:
    """What a refused request must not change: instances, policy, index, sessions."""
    state = conductor.state
    return {
        "instances": sorted(state.instances),
        "policy": state.scheduler.spec,
        "index_blocks": len(state.cluster.index),
        "sessions": len(state.cluster.sessions),
        "in_flight": state.cluster.load.in_flight.tolist(),
    }


async def alive(
    http: aiohttp.ClientSession, routers: Routers, engines: list[EngineProcess]
) -> None:
    for url in [routers.open.url, routers.keyed.url, *(e.url for e in engines)]:
        async with http.get(url + "/health") as resp:
            assert resp.status == 200, url
    assert all(e.process.poll() is None for e in engines)


class LoopBridge:
    """Runs hypothesis in a thread beside the event loop of the servers it fuzzes (hypothesis
    drives its examples synchronously), each example's requests made on that loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop

    def call(self, work: Coroutine[Any, Any, T]) -> T:
        """Run `work` on the loop from hypothesis's thread; returns its result."""
        return asyncio.run_coroutine_threadsafe(work, self.loop).result(timeout=120)

    async def run(self, fuzz: Callable[[], None]) -> None:
        """Run a hypothesis test (`fuzz`) in a thread."""
        await asyncio.to_thread(fuzz)


async def test_the_router_survives_fuzzed_http(
    stack: Stack, keys_file: tuple[Path, dict[str, str]]
) -> None:
    conductor, engines, router = await stack.up(2)
    keyed = await stack.start_router(
        conductor.url, router_id="r2", no_auth=False, api_keys=str(keys_file[0])
    )
    routers = Routers(router, keyed)
    loop = LoopBridge(asyncio.get_running_loop())
    statuses: list[int] = []

    def run_batch(batch: list[FuzzRequest]) -> list[int]:
        """Send a batch concurrently; returns the statuses."""

        async def send_all() -> list[int]:
            return list(await asyncio.gather(*(send(stack.http, routers, r) for r in batch)))

        return loop.call(send_all())

    @fuzz_settings(REFUSED_EXAMPLES)
    @given(st.lists(to_either_router(refused_requests), min_size=BATCH, max_size=BATCH))
    def fuzz_refused(batch: list[FuzzRequest]) -> None:
        got = run_batch(batch)
        answered = [(req, s) for req, s in zip(batch, got, strict=True) if not 400 <= s < 500]
        assert not answered, answered  # only the requests not refused, to say which
        statuses.extend(got)

    @fuzz_settings(MIXED_EXAMPLES)
    @given(st.lists(to_either_router(fuzz_requests()), min_size=BATCH, max_size=BATCH))
    def fuzz_mixed(batch: list[FuzzRequest]) -> None:
        statuses.extend(run_batch(batch))

    before = conductor_state(conductor)
    await loop.run(fuzz_refused)
    assert conductor_state(conductor) == before  # refused requests changed nothing
    await loop.run(fuzz_mixed)
    await alive(stack.http, routers, engines)
    assert conductor.serving
    assert len(statuses) >= MIN_REQUESTS, len(statuses)
    print(f"{len(statuses)} requests; statuses {sorted(set(statuses))}")
