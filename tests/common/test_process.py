"""`services.common.serving.process`: the event loop every service runs on (uvloop, else asyncio's
own), and a service process run to its end on either."""

from __future__ import annotations

import asyncio
import builtins
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import uvloop

from services.common.serving.process import EVENT_LOOP_ENV, event_loop
from tests.fixtures.process import run_to_end

REPO = Path(__file__).resolve().parents[2]


def test_uvloop_is_the_default() -> None:
    name, run = event_loop({})
    assert (name, run) == ("uvloop", uvloop.run)
    assert event_loop({EVENT_LOOP_ENV: "uvloop"})[0] == "uvloop"


def test_asking_for_asyncio_gets_asyncios_own_loop() -> None:
    assert event_loop({EVENT_LOOP_ENV: " AsyncIO "}) == ("asyncio", asyncio.run)


def test_without_uvloop_a_service_runs_on_asyncios_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    real_import = builtins.__import__

    def no_uvloop(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "uvloop":
            raise ImportError("No module named 'uvloop'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_uvloop)
    name, run = event_loop({})
    assert (name, run) == ("asyncio", asyncio.run)
    loops: list[str] = []

    async def serve() -> None:
        loops.append(type(asyncio.get_running_loop()).__module__)

    run(serve())
    assert loops == ["asyncio.unix_events"]


@pytest.mark.parametrize(("setting", "module"), [("", "uvloop"), ("asyncio", "asyncio")])
async def test_a_service_process_runs_on_the_loop_the_environment_names(
    setting: str, module: str
) -> None:
    code = (
        "import asyncio\n"
        "from services.common.serving.logs import LogSettings\n"
        "from services.common.serving.process import run_service\n"
        "async def serve(provider):\n"
        "    print(type(asyncio.get_running_loop()).__module__)\n"
        "raise SystemExit(run_service('test', serve, LogSettings()))\n"
    )
    env = {**os.environ, EVENT_LOOP_ENV: setting}
    out = await run_to_end([sys.executable, "-c", code], cwd=REPO, env=env, timeout_s=60)
    assert out.splitlines()[-1].startswith(module)
