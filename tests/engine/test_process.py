"""The engine as its own process (`python -m services.engine`), and its request spans."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

from services.common.telemetry import TelemetrySettings, get_tracer, setup_tracing, shutdown_tracing
from tests.engine.conftest import RunningEngine, engine_process
from tests.engine.test_api import sse
from tests.fixtures.otlp import OtlpReceiver, ReceivedSpan


async def test_the_engine_process_serves_and_drains_on_sigterm(tmp_path: Path) -> None:
    env = {"KVSCHED_ENGINE_TIME_SCALE": "0.05"}  # flags also come from the environment
    async with engine_process(tmp_path / "engine.log", env=env) as eng:
        body = {"prompt": "from another process", "max_tokens": 4}
        answer = await eng.call("POST", "/v1/completions", body)
        assert answer["usage"]["completion_tokens"] == 4
        # SIGTERM mid-stream: the open stream still finishes, then the process exits 0.
        body = {"prompt": "a longer one", "max_tokens": 1000, "stream": True}
        async with eng.http.post(f"{eng.url}/v1/completions", json=body) as resp:
            first = await resp.content.readline()
            eng.proc.send_signal(signal.SIGTERM)
            chunks = sse(first + await resp.read())
        assert sum(len(c["choices"][0]["text"].split()) for c in chunks) == 1000
        assert await asyncio.to_thread(eng.proc.wait, 10) == 0


async def test_a_request_span_continues_the_callers_trace(
    start_engine: Any, otlp_receiver: OtlpReceiver
) -> None:
    provider = setup_tracing(TelemetrySettings("kvsched-engine", otlp_receiver.endpoint))
    try:
        eng: RunningEngine = await start_engine(tracer=get_tracer(provider))
        trace_id, parent = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
        headers = {"traceparent": f"00-{trace_id}-{parent}-01"}
        await eng.complete({"prompt": [9] * 40, "max_tokens": 3}, headers=headers)
        await eng.complete({"prompt": [9] * 40 + [1], "max_tokens": 3}, headers=headers)
        await asyncio.to_thread(provider.force_flush)
        spans = [
            await otlp_receiver.wait_for_span("POST /v1/completions", kind="SERVER", where=w)
            for w in (_prompt_of(40), _prompt_of(41))
        ]
    finally:
        await asyncio.to_thread(shutdown_tracing, provider)
    for span in spans:
        assert (span.trace_id, span.parent_span_id) == (trace_id, parent)
        assert span.service_name == "kvsched-engine"
        assert span.attributes["gen_ai.usage.completion_tokens"] == 3
    assert [s.attributes["gen_ai.usage.cached_tokens"] for s in spans] == [0, 32]


def _prompt_of(tokens: int) -> Callable[[ReceivedSpan], bool]:
    return lambda span: span.attributes.get("gen_ai.usage.prompt_tokens") == tokens
