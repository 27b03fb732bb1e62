"""Log lines: every service's `--log-level` and `--log-format`, and JSON lines that lead to
their trace."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

from services.common.serving.logs import LogSettings
from services.conductor.settings import parse as conductor
from services.engine.settings import parse as engine
from services.messenger.settings import parse as messenger
from services.router.settings import parse as router
from tests.fixtures.process import run_to_end

REPO = Path(__file__).resolve().parents[2]
SERVICES: list[tuple[Callable[[Sequence[str]], Any], list[str]]] = [
    (conductor, ["--insecure"]),
    (router, ["--insecure", "--no-auth"]),
    (messenger, ["--insecure"]),
    (engine, []),
]


@pytest.mark.parametrize(("parse", "needed"), SERVICES)
def test_every_service_takes_a_log_level_and_format(
    parse: Callable[[Sequence[str]], Any], needed: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert parse(needed).log == LogSettings("INFO", "text")
    chosen = parse([*needed, "--log-level", "warning", "--log-format", "JSON"])
    assert chosen.log == LogSettings("WARNING", "json")
    for bad in (["--log-level", "loud"], ["--log-format", "xml"]):
        with pytest.raises(SystemExit) as exit_:
            parse([*needed, *bad])
        assert exit_.value.code == 2
        assert bad[1] in capsys.readouterr().err


async def test_a_json_line_carries_the_trace_it_was_logged_in() -> None:
    code = (
        "import logging\n"
        "from services.common.serving.logs import LogSettings\n"
        "from services.common.serving.process import run_service\n"
        "async def serve(provider):\n"
        "    with provider.get_tracer('t').start_as_current_span('work') as span:\n"
        "        print('trace', format(span.get_span_context().trace_id, '032x'), flush=True)\n"
        "        logging.getLogger('kvsched.test').warning('placed %d', 3)\n"
        "    logging.getLogger('kvsched.test').debug('not at WARNING')\n"
        "raise SystemExit(run_service('test', serve, LogSettings('WARNING', 'json')))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    out = await run_to_end([sys.executable, "-c", code], cwd=REPO, env=env, timeout_s=60)
    lines = out.splitlines()
    trace_id = next(line.split()[1] for line in lines if line.startswith("trace "))
    logged = [json.loads(line) for line in lines if line.startswith("{")]
    assert len(logged) == 1, out
    assert logged[0]["message"] == "placed 3" and logged[0]["level"] == "WARNING"
    assert logged[0]["logger"] == "kvsched.test" and logged[0]["trace_id"] == trace_id
    assert len(logged[0]["span_id"]) == 16 and logged[0]["time"].endswith("+00:00")
