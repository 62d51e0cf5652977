"""The package's shape: folders import only downwards, never another folder's private names,
and no module or function grows past what reads as one idea."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import blade_relax

PACKAGE = Path(blade_relax.__file__).parent
MAX_MODULE_LINES = 1000
MAX_FUNCTION_LINES = 100

# Each top-level folder (or root module) of blade_relax and its layer: a module may import
# from its own layer or below, never above. ``transform`` and ``runtime`` share a layer and
# never import each other: they meet only through ``contract`` (names, formats, the
# expression language the runtime evaluates).
LAYERS = {
    "contract": 0,
    "util": 0,
    "symbolic": 1,
    "analysis": 2,
    "transform": 3,
    "runtime": 3,
    "frontend": 4,
    "pipeline": 4,
    "training": 5,
    "testing": 5,
    "bench": 6,
    "gpuprog": 6,
    "": 6,  # the package root (``import blade_relax``: the public entry points)
    "cli": 7,
}
SIBLINGS_APART = {("transform", "runtime"), ("runtime", "transform")}


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _folder(module: str) -> str:
    """The top-level folder of a module; "" for the package root and its loose modules (a
    root module named in LAYERS, like ``pipeline``, is a layer of its own)."""
    parts = module.split(".")
    if len(parts) < 2 or (parts[1] not in LAYERS and not (PACKAGE / parts[1]).is_dir()):
        return ""
    return parts[1]


def _is_module(dotted: str) -> bool:
    path = PACKAGE.parent.joinpath(*dotted.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def _imports(path: Path) -> list[tuple[str, str]]:
    """``(module imported, name imported from it or "")`` for every blade_relax import."""
    me = _module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if not source.startswith("blade_relax"):
                continue
            for alias in node.names:
                child = f"{source}.{alias.name}"
                out.append((child, "") if _is_module(child) else (source, alias.name))
        elif isinstance(node, ast.Import):
            out += [(a.name, "") for a in node.names if a.name.startswith("blade_relax")]
    return out


def _is_private(module: str, name: str) -> bool:
    parts = [p for p in module.split(".")[1:] if p not in ("__init__", "__main__")]
    return any(p.startswith("_") for p in parts) or (name.startswith("_") and name != "__version__")


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_module_and_functions_are_short(path):
    text = path.read_text()
    assert text.count("\n") <= MAX_MODULE_LINES, f"{path.name}: {text.count(chr(10))} lines"
    long = [
        f"{node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for node in ast.walk(ast.parse(text))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    ]
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"


def test_imports_go_down_and_never_reach_another_folders_privates():
    wrong = []
    for path in _modules():
        me = _module_name(path)
        mine = _folder(me)
        for module, name in _imports(path):
            theirs = _folder(module)
            if theirs == mine:
                continue
            if _is_private(module, name):
                wrong.append(f"{me} reads {module} {name} (private to {theirs or 'the root'})")
            if LAYERS[theirs] > LAYERS[mine] or (mine, theirs) in SIBLINGS_APART:
                wrong.append(f"{me} imports {module} (a layer above {mine or 'the root'})")
    assert not wrong, "\n".join(wrong)


def test_eval_lives_in_one_module():
    evaluating = {
        _module_name(path)
        for path in _modules()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in ("eval", "exec")
    }
    assert len(evaluating) <= 1, sorted(evaluating)


def test_the_checks_see_what_they_forbid():
    # The import reader resolves relative imports and tells modules from names.
    sample = PACKAGE / "transform" / "fold_broadcast_matmul.py"
    found = _imports(sample)
    assert ("blade_relax.transform.simplify_transposes", "_axes") in found
    assert _is_private("blade_relax.runtime.remat_policy._search", "decide")
    assert _is_private("blade_relax.runtime.budget", "_check_budget")
    assert not _is_private("blade_relax.runtime.budget", "check_budget")
