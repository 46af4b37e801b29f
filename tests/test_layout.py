"""The architecture's import rules, checked on the source: the runtime interprets programs and
never imports the compiler or the passes; the compiler never imports the planner (costs reach it
through an analyze hook), so compiler and planner do not import each other."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def imported_modules(path: Path) -> set[str]:
    mods: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            mods |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            mods.add(node.module)
    return mods


def offending(folder: str, forbidden: tuple[str, ...]) -> list[str]:
    bad = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        for mod in imported_modules(path):
            if mod.startswith(forbidden):
                bad.append(f"{path.relative_to(ROOT)} imports {mod}")
    return bad


@pytest.mark.parametrize("folder, forbidden", [
    ("runtime", ("fxspeed.passes", "fxspeed.compiler")),
    ("fxspeed/compiler", ("fxspeed.planner", "fxspeed.runtime.engine")),
    ("fxspeed/ir", ("fxspeed.passes", "fxspeed.compiler", "fxspeed.runtime", "fxspeed.planner")),
])
def test_a_layer_never_imports_the_layers_above_it(folder: str, forbidden: tuple[str, ...]) -> None:
    assert offending(folder, forbidden) == []


def test_there_is_one_engine_class_and_compile_returns_it() -> None:
    import fxspeed
    from fxspeed.runtime.engine import Engine

    assert fxspeed.Engine is Engine
    assert fxspeed.compile.__annotations__["return"] in ("Engine", Engine)
    engines = [p for p in ROOT.rglob("*.py") if ".venv" not in p.parts
               and any(isinstance(n, ast.ClassDef) and n.name.endswith("Engine") for n in ast.walk(ast.parse(p.read_text())))]
    assert [str(p.relative_to(ROOT)) for p in engines] == ["runtime/engine.py"]
