"""Every service is laid out alike: its process class in `app.py`, its gRPC servicer (where
it serves gRPC) in `service.py`, its flags in `settings.py` and its command in `__main__.py`."""

from __future__ import annotations

import ast
from pathlib import Path

SERVICES_DIR = Path(__file__).resolve().parent.parent / "services"
PROCESS_CLASSES = {
    "conductor": "Conductor",
    "router": "Router",
    "messenger": "Messenger",
    "engine": "EngineApp",
}


def _classes(path: Path) -> dict[str, list[str]]:
    """{class name: the names of its bases} of a module's top level."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return {
        node.name: [ast.unparse(base) for base in node.bases]
        for node in tree.body
        if isinstance(node, ast.ClassDef)
    }


def servicers(path: Path) -> list[str]:
    return [name for name, bases in _classes(path).items() if any("Servicer" in b for b in bases)]


def test_each_service_has_its_process_class_flags_and_command_in_the_same_files() -> None:
    for service, process_class in PROCESS_CLASSES.items():
        folder = SERVICES_DIR / service
        assert process_class in _classes(folder / "app.py"), f"{service}/app.py"
        assert (folder / "settings.py").is_file() and (folder / "__main__.py").is_file()


def test_grpc_servicers_live_in_service_py_only() -> None:
    found = {
        str(path.relative_to(SERVICES_DIR)): servicers(path)
        for service in PROCESS_CLASSES
        for path in sorted((SERVICES_DIR / service).rglob("*.py"))
        if servicers(path)
    }
    assert found
    assert all(path.endswith("/service.py") for path in found), found
    assert {path.split("/")[0] for path in found} == {"conductor", "router", "messenger"}


def test_a_servicer_is_found_where_a_class_extends_one(tmp_path: Path) -> None:
    module = tmp_path / "probe.py"
    module.write_text("class A(pb.FooServicer):\n    pass\n\n\nclass B(A, object):\n    pass\n")
    assert servicers(module) == ["A"]
