"""`kvsched/core` stays pure: no I/O frameworks, no clocks, no environment, no module-level
randomness and no process-wide switches."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CORE = ROOT / "kvsched" / "core"
# What may build on the simulator: the simulated engine (its engine model) and the trace bench
# (`kvsched bench`, which sets its live report beside a replay's).
SIMULATOR_USERS = {"services/engine", "services/loadgen"}
FORBIDDEN_MODULES = {
    "asyncio",
    "grpc",
    "etcd",
    "aetcd",
    "opentelemetry",
    "time",
    "services",
    "socket",
    "zmq",
    "threading",
    "os",  # the environment (and files): what a core object runs on is given to it
}
RANDOM_OK = {"Random"}  # a seeded instance is passed in; the module's own functions are not


def _imports(tree: ast.AST) -> list[str]:
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.append(node.module)
    return names


def test_core_imports_nothing_impure() -> None:
    files = sorted(CORE.rglob("*.py"))
    assert len(files) > 10
    offenders = []
    for path in files:
        for name in _imports(ast.parse(path.read_text(encoding="utf-8"))):
            root = name.split(".")[0]
            if (
                root in FORBIDDEN_MODULES
                or name.startswith("kvsched.sim")
                or name.startswith("kvsched.services")
            ):
                offenders.append(f"{path.name}: {name}")
    assert offenders == []


def test_core_calls_no_module_level_random() -> None:
    offenders = []
    for path in sorted(CORE.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == "random":
                offenders += [
                    f"{path.name}: from random import {a.name}"
                    for a in node.names
                    if a.name not in RANDOM_OK
                ]
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id == "random"
                and node.attr not in RANDOM_OK
            ):
                offenders.append(f"{path.name}: random.{node.attr}")
    assert offenders == []


def _globals(tree: ast.AST) -> list[str]:
    return [name for node in ast.walk(tree) if isinstance(node, ast.Global) for name in node.names]


def test_core_keeps_no_process_wide_switch() -> None:
    # State is the objects' own (a cluster's kernels, its index): no function rebinds a
    # module's global for every caller in the process.
    offenders = [
        f"{path.name}: global {name}"
        for path in sorted(CORE.rglob("*.py"))
        for name in _globals(ast.parse(path.read_text(encoding="utf-8")))
    ]
    assert offenders == []


def test_the_live_services_import_nothing_from_the_simulator() -> None:
    offenders = []
    for path in sorted([*(ROOT / "services").rglob("*.py"), *(ROOT / "clients").rglob("*.py")]):
        where = path.relative_to(ROOT).as_posix()
        if any(where.startswith(f"{user}/") for user in SIMULATOR_USERS):
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        offenders += [f"{where}: {n}" for n in _imports(tree) if n.startswith("kvsched.sim")]
    assert offenders == []


def test_layering_check_catches_a_violation(tmp_path: Path) -> None:
    # The checks above must be able to fail: feed them a bad module.
    bad = ast.parse("import time\nimport os\nimport random\nx = random.random()\n")
    assert {"time", "os"} <= set(_imports(bad))
    assert _globals(ast.parse("def f():\n    global active\n    active = 1\n")) == ["active"]
    assert any(
        isinstance(n, ast.Attribute)
        and n.attr == "random"
        and isinstance(n.value, ast.Name)
        and n.value.id == "random"
        for n in ast.walk(bad)
    )
