"""The app is layered, and no import runs back up a layer.

From the bottom: ``core`` and ``schemas`` (shapes and shared types, importing nothing
else of the app), ``stores``, the ``engines`` (they generate; structured output's
grammars are theirs), the ``services`` that call them, then ``api`` with the
``console`` beside it, and ``main``/``server`` on top. A module may
import its own layer or any layer below it, never one above. Every import is read
from the source (``ast``), lazy and ``TYPE_CHECKING`` ones included, so a function-
local import cannot slip an arrow past the test.

The scan (``worldcup_scan``) runs without the web stack: it may use ``app.core`` and
``app.stores`` (through the shared helpers there) and the corpus reader
(``app.services.corpus``, which sits beside the console's service that reads uploads
with it and imports only the standard library), never FastAPI or the other layers above.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

LAYERS: dict[str, int] = {
    "app.core": 0,
    "app.schemas": 0,
    "app.stores": 1,
    "app.engines": 2,
    "app.services": 3,
    "app.api": 4,
    "app.console": 4,
    "app.main": 5,
    "app.server": 5,
    "app": 5,  # the package itself (app/__init__.py)
}


def layer_of(module: str) -> int | None:
    """The layer of an ``app`` module (the longest matching prefix); None outside app."""
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        prefix = ".".join(parts[:n])
        if prefix in LAYERS:
            return LAYERS[prefix]
    return None


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(source: str, module: str, is_package: bool) -> list[tuple[int, str]]:
    """(line, module) for every import in ``source``; ``from a import b`` yields
    ``a.b`` (b may be a module: ``from app.services import generation``)."""
    package = module if is_package else module.rpartition(".")[0]
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return found


def upward_imports(source: str, module: str, is_package: bool = False) -> list[str]:
    """Every import in ``source`` that reaches a layer above ``module``'s."""
    own = layer_of(module)
    assert own is not None, module
    bad = []
    for line, target in imported_modules(source, module, is_package):
        theirs = layer_of(target)
        if theirs is not None and theirs > own:
            bad.append(f"{module}:{line} imports {target} (layer {theirs} > {own})")
    return bad


def app_modules() -> list[Path]:
    return sorted((ROOT / "app").rglob("*.py"))


def test_every_app_module_has_a_layer() -> None:
    paths = app_modules()
    assert len(paths) > 30  # the walk found the app, not an empty folder
    missing = [module_name(p) for p in paths if layer_of(module_name(p)) is None]
    assert missing == []


def test_no_app_import_runs_up_a_layer() -> None:
    bad: list[str] = []
    for path in app_modules():
        name = module_name(path)
        bad += upward_imports(path.read_text(), name, path.name == "__init__.py")
    assert bad == []


@pytest.mark.parametrize(
    ("module", "source", "expected"),
    [
        ("app.services.generation", "from app.api.deps import Runtime\n", 1),
        ("app.services.tenants", "def f():\n    import app.api.errors\n", 1),
        ("app.core.errors", "from app.stores.base import Store\n", 1),
        ("app.stores.base", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
         "    from app.services.runtime import Runtime\n", 1),
        ("app.services.detection", "from . import tenants\nfrom ..api import deps\n", 1),
        ("app.api.routes.detection", "from app.services.watermark import decode\n", 0),
        # an engine serves the services: it never reads them (the vllm engine once
        # imported app.services.grammar for the JSON schema of a spec)
        ("app.engines.vllm", "from app.services.grammar import json_schema_of\n", 1),
        ("app.services.openai.run", "from app.engines.grammar import compile_spec\n", 0),
        ("app.core.config", "import fastapi\nfrom worldcup_core import WorldCup\n", 0),
    ],
)  # fmt: skip
def test_the_check_catches_an_upward_import(module: str, source: str, expected: int) -> None:
    """The check itself can fail: a planted upward import is reported, a downward or
    sideways one is not."""
    assert len(upward_imports(source, module)) == expected


# modules of a higher layer that the scan may use: they import only the standard library
SCAN_MAY_USE = ("app.services.corpus",)


def test_the_scan_does_not_need_the_web_stack() -> None:
    """worldcup_scan reads keys through app.core and app.stores and corpora through the
    corpus reader, never FastAPI, Starlette or the app's other services and routes."""
    bad = []
    for path in sorted((ROOT / "worldcup_scan").rglob("*.py")):
        name = module_name(path)
        for line, target in imported_modules(path.read_text(), name, path.name == "__init__.py"):
            top = target.split(".")[0]
            layer = layer_of(target)
            allowed = target.rpartition(".")[0] in SCAN_MAY_USE or target in SCAN_MAY_USE
            if top in {"fastapi", "starlette"} or (layer is not None and layer > 1 and not allowed):
                bad.append(f"{name}:{line} imports {target}")
    assert bad == []


def test_what_the_scan_may_use_imports_only_the_standard_library() -> None:
    """The exception above holds only while those modules need nothing of the app nor
    of the web stack (Parquet's pyarrow, the scan extra, is imported when one is read)."""
    for module in SCAN_MAY_USE:
        path = ROOT / (module.replace(".", "/") + ".py")
        found = imported_modules(path.read_text(), module, False)
        tops = {target.split(".")[0] for _, target in found}
        assert tops - set(sys.stdlib_module_names) - {"__future__", "pyarrow"} == set(), module


def private_imports(source: str, module: str, is_package: bool = False) -> list[str]:
    """Every import in ``source`` of another service or API module's private name."""
    bad = []
    for line, target in imported_modules(source, module, is_package):
        owner, _, imported = target.rpartition(".")
        private = imported.startswith("_") and not imported.startswith("__")
        if private and owner != module and layer_of(owner) in (3, 4):
            bad.append(f"{module}:{line} imports {target}")
    return bad


def test_services_and_routes_use_each_others_public_names_only() -> None:
    """provenance once took detection's private ``_sketcher`` and ``_admit_one``: text
    intake is now one module (``app.services.intake``) whose public names serve all."""
    assert private_imports("from app.services.detection import _sketcher\n", "a.b") != []
    assert private_imports("from app.services.intake import sketcher\n", "a.b") == []
    bad: list[str] = []
    for path in app_modules():
        bad += private_imports(path.read_text(), module_name(path), path.name == "__init__.py")
    assert bad == []


def test_routes_reach_the_store_through_the_services() -> None:
    """Routes parse, call a service and answer: none reads ``runtime.store`` itself
    (the admin's audit log and registry lookup once did)."""
    bad = []
    for path in sorted((ROOT / "app" / "api").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "store":
                bad.append(f"{module_name(path)}:{node.lineno}")
    assert bad == []
