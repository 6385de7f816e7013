"""The dependency rule of docs/architecture.md, checked on every import statement of the tree: schemas import
nothing of the project's; shared imports no service and no tool; a service never imports another service;
a tool never imports a service's internals; the compute package touches no NATS or aiohttp, and asyncio only
in its torch-thread bridge."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def imports_of(path: Path) -> set[str]:
    """Every module a file imports, at any depth (lazy imports inside functions count too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
    return found


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


@pytest.mark.parametrize("path", files("tools"), ids=lambda p: str(p.relative_to(ROOT)))
def test_a_tool_imports_no_service(path):
    assert not any(top(m) == "services" for m in imports_of(path)), imports_of(path)


@pytest.mark.parametrize("path", files("shared/compute"), ids=lambda p: str(p.relative_to(ROOT)))
def test_compute_touches_no_nats_no_http_and_asyncio_only_in_the_bridge(path):
    tops = {top(m) for m in imports_of(path)}
    assert tops & {"nats", "aiohttp"} == set()
    assert "asyncio" not in tops or path.name == "torch_thread.py"
