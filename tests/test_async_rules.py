"""Rules for asynchronous code that reviews miss and shutdowns reveal.

`asyncio.wait_for` on Python 3.11 loses a cancellation that arrives as the awaited thing
completes (CPython gh-86296, fixed in 3.12): the cancelled task carries on. A service's
background loop (`while True: await wait_for(event.wait(), t)`) then never ends, and the
process hangs at shutdown waiting for it. `asyncio.timeout` keeps the cancellation, so the
services, clients and tools use only that."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CHECKED = ("services", "clients", "kvsched", "bench", "tools")


def _wait_for_calls(path: Path) -> list[int]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and node.attr == "wait_for"
        and isinstance(node.value, ast.Name)
        and node.value.id == "asyncio"
    ]


def test_no_asyncio_wait_for_outside_tests() -> None:
    files = [p for top in CHECKED for p in sorted((REPO / top).rglob("*.py"))]
    assert len(files) > 100
    offenders = [f"{p.relative_to(REPO)}:{line}" for p in files for line in _wait_for_calls(p)]
    assert offenders == [], f"use `async with asyncio.timeout(...)` instead: {offenders}"


def test_the_rule_finds_a_wait_for(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text("import asyncio\n\nasync def f(e):\n    await asyncio.wait_for(e, 1)\n")
    assert _wait_for_calls(sample) == [4]
