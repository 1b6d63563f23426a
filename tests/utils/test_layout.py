"""The package's layout rules, read from the source: few top-level modules, imports that flow one way and
form no cycle, evaluation kept apart from the commands that only open a model, and short functions."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "atma_titan"
MAX_TOP_LEVEL_MODULES = 10
MAX_FUNCTION_LINES = 80  # Triton kernels excepted: a kernel is one launch, split only at a cost


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@functools.cache
def modules() -> dict[str, Path]:
    return {module_name(p): p for p in PACKAGE.rglob("*.py")}


def imports(name: str, *, module_level_only: bool) -> set[str]:
    """The atma_titan modules `name` imports (`from package import module` names the module)."""
    known, found = modules(), set()

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inside = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if isinstance(child, ast.ImportFrom) and child.module and not (module_level_only and inside):
                subs = {f"{child.module}.{alias.name}" for alias in child.names} & set(known)
                found.update(subs or ({child.module} & set(known)))
            elif isinstance(child, ast.Import) and not (module_level_only and inside):
                found.update(alias.name for alias in child.names if alias.name in known)
            if not (isinstance(child, ast.If) and ast.unparse(child.test) == "TYPE_CHECKING"):
                visit(child, inside)

    visit(ast.parse(known[name].read_text()), False)
    return found - {name}


def test_few_modules_at_the_top_of_the_package():
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL_MODULES, top


def test_no_import_cycle():
    graph = {name: imports(name, module_level_only=True) for name in modules()}
    done, path = set(), []

    def walk(name: str) -> None:
        if name in path:
            raise AssertionError("import cycle: " + " -> ".join(path[path.index(name) :] + [name]))
        if name in done:
            return
        path.append(name)
        for dep in sorted(graph[name]):
            walk(dep)
        path.pop()
        done.add(name)

    for name in sorted(graph):
        walk(name)


def test_imports_flow_one_way():
    """Models know nothing of data, parallelism or training; kernels nothing of models; the commands that
    only open a trained model (generate, export, lm_eval) nothing of evaluation."""
    rules = {
        "atma_titan.models": ("atma_titan.data", "atma_titan.parallel", "atma_titan.train"),
        "atma_titan.kernels": ("atma_titan.models",),
        "atma_titan.generate": ("atma_titan.eval",),
        "atma_titan.export": ("atma_titan.eval",),
        "atma_titan.lm_eval": ("atma_titan.eval",),
        "atma_titan.checkpoint": ("atma_titan.eval",),
    }
    broken = []
    for name in modules():
        for owner, banned in rules.items():
            if name == owner or name.startswith(owner + "."):
                bad = [m for m in imports(name, module_level_only=False) if m.startswith(banned)]
                broken += [f"{name} imports {m}" for m in bad]
    assert not broken, broken


def is_triton_kernel(fn: ast.FunctionDef) -> bool:
    return any("triton.jit" in ast.unparse(d) or "autotune" in ast.unparse(d) for d in fn.decorator_list)


def test_no_long_functions_outside_triton_kernels():
    long = []
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not is_triton_kernel(node):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{name}.{node.name}: {lines} lines")
    assert not long, long
