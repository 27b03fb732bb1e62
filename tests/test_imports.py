"""The import graph of our own code: no circles, and no service reaching into another's
internals.

Every module under kvsched (but the generated `kvsched/api`), services, clients, bench and
tools is parsed, never imported, so the check sees imports that only run under
`if TYPE_CHECKING:` or inside functions too: a circle that mypy or a lazy import hides is
still a circle in the design.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("kvsched", "services", "clients", "bench", "tools")
GENERATED = ("kvsched.api",)
# The four services that run as their own processes. Each may use `services.common`,
# `services.dataplane`, `services.kv_events`, the core (`kvsched`), the clients, and its own
# package: nothing of another. The launcher and `services.cli` are not among them: they start
# the others, so naming their entry points is their job.
SERVICES = ("services.router", "services.messenger", "services.engine", "services.conductor")
SHARED = ("services.common", "services.dataplane", "services.kv_events", "kvsched", "clients")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def find_modules() -> dict[str, Path]:
    """Module name -> file, for every module we own."""
    found: dict[str, Path] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            name = _module_name(path)
            if not any(_within(name, g) for g in GENERATED):
                found[name] = path
    return found


def imports_of(name: str, tree: ast.AST, modules: Iterable[str], *, is_package: bool) -> set[str]:
    """The modules among `modules` that module `name` imports, anywhere in its body.

    `import a.b` names `a.b`. `from a import b` names `a` (running it is what the statement
    does first) and also `a.b` when that is a module. Relative imports resolve against
    `name` (a package's own name for its `__init__`)."""
    known = set(modules)
    here = name if is_package else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = here.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            out.add(base)
            out.update(f"{base}.{alias.name}" for alias in node.names)
    return {m for m in out if m in known and m != name}


def import_graph() -> dict[str, set[str]]:
    modules = find_modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        graph[name] = imports_of(name, tree, modules, is_package=path.name == "__init__.py")
    return graph


def circles(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (or a module importing
    itself), each sorted; Tarjan's algorithm, iterative."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work: list[tuple[str, list[str]]] = [(start, sorted(graph.get(start, ())))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, pending = work[-1]
            if pending:
                nxt = pending.pop()
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, sorted(graph.get(nxt, ()))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1 or node in graph.get(node, ()):
                    found.append(sorted(component))
    return sorted(found)


def cross_service_imports(graph: Mapping[str, Iterable[str]]) -> list[str]:
    """`importer -> imported` for every import from one of the four services into another."""
    out = []
    for name, targets in sorted(graph.items()):
        own = next((s for s in SERVICES if _within(name, s)), None)
        if own is None:
            continue
        for target in sorted(targets):
            if any(_within(target, s) for s in SERVICES if s != own):
                out.append(f"{name} -> {target}")
    return out


def test_the_graph_covers_our_code() -> None:
    graph = import_graph()
    assert len(graph) > 100
    assert "services.conductor.app" in graph and "kvsched.core.scheduler" in graph
    assert not any(_within(m, "kvsched.api") for m in graph)
    assert "kvsched.core.scheduler" in graph["services.conductor.state"]


def test_no_import_circles() -> None:
    found = circles(import_graph())
    assert found == [], "import circles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_services_import_no_other_service() -> None:
    assert cross_service_imports(import_graph()) == []


def test_the_checks_can_fail() -> None:
    cyclic = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a", "d"}, "e": {"d"}}
    assert circles(cyclic) == [["a", "b", "c"], ["d"]]
    assert circles({"a": {"b"}, "b": set()}) == []
    modules = ["p", "p.x", "p.y", "p.sub", "p.sub.z"]
    tree = ast.parse(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from . import y\n"
        "from .sub import z\nimport p.sub\n"
    )
    assert imports_of("p.x", tree, modules, is_package=False) == {"p", "p.y", "p.sub", "p.sub.z"}
    mixed = {"services.router.app": {"services.conductor.keys"}, "services.conductor.keys": set()}
    assert cross_service_imports(mixed) == ["services.router.app -> services.conductor.keys"]
    assert cross_service_imports({"services.launcher.plan": {"services.conductor"}}) == []
