"""Client mistakes are logged at WARNING, a burst at a time, without tracebacks; what was left
out is counted in the next line that gets through."""

from __future__ import annotations

import logging

import pytest

from services.common.serving.client_errors import ClientErrorLog


def test_a_burst_is_logged_then_one_per_refill(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    log = ClientErrorLog(logging.getLogger("test.client_errors"), burst=3, per_s=2.0,
                         clock=lambda: now[0])  # fmt: skip
    with caplog.at_level(logging.WARNING, "test.client_errors"):
        logged = [log.warning("bad request %d", i) for i in range(5)]
        assert logged == [True, True, True, False, False]
        now[0] += 0.5  # one token back
        assert log.warning("bad request %d", 5)
        assert not log.warning("bad request %d", 6)
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "bad request 0",
        "bad request 1",
        "bad request 2",
        "bad request 5 (and 2 client errors not logged)",
    ]
    assert all(r.levelno == logging.WARNING and r.exc_info is None for r in caplog.records)
