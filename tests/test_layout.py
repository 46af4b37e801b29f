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


def _undocumented(name: str, f: object) -> list[str]:
    """What a public function or method lacks: a docstring, a parameter's or the return's type hint."""
    import inspect

    missing = [] if (getattr(f, "__doc__", None) or "").strip() else [f"{name}: no docstring"]
    sig = inspect.signature(f)
    missing += [f"{name}: parameter {p} has no type hint" for p, v in sig.parameters.items()
                if p not in ("self", "cls") and v.annotation is inspect.Parameter.empty]
    if sig.return_annotation is inspect.Signature.empty and getattr(f, "__name__", "") != "__init__":
        missing.append(f"{name}: no return type")
    return missing


def test_every_public_function_and_method_fxspeed_exports_has_type_hints_and_a_docstring() -> None:
    import inspect

    import fxspeed

    missing: list[str] = []
    for export in fxspeed.__all__:
        obj = getattr(fxspeed, export)
        if inspect.isfunction(obj):
            missing += _undocumented(export, obj)
        elif inspect.isclass(obj) and obj.__module__.startswith("fxspeed"):
            for attr, member in vars(obj).items():
                if attr.startswith("_"):
                    continue
                f = member.__func__ if isinstance(member, (staticmethod, classmethod)) else member
                f = f.fget if isinstance(f, property) else f
                if inspect.isfunction(f):
                    missing += _undocumented(f"{export}.{attr}", f)
    assert missing == []


def _doc(name: str) -> str:
    return (ROOT / name).read_text()


def test_the_readme_s_test_command_is_the_one_ci_runs() -> None:
    ci = [line for line in _doc(".ci/run").splitlines() if line.startswith("python -m pytest")]
    assert len(ci) == 1 and f"```bash\n{ci[0]}\n```" in _doc("README.md")


@pytest.mark.parametrize("doc", ["README.md", "docs/architecture.md"])
def test_every_repository_path_the_docs_name_exists(doc: str) -> None:
    import re

    # "no `runtime/binding.py`": the layout differences from DESIGN.md name files that do not exist
    absent = {"runtime/binding.py", "runtime/p2p.py"}
    named = set(re.findall(r"(?<![\w./-])((?:fxspeed|runtime|passes|tests|benchmarks|docs|notebooks|\.ci)/[\w/.*-]+"
                           r"\.(?:py|sh|md|ipynb|json))", _doc(doc))) - absent
    assert sorted(p for p in named if not list(ROOT.glob(p))) == []


def test_every_config_key_the_readme_names_exists() -> None:
    import dataclasses
    import re

    from fxspeed.config import Config

    keys = {f.name for f in dataclasses.fields(Config)}
    text = _doc("README.md")
    named = set(re.findall(r"(?<![\w.])Config\.(\w+)", text))
    for call in re.finditer(r"(?<![\w])Config\(([^()]*(?:\([^()]*\)[^()]*)*)\)", text):
        named |= set(re.findall(r"(?:^|[(,\s])(\w+)=", call.group(1)))
    assert sorted(named - keys) == []
