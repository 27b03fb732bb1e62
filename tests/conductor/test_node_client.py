"""The Node.js client (clients/node) against a live Conductor on a real etcd."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from typing import Any

import pytest

from tests.conductor.conftest import REPO
from tests.fixtures.process import run_to_end

NODE_CLIENT = REPO / "clients" / "node"


async def test_node_client_registers_schedules_and_lists(
    start_conductor: Callable[..., Any],
) -> None:
    node = shutil.which("node")
    assert node is not None, "Node.js is needed for the Node client test"
    if not (NODE_CLIENT / "node_modules" / "@grpc" / "grpc-js").is_dir():
        pytest.fail("clients/node has no node_modules: run `npm ci --prefix clients/node`")
    c = await start_conductor()
    env = dict(os.environ, KVSCHED_CONDUCTOR=c.url)
    text = await run_to_end([node, "--test", "test/"], cwd=NODE_CLIENT, env=env, timeout_s=60)
    assert "# fail 0" in text and "# pass 4" in text, text
