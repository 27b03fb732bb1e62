"""The KV data plane is one wing behind one front door: the services import
`services.dataplane` and nothing deeper (kvsched's vLLM connector imports the pool's wire
format, `services.dataplane.pool_wire`, and nothing else of it), the wing imports none of the
services above it, importing the wire format pulls in nothing but the standard library, and
the front door's names are the objects their modules own.

Modules are parsed, never imported (but in the subprocess that checks what an import pulls
in), so imports under `if TYPE_CHECKING:` or inside functions count too. Tests, the benches
and the tools may import the wing's internals."""

from __future__ import annotations

import ast
import importlib
import json
import subprocess
import sys
from pathlib import Path

import services.dataplane as front_door
from services.dataplane.kv_transfer import TransferError as Refused
from services.dataplane.transfer.errors import TransferError
from services.dataplane.transfer_progress import TransferFailed

ROOT = Path(__file__).resolve().parents[2]
SERVICES = ROOT / "services"
WING = SERVICES / "dataplane"
CONNECTOR = "services/vllm_connector/"
WIRE = "services.dataplane.pool_wire"
MESSENGER_MAX_FILES = 15
MODULE_MAX_LINES = 400
# What the wing may not import: the services it serves, and the connector it serves too.
ABOVE = (
    "services.messenger",
    "services.engine",
    "services.router",
    "services.conductor",
    "services.launcher",
    "services.loadgen",
    "services.vllm_connector",
    "services.cli",
)
# What importing the wire format (as the connector does, inside vLLM) must not pull in.
HEAVY = ("grpc", "aiohttp", "aetcd", "zmq", "opentelemetry", "prometheus_client", "google")


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def wing_imports(tree: ast.AST) -> list[str]:
    """The modules of the wing a module's code names: `import services.dataplane.x`,
    `from services.dataplane.x import y`, and `from services.dataplane import y` (the front
    door, `services.dataplane`, or its submodule `services.dataplane.y` where one is a file
    or package of the wing)."""
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names if _within(a.name, "services.dataplane")]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "services.dataplane":
                for alias in node.names:
                    inner = WING / alias.name
                    is_module = inner.with_suffix(".py").is_file() or inner.is_dir()
                    names.append(f"services.dataplane.{alias.name}" if is_module else node.module)
            elif _within(node.module, "services.dataplane"):
                names.append(node.module)
    return names


def all_imports(tree: ast.AST) -> list[str]:
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return names


def _parsed(path: Path) -> ast.AST:
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def reaching_in(modules: dict[str, ast.AST]) -> list[str]:
    """`file: module` for every import of the wing's internals by `modules` (by file, from
    the repository's root), the connector's of the wire format excepted."""
    found = []
    for where, tree in modules.items():
        for name in wing_imports(tree):
            if name == "services.dataplane":
                continue
            if where.startswith(CONNECTOR) and name == WIRE:
                continue
            found.append(f"{where}: {name}")
    return found


def test_the_services_import_the_wing_only_through_its_front_door() -> None:
    modules = {
        path.relative_to(ROOT).as_posix(): _parsed(path)
        for path in sorted(SERVICES.rglob("*.py"))
        if WING not in path.parents
    }
    assert len(modules) > 100
    assert reaching_in(modules) == []


def test_the_connector_imports_nothing_of_the_wing_but_the_wire_format() -> None:
    used = {
        name
        for path in sorted((SERVICES / "vllm_connector").rglob("*.py"))
        for name in wing_imports(_parsed(path))
    }
    assert used == {WIRE}


def test_the_wing_imports_none_of_the_services_above_it() -> None:
    offenders = [
        f"{path.relative_to(ROOT).as_posix()}: {name}"
        for path in sorted(WING.rglob("*.py"))
        for name in all_imports(_parsed(path))
        if any(_within(name, above) for above in ABOVE)
    ]
    assert offenders == []


def test_the_check_catches_a_reach_past_the_front_door() -> None:
    tree = ast.parse(
        "from services.dataplane import NodePool\n"
        "from services.dataplane import kv_pool\n"
        "from services.dataplane.pool_wire import encode\n"
        "import services.dataplane.transfer.factory\n"
    )
    assert wing_imports(tree) == [
        "services.dataplane",
        "services.dataplane.kv_pool",
        "services.dataplane.pool_wire",
        "services.dataplane.transfer.factory",
    ]
    wire = ast.parse("from services.dataplane.pool_wire import encode\n")
    # The connector may import the wire format; anywhere else it is an internal.
    assert reaching_in({"services/vllm_connector/x.py": wire}) == []
    assert reaching_in({"services/messenger/x.py": wire}) == [f"services/messenger/x.py: {WIRE}"]
    assert reaching_in({"services/engine/x.py": tree}) == [
        "services/engine/x.py: services.dataplane.kv_pool",
        f"services/engine/x.py: {WIRE}",
        "services/engine/x.py: services.dataplane.transfer.factory",
    ]


def test_importing_the_wire_format_pulls_in_only_the_standard_library() -> None:
    # A fresh interpreter, as vLLM's is: what the connector's imports of the pool bring.
    probe = (
        "import json, sys\n"
        "import services.dataplane.pool_wire\n"
        "import services.vllm_connector.pool_client\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True
    )
    loaded = json.loads(done.stdout)
    heavy = [m for m in loaded if any(_within(m, h) for h in HEAVY)]
    ours = [m for m in loaded if m.startswith(("services.", "kvsched", "clients"))]
    assert heavy == []
    assert sorted(ours) == [
        "services.dataplane",
        "services.dataplane.pool_wire",
        "services.vllm_connector",
        "services.vllm_connector.pool_client",
    ]


def test_every_front_door_name_is_its_owners_object() -> None:
    names = front_door.__all__
    assert len(names) == len(set(names))
    assert {"NodePool", "Transfers", "Exporter", "open_backend", "DataPlaneError"} <= set(names)
    for name in names:
        module, attribute = front_door._FRONT_DOOR[name]
        owner = importlib.import_module(f"services.dataplane.{module}")
        assert getattr(front_door, name) is getattr(owner, attribute), name
    assert set(front_door._FRONT_DOOR) == set(names)
    assert set(names) <= set(dir(front_door))


def test_a_name_not_at_the_front_door_is_an_attribute_error() -> None:
    assert not hasattr(front_door, "NoSuchName")
    assert not hasattr(front_door, "PoolStore")  # an internal: import it from its module


def test_the_wings_errors_share_one_base() -> None:
    base = front_door.DataPlaneError
    for error in (
        front_door.PoolError,
        front_door.PoolFull,
        front_door.PoolRefused,
        front_door.TransferRefused,
        Refused,
        TransferError,
        TransferFailed,
    ):
        assert issubclass(error, base), error
    assert issubclass(front_door.PoolFull, front_door.PoolError)


def test_the_messenger_keeps_at_most_15_files() -> None:
    files = sorted((SERVICES / "messenger").rglob("*.py"))
    assert len(files) <= MESSENGER_MAX_FILES, [p.name for p in files]


def test_every_module_of_the_wing_is_at_most_400_lines() -> None:
    long = {
        path.relative_to(WING).as_posix(): lines
        for path in sorted(WING.rglob("*.py"))
        if (lines := len(path.read_text(encoding="utf-8").splitlines())) > MODULE_MAX_LINES
    }
    assert long == {}
