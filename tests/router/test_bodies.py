"""The body worker (`bodies`, `body_worker`): a large body decoded and checked in a child
process comes back as the same object, or refused as the Router itself would refuse it; a
worker that died is replaced, and the body it dropped decoded on the event loop."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from services.common.inference_api.openai_api import ApiError, decode_json
from services.router.bodies import BodyWorker, WorkerFailed
from services.router.body_worker import check_body
from tests.fixtures.poll import wait_for
from tests.router.conftest import Stack, chat, completion

JSON = {"Content-Type": "application/json"}
LONGEST = 74  # the demo tokenizer's longest token, bytes
CONTEXT = 64


@pytest.fixture
async def worker() -> AsyncIterator[BodyWorker]:
    w = BodyWorker(LONGEST, CONTEXT)
    await w.start()
    yield w
    await w.close()


def pieces(body: bytes, size: int = 1000) -> list[bytes]:
    return [body[i : i + size] for i in range(0, len(body), size)]


async def answer(worker: BodyWorker, kind: Any, raw: bytes) -> dict[str, Any]:
    """What the worker makes of `raw`: the body, or the refusal's JSON."""
    try:
        return await worker.check(kind, pieces(raw), len(raw))
    except ApiError as err:
        return {"refused": err.status, **err.body()}


def here(kind: Any, raw: bytes) -> dict[str, Any]:
    """What `check_body` makes of `raw` in this process."""
    try:
        return check_body(raw, kind, LONGEST, CONTEXT)
    except ApiError as err:
        return {"refused": err.status, **err.body()}


async def test_the_worker_answers_as_the_router_would(worker: BodyWorker) -> None:
    beyond = "x" * (CONTEXT * LONGEST)
    cases: list[tuple[str, bytes]] = [
        ("completion", json.dumps(completion("a fine prompt, \ud800 and all")).encode()),
        ("chat", json.dumps(chat("a fine story")).encode()),
        ("completion", json.dumps(completion(beyond)).encode()),
        ("chat", json.dumps(chat(beyond)).encode()),
        ("completion", b'{"prompt": "cut sh'),
        ("completion", b"[1, 2]"),
        ("completion", b"[" * 100_000 + b"]" * 100_000),
        ("completion", json.dumps(completion(temperature="hot")).encode()),
    ]
    answers = [await answer(worker, kind, raw) for kind, raw in cases]
    assert answers == [here(kind, raw) for kind, raw in cases]
    assert answers[0] == json.loads(cases[0][1]) and answers[1] == json.loads(cases[1][1])
    for refused in answers[2:4]:
        assert refused["refused"] == 400 and refused["error"]["param"] == "input_tokens"
        assert "at least" in refused["error"]["message"]
    assert all(a["refused"] == 400 for a in answers[4:])
    assert worker.starts == 1  # one process answered them all


async def test_a_dead_worker_fails_its_body_and_is_replaced(worker: BodyWorker) -> None:
    raw = json.dumps(completion("hello")).encode()
    proc = worker._proc
    assert proc is not None
    proc.kill()
    await proc.wait()
    with pytest.raises(WorkerFailed):
        await worker.check("completion", [raw], len(raw))
    assert await worker.check("completion", [raw], len(raw)) == decode_json(raw)
    assert worker.starts == 2


async def test_a_router_answers_the_same_with_or_without_the_worker(stack: Stack) -> None:
    # One Router decodes every body in its worker, one every body on its loop.
    conductor, _, offloading = await stack.up(1, max_model_len=CONTEXT, body_worker_bytes=1)
    inline = await stack.start_router(conductor.url, max_model_len=CONTEXT, body_worker_bytes=0)
    await wait_for(lambda: len(inline.placer.instances) == 1, 5.0, message="it knows the engine")
    worker = offloading.preparer.bodies.worker
    assert worker is not None and inline.preparer.bodies.worker is None
    bodies = [
        ("/v1/completions", completion()),
        ("/v1/chat/completions", chat()),
        ("/v1/completions", completion("x" * (CONTEXT * LONGEST))),
        ("/v1/chat/completions", chat("x" * (CONTEXT * LONGEST))),
        ("/v1/completions", completion(max_tokens=-1)),
        ("/v1/completions", b'{"prompt": 1'),
        ("/v1/completions", b'"a string"'),
    ]
    for path, body in bodies:
        a = await stack.post(offloading.url + path, body, **JSON)
        b = await stack.post(inline.url + path, body, **JSON)
        assert a[0] == b[0], (a, b)
        if a[0] == 200:
            usage = [json.loads(data)["usage"] for data in (a[2], b[2])]
            assert usage[0]["prompt_tokens"] == usage[1]["prompt_tokens"] > 0
        else:
            assert a[0] == 400 and json.loads(a[2]) == json.loads(b[2])
    assert worker.starts == 1


async def test_a_body_the_dead_worker_dropped_is_served_and_the_next_finds_a_new_one(
    stack: Stack, caplog: pytest.LogCaptureFixture
) -> None:
    _, _, router = await stack.up(1, body_worker_bytes=1)
    worker = router.preparer.bodies.worker
    assert worker is not None and worker._proc is not None
    worker._proc.kill()
    await worker._proc.wait()
    url = router.url + "/v1/completions"
    for _ in range(2):  # decoded here, then by a new worker
        status, _, data = await stack.post(url, completion())
        assert status == 200, data
    assert worker.starts == 2
    dropped = [r.getMessage() for r in caplog.records if "gave no answer" in r.getMessage()]
    assert len(dropped) == 1 and "decoding a" in dropped[0]
