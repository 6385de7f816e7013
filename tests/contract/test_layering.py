"""The dependency rule of docs/architecture.md (its dependency rule), checked on every import statement of the tree, lazy
ones included: schemas import nothing of the project's; shared imports no service and no tool; a service never
imports another service; a tool never imports a service's internals; and, following imports transitively through
the project's own modules, the compute package never reaches asyncio, NATS, aiohttp or the data plane, and the data
plane never reaches torch."""
from __future__ import annotations

import ast
import functools
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@functools.cache
def imports_of(path: Path) -> frozenset[str]:
    """Every module a file imports, at any depth (lazy imports inside functions count too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}  # `from pkg import module`
    return frozenset(found)


def source_of(module: str) -> Path | None:
    """The project file that defines `module`, or None for a third-party module or a name inside a module."""
    base = ROOT.joinpath(*module.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def reached_from(path: Path) -> set[str]:
    """Every module `path` imports, directly or through the project's own modules (and their packages'
    __init__ files)."""
    seen: set[str] = set()
    todo = [path]
    visited: set[Path] = set()
    while todo:
        current = todo.pop()
        if current in visited:
            continue
        visited.add(current)
        for module in imports_of(current):
            parts = module.split(".")
            for i in range(1, len(parts) + 1):  # importing a.b.c runs a/__init__ and a/b/__init__ too
                prefix = ".".join(parts[:i])
                source = source_of(prefix)
                if source is not None:
                    seen.add(prefix)
                    todo.append(source)
                elif i == 1:
                    seen.add(prefix)
    return seen


def files(folder: str) -> list[Path]:
    return sorted((ROOT / folder).rglob("*.py"))


def top(module: str) -> str:
    return module.split(".")[0]


@pytest.mark.parametrize("path", files("schemas"), ids=lambda p: str(p.relative_to(ROOT)))
def test_schemas_import_nothing_of_the_project_but_themselves(path):
    assert {top(m) for m in imports_of(path)} & {"shared", "services", "tools"} == set()


@pytest.mark.parametrize("path", files("shared"), ids=lambda p: str(p.relative_to(ROOT)))
def test_shared_imports_no_service_and_no_tool(path):
    assert {top(m) for m in imports_of(path)} & {"services", "tools"} == set()


@pytest.mark.parametrize("path", files("services"), ids=lambda p: str(p.relative_to(ROOT)))
def test_a_service_imports_no_other_service_and_no_tool(path):
    role = path.relative_to(ROOT / "services").parts[0]
    for module in imports_of(path):
        parts = module.split(".")
        assert parts[0] != "tools", module
        if parts[0] == "services" and len(parts) > 1:
            assert parts[1] == role, f"{path.name} ({role}) imports {module}"


# tools reach services through processes, NATS and HTTP; the one exception traces the services' own code, which it
# must run in its own process (`smartgen walk`, docs/architecture.md)
IN_PROCESS_TOOLS = {"tools/walk.py"}


@pytest.mark.parametrize("path", [p for p in files("tools") if str(p.relative_to(ROOT)) not in IN_PROCESS_TOOLS],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_a_tool_imports_no_service(path):
    assert not any(top(m) == "services" for m in imports_of(path)), imports_of(path)


@pytest.mark.parametrize("path", files("shared/compute"), ids=lambda p: str(p.relative_to(ROOT)))
def test_compute_never_reaches_asyncio_nats_http_or_the_data_plane(path):
    reached = reached_from(path)
    assert reached & {"asyncio", "nats", "aiohttp", "shared.dataplane"} == set(), sorted(reached)


@pytest.mark.parametrize("path", files("shared/dataplane"), ids=lambda p: str(p.relative_to(ROOT)))
def test_the_data_plane_never_reaches_torch_or_compute(path):
    reached = reached_from(path)
    assert reached & {"torch", "shared.compute"} == set(), sorted(reached)


def test_the_transitive_check_can_fail(tmp_path, monkeypatch):
    """A module that imports asyncio two hops away is caught (the check follows project imports)."""
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "a.py").write_text("from pkg import b\n")
    (tmp_path / "pkg" / "b.py").write_text("def f():\n    import asyncio\n")
    assert "asyncio" in reached_from(tmp_path / "pkg" / "a.py")
